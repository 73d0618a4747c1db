package core

import (
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The import cache (issue 13), on host memory: its fixtures and its hits
// here; misses, the bounds and the configuration in cache_bounds_test.go;
// invalidation, in-place writes and no stale hit in
// cache_invalidation_test.go; confirmations in cache_confirm_test.go.

const cachePages = 16
const cacheSize = cachePages * 4096

// confirmsAnswered waits, at most within, until no confirmation is queued
// or in flight (table hits' spends among them), and reports whether none is.
func confirmsAnswered(within time.Duration) bool {
	return waitUntil(within, func() bool { pending, _ := confirms.counts(); return pending == 0 })
}

// cacheTest starts from an empty cache (nothing kept by earlier tests, no
// reference leaked by one) and restores its limit at the end. It returns
// the cache as it starts, the base of the counters that expectCache
// compares.
func cacheTest(t *testing.T) CacheInfo {
	t.Helper()
	flushCache(t)
	// An earlier test's late uses (table hits) are answered first.
	confirmsAnswered(5 * time.Second)
	info := GetCacheInfo()
	if info.Entries != 0 || info.ReferencedBytes != 0 || info.UnreferencedBytes != 0 {
		t.Fatalf("the cache holds %d mappings (%d bytes referenced, %d not) before the test: an earlier test leaked a reference", info.Entries, info.ReferencedBytes, info.UnreferencedBytes)
	}
	expectNoMemfdMappings(t, "before the test")
	limit := info.LimitBytes
	t.Cleanup(func() {
		_ = SetCacheLimit(0) // undo what the test kept
		_ = SetCacheLimit(limit)
	})
	return info
}

// counting is a registration of a memfd of pattern(seed) whose exporter
// counts the descriptors it made: a hit must make none.
type counting struct {
	tk      *Ticket
	exports *atomic.Int64
}

func registerCounting(t *testing.T, s *Server, size int, seed byte, opts RegisterOptions) counting {
	t.Helper()
	fd := newMemfd(t, size, pattern(size, seed))
	defer unix.Close(fd)
	var n atomic.Int64
	spec := hookedFile(t, fd, uint64(size), 4096, func(uint64) error { n.Add(1); return nil })
	tk, err := s.Register(spec, opts)
	if err != nil {
		t.Fatal(err)
	}
	return counting{tk, &n}
}

// cacheDelta is what changed in the counters since before; the other fields
// are as they are now.
func cacheDelta(before CacheInfo) CacheInfo {
	// A table hit's use is spent after it returned: count what the
	// exporter answered.
	confirmsAnswered(5 * time.Second)
	d := GetCacheInfo()
	d.TableHits -= before.TableHits
	d.Hits -= before.Hits
	d.Misses -= before.Misses
	d.Evictions -= before.Evictions
	d.Invalidations -= before.Invalidations
	d.ConfirmsFailed -= before.ConfirmsFailed
	d.TableImports -= before.TableImports
	return d
}

// expectCache compares the cache with want (counters as deltas since
// before; LimitBytes is not compared).
func expectCache(t *testing.T, what string, before, want CacheInfo) {
	t.Helper()
	got := cacheDelta(before)
	got.LimitBytes = want.LimitBytes
	got.TableImports = want.TableImports // how a miss was mapped: tablemiss_test.go
	if got != want {
		t.Fatalf("%s: cache %+v, want %+v", what, got, want)
	}
}

// expectMapped checks, independently of the cache's own counts, how many
// bytes of the senders' memfds are mapped here.
func expectMapped(t *testing.T, what string, want uint64) {
	t.Helper()
	if _, got := memfdMappings(t); got != want {
		t.Fatalf("%s: %d bytes of memfds mapped in /proc/self/maps, want %d", what, got, want)
	}
}

func unmapRef(t *testing.T, r Ref) {
	t.Helper()
	if err := Unmap(r.ID, r.Base); err != nil {
		t.Fatal(err)
	}
}

// unmapLast checks r against pattern(seed) and unmaps it, the last
// reference of a buffer that has ended: the cache keeps nothing of it
// (want: the cache after, counters as deltas since before) and nothing
// stays mapped.
func unmapLast(t *testing.T, what string, r Ref, seed byte, before, want CacheInfo) {
	t.Helper()
	if err := verifyAndUnmap(r, seed); err != nil {
		t.Fatal(err)
	}
	expectCache(t, what, before, want)
	expectMapped(t, what, 0)
}

// TestCacheHitSameTicket: the same ticket imported again (uses = 2) is a
// hit: the same address, no descriptor made, one use spent. The second
// import uses the registration up, so the exporter says the buffer does
// not live on and the last Unmap undoes the mapping.
func TestCacheHitSameTicket(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	reg := registerCounting(t, s, cacheSize, 1, RegisterOptions{Uses: 2})
	first := importHost(t, reg.tk, ImportOptions{})
	if err := verifyRef(first, 1); err != nil {
		t.Fatal(err)
	}
	if reg.exports.Load() != cachePages {
		t.Fatalf("%d chunks exported for the first import, want %d", reg.exports.Load(), cachePages)
	}
	expectCache(t, "after the miss", before, CacheInfo{Entries: 1, ReferencedBytes: cacheSize, Misses: 1})
	unmapRef(t, first)
	expectCache(t, "kept", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Misses: 1})
	expectMapped(t, "kept", cacheSize)

	second := importHost(t, reg.tk, ImportOptions{})
	if second.Base != first.Base || second.ID == first.ID {
		t.Fatalf("the hit is reference %d at %#x; the first was %d at %#x", second.ID, second.Base, first.ID, first.Base)
	}
	if reg.exports.Load() != cachePages {
		t.Fatalf("a hit made %d descriptors", reg.exports.Load()-cachePages)
	}
	if !waitUntil(2*time.Second, func() bool { return s.Live() == 0 }) {
		t.Fatal("the hit did not spend the registration's second use")
	}
	expectCache(t, "after the hit", before, CacheInfo{Entries: 1, ReferencedBytes: cacheSize, Hits: 1, TableHits: 1, Misses: 1})
	unmapLast(t, "after the last use", second, 1, before, CacheInfo{Hits: 1, TableHits: 1, Misses: 1})
	if _, err := Import(reg.tk, DeviceHost, ImportOptions{}, nil); CodeOf(err) != ENOENT {
		t.Fatalf("a third import of a used-up ticket: %v, want ENOENT", err)
	}
}

