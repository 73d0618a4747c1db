package core

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Registrations from the sender's side: Wait, RegisterAgain, the option
// bounds and what HostFile accepts; and the receiver's address-space check.

// TestWaitUntilReleased: Wait times out on a live registration (0 = just
// check), returns once it ended and its OnRelease returned, and returns at
// once for one that ended long ago.
func TestWaitUntilReleased(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, 1))
	defer unix.Close(fd)
	var released atomic.Bool
	tk := registerFile(t, s, fd, 4*4096, 4096, RegisterOptions{Uses: 1, OnRelease: func() { released.Store(true) }})
	if err := s.Wait(tk, 0); CodeOf(err) != ETIMEDOUT || !strings.Contains(err.Error(), "is still live") {
		t.Fatalf("wait(0) on a live registration: %v, want ETIMEDOUT", err)
	}
	start := time.Now()
	if err := s.Wait(tk, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT {
		t.Fatalf("wait(50 ms) on a live registration: %v, want ETIMEDOUT", err)
	}
	if d := time.Since(start); d < 50*time.Millisecond || d > promptly {
		t.Fatalf("wait(50 ms) returned after %v", d)
	}
	waited := make(chan error, 1)
	go func() { waited <- s.Wait(tk, 10*time.Second) }()
	r := importHost(t, tk, ImportOptions{}) // the only use
	Unmap(r.ID, r.Base)
	select {
	case err := <-waited:
		if err != nil {
			t.Fatalf("wait across the last use: %v", err)
		}
		if !released.Load() {
			t.Fatal("wait returned before OnRelease ran")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("wait did not return after the last use")
	}
	if err := s.Wait(tk, 0); err != nil {
		t.Fatalf("wait(0) on a registration released earlier: %v", err)
	}
}

// registerPage registers one page of pattern(1) with opts on a server of
// the test's own. The memfd is closed at once: the registration holds a
// duplicate of its own.
func registerPage(t *testing.T, opts RegisterOptions) (*Server, *Ticket) {
	t.Helper()
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	return s, registerFile(t, s, fd, 4096, 4096, opts)
}

// TestWaitForASlowRelease: while OnRelease runs, the registration has ended
// but Wait still times out, saying so.
func TestWaitForASlowRelease(t *testing.T) {
	unblock := make(chan struct{})
	s, tk := registerPage(t, RegisterOptions{OnRelease: func() { <-unblock }})
	unregistered := make(chan error, 1)
	go func() { unregistered <- s.Unregister(tk) }() // runs OnRelease, which blocks
	if !waitUntil(2*time.Second, func() bool { return s.Live() == 0 }) {
		t.Fatal("unregister did not end the registration")
	}
	if err := s.Wait(tk, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT || !strings.Contains(err.Error(), "has ended, but what it lent is still in use") {
		t.Fatalf("wait while OnRelease runs: %v, want ETIMEDOUT saying it has ended", err)
	}
	close(unblock)
	if err := <-unregistered; err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(tk, 2*time.Second); err != nil {
		t.Fatalf("wait after OnRelease returned: %v", err)
	}
}

// TestWaitForLenders: a registration that lends the exporter (a C
// export_fn, borrowed CUDA handles) is released only once no registration
// of its buffer lives, after the exporter; Wait says so until then.
func TestWaitForLenders(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, 2))
	defer unix.Close(fd)
	var mu sync.Mutex
	var order []string
	note := func(what string) func() {
		return func() { mu.Lock(); order = append(order, what); mu.Unlock() }
	}
	spec := hookedFile(t, fd, 4*4096, 4096, func(uint64) error { return nil })
	file := spec.Exporter
	spec.Exporter = &testExporter{export: file.ExportChunk, release: func() { note("exporter")(); file.Release() }}
	lender, err := s.Register(spec, RegisterOptions{Uses: 1, LendsExporter: true, OnRelease: note("lender")})
	if err != nil {
		t.Fatal(err)
	}
	again, err := s.RegisterAgain(lender, RegisterOptions{OnRelease: note("again")})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(lender); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(lender, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT || !strings.Contains(err.Error(), "registrations made from it still live") {
		t.Fatalf("wait on a lender whose buffer lives on: %v, want ETIMEDOUT", err)
	}
	r := importHost(t, again, ImportOptions{NoCache: true}) // the buffer still serves
	if err := verifyAndUnmap(r, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(again); err != nil {
		t.Fatal(err)
	}
	for _, tk := range []*Ticket{lender, again} {
		if err := s.Wait(tk, 2*time.Second); err != nil {
			t.Fatalf("wait on registration %d once the buffer ended: %v", tk.RegID, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	count := map[string]int{}
	at := map[string]int{}
	for i, what := range order {
		count[what]++
		at[what] = i
	}
	if len(order) != 3 || count["again"] != 1 || count["exporter"] != 1 || count["lender"] != 1 || at["lender"] < at["exporter"] {
		t.Fatalf("releases %v: want each once, the lender after the exporter it lent", order)
	}
}

// TestWaitRefusals: Wait on tickets that are not this server's, or with a
// wrong secret.
func TestWaitRefusals(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{})
	bad := *tk
	bad.Secret[0] ^= 1
	if err := s.Wait(&bad, 0); CodeOf(err) != EAUTH {
		t.Fatalf("wait with a wrong secret: %v, want EAUTH", err)
	}
	unknown := *tk
	unknown.RegID += 100
	if err := s.Wait(&unknown, 0); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "never registered") {
		t.Fatalf("wait on a registration never issued: %v, want ENOENT", err)
	}
}

// TestWaitOnAnotherExportersTicket: a ticket of another exporter is
// refused (ENOENT), even when its registration id is one this server
// issued too (ids are small numbers, counted from 1 by every exporter).
func TestWaitOnAnotherExportersTicket(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{})
	for _, other := range []func(*Ticket){
		func(o *Ticket) { o.Pid++ },
		func(o *Ticket) { o.Address += "x" },
	} {
		o := *tk
		other(&o)
		if err := s.Wait(&o, 0); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "another exporter") {
			t.Fatalf("wait on another exporter's ticket (%s, pid %d) with a registration id this server issued: %v, want ENOENT", o.Address, o.Pid, err)
		}
	}
}

// TestRegisterAgain: a new registration of the same buffer with its own
// uses and secret; the memory stays exported (the memfd duplicate open)
// until the last registration of it ends.
func TestRegisterAgain(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, 3))
	defer unix.Close(fd)
	before := ourFDs().settled(t)
	var released atomic.Int32
	orig := registerFile(t, s, fd, 4*4096, 4096, RegisterOptions{Uses: 1, OnRelease: func() { released.Add(1) }})
	again, err := s.RegisterAgain(orig, RegisterOptions{Uses: 2, OnRelease: func() { released.Add(10) }})
	if err != nil {
		t.Fatal(err)
	}
	if again.BufferID != orig.BufferID || again.RegID == orig.RegID || again.Secret == orig.Secret || again.Count != orig.Count || again.Total != orig.Total {
		t.Fatalf("register again gave %s, the original %s", again, orig)
	}
	ourFDs().waitFor(t, before+1, "two registrations of one memfd (one duplicate)")
	r := importHost(t, orig, ImportOptions{NoCache: true})
	Unmap(r.ID, r.Base)
	if _, err := Open(orig, OpenOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("the original's second use: %v, want ENOENT (its one use is spent)", err)
	}
	if !waitUntil(2*time.Second, func() bool { return released.Load() == 1 }) {
		t.Fatalf("release count %d after the original ended, want its own 1", released.Load())
	}
	ourFDs().waitFor(t, before+1, "the original ended, a registration of its memory lives (the duplicate stays)")
	for i := 0; i < 2; i++ { // its own two uses
		r := importHost(t, again, ImportOptions{NoCache: true})
		if err := verifyAndUnmap(r, 3); err != nil {
			t.Fatal(err)
		}
	}
	if !waitUntil(2*time.Second, func() bool { return released.Load() == 11 }) {
		t.Fatalf("release count %d after both ended, want 11", released.Load())
	}
	ourFDs().waitFor(t, before, "once no registration of the memfd lives")
	if _, err := s.RegisterAgain(orig, RegisterOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("register again from an ended registration: %v, want ENOENT", err)
	}
}

