package core

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// What the tests of this package share: memfds with a known pattern, an
// Exporter made of functions, the in-process server, and small helpers.
// The two ways to see what the library holds (descriptors in
// /proc/<pid>/fd, mappings in /proc/self/maps) are in
// testutil_leaks_test.go.

// testMemfdName names every memfd the tests make. No test maps one itself,
// so a mapping of it in /proc/self/maps ("/memfd:vmmipc-test (deleted)") is
// always one the library imported.
const testMemfdName = "vmmipc-test"

// pattern is the content of test buffers: it differs per page and per seed,
// so a chunk mapped at the wrong place or from the wrong buffer shows.
func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i/4096) ^ byte(i) ^ seed
	}
	return b
}

// newMemfd makes a memfd of size bytes that starts with content (the rest
// reads as zeros and takes no memory), sealed against shrinking as host
// memory must be: the one memfd maker of these tests. The caller closes it.
func newMemfd(t testing.TB, size int, content []byte) int {
	t.Helper()
	fd, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	if _, err := unix.Pwrite(fd, content, 0); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	return fd
}

// bytesAt views mapped memory at a raw address (the mapping is not Go
// memory, so the GC does not care).
func bytesAt(addr, n uint64) []byte {
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr))), n)
}

// expected holds the patterns verifyRef compares with, computed once per
// size and seed: a thousand concurrent receivers would otherwise each
// compute their own, slowly under the race detector.
var expected struct {
	mu sync.Mutex
	m  map[[2]int][]byte
}

// verifyRef checks an imported mapping byte for byte against
// pattern(seed), naming the first byte that differs.
func verifyRef(r Ref, seed byte) error {
	expected.mu.Lock()
	key := [2]int{int(r.Size), int(seed)}
	want := expected.m[key]
	if want == nil {
		if expected.m == nil {
			expected.m = map[[2]int][]byte{}
		}
		want = pattern(int(r.Size), seed)
		expected.m[key] = want
	}
	expected.mu.Unlock()
	got := bytesAt(r.Base, r.Size)
	if bytes.Equal(got, want) {
		return nil
	}
	for i := range want {
		if got[i] != want[i] {
			return fmt.Errorf("mapping at %#x: byte %d (page %d) is %#x, want %#x (seed %d)", r.Base, i, i/4096, got[i], want[i], seed)
		}
	}
	return nil
}

// testExporter is an Exporter made of functions, for tests that inject
// failures or stalls (the library itself exports files and CUDA handles).
type testExporter struct {
	export  func(index uint64) (fd int, fileOffset uint64, err error)
	release func()
}

func (e *testExporter) ExportChunk(i uint64) (int, uint64, error) { return e.export(i) }

func (e *testExporter) Release() {
	if e.release != nil {
		e.release()
	}
}

// hookedFile is HostFile(fd, size, chunk) with before(i) run ahead of each
// export: an error from it fails the chunk. The spec has no key, so it
// never joins another registration of the same file.
func hookedFile(t testing.TB, fd int, size, chunk uint64, before func(i uint64) error) BufferSpec {
	t.Helper()
	spec, err := HostFile(fd, size, chunk)
	if err != nil {
		t.Fatal(err)
	}
	file := spec.Exporter
	spec.Key = ""
	spec.Exporter = &testExporter{
		export: func(i uint64) (int, uint64, error) {
			if err := before(i); err != nil {
				return -1, 0, err
			}
			return file.ExportChunk(i)
		},
		release: file.Release,
	}
	return spec
}

// newTestServer starts a server of its own for one test. At the end it
// stops listening and ends every registration still live, so that the
// descriptors they hold (memfd duplicates) do not outlive the test.
func newTestServer(t testing.TB) *Server {
	t.Helper()
	return newTestServerIn(t, "")
}

// newTestServerIn is newTestServer with its socket in dir ("": abstract).
func newTestServerIn(t testing.TB, dir string) *Server {
	t.Helper()
	s, err := NewServer(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Close()
		s.reg.mu.Lock()
		var live []*registration
		for _, g := range s.reg.live {
			live = append(live, g)
		}
		s.reg.mu.Unlock()
		for _, g := range live {
			g.end("ended with its test")
		}
	})
	return s
}

// registerFile registers bytes [0, size) of fd in chunks of chunk bytes
// (sealing it, as vmmipc_register_host_file does).
func registerFile(t testing.TB, s *Server, fd int, size, chunk uint64, opts RegisterOptions) *Ticket {
	t.Helper()
	tk, err := s.RegisterHostFile(fd, size, chunk, opts)
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// importHost imports a host ticket and fails the test on error.
func importHost(t testing.TB, tk *Ticket, opts ImportOptions) Ref {
	t.Helper()
	r, err := Import(tk, DeviceHost, opts, nil)
	if err != nil {
		t.Fatalf("import %s: %v", tk, err)
	}
	return r
}

// verifyAndUnmap checks r byte for byte against pattern(seed) and unmaps
// it whatever the bytes were, so that a failed check leaves no mapping
// behind; it returns the first failure.
func verifyAndUnmap(r Ref, seed byte) error {
	verr := verifyRef(r, seed)
	if err := Unmap(r.ID, r.Base); err != nil && verr == nil {
		return err
	}
	return verr
}

// importVerified imports a host ticket, checks every byte against
// pattern(seed) and unmaps it: one receiver, start to end, for tests that
// run many (it returns its failure instead of failing the test, so that
// goroutines may call it).
func importVerified(tk *Ticket, opts ImportOptions, seed byte) error {
	r, err := Import(tk, DeviceHost, opts, nil)
	if err != nil {
		return err
	}
	return verifyAndUnmap(r, seed)
}

// runAtOnce runs f(0), …, f(n-1) in goroutines released together and
// returns once every one has returned: how many failed, and the first
// failure to come back.
func runAtOnce(n int, f func(i int) error) (failed int, first error) {
	start := make(chan struct{})
	errs := make(chan error, n)
	for i := range n {
		go func() {
			<-start
			errs <- f(i)
		}()
	}
	close(start)
	for range n {
		if err := <-errs; err != nil {
			failed++
			first = cmpOr(first, err)
		}
	}
	return failed, first
}

// dirNames lists the names in dir, sorted (as os.ReadDir returns them).
func dirNames(t testing.TB, dir string) []string {
	t.Helper()
	es, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range es {
		names = append(names, e.Name())
	}
	return names
}

// cat concatenates byte slices.
func cat(bs ...[]byte) []byte {
	var out []byte
	for _, b := range bs {
		out = append(out, b...)
	}
	return out
}

// trials returns n, or short under -short.
func trials(n, short int) int {
	if testing.Short() {
		return short
	}
	return n
}

// randIndex picks an index in [0, n).
func randIndex(n int) int { return rand.IntN(n) }

func itoa(i int) string { return strconv.Itoa(i) }

// waitUntil polls cond every millisecond until it holds or timeout passes,
// and reports whether it held.
func waitUntil(timeout time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}
