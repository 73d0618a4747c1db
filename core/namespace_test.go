package core

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"
)

// Receivers and exporters in other namespaces, made with unshare (root is
// needed: the lab's containers are made without a user namespace; the
// tests skip with the reason where unshare cannot make them). A "container" is what
// tests/namespaces/container.sh makes: its own PID, network and mount
// namespaces (and, where asked, user namespace), in which the lab's
// directory is a private tmpfs with only the socket directory bind-mounted
// at its own path, as a volume would be. The rest of the file system (the
// test binary, libraries) is shared, as an image would be.

// containerScript and newLabScript are in tests/namespaces (go test runs
// in core/).
const (
	containerScript = "../tests/namespaces/container.sh"
	newLabScript    = "../tests/namespaces/new_lab.sh"
)

// nsLab is one test's directory: root/shared is the socket directory.
type nsLab struct {
	root, shared string
}

// newNSLab makes one with new_lab.sh, or skips the test saying why no
// container can be made here.
func newNSLab(t *testing.T) *nsLab {
	t.Helper()
	cmd := exec.Command("sh", newLabScript)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Skipf("%s: %v: %s", newLabScript, err, strings.TrimSpace(stderr.String()))
	}
	root := strings.TrimSpace(string(out))
	t.Cleanup(func() { os.RemoveAll(root) })
	return &nsLab{root: root, shared: filepath.Join(root, "shared")}
}

// pidOnly runs a helper in a new PID namespace with its own /proc,
// sharing everything else.
func (l *nsLab) pidOnly() []string {
	return []string{"unshare", "--pid", "--fork", "--mount-proc", "--kill-child"}
}

// containerOpts say what else a container gets.
type containerOpts struct {
	user bool // its own user namespace (uid 0 inside maps to ours)
	keep bool // pid 1 outlives the helper, so that a child the helper leaves (fork-listener) lives on
}

// container runs a helper in a container of the lab. Its pid 1 is a
// shell, which dies with the helper's process (unshare), taking the whole
// PID namespace with it: a helper that execs from a thread other than its
// first would lose a parent-death signal of its own. The helper's pid is
// the same in every container.
func (l *nsLab) container(o containerOpts) []string {
	wrap := []string{"sh", containerScript}
	if o.user {
		wrap = append(wrap, "--user")
	}
	if o.keep {
		wrap = append(wrap, "--keep")
	}
	return append(wrap, l.shared, l.root)
}

// files lists the socket directory.
func (l *nsLab) files(t *testing.T) []string {
	t.Helper()
	return dirNames(t, l.shared)
}

// expectFiles fails unless the socket directory holds exactly names.
func (l *nsLab) expectFiles(t *testing.T, what string, names ...string) {
	t.Helper()
	sort.Strings(names)
	if got := l.files(t); strings.Join(got, " ") != strings.Join(names, " ") {
		t.Fatalf("%s: the socket directory holds %q, want %q", what, got, names)
	}
}

// exporterFiles names the files of the exporter at addr.
func exporterFiles(addr string) []string {
	lock, _ := lockPathFor(addr)
	return []string{filepath.Base(addr), filepath.Base(lock)}
}

// startSender starts a sender helper in wrap with its socket in dir ("":
// abstract) and returns it with its address.
func startSender(t *testing.T, wrap []string, dir string) (*helper, string) {
	t.Helper()
	h := startHelper(t, partSender, helperOpts{wrap: wrap, env: []string{SocketDirEnv + "=" + dir}})
	return h, h.expect("serving ", faultTimeout)
}

// waitLive waits (up to 5 s) until a sender helper holds want live
// registrations: a used-up registration ends just after its receiver got
// its answer.
func (h *helper) waitLive(want int) {
	h.t.Helper()
	var n int
	if !waitUntil(5*time.Second, func() bool { n = h.live(); return n == want }) {
		h.t.Fatalf("the sender holds %d live registrations, want %d", n, want)
	}
}

// expectDone waits until a sender helper's registrations have all ended
// and checks that it holds the descriptors it held before it registered.
func (h *helper) expectDone(base int) {
	h.t.Helper()
	h.waitLive(0)
	// The session's socket and the exporter's duplicate close after the
	// registration ends: wait for them.
	var n int
	if !waitUntil(3*time.Second, func() bool { n = h.fds(); return n == base }) {
		h.t.Fatalf("the sender holds %d descriptors after its registrations ended, %d before", n, base)
	}
}

// expectCleanClose checks that the sender's files are in the socket
// directory while it serves and gone once it closes its server.
func (l *nsLab) expectCleanClose(t *testing.T, sender *helper, addr string) {
	t.Helper()
	l.expectFiles(t, "while the sender serves", exporterFiles(addr)...)
	sender.send("close")
	sender.expect("closed", faultTimeout)
	l.expectFiles(t, "after the sender closed its server")
}

// importResult is what an importer helper reported.
type importResult struct {
	code                      Code
	took                      time.Duration
	fdsBefore, fdsAfter, maps int
	hits                      uint64
	msg                       string
}

// importIn imports tk once in an importer helper run in wrap.
func importIn(t *testing.T, wrap []string, tk *Ticket, seed byte) importResult {
	t.Helper()
	return importTimesIn(t, wrap, tk, seed, 1)
}