// TestCacheHitWhileReferenced: hits on a mapping that is still referenced,
// from several goroutines at once, all return the same address; it is
// undone only with the last reference once the buffer ended.
func TestCacheHitWhileReferenced(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	reg := registerCounting(t, s, cacheSize, 2, RegisterOptions{})
	first := importHost(t, reg.tk, ImportOptions{})
	const hits = 8
	refs := make([]Ref, hits)
	failed, firstErr := runAtOnce(hits, func(i int) (err error) {
		refs[i], err = Import(reg.tk, DeviceHost, ImportOptions{}, nil)
		return err
	})
	if failed > 0 {
		t.Fatalf("%d of %d concurrent hits failed; the first: %v", failed, hits, firstErr)
	}
	for _, r := range refs {
		if r.Base != first.Base {
			t.Fatalf("a concurrent hit at %#x, the mapping is at %#x", r.Base, first.Base)
		}
	}
	if reg.exports.Load() != cachePages {
		t.Fatalf("%d hits made %d descriptors", hits, reg.exports.Load()-cachePages)
	}
	expectCache(t, "referenced 9 times", before, CacheInfo{Entries: 1, ReferencedBytes: cacheSize, Hits: hits, TableHits: hits, Misses: 1})
	if err := s.Unregister(reg.tk); err != nil {
		t.Fatal(err)
	}
	for _, r := range refs {
		unmapRef(t, r)
	}
	// Still referenced: valid memory, whatever the exporter did since.
	if err := verifyRef(first, 2); err != nil {
		t.Fatal(err)
	}
	unmapRef(t, first)
	// The buffer ended while it was referenced: the poller, or the last
	// Unmap, undoes it; it is never kept.
	if !waitUntil(2*time.Second, func() bool { return GetCacheInfo().Entries == 0 }) {
		t.Fatalf("a mapping of an ended buffer is still cached: %+v", GetCacheInfo())
	}
	expectMapped(t, "after the last reference", 0)
}

// TestCacheHitRegisterAgain: a ticket made with RegisterAgain names the same
// buffer, so a receiver that has it mapped hits, even after the first
// registration was used up (another one of the buffer lives on).
func TestCacheHitRegisterAgain(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	reg := registerCounting(t, s, cacheSize, 3, RegisterOptions{Uses: 1})
	again, err := s.RegisterAgain(reg.tk, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	if again.BufferID != reg.tk.BufferID || again.RegID == reg.tk.RegID || again.Secret == reg.tk.Secret {
		t.Fatalf("register again: buffer %d reg %d, the original buffer %d reg %d (secrets equal: %v)", again.BufferID, again.RegID, reg.tk.BufferID, reg.tk.RegID, again.Secret == reg.tk.Secret)
	}
	first := importHost(t, reg.tk, ImportOptions{})
	unmapRef(t, first)
	expectCache(t, "the first registration used up, the buffer lives on", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Misses: 1})
	second := importHost(t, again, ImportOptions{})
	if second.Base != first.Base || reg.exports.Load() != cachePages {
		t.Fatalf("register-again ticket: at %#x with %d descriptors made; the mapping is at %#x", second.Base, reg.exports.Load()-cachePages, first.Base)
	}
	unmapLast(t, "every registration used up", second, 3, before, CacheInfo{Hits: 1, TableHits: 1, Misses: 1})
}