func TestRegisterAgainRefusals(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{})
	bad := *tk
	bad.Secret[5] ^= 1
	if _, err := s.RegisterAgain(&bad, RegisterOptions{}); CodeOf(err) != EAUTH {
		t.Fatalf("wrong secret: %v, want EAUTH", err)
	}
	other := *tk
	other.Address += "x"
	if _, err := s.RegisterAgain(&other, RegisterOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("another exporter's ticket: %v, want ENOENT", err)
	}
	if _, err := s.RegisterAgain(tk, RegisterOptions{TTL: MaxTTL + time.Millisecond}); CodeOf(err) != EINVAL {
		t.Fatalf("ttl above the bound: %v, want EINVAL", err)
	}
	if s.Live() != 1 {
		t.Fatalf("%d live registrations after refused calls, want 1", s.Live())
	}
}

// TestRegisterAgainOwnTTL: the new registration expires on its own ttl;
// the original is untouched.
func TestRegisterAgainOwnTTL(t *testing.T) {
	s, orig := registerPage(t, RegisterOptions{})
	again, err := s.RegisterAgain(orig, RegisterOptions{TTL: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(again, 5*time.Second); err != nil {
		t.Fatalf("the new registration did not expire: %v", err)
	}
	if _, err := Open(again, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("after its ttl: %v", err)
	}
	st, err := Open(orig, OpenOptions{})
	if err != nil {
		t.Fatalf("the original after the new one expired: %v", err)
	}
	st.Close()
}

// TestOptionBounds: each bound of vmmipc.h's VMMIPC_MAX_* holds at its
// value and is refused one past it, by Validate and by the calls that take
// the options.
func TestOptionBounds(t *testing.T) {
	ok := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v, want ok", what, err)
		}
	}
	refused := func(what string, err error, says string) {
		t.Helper()
		if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), says) {
			t.Errorf("%s: %v, want EINVAL saying %q", what, err, says)
		}
	}
	ok("window at the bound", OpenOptions{Window: MaxWindow}.Validate())
	refused("window past the bound", OpenOptions{Window: MaxWindow + 1}.Validate(), "window 1025 is larger than 1024")
	refused("negative timeout", OpenOptions{Timeout: -time.Second}.Validate(), "negative")
	ok("64 access devices", ImportOptions{Access: make([]int32, MaxAccessDevices)}.Validate())
	refused("65 access devices", ImportOptions{Access: make([]int32, MaxAccessDevices+1)}.Validate(), "65 access devices exceed the limit of 64")
	refused("window inside import options", ImportOptions{OpenOptions: OpenOptions{Window: MaxWindow + 1}}.Validate(), "window")
	refused("a count of access devices", CheckAccessCount(1<<40), "exceed the limit")
	ok("ttl at the bound", RegisterOptions{TTL: MaxTTL}.Validate())
	refused("ttl past the bound", RegisterOptions{TTL: MaxTTL + time.Millisecond}.Validate(), "ttl")
	refused("negative ttl", RegisterOptions{TTL: -1}.Validate(), "ttl")
	if d, err := TTLFromMillis(1 << 40); err != nil || d != MaxTTL {
		t.Errorf("TTLFromMillis(2^40) = %v, %v", d, err)
	}
	_, err := TTLFromMillis(1<<40 + 1)
	refused("ttl_ms past the bound", err, "ttl_ms 1099511627777 is larger than 1099511627776")
	// Each count message says which of the two is wrong, and nothing of the
	// other (not "count 0 is 0 or above the limit").
	refused("0 chunks", CheckCount(0, "vmmipc_register"), "vmmipc_register: count is 0: register at least one chunk")
	if err := CheckCount(0, "x"); strings.Contains(err.Error(), "limit") {
		t.Errorf("0 chunks: %v, speaks of the limit", err)
	}
	ok("1 chunk", CheckCount(1, "x"))
	ok("chunks at the bound", CheckCount(MaxChunks, "x"))
	refused("chunks past the bound", CheckCount(MaxChunks+1, "x"), "x: count 67108865 is above the limit of 67108864 chunks (VMMIPC_MAX_CHUNKS)")
	if err := CheckCount(MaxChunks+1, "x"); strings.Contains(err.Error(), " 0 ") {
		t.Errorf("chunks past the bound: %v, speaks of 0", err)
	}
	for _, k := range []uint32{1, 2} {
		if got, err := KindOf(k); err != nil || got != uint8(k) {
			t.Errorf("KindOf(%d) = %d, %v", k, got, err)
		}
	}
	for _, k := range []uint32{0, 3, 257} {
		_, err := KindOf(k)
		refused(fmt.Sprintf("memory kind %d", k), err, "memory_kind")
	}

	// The calls check them too.
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, 4096, 4096, RegisterOptions{})
	_, err = Open(tk, OpenOptions{Window: MaxWindow + 1})
	refused("Open", err, "window")
	_, err = Import(tk, DeviceHost, ImportOptions{Access: make([]int32, MaxAccessDevices+1)}, nil)
	refused("Import", err, "access devices")
	_, err = Import(tk, DeviceHost, ImportOptions{Access: []int32{0}}, nil)
	refused("Import of host memory with access devices", err, "CUDA memory only")
	spec, err := HostFile(fd, 4096, 4096)
	if err != nil {
		t.Fatal(err)
	}
	var releasedSpec atomic.Bool
	file := spec.Exporter
	spec.Exporter = &testExporter{export: file.ExportChunk, release: func() { releasedSpec.Store(true); file.Release() }}
	_, err = s.Register(spec, RegisterOptions{TTL: MaxTTL + time.Millisecond})
	refused("Register", err, "ttl")
	if releasedSpec.Load() {
		t.Error("a refused Register released the caller's exporter")
	}
	spec.Exporter.Release()
}