// importTimesIn imports tk n times in one importer helper run in wrap, with
// env added to its environment.
func importTimesIn(t *testing.T, wrap []string, tk *Ticket, seed byte, n int, env ...string) importResult {
	t.Helper()
	env = append([]string{envTicket + "=" + ticketHex(t, tk), envSeed + "=" + itoa(int(seed)), envImports + "=" + itoa(n)}, env...)
	h := startHelper(t, partImporter, helperOpts{wrap: wrap, env: env})
	line := h.expect("import ", 2*faultTimeout)
	var r importResult
	var code, took int
	if _, err := fmt.Sscanf(line, "code=%d took=%d fds=%d/%d maps=%d hits=%d", &code, &took, &r.fdsBefore, &r.fdsAfter, &r.maps, &r.hits); err != nil {
		t.Fatalf("importer said %q: %v", line, err)
	}
	r.code, r.took = Code(code), time.Duration(took)*time.Millisecond
	if f := strings.SplitN(line, " ", 6); len(f) == 6 { // five fields, then the message
		r.msg = f[5]
	}
	if r.fdsAfter != r.fdsBefore || r.maps != 0 {
		t.Fatalf("the importer kept %d descriptors and %d mappings after %v", r.fdsAfter-r.fdsBefore, r.maps, r.msg)
	}
	return r
}

// ok fails unless the import succeeded, every byte as sent.
func (r importResult) ok(t *testing.T) {
	t.Helper()
	if r.code != OK {
		t.Fatalf("the import across namespaces failed: %v: %s", r.code, r.msg)
	}
}

// refused fails unless the import failed at once with code, saying want.
func (r importResult) refused(t *testing.T, want string, code Code) {
	t.Helper()
	if r.code != code || !strings.Contains(r.msg, want) {
		t.Fatalf("got %v: %s; want %v saying %q", r.code, r.msg, code, want)
	}
	if r.took > promptly {
		t.Fatalf("refused only after %v (timeout %v): %s", r.took, faultTimeout, r.msg)
	}
}

// TestReceiverInOtherNamespaces: the receiver in a PID namespace of its
// own, or in a container of its own (PID, network and mount namespaces, the
// socket directory bind-mounted), the exporter in ours. Through the socket
// directory every byte arrives and nothing is left on either side; with an
// abstract socket the receiver is refused at once, naming the cause, and
// the use is not spent.
func TestReceiverInOtherNamespaces(t *testing.T) {
	lab := newNSLab(t)
	for _, tc := range []struct {
		name         string
		wrap         []string
		seed         byte
		abstractSays string
	}{
		{"PID namespace", lab.pidOnly(), 31, "is in another PID namespace and no shared socket directory is set"},
		{"container", lab.container(containerOpts{}), 34, "abstract sockets do not cross network namespaces; set VMMIPC_SOCKET_DIR"},
	} {
		t.Run(tc.name+"/socket directory", func(t *testing.T) {
			sender, addr := startSender(t, nil, lab.shared)
			base := sender.fds()
			tk := sender.register(8, 4096, 1, -1, tc.seed)
			importIn(t, tc.wrap, tk, tc.seed).ok(t)
			sender.expectDone(base)
			lab.expectCleanClose(t, sender, addr)
		})
		t.Run(tc.name+"/abstract socket", func(t *testing.T) {
			sender, _ := startSender(t, nil, "")
			tk := sender.register(4, 4096, 1, -1, tc.seed+1)
			importIn(t, tc.wrap, tk, tc.seed+1).refused(t, tc.abstractSays, EIO)
			if n := sender.live(); n != 1 {
				t.Fatalf("%d registrations live, want the one, not spent", n)
			}
		})
	}
}

// TestExporterInAnotherPidNamespace: the exporter in a PID namespace of
// its own, the receiver in ours: every byte arrives, nothing is left here.
func TestExporterInAnotherPidNamespace(t *testing.T) {
	lab := newNSLab(t)
	sender, _ := startSender(t, lab.pidOnly(), lab.shared)
	tk := sender.register(8, 4096, 1, -1, 32)
	if tk.NS.pidNS() != nsOther {
		t.Fatalf("the ticket's PID namespace %d is not another one than ours (%d)", tk.NS.PID, selfNamespaces().PID)
	}
	fdsBefore := ourFDs().settled(t)
	if err := importVerified(tk, ImportOptions{}, 32); err != nil {
		t.Fatal(err)
	}
	ourFDs().waitFor(t, fdsBefore, "after importing from another PID namespace")
	expectNoMemfdMappings(t, "after importing from another PID namespace")
}

// TestTwoContainers: exporter and receiver each in a container of its own,
// sharing only the socket directory (and, in the second case, each in a
// user namespace of its own, uid 0 inside mapped to ours). Every byte
// arrives, the second time through an import-cache hit (its confirmation
// runs the whole handshake); the exporter's descriptors are back after;
// its files go when it closes.
func TestTwoContainers(t *testing.T) {
	for _, tc := range []struct {
		name string
		o    containerOpts
	}{{"pid+net+mount", containerOpts{}}, {"pid+net+mount+user", containerOpts{user: true}}} {
		t.Run(tc.name, func(t *testing.T) {
			lab := newNSLab(t)
			sender, addr := startSender(t, lab.container(tc.o), lab.shared)
			base := sender.fds()
			tk := sender.register(64, 4096, 3, -1, 36)
			importIn(t, lab.container(tc.o), tk, 36).ok(t)
			r := importTimesIn(t, lab.container(tc.o), tk, 36, 2)
			if r.ok(t); r.hits != 1 {
				t.Fatalf("%d import-cache hits for the second import, want 1", r.hits)
			}
			sender.expectDone(base)
			lab.expectCleanClose(t, sender, addr)
		})
	}
}