// TestCacheHitSameMemfdRegisteredAgain: registering the same memfd (same
// size and chunking) while a registration of it lives joins its buffer,
// taking no new descriptor, and a receiver that has it mapped hits.
func TestCacheHitSameMemfdRegisteredAgain(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	fd := newMemfd(t, cacheSize, pattern(cacheSize, 4))
	defer unix.Close(fd)
	tk1 := registerFile(t, s, fd, cacheSize, 4096, RegisterOptions{Uses: 1})
	fdsBefore := ourFDs().settled(t)
	tk2 := registerFile(t, s, fd, cacheSize, 4096, RegisterOptions{Uses: 1})
	ourFDs().waitFor(t, fdsBefore, "after registering the same memfd again")
	if tk2.BufferID != tk1.BufferID {
		t.Fatalf("the same memfd registered again is buffer %d, first %d", tk2.BufferID, tk1.BufferID)
	}
	other := registerFile(t, s, fd, cacheSize, 8192, RegisterOptions{Uses: 1})
	if other.BufferID == tk1.BufferID {
		t.Fatal("the same memfd in other chunks joined the buffer")
	}
	first := importHost(t, tk1, ImportOptions{})
	unmapRef(t, first)
	second := importHost(t, tk2, ImportOptions{})
	if second.Base != first.Base {
		t.Fatalf("the same memfd's second ticket mapped at %#x, the cached mapping is at %#x", second.Base, first.Base)
	}
	unmapRef(t, second)
	third := importHost(t, other, ImportOptions{})
	if got := cacheDelta(before); got.Hits != 1 || got.Misses != 2 {
		t.Fatalf("another buffer of the same file: %+v, want a miss", got)
	}
	unmapLast(t, "after three imports", third, 4, before, CacheInfo{Hits: 1, TableHits: 1, Misses: 2})
}

// countingGPU is a core.GPU whose importer maps on the host (the chunks are
// memfds), counting the importers it builds: all the driver work of a real
// one happens there.
type countingGPU struct{ built atomic.Int64 }

func (g *countingGPU) Placement(device int32, uuid [16]byte, access []int32) (string, error) {
	return fmt.Sprintf("fake:%d:%x:%v", device, uuid, access), nil
}

func (g *countingGPU) NewImporter(int32, [16]byte, []int32) (Importer, error) {
	g.built.Add(1)
	return &HostImporter{}, nil
}

// TestCacheHitBuildsNoImporter: a hit of CUDA memory (vmmipc.h: "no
// descriptor and no driver call") never builds the backend's importer; a
// miss builds exactly one.
func TestCacheHitBuildsNoImporter(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	fd := newMemfd(t, cacheSize, pattern(cacheSize, 11))
	defer unix.Close(fd)
	spec := hookedFile(t, fd, cacheSize, 4096, func(uint64) error { return nil })
	spec.Kind, spec.DeviceUUID = MemoryCUDA, [16]byte{0xab}
	tk, err := s.Register(spec, RegisterOptions{Uses: 0})
	if err != nil {
		t.Fatal(err)
	}
	gpu := &countingGPU{}
	first, err := Import(tk, DeviceSame, ImportOptions{}, gpu)
	if err != nil {
		t.Fatal(err)
	}
	for _, later := range []bool{false, true} {
		again, err := Import(tk, DeviceSame, ImportOptions{ConfirmLater: later}, gpu)
		if err != nil {
			t.Fatal(err)
		}
		if again.Base != first.Base {
			t.Fatalf("confirm later %v: not a hit (%#x, the mapping is at %#x)", later, again.Base, first.Base)
		}
		unmapRef(t, again)
	}
	if n := gpu.built.Load(); n != 1 {
		t.Fatalf("%d importers built for one miss and two hits, want 1", n)
	}
	// The deferred hit spends its use in the background; ending the buffer
	// before that session ran would count a failed confirmation.
	if !confirmsAnswered(10 * time.Second) {
		t.Fatal("confirmation still pending after 10 s")
	}
	if err := verifyAndUnmap(first, 11); err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(tk); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(1500*time.Millisecond, func() bool { return GetCacheInfo().Entries == 0 }) {
		t.Fatalf("the mapping of an ended buffer is still cached: %+v", GetCacheInfo())
	}
	expectCache(t, "the buffer ended", before, CacheInfo{Hits: 2, TableHits: 1, Misses: 1, Invalidations: 1})
}