// TestBufferSpecChecks: what Register refuses in a spec, and what HostFile
// refuses in a file, with messages that say what to change.
func TestBufferSpecChecks(t *testing.T) {
	s := newTestServer(t)
	exp := &testExporter{export: func(uint64) (int, uint64, error) { return -1, 0, nil }}
	for _, tc := range []struct {
		name string
		spec BufferSpec
		says string
	}{
		{"no chunks", BufferSpec{Kind: MemoryHost, Exporter: exp}, "register: count is 0: register at least one chunk"},
		{"no exporter", BufferSpec{Sizes: []uint64{4096}, Kind: MemoryHost}, "no exporter"},
		{"unknown kind", BufferSpec{Sizes: []uint64{4096}, Kind: 3, Exporter: exp}, "unknown memory kind 3"},
		{"host with a UUID", BufferSpec{Sizes: []uint64{4096}, Kind: MemoryHost, DeviceUUID: [16]byte{1}, Exporter: exp}, "no device UUID"},
		{"a zero size", BufferSpec{Sizes: []uint64{4096, 0}, Kind: MemoryCUDA, Exporter: exp}, "chunk 1 has size 0"},
		{"host chunk not page aligned", BufferSpec{Sizes: []uint64{4095, 4096}, Kind: MemoryHost, Exporter: exp}, "not a multiple of the page size"},
		{"sizes overflow", BufferSpec{Sizes: []uint64{1 << 63, 1 << 63}, Kind: MemoryCUDA, Exporter: exp}, "overflow"},
	} {
		if _, err := s.Register(tc.spec, RegisterOptions{}); CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want EINVAL saying %q", tc.name, err, tc.says)
		}
	}
	if _, err := s.Register(BufferSpec{Sizes: []uint64{4096, 100}, Kind: MemoryHost, Exporter: exp}, RegisterOptions{}); err != nil {
		t.Errorf("a host buffer whose last chunk is short: %v", err)
	}

	before := ourFDs().settled(t)
	sealed := newMemfd(t, 8192, nil)
	defer unix.Close(sealed)
	unsealed, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	unix.Ftruncate(unsealed, 8192)
	unsealable, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC) // F_SEAL_SEAL set
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealable)
	unix.Ftruncate(unsealable, 8192)
	disk := tempFile(t, os.TempDir())
	shm := tempFile(t, "/dev/shm")
	pipe := make([]int, 2)
	if err := unix.Pipe2(pipe, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	before += 7 // the descriptors just opened
	for _, tc := range []struct {
		name        string
		fd          int
		size, chunk uint64
		says        string
	}{
		{"chunk size 0", sealed, 8192, 0, "chunk size 0 is not a positive multiple of the page size"},
		{"chunk not page aligned", sealed, 8192, 1000, "chunk size 1000"},
		{"size 0", sealed, 0, 4096, "size is 0"},
		{"too many chunks", sealed, (MaxChunks + 1) * 4096, 4096, "chunks exceed the limit"},
		{"no descriptor", -1, 8192, 4096, "is not a descriptor"},
		{"closed descriptor", 1 << 20, 8192, 4096, "bad file descriptor"},
		{"larger than the file", sealed, 3 * 4096, 4096, "fewer than the 12288 needed"},
		{"a pipe", pipe[0], 4096, 4096, "not a regular file or memfd"},
		{"unsealed memfd", unsealed, 8192, 4096, "seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)"},
		{"memfd that can no longer be sealed", unsealable, 8192, 4096, "can no longer be"},
		{"a file in " + os.TempDir(), int(disk.Fd()), 8192, 4096, unsealableSays(t, disk)},
		{"a file in /dev/shm", int(shm.Fd()), 8192, 4096, unsealableSays(t, shm)},
	} {
		if _, err := HostFile(tc.fd, tc.size, tc.chunk); CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("HostFile, %s: %v, want EINVAL saying %q", tc.name, err, tc.says)
		}
	}
	ourFDs().waitFor(t, before, "after refused host files (no duplicate may stay open)")
}

