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
// address. So:
//
//   - the directory, and every directory above it, must belong to us or
//     root and be writable by nobody else unless it has the sticky bit
//     (then only a file's owner may rename or remove it);
//   - an exporter's files are vmmipc-<pidns>-<pid>-<random>.sock, its
//     socket (mode 0600), and .lock, a file on which it holds a POSIX
//     write lock for its whole life: the kernel drops that lock when the
//     process exits or execs, and a forked child never inherits it, so a
//     receiver in any namespace can tell a live exporter from a socket file
//     left behind or held by a child (liveness.go);
//   - a starting exporter removes the files of ours whose lock is free
//     (a crashed exporter's), and the library removes its own at exit
//     (Server.Files, export/abi.c).

const (
	fileNamePrefix = "vmmipc-"
	socketSuffix   = ".sock"
	lockSuffix     = ".lock"
)

// checkSocketDir resolves dir and checks that nobody but us and root can
// replace what is in it.
func checkSocketDir(dir string) (string, error) {
	fail := func(format string, args ...any) (string, error) {
		return "", Errorf(EIO, "server: %s=%q: "+format, append([]any{SocketDirEnv, dir}, args...)...)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fail("%w", err)
	}
	real, err := filepath.EvalSymlinks(abs)
	if errors.Is(err, os.ErrNotExist) {
		return fail("no such directory: create it (mode 0700) or mount the shared volume there, at the same path on both sides")
	}
	if err != nil {
		return fail("%w", err)
	}
	var st unix.Stat_t
	if err := unix.Stat(real, &st); err != nil {
		return fail("%w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fail("not a directory")
	}
	// The directories as named (a symlink's own directory decides who can
	// change where it points) and as resolved.
	for _, p := range []string{filepath.Dir(abs), real} {
		if err := checkDirChain(p); err != nil {
			return fail("%w", err)
		}
	}
	return abs, nil
}

// checkDirChain checks dir and each directory above it.
func checkDirChain(dir string) error {
	uid := uint32(os.Geteuid())
	for p := dir; ; p = filepath.Dir(p) {
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			switch {
			case st.Uid != uid && st.Uid != 0:
				return Errorf(EIO, "%s belongs to uid %d, who could replace the exporter's socket; use a directory of uid %d (ours) or root", p, st.Uid, uid)
			case st.Mode&0o022 != 0 && st.Mode&unix.S_ISVTX == 0:
				return Errorf(EIO, "%s is writable by other users (mode %04o) and has no sticky bit, so any of them could replace the exporter's socket; use a directory only this user can write (chmod 0700), or set the sticky bit (chmod +t), as /tmp has", p, st.Mode&0o7777)
			}
		}
		if p == "/" { // only absolute paths come here
			return nil
		}
	}
}

// serverLock is the lock an exporter holds next to its socket.
type serverLock struct {
	fd       int
	path     string
	released sync.Once
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

// createLock creates base.lock, locked: it is made and locked under a
// temporary name and then linked into place, so that no scan ever sees it
// unlocked.
func createLock(base string) (*serverLock, error) {
	tmp, path := base+".new", base+lockSuffix
	fd, err := unix.Open(tmp, unix.O_RDWR|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
	if err != nil {
		return nil, &Error{Code: ioCode(err), Msg: "server: creating the lock " + tmp, Err: err}
	}
	defer unix.Unlink(tmp)
	lk := unix.Flock_t{Type: unix.F_WRLCK}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_SETLK, &lk); err != nil {
		_ = unix.Close(fd)
		return nil, &Error{Code: EIO, Msg: "server: locking " + tmp + " (the socket directory's file system must support POSIX locks)", Err: err}
	}
	setOwnLock(path, true)
	if err := unix.Link(tmp, path); err != nil {
		setOwnLock(path, false)
		_ = unix.Close(fd)
		return nil, &Error{Code: EIO, Msg: "server: creating the lock " + path, Err: err}
	}
	return &serverLock{fd: fd, path: path}, nil
}

// release removes the lock file and drops the lock, once: a second Close
// of the server must not close whatever descriptor took the number.
func (l *serverLock) release() {
	l.released.Do(func() {
		_ = unix.Unlink(l.path)
		_ = unix.Close(l.fd)
		setOwnLock(l.path, false)
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
	if ownsLock(path) {
		return lockHeld, int32(os.Getpid())
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
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

// removeStale removes our uid's exporter files in dir whose exporter is
// gone: sockets whose lock is free (or missing, with nothing listening),
// and free locks with no socket.
func removeStale(dir string) {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	uid := uint32(os.Geteuid())
	for _, e := range entries {
		name := e.Name()
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
		path, lock, sock := filepath.Join(dir, name), filepath.Join(dir, base+lockSuffix), filepath.Join(dir, base+socketSuffix)
		var st unix.Stat_t
		if unix.Lstat(path, &st) != nil || st.Uid != uid || ownsLock(lock) {
			continue
		}
		state, _ := probeLock(lock)
		switch {
		case isSocket && st.Mode&unix.S_IFMT != unix.S_IFSOCK:
		case isSocket && (state == lockFree || (state == lockMissing && !listening(sock))):
			_ = unix.Unlink(sock)
			if state == lockFree {
				_ = unix.Unlink(lock)
			}
		case !isSocket && st.Mode&unix.S_IFMT == unix.S_IFREG && state == lockFree:
			if unix.Access(sock, unix.F_OK) == unix.ENOENT {
				_ = unix.Unlink(lock)
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
