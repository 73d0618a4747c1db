package core

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// The socket directory (VMMIPC_SOCKET_DIR) is how receivers in other
// namespaces reach an exporter, and it is a security boundary: whoever may
// replace a file in it may put a socket of its own at an exporter's
// address, and whoever may re-point the path may make both sides use
// another directory. So:
//
//   - nobody but us and root may change where the path leads
//     (socketpath.go): the exporter checks this when it starts
//     (openSocketDir), and a receiver before it trusts a lock or dials
//     (liveness.go);
//   - the exporter holds a descriptor of the directory it checked and
//     makes, scans and removes its files through it, so even a path that
//     changed later (we or root could) never makes it delete in another
//     directory (export/abi.c removes its files at exit through a
//     duplicate);
//   - an exporter's files are vmmipc-<pidns>-<pid>-<random>.sock, its
//     socket (mode 0600), and .lock, a file on which it holds a POSIX
//     write lock for its whole life: the kernel drops that lock when the
//     process exits or execs, and a forked child never inherits it, so a
//     receiver in any namespace can tell a live exporter from a socket file
//     left behind or held by a child (liveness.go);
//   - a starting exporter removes the files of ours whose lock is free
//     (a crashed exporter's), and the library removes its own at exit
//     (Server.DirFiles, export/abi.c).

// SocketDirEnv names the environment variable that, when set, makes the
// server listen on a filesystem socket in that directory (mode 0600) instead
// of the abstract namespace: for receivers in other network or PID
// namespaces (containers) that mount the same directory at the same path.
const SocketDirEnv = "VMMIPC_SOCKET_DIR"

const (
	fileNamePrefix = "vmmipc-"
	socketSuffix   = ".sock"
	lockSuffix     = ".lock"
)

// socketDir is a checked socket directory: the path as named, which goes
// into tickets (receivers in other mount namespaces use the same path),
// and a descriptor of the directory it led to when checked.
type socketDir struct {
	path string // absolute, as named
	fd   int    // O_PATH; closed by close
}

// openSocketDir checks dir (checkPath) and opens the directory it leads
// to. A directory that is missing, unsafe or unusable is the caller's
// configuration (ECONFIG), told apart from an I/O failure (EIO).
func openSocketDir(dir string) (*socketDir, error) {
	failAs := func(code Code, format string, args ...any) (*socketDir, error) {
		return nil, Errorf(code, "server: %s=%q: "+format, append([]any{SocketDirEnv, dir}, args...)...)
	}
	fail := func(format string, args ...any) (*socketDir, error) { return failAs(ECONFIG, format, args...) }
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fail("%w", err)
	}
	real, err := checkPath(abs)
	switch {
	case errors.Is(err, unix.ENOENT):
		return fail("no such directory: create it (mode 0700) or mount the shared volume there, at the same path on both sides")
	case errors.Is(err, unix.ENOTDIR):
		return fail("not a directory")
	case err != nil:
		return fail("%w", err)
	}
	fd, err := unix.Open(real, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return failAs(EIO, "opening %s: %w", real, err)
	}
	// Only we or root could have changed the path since the check; if one
	// did, say so rather than work in a directory the path no longer names.
	var held, named unix.Stat_t
	if err := unix.Fstat(fd, &held); err != nil || unix.Stat(abs, &named) != nil || held.Dev != named.Dev || held.Ino != named.Ino {
		_ = unix.Close(fd)
		return failAs(EIO, "it changed while being checked; start again")
	}
	return &socketDir{path: abs, fd: fd}, nil
}

func (d *socketDir) close() { _ = unix.Close(d.fd) }

// serverFiles are the files a server made in its socket directory: its
// socket and its lock, held.
type serverFiles struct {
	dir      *socketDir
	name     string // of the socket and lock, less their suffixes
	lockFD   int
	released sync.Once
}

func (f *serverFiles) socketPath() string {
	return filepath.Join(f.dir.path, f.name+socketSuffix)
}

func (f *serverFiles) lockPath() string {
	return filepath.Join(f.dir.path, f.name+lockSuffix)
}

// ownLocks are the lock files this process holds. The process must never
// open one of them: closing any descriptor of a file drops every POSIX lock
// the process holds on it.
var ownLocks struct {
	sync.Mutex
	paths map[string]bool
}

func ownsLock(path string) bool {
	ownLocks.Lock()
	defer ownLocks.Unlock()
	return ownLocks.paths[path]
}

func setOwnLock(path string, own bool) {
	ownLocks.Lock()
	defer ownLocks.Unlock()
	if ownLocks.paths == nil {
		ownLocks.paths = map[string]bool{}
	}
	if own {
		ownLocks.paths[path] = true
	} else {
		delete(ownLocks.paths, path)
	}
}