// tempFile is a file of 8192 bytes in dir, removed at the end.
func tempFile(t *testing.T, dir string) *os.File {
	t.Helper()
	f, err := os.CreateTemp(dir, "vmmipc-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close(); os.Remove(f.Name()) })
	if err := f.Truncate(8192); err != nil {
		t.Fatal(err)
	}
	return f
}

// unsealableSays is what HostFile must say of a file that is not a memfd:
// tmpfs files (/dev/shm) have a message of their own.
func unsealableSays(t *testing.T, f *os.File) string {
	t.Helper()
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil {
		t.Fatal(err)
	}
	if fs.Type == unix.TMPFS_MAGIC {
		return "cannot be sealed (a tmpfs file such as one in /dev/shm, not a memfd)"
	}
	return "cannot be sealed (not a memfd: a disk file?"
}

// TestSizesRoundDown: a refusal's figures never round up to what was
// needed (192 MiB less 40 KiB read "192.0 MiB free" for 192 MiB needed).
func TestSizesRoundDown(t *testing.T) {
	for n, want := range map[uint64]string{
		192<<20 - 40<<10: "191.9 MiB", 192 << 20: "192.0 MiB", 1<<30 + 1<<30/10*9 + 1<<29/10: "1.9 GiB", 4095: "4095 bytes",
	} {
		if got := sizeStr(n); got != want {
			t.Errorf("sizeStr(%d) = %q, want %q", n, got, want)
		}
	}
	for n, want := range map[uint64]string{
		40<<10 - 1: "40 KiB", 2<<20 - 10<<10: "2.0 MiB", 2 << 20: "2.0 MiB", 2<<20 + 1: "2.1 MiB", 3 << 30: "3072.0 MiB",
	} {
		if got := shortStr(n); got != want {
			t.Errorf("shortStr(%d) = %q, want %q (never less than it is)", n, got, want)
		}
	}
}

// TestAddressSpaceCheck: under a tight RLIMIT_AS, a reservation that would
// leave the Go runtime less than its headroom is refused with ENOMEM and
// the figures, before anything is reserved; the use it claimed is given
// back. It runs in a helper process, which lowers its own limit (1 GiB
// above what it uses, so it works under the race detector's huge
// reservations too).
func TestAddressSpaceCheck(t *testing.T) {
	h := startHelper(t, partAddrSpace, helperOpts{})
	if got := h.expect("check 67108864 ", faultTimeout); got != "code=0 <nil>" {
		t.Fatalf("64 MiB with 1 GiB free: %s", got)
	}
	got := h.expect("check 2147483648 ", faultTimeout)
	for _, want := range []string{fmt.Sprintf("code=%d", ENOMEM), "reserving 2.0 GiB needs that much address space plus 128.0 MiB kept for the Go runtime", "but RLIMIT_AS (", "free (", "in use), ", " short: raise RLIMIT_AS (ulimit -v) or import less at a time"} {
		if !strings.Contains(got, want) {
			t.Fatalf("2 GiB with 1 GiB free: %q does not say %q", got, want)
		}
	}
	got = h.expect("import ", faultTimeout)
	var code, fdsBefore, fdsAfter, maps int
	if _, err := fmt.Sscanf(got, "code=%d fds=%d/%d maps=%d", &code, &fdsBefore, &fdsAfter, &maps); err != nil {
		t.Fatalf("%q: %v", got, err)
	}
	if Code(code) != ENOMEM || fdsAfter != fdsBefore || maps != 0 || !strings.Contains(got, "RLIMIT_AS") {
		t.Fatalf("a 2 GiB import with 1 GiB free: %s; want ENOMEM, no descriptor and no mapping left", got)
	}
	if got := h.expect("retry ", faultTimeout); got != "code=0 <nil>" {
		t.Fatalf("the same import once the limit is back (its use was given back?): %s", got)
	}
}

// sentEverythingThenUsedUp registers a buffer of 4 chunks for 2 uses and
// makes it used up behind receiver A's back: A is sent every chunk (which
// spends its use) and has not said done yet when receiver B spends the
// last use. It returns the server and A, whose done comes next.
func sentEverythingThenUsedUp(t *testing.T) (*Server, *Stream) {
	t.Helper()
	s := newTestServer(t)
	const chunks = 4
	fd := newMemfd(t, chunks*4096, pattern(chunks*4096, 7))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, chunks*4096, 4096, RegisterOptions{Uses: 2})
	a, err := Open(tk, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	for range chunks {
		ch, err := a.Next()
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ch.FD)
	}
	s.reg.mu.Lock()
	g := s.reg.live[tk.RegID]
	s.reg.mu.Unlock()
	if !waitUntil(2*time.Second, func() bool { g.mu.Lock(); defer g.mu.Unlock(); return g.consumed == 1 }) {
		t.Fatal("A's use was not spent once every chunk was sent to it")
	}
	b := importHost(t, tk, ImportOptions{NoCache: true}) // the last use
	Unmap(b.ID, b.Base)
	return s, a
}

