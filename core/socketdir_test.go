package core

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestSocketDirRules: a socket directory that others could write into
// (without the sticky bit), that belongs to another user, below such a
// directory, missing, or not a directory, is refused with ECONFIG (a
// configuration error, not EIO) saying why;
// a private or sticky one is used: the socket is mode 0600, named with the
// PID namespace, pid and 64 random bits, with its lock next to it, and
// both go when the server closes.
func TestSocketDirRules(t *testing.T) {
	root := t.TempDir()
	mk := func(rel string, mode uint32) string {
		p := filepath.Join(root, rel)
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		return p
	}
	private, sticky := mk("private", 0o700), mk("sticky", 0o1777)
	open, group := mk("open", 0o777), mk("group", 0o770)
	below := mk("open/below", 0o700)
	file := filepath.Join(root, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(root, "link")
	if err := os.Symlink(private, link); err != nil {
		t.Fatal(err)
	}
	refused := []struct{ dir, want string }{
		{open, "is writable by other users (mode 0777) and has no sticky bit"},
		{group, "is writable by other users (mode 0770) and has no sticky bit"},
		{below, open + " is writable by other users"},
		{filepath.Join(root, "missing"), "no such directory"},
		{file, "not a directory"},
		{private + "/" + strings.Repeat("x", 80), "no such directory"},
	}
	if os.Geteuid() == 0 {
		foreign := mk("foreign", 0o700)
		if err := os.Chown(foreign, 65534, 65534); err != nil {
			t.Fatal(err)
		}
		refused = append(refused, struct{ dir, want string }{foreign, "belongs to uid 65534"})
	}
	for _, tc := range refused {
		s, err := NewServer(tc.dir)
		if err == nil {
			s.Close()
			t.Fatalf("%s: a server started there", tc.dir)
		}
		if CodeOf(err) != ECONFIG || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), SocketDirEnv) {
			t.Fatalf("%s: got %v, want ECONFIG naming %s and saying %q", tc.dir, err, SocketDirEnv, tc.want)
		}
	}
	long := mk(strings.Repeat("d", 60), 0o700)
	if _, err := NewServer(long); CodeOf(err) != ECONFIG || !strings.Contains(err.Error(), "longer than 107 bytes") {
		t.Fatalf("a socket path too long: got %v", err)
	}
	for _, dir := range []string{private, sticky, link} {
		s, err := NewServer(dir)
		if err != nil {
			t.Fatalf("%s: %v", dir, err)
		}
		name := filepath.Base(s.Addr())
		prefix := fileNamePrefix + strconv.FormatUint(selfNamespaces().PID, 10) + "-" + strconv.Itoa(os.Getpid()) + "-"
		if filepath.Dir(s.Addr()) != dir || !strings.HasPrefix(name, prefix) || len(name) != len(prefix)+16+len(socketSuffix) {
			t.Fatalf("socket %s, want %s/%s<16 hex digits>%s", s.Addr(), dir, prefix, socketSuffix)
		}
		files := s.Files()
		for i, want := range []uint32{unix.S_IFSOCK, unix.S_IFREG} {
			var st unix.Stat_t
			if err := unix.Lstat(files[i], &st); err != nil || st.Mode&unix.S_IFMT != want || st.Mode&0o777 != 0o600 {
				t.Fatalf("%s: mode %o (%v), want type %o, mode 0600", files[i], st.Mode, err, want)
			}
		}
		s.Close()
		for _, f := range files {
			if _, err := os.Lstat(f); !os.IsNotExist(err) {
				t.Fatalf("%s is still there after the server closed (%v)", f, err)
			}
		}
	}
}

// TestTwoServersOneDirOneProcess: a process never opens its own lock files
// (closing any descriptor of one would drop its lock), so a second server
// in the same directory leaves the first's files alone, receivers in the
// same process import from both, and other processes still see both locks
// held.
func TestTwoServersOneDirOneProcess(t *testing.T) {
	dir := t.TempDir()
	var servers []*Server
	for i := range 2 {
		s := newTestServerIn(t, dir)
		servers = append(servers, s)
		for _, other := range servers {
			for _, f := range other.Files() {
				if _, err := os.Lstat(f); err != nil {
					t.Fatalf("after server %d started: %v", i, err)
				}
			}
		}
	}
	for i, s := range servers {
		fd := newMemfd(t, 4*int(pageSize), pattern(4*int(pageSize), byte(50+i)))
		tk := registerFile(t, s, fd, 4*pageSize, pageSize, RegisterOptions{Uses: 1})
		unix.Close(fd)
		if err := importVerified(tk, ImportOptions{}, byte(50+i)); err != nil {
			t.Fatalf("server %d: %v", i, err)
		}
		o := startHelper(t, partOpener, helperOpts{env: []string{envTicket + "=" + ticketHex(t, tk)}})
		if got := o.expect("open ", faultTimeout); got != "code="+strconv.Itoa(int(ENOENT)) {
			t.Fatalf("server %d, from another process after the only use: %s, want ENOENT (a live exporter, its lock held)", i, got)
		}
	}
}