// createLock creates name.lock in dir, locked: it is made and locked under
// a temporary name and then linked into place, so that no scan ever sees it
// unlocked.
func createLock(dir *socketDir, name string) (*serverFiles, error) {
	f := &serverFiles{dir: dir, name: name}
	tmp, lock, path := name+".new", name+lockSuffix, f.lockPath()
	fd, err := unix.Openat(dir.fd, tmp, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, &Error{Code: ioCode(err), Msg: "server: creating the lock " + filepath.Join(dir.path, tmp), Err: err}
	}
	defer unix.Unlinkat(dir.fd, tmp, 0)
	lk := unix.Flock_t{Type: unix.F_WRLCK}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_SETLK, &lk); err != nil {
		_ = unix.Close(fd)
		return nil, &Error{Code: EIO, Msg: "server: locking " + filepath.Join(dir.path, tmp) + " (the socket directory's file system must support POSIX locks)", Err: err}
	}
	setOwnLock(path, true)
	if err := unix.Linkat(dir.fd, tmp, dir.fd, lock, 0); err != nil {
		setOwnLock(path, false)
		_ = unix.Close(fd)
		return nil, &Error{Code: EIO, Msg: "server: creating the lock " + path, Err: err}
	}
	f.lockFD = fd
	return f, nil
}

// release removes the socket (if there is one) and the lock file, in that
// order, through the directory's descriptor, drops the lock and closes the
// directory, once: a second Close of the server must not close whatever
// descriptors took the numbers.
func (f *serverFiles) release() {
	f.released.Do(func() {
		_ = unix.Unlinkat(f.dir.fd, f.name+socketSuffix, 0)
		_ = unix.Unlinkat(f.dir.fd, f.name+lockSuffix, 0)
		_ = unix.Close(f.lockFD)
		setOwnLock(f.lockPath(), false)
		f.dir.close()
	})
}

// lockState is what probeLock found.
type lockState int

const (
	lockUnknown lockState = iota // cannot tell (not a regular file, no access)
	lockMissing                  // no such file
	lockFree                     // nobody holds it: its exporter is gone
	lockHeld
)

// probeLock tells whether some process holds a lock on path and, if the
// kernel can name it in our PID namespace, which (else 0).
func probeLock(path string) (lockState, int32) {
	return probeLockAt(unix.AT_FDCWD, path, path)
}

// probeLockAt is probeLock of name in the directory dirfd; path names the
// same file for ownsLock.
func probeLockAt(dirfd int, name, path string) (lockState, int32) {
	if ownsLock(path) {
		return lockHeld, int32(os.Getpid())
	}
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err == unix.ENOENT {
		return lockMissing, 0
	}
	if err != nil {
		return lockUnknown, 0
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return lockUnknown, 0
	}
	lk := unix.Flock_t{Type: unix.F_WRLCK}
	if unix.FcntlFlock(uintptr(fd), unix.F_GETLK, &lk) != nil {
		return lockUnknown, 0
	}
	if lk.Type == unix.F_UNLCK {
		return lockFree, 0
	}
	return lockHeld, lk.Pid
}

// lockPathFor is the lock next to a filesystem socket address.
func lockPathFor(addr string) (string, bool) {
	if strings.HasPrefix(addr, "@") || !strings.HasSuffix(addr, socketSuffix) {
		return "", false
	}
	return strings.TrimSuffix(addr, socketSuffix) + lockSuffix, true
}

// removeStale removes our uid's exporter files in d whose exporter is
// gone: sockets whose lock is free (or missing, with nothing listening),
// and free locks with no socket.
func (d *socketDir) removeStale() {
	dfd, err := unix.Openat(d.fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	f := os.NewFile(uintptr(dfd), d.path)
	names, _ := f.Readdirnames(-1)
	_ = f.Close()
	uid := uint32(os.Geteuid())
	for _, name := range names {
		base, isSocket := strings.CutSuffix(name, socketSuffix)
		if !isSocket {
			var isLock bool
			if base, isLock = strings.CutSuffix(name, lockSuffix); !isLock {
				continue
			}
		}
		if !strings.HasPrefix(name, fileNamePrefix) {
			continue
		}
		lock, sock := base+lockSuffix, base+socketSuffix
		lockPath := filepath.Join(d.path, lock)
		var st unix.Stat_t
		if unix.Fstatat(d.fd, name, &st, unix.AT_SYMLINK_NOFOLLOW) != nil || st.Uid != uid || ownsLock(lockPath) {
			continue
		}
		state, _ := probeLockAt(d.fd, lock, lockPath)
		switch {
		case isSocket && st.Mode&unix.S_IFMT != unix.S_IFSOCK:
		case isSocket && (state == lockFree || (state == lockMissing && !listening(filepath.Join(d.path, sock)))):
			_ = unix.Unlinkat(d.fd, sock, 0)
			if state == lockFree {
				_ = unix.Unlinkat(d.fd, lock, 0)
			}
		case !isSocket && st.Mode&unix.S_IFMT == unix.S_IFREG && state == lockFree:
			if unix.Fstatat(d.fd, sock, &st, unix.AT_SYMLINK_NOFOLLOW) == unix.ENOENT {
				_ = unix.Unlinkat(d.fd, lock, 0)
			}
		}
	}
}

// listening reports whether a process accepts connections at the socket
// path (a full backlog counts as listening).
func listening(path string) bool {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
	if err != nil {
		return true
	}
	defer unix.Close(fd)
	err = unix.Connect(fd, &unix.SockaddrUnix{Name: path})
	return err != unix.ECONNREFUSED && err != unix.ENOENT
}