// TestUsedUpLetsFinishedReceiversFinish: receiver A has been sent every
// chunk (its use is spent) and has not said done yet when receiver B spends
// the registration's last use. A must still get its done-ack: it has
// everything, and its use counted. (Cutting it makes an import that
// received every chunk fail and undo itself at the last step.)
func TestUsedUpLetsFinishedReceiversFinish(t *testing.T) {
	_, a := sentEverythingThenUsedUp(t)
	if _, err := a.Next(); !IsEnd(err) {
		t.Fatalf("A, sent every chunk before the registration was used up, then says done: %v, want the end of its stream", err)
	}
}

// TestDoneAckSaysWhetherTheBufferLives: the done-ack tells a receiver
// whether the buffer outlives its use, which decides whether it may keep
// the mapping cached. Receiver A was sent every chunk, then receiver B spent
// the last use: when A says done, no registration of the buffer lives, and
// its done-ack must say so.
func TestDoneAckSaysWhetherTheBufferLives(t *testing.T) {
	s, a := sentEverythingThenUsedUp(t)
	if !waitUntil(2*time.Second, func() bool { return s.Live() == 0 }) {
		t.Fatal("the registration did not end when its last use was spent")
	}
	if _, err := a.Next(); !IsEnd(err) {
		t.Fatalf("A says done: %v", err)
	}
	if a.bufferLives {
		t.Fatal("A's done-ack says the buffer lives on, but its only registration has ended")
	}
}

