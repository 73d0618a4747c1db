package core

import (
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A socket directory named through a symlink that another user can
// re-point (theirs, in a sticky directory such as /tmp: the owner of an
// entry may replace it there) would let that user move both sides into a
// directory of theirs. These tests play that user (uid 65534) for real, so
// they need root; fs.protected_symlinks plays no part, since the exporter
// refuses such a path and neither side ever follows it into another
// directory.

// otherUID is the uid that plays the other user.
const otherUID = 65534

// repointLab is a sticky directory (as /tmp) holding link, which leads to
// private, the exporter's directory; elsewhere is the other user's
// directory, holding decoys named as the exporter's files.
type repointLab struct {
	sticky, private, elsewhere, link string
}

func newRepointLab(t *testing.T) *repointLab {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: it plays another uid's symlink and directory")
	}
	root, err := os.MkdirTemp("", "vmmipc-") // short: a socket path has 107 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	l := &repointLab{
		sticky: filepath.Join(root, "sticky"), private: filepath.Join(root, "private"),
		elsewhere: filepath.Join(root, "elsewhere"),
	}
	l.link = filepath.Join(l.sticky, "link")
	for _, d := range []struct {
		path string
		mode uint32
	}{{l.sticky, 0o1777}, {l.private, 0o700}, {l.elsewhere, 0o755}} {
		if err := os.Mkdir(d.path, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := unix.Chmod(d.path, d.mode); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chown(l.elsewhere, otherUID, otherUID); err != nil {
		t.Fatal(err)
	}
	l.point(t, l.private, uint32(os.Geteuid()))
	return l
}

// point makes link lead to dir, owned by uid.
func (l *repointLab) point(t *testing.T, dir string, uid uint32) {
	t.Helper()
	if err := os.Remove(l.link); err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	if err := os.Symlink(dir, l.link); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(l.link, int(uid), int(uid)); err != nil {
		t.Fatal(err)
	}
}

// decoys puts the other user's files in elsewhere under the names of the
// exporter at addr: a regular file for each, its lock unlocked (which says
// "exited" to whoever probes it).
func (l *repointLab) decoys(t *testing.T, addr string) []string {
	t.Helper()
	var paths []string
	for _, name := range exporterFiles(addr) {
		p := filepath.Join(l.elsewhere, name)
		if err := os.WriteFile(p, []byte("theirs"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(p, otherUID, otherUID); err != nil {
			t.Fatal(err)
		}
		paths = append(paths, p)
	}
	return paths
}

func expectEntries(t *testing.T, dir, what string, want ...string) {
	t.Helper()
	got := dirNames(t, dir)
	sort.Strings(want)
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Fatalf("%s: %s holds %q, want %q", what, dir, got, want)
	}
}

// TestSocketDirThroughAnotherUsersSymlink: the exporter refuses a socket
// directory whose path passes through a symlink of another uid, named
// directly, below it, or reached through a symlink of ours, with EIO
// naming the symlink and its owner; the same link of ours is used.
func TestSocketDirThroughAnotherUsersSymlink(t *testing.T) {
	l := newRepointLab(t)
	if err := os.Mkdir(filepath.Join(l.private, "sub"), 0o700); err != nil {
		t.Fatal(err)
	}
	s, err := NewServer(l.link)
	if err != nil {
		t.Fatalf("a symlink of ours in a sticky directory: %v", err)
	}
	s.Close()
	expectEntries(t, l.private, "after the server closed", "sub")

	l.point(t, l.private, otherUID)
	hop := filepath.Join(l.private, "hop") // ours, relative, through theirs
	if err := os.Symlink("../sticky/link", hop); err != nil {
		t.Fatal(err)
	}
	for _, dir := range []string{l.link, filepath.Join(l.link, "sub"), hop} {
		s, err := NewServer(dir)
		if err == nil {
			s.Close()
			t.Fatalf("%s: a server started there, through a symlink of uid %d", dir, otherUID)
		}
		want := l.link + " is a symlink of uid 65534, who could point it at a directory of theirs"
		if CodeOf(err) != ECONFIG || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), SocketDirEnv) {
			t.Fatalf("%s: got %v, want ECONFIG naming %s and saying %q", dir, err, SocketDirEnv, want)
		}
	}
	expectEntries(t, l.private, "after the refusals", "hop", "sub")
}

// startInLink starts a sender helper whose socket directory is named
// through the lab's link (ours, for now), registers a host buffer of seed
// and returns the sender, its address and the ticket.
func startInLink(t *testing.T, l *repointLab, seed byte) (*helper, string, *Ticket) {
	t.Helper()
	sender := startHelper(t, partSender, helperOpts{env: []string{SocketDirEnv + "=" + l.link}})
	addr := sender.expect("serving ", faultTimeout)
	tk := sender.register(4, 4096, 0, -1, seed)
	expectEntries(t, l.private, "the exporter's files", exporterFiles(addr)...)
	return sender, addr, tk
}

// TestReceiverRefusesRepointedSocketDir: an exporter started in a socket
// directory named through a symlink; then the symlink belongs to another
// uid, who points it at a directory of theirs holding files named as the
// exporter's (an unlocked lock: "exited"). A receiver is not fooled: it
// refuses the path at once, naming the symlink and its owner, instead of
// calling the live exporter exited; once the path is ours again it
// imports.
func TestReceiverRefusesRepointedSocketDir(t *testing.T) {
	l := newRepointLab(t)
	flushCache(t)
	_, addr, tk := startInLink(t, l, 46)
	l.decoys(t, addr)
	l.point(t, l.elsewhere, otherUID)
	start := time.Now()
	_, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	want := l.link + " is a symlink of uid 65534"
	if CodeOf(err) != ECONFIG || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "has exited") {
		t.Fatalf("import through the re-pointed path: got %v, want ECONFIG saying %q (not that the exporter has exited)", err, want)
	}
	if took := time.Since(start); took > promptly {
		t.Fatalf("refused only after %v", took)
	}
	l.point(t, l.private, uint32(os.Geteuid()))
	if err := importVerified(tk, ImportOptions{NoCache: true}, 46); err != nil {
		t.Fatalf("once the path is ours again: %v", err)
	}
}

// TestExporterRemovesOnlyItsOwnFiles: the same, but the exporter closes
// while the symlink leads to the other user's directory. It removes its
// own socket and lock, in the directory it made them in, and none of the
// other user's files of the same names.
func TestExporterRemovesOnlyItsOwnFiles(t *testing.T) {
	l := newRepointLab(t)
	sender, addr, _ := startInLink(t, l, 47)
	decoys := l.decoys(t, addr)
	l.point(t, l.elsewhere, otherUID)
	sender.send("close")
	sender.expect("closed", faultTimeout)
	expectEntries(t, l.private, "after the exporter closed")
	for _, p := range decoys {
		if b, err := os.ReadFile(p); err != nil || string(b) != "theirs" {
			t.Fatalf("the other user's %s, after the exporter closed: %q, %v", p, b, err)
		}
	}
}