// TestLocalCallsRefuseAlteredTickets: unregister, wait and register_again
// take only the very ticket issued: a copy with any single byte changed is
// refused (or does not parse), and the registration is untouched.
func TestLocalCallsRefuseAlteredTickets(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{Uses: 0})
	raw, err := tk.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	for i := range raw {
		b := raw
		b[i] ^= 0x01
		bad, err := DecodeTicket(b[:])
		if err != nil {
			continue // refused already by parsing
		}
		if err := s.Unregister(bad); err == nil {
			t.Fatalf("byte %d changed: unregister succeeded", i)
		}
		if err := s.Wait(bad, 0); err == nil || CodeOf(err) == ETIMEDOUT {
			t.Fatalf("byte %d changed: wait answered %v", i, err)
		}
		if _, err := s.RegisterAgain(bad, RegisterOptions{}); err == nil {
			t.Fatalf("byte %d changed: register_again succeeded", i)
		}
	}
	if s.Live() != 1 {
		t.Fatalf("%d registrations live after the refusals, want 1", s.Live())
	}
	if err := s.Unregister(tk); err != nil {
		t.Fatalf("the real ticket: %v", err)
	}
}

// TestWaiterOutlivesAGivenBackUse: uses = 1, one receiver is being served
// and another waits for the use. The first spends it for its last chunk,
// then that send fails and the use is given back: the waiter gets it,
// rather than being told at the spend that the registration was used up.
func TestWaiterOutlivesAGivenBackUse(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4096, nil)
	defer unix.Close(fd)
	tk, err := s.Register(hookedFile(t, fd, 4096, 4096, func(uint64) error { return nil }), RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	g, err := s.reg.lookup(tk.RegID)
	if err != nil {
		t.Fatal(err)
	}
	first, err := g.claim(func() {})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		c   *claim
		err error
	}
	waiter := make(chan result, 1)
	go func() { c, err := g.claim(func() {}); waiter <- result{c, err} }()
	if !waitUntil(5*time.Second, func() bool { return blockedIn("(*registration).claim") }) {
		t.Fatal("the second receiver never waited for the use")
	}
	g.spend(first)
	select {
	case r := <-waiter:
		t.Fatalf("the waiter returned at the spend (%v, %v): the use may still come back", r.c, r.err)
	case <-time.After(100 * time.Millisecond):
	}
	g.unspend(first) // the last send failed
	g.drop(first)
	select {
	case r := <-waiter:
		if r.err != nil {
			t.Fatalf("the waiter was refused a use that was given back: %v", r.err)
		}
		g.drop(r.c)
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter never got the use given back")
	}
	if err := s.Unregister(tk); err != nil {
		t.Fatal(err)
	}
}

// blockedIn reports whether some goroutine is parked in a select inside fn
// (a waiter in claim).
func blockedIn(fn string) bool {
	buf := make([]byte, 1<<20)
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "[select") && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}
