package core

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The import cache (issue 13), on host memory: hits, misses, eviction
// under the byte bound, invalidation when the buffer ends or the exporter
// dies, the bound on the address space it keeps, the bypass, in-place
// writes, no stale hit, its counters and its configuration.

const cachePages = 16
const cacheSize = cachePages * 4096

// cacheTest starts from an empty cache (nothing kept by earlier tests, no
// reference leaked by one) and restores its limit at the end. It returns
// the cache as it starts, the base of the counters that expectCache
// compares.
func cacheTest(t *testing.T) CacheInfo {
	t.Helper()
	flushCache(t)
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
	d := GetCacheInfo()
	d.Hits -= before.Hits
	d.Misses -= before.Misses
	d.Evictions -= before.Evictions
	d.Invalidations -= before.Invalidations
	d.ConfirmsFailed -= before.ConfirmsFailed
	return d
}

// expectCache compares the cache with want (counters as deltas since
// before; LimitBytes is not compared).
func expectCache(t *testing.T, what string, before, want CacheInfo) {
	t.Helper()
	got := cacheDelta(before)
	got.LimitBytes = want.LimitBytes
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
	expectCache(t, "after the hit", before, CacheInfo{Entries: 1, ReferencedBytes: cacheSize, Hits: 1, Misses: 1})
	unmapLast(t, "after the last use", second, 1, before, CacheInfo{Hits: 1, Misses: 1})
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
	expectCache(t, "referenced 9 times", before, CacheInfo{Entries: 1, ReferencedBytes: cacheSize, Hits: hits, Misses: 1})
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
	unmapLast(t, "every registration used up", second, 3, before, CacheInfo{Hits: 1, Misses: 1})
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
	unmapLast(t, "after three imports", third, 4, before, CacheInfo{Hits: 1, Misses: 2})
}

// TestCacheMisses: what is never kept: mappings whose exporter said the
// buffer ends with this use, mappings larger than the bound, and imports
// that bypass the cache (VMMIPC_IMPORT_NO_CACHE), which neither reuse a
// kept mapping nor keep their own.
func TestCacheMisses(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	once := registerCounting(t, s, cacheSize, 5, RegisterOptions{Uses: 1})
	unmapRef(t, importHost(t, once.tk, ImportOptions{}))
	expectCache(t, "a use that ended the buffer", before, CacheInfo{Misses: 1})
	expectMapped(t, "a use that ended the buffer", 0)

	kept := registerCounting(t, s, cacheSize, 6, RegisterOptions{})
	r := importHost(t, kept.tk, ImportOptions{})
	unmapRef(t, r)
	expectCache(t, "kept", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Misses: 2})
	bypass := importHost(t, kept.tk, ImportOptions{NoCache: true})
	if bypass.Base == r.Base || kept.exports.Load() != 2*cachePages {
		t.Fatalf("the bypass mapped at %#x (the kept mapping is at %#x) with %d descriptors", bypass.Base, r.Base, kept.exports.Load()-cachePages)
	}
	if err := verifyRef(bypass, 6); err != nil {
		t.Fatal(err)
	}
	expectMapped(t, "the kept mapping and the bypass", 2*cacheSize)
	unmapRef(t, bypass)
	expectCache(t, "the bypass undone", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Misses: 3})
	expectMapped(t, "the bypass undone", cacheSize)
	hit := importHost(t, kept.tk, ImportOptions{})
	if hit.Base != r.Base {
		t.Fatal("the bypass disturbed the kept mapping")
	}
	unmapRef(t, hit)

	// Larger than the bound: never kept.
	if err := SetCacheLimit(cacheSize - 1); err != nil {
		t.Fatal(err)
	}
	expectCache(t, "a bound smaller than the kept mapping", before, CacheInfo{Hits: 1, Misses: 3, Evictions: 1})
	big := registerCounting(t, s, cacheSize, 7, RegisterOptions{})
	unmapRef(t, importHost(t, big.tk, ImportOptions{}))
	expectCache(t, "larger than the bound", before, CacheInfo{Hits: 1, Misses: 4, Evictions: 1})
	expectMapped(t, "larger than the bound", 0)
	// Off: nothing is kept or hit.
	if err := SetCacheLimit(0); err != nil {
		t.Fatal(err)
	}
	a := importHost(t, big.tk, ImportOptions{})
	b := importHost(t, big.tk, ImportOptions{})
	if a.Base == b.Base {
		t.Fatal("with the cache off, two imports share a mapping")
	}
	unmapRef(t, a)
	unmapRef(t, b)
	expectCache(t, "cache off", before, CacheInfo{Hits: 1, Misses: 6, Evictions: 1})
	expectMapped(t, "cache off", 0)
}

// TestCacheEvictionUnderBound keeps at most 3 buffers' worth of
// unreferenced mappings: importing and dropping 5 evicts the 2 least
// recently used, which then miss, while the others hit.
func TestCacheEvictionUnderBound(t *testing.T) {
	before := cacheTest(t)
	if err := SetCacheLimit(3 * cacheSize); err != nil {
		t.Fatal(err)
	}
	s := newTestServer(t)
	var regs []counting
	for i := range 5 {
		regs = append(regs, registerCounting(t, s, cacheSize, byte(10+i), RegisterOptions{}))
	}
	bases := make([]uint64, len(regs))
	for i, reg := range regs {
		r := importHost(t, reg.tk, ImportOptions{})
		bases[i] = r.Base
		unmapRef(t, r)
		if info := GetCacheInfo(); info.UnreferencedBytes > 3*cacheSize {
			t.Fatalf("after %d imports: %d unreferenced bytes kept, bound %d", i+1, info.UnreferencedBytes, 3*cacheSize)
		}
		expectMapped(t, fmt.Sprintf("after %d imports", i+1), min(uint64(i+1), 3)*cacheSize)
	}
	expectCache(t, "5 dropped, 3 kept", before, CacheInfo{Entries: 3, UnreferencedBytes: 3 * cacheSize, Misses: 5, Evictions: 2})
	for i := 4; i >= 2; i-- { // the 3 most recent hit
		r := importHost(t, regs[i].tk, ImportOptions{})
		if r.Base != bases[i] {
			t.Fatalf("buffer %d was evicted; the least recently used should have gone first", i)
		}
		unmapRef(t, r)
	}
	expectCache(t, "3 hits", before, CacheInfo{Entries: 3, UnreferencedBytes: 3 * cacheSize, Hits: 3, Misses: 5, Evictions: 2})
	// Buffer 4 is now the least recently used: importing buffer 0 again
	// (a miss) evicts it.
	r := importHost(t, regs[0].tk, ImportOptions{})
	if err := verifyRef(r, 10); err != nil {
		t.Fatal(err)
	}
	unmapRef(t, r)
	expectCache(t, "an evicted buffer again", before, CacheInfo{Entries: 3, UnreferencedBytes: 3 * cacheSize, Hits: 3, Misses: 6, Evictions: 3})
	r = importHost(t, regs[4].tk, ImportOptions{})
	unmapRef(t, r)
	if got := cacheDelta(before); got.Misses != 7 {
		t.Fatalf("buffer 4, the least recently used, was not the one evicted: %+v", got)
	}
	// Lowering the bound evicts at once.
	if err := SetCacheLimit(cacheSize); err != nil {
		t.Fatal(err)
	}
	expectCache(t, "bound lowered to one buffer", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Hits: 3, Misses: 7, Evictions: 6})
	expectMapped(t, "bound lowered to one buffer", cacheSize)
}

// TestCacheAddressSpaceBound: over a random run of imports and drops of
// buffers of different sizes, the cache never keeps more unreferenced bytes
// than its bound, by its own count and, independently, by the memfd
// mappings in /proc/self/maps beyond those the test holds.
func TestCacheAddressSpaceBound(t *testing.T) {
	cacheTest(t)
	const bound = 10 * 4096 * 4
	if err := SetCacheLimit(bound); err != nil {
		t.Fatal(err)
	}
	s := newTestServer(t)
	type buf struct {
		tk   *Ticket
		seed byte
	}
	var bufs []buf
	for i := range 8 {
		size := (1 + i%4) * 4 * 4096 // 16, 32, 48 and 64 KiB
		reg := registerCounting(t, s, size, byte(30+i), RegisterOptions{})
		bufs = append(bufs, buf{reg.tk, byte(30 + i)})
	}
	var held []Ref
	var heldBytes uint64
	for step := 0; step < trials(300, 60); step++ {
		if len(held) > 0 && (len(held) > 3 || randIndex(2) == 0) {
			i := randIndex(len(held))
			unmapRef(t, held[i])
			heldBytes -= held[i].Size
			held = append(held[:i], held[i+1:]...)
		} else {
			b := bufs[randIndex(len(bufs))]
			r := importHost(t, b.tk, ImportOptions{})
			if err := verifyRef(r, b.seed); err != nil {
				t.Fatal(err)
			}
			held = append(held, r)
			heldBytes += r.Size
		}
		info := GetCacheInfo()
		if info.UnreferencedBytes > bound {
			t.Fatalf("step %d: the cache keeps %d unreferenced bytes, bound %d", step, info.UnreferencedBytes, bound)
		}
		_, mapped := memfdMappings(t)
		if mapped != info.ReferencedBytes+info.UnreferencedBytes || info.ReferencedBytes > heldBytes || mapped > heldBytes+bound {
			t.Fatalf("step %d: %d bytes mapped in /proc/self/maps, the cache counts %d referenced and %d not, the test holds %d; bound %d", step, mapped, info.ReferencedBytes, info.UnreferencedBytes, heldBytes, bound)
		}
	}
	for _, r := range held {
		unmapRef(t, r)
	}
	info := GetCacheInfo()
	_, mapped := memfdMappings(t)
	if info.ReferencedBytes != 0 || mapped != info.UnreferencedBytes || mapped > bound {
		t.Fatalf("nothing held: %d bytes mapped, the cache counts %d referenced and %d not; bound %d", mapped, info.ReferencedBytes, info.UnreferencedBytes, bound)
	}
	t.Logf("%+v", info)
}

// TestCacheInvalidatedOnUnregister: once the exporter unregisters a buffer,
// its unreferenced cached mapping is undone within about a second (the
// poller asks every 250 ms), and a receiver importing the old ticket again
// is refused instead of given the old mapping.
func TestCacheInvalidatedOnUnregister(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	reg := registerCounting(t, s, cacheSize, 8, RegisterOptions{})
	unmapRef(t, importHost(t, reg.tk, ImportOptions{}))
	expectCache(t, "kept", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Misses: 1})
	if err := s.Unregister(reg.tk); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := Import(reg.tk, DeviceHost, ImportOptions{}, nil); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "cached mapping") {
		t.Fatalf("importing an unregistered ticket that is cached here: %v, want ENOENT from the exporter", err)
	}
	if !waitUntil(1500*time.Millisecond, func() bool { return GetCacheInfo().Entries == 0 }) {
		t.Fatalf("the mapping of an unregistered buffer is still cached %v later: %+v", time.Since(start), GetCacheInfo())
	}
	took := time.Since(start)
	expectCache(t, "invalidated", before, CacheInfo{Misses: 1, Invalidations: 1})
	expectMapped(t, "invalidated", 0)
	t.Logf("undone %v after the exporter unregistered", took)
}

// TestCacheInvalidatedOnExporterDeath: a cached mapping of a sender process
// that is killed is undone within about a second, and its ticket fails at
// once.
func TestCacheInvalidatedOnExporterDeath(t *testing.T) {
	before := cacheTest(t)
	sender := startHelper(t, partSender, helperOpts{})
	tk := sender.register(cachePages, 4096, 0, -1, 9)
	r := importHost(t, tk, ImportOptions{})
	if err := verifyRef(r, 9); err != nil {
		t.Fatal(err)
	}
	unmapRef(t, r)
	expectCache(t, "kept", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Misses: 1})
	sender.kill()
	start := time.Now()
	if !waitUntil(1500*time.Millisecond, func() bool { return GetCacheInfo().Entries == 0 }) {
		t.Fatalf("the mapping of a dead exporter is still cached %v later: %+v", time.Since(start), GetCacheInfo())
	}
	took := time.Since(start)
	expectCache(t, "invalidated", before, CacheInfo{Misses: 1, Invalidations: 1})
	expectMapped(t, "invalidated", 0)
	if _, err := Import(tk, DeviceHost, ImportOptions{}, nil); CodeOf(err) != EIO || !strings.Contains(err.Error(), "has exited") {
		t.Fatalf("the dead exporter's ticket: %v, want EIO at once", err)
	}
	t.Logf("undone %v after the exporter was killed", took)
}

// TestCacheSeesInPlaceWrites: a cached mapping is the sender's memory, so
// what the sender writes in place is seen through it, held or dropped and
// hit again.
func TestCacheSeesInPlaceWrites(t *testing.T) {
	cacheTest(t)
	s := newTestServer(t)
	fd := newMemfd(t, cacheSize, pattern(cacheSize, 14))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, cacheSize, 4096, RegisterOptions{})
	r := importHost(t, tk, ImportOptions{})
	if _, err := unix.Pwrite(fd, pattern(cacheSize, 15), 0); err != nil {
		t.Fatal(err)
	}
	if err := verifyRef(r, 15); err != nil {
		t.Fatalf("a write by the sender while the mapping is held: %v", err)
	}
	unmapRef(t, r)
	if _, err := unix.Pwrite(fd, pattern(cacheSize, 16), 0); err != nil {
		t.Fatal(err)
	}
	hit := importHost(t, tk, ImportOptions{})
	if hit.Base != r.Base {
		t.Fatal("not a hit")
	}
	if err := verifyRef(hit, 16); err != nil {
		t.Fatalf("a write by the sender while the mapping was kept unreferenced: %v", err)
	}
	unmapRef(t, hit)
}

// TestCacheNoStaleHit: an exporter that restarts in the same process (exec:
// same pid, same start time) has a new server whose buffer ids start at 1
// again: a receiver that has the old buffer 1 cached gets the new memory,
// never the old mapping.
func TestCacheNoStaleHit(t *testing.T) {
	cacheTest(t)
	sender := startHelper(t, partSender, helperOpts{})
	old := sender.register(cachePages, 4096, 0, -1, 17)
	r := importHost(t, old, ImportOptions{})
	unmapRef(t, r)
	before := GetCacheInfo()
	sender.send("exec sender")
	sender.expect("serving ", faultTimeout) // the new image reads stdin now
	tk := sender.register(cachePages, 4096, 0, -1, 18)
	if tk.Pid != old.Pid || tk.StartTime != old.StartTime || tk.BufferID != old.BufferID || tk.RegID != old.RegID {
		t.Fatalf("the restarted exporter: pid %d start %d buffer %d reg %d; before pid %d start %d buffer %d reg %d",
			tk.Pid, tk.StartTime, tk.BufferID, tk.RegID, old.Pid, old.StartTime, old.BufferID, old.RegID)
	}
	n := importHost(t, tk, ImportOptions{})
	if err := verifyRef(n, 18); err != nil { // not the old bytes
		t.Fatal(err)
	}
	unmapRef(t, n)
	if got := cacheDelta(before); got.Hits != 0 || got.Misses != 1 {
		t.Fatalf("the restarted exporter's buffer %d, after its old buffer %d was cached here: %+v, want a miss", tk.BufferID, old.BufferID, got)
	}
	if _, err := Import(old, DeviceHost, ImportOptions{}, nil); CodeOf(err) != EIO {
		t.Fatalf("the ticket of the exporter's old server: %v, want EIO (nothing listens there)", err)
	}
}

// TestCacheBytesEnv: VMMIPC_CACHE_BYTES sets the bound (read once per
// process, so each value runs in a helper process of its own); a bad value
// makes imports fail with EINVAL naming the variable.
func TestCacheBytesEnv(t *testing.T) {
	for _, tc := range []struct {
		value       string
		code        Code
		limit, kept uint64
		inMessage   string
	}{
		{"", OK, DefaultCacheBytes, 1, ""}, // unset
		{"1G", OK, 1 << 30, 1, ""},
		{"0", OK, 0, 0, ""},
		{"16K", OK, 16 << 10, 0, ""}, // smaller than the 64 KiB buffer
		{"bogus", EINVAL, DefaultCacheBytes, 0, "VMMIPC_CACHE_BYTES=\"bogus\""},
		{"-1", EINVAL, DefaultCacheBytes, 0, "VMMIPC_CACHE_BYTES=\"-1\""},
		{"99999999999T", EINVAL, DefaultCacheBytes, 0, "too large"},
	} {
		t.Run(tc.value, func(t *testing.T) {
			var env []string
			if tc.value != "" {
				env = []string{CacheBytesEnv + "=" + tc.value}
			} else if v, ok := os.LookupEnv(CacheBytesEnv); ok {
				t.Skipf("%s=%q is set for the tests: the default cannot be seen", CacheBytesEnv, v)
			}
			h := startHelper(t, partCacheEnv, helperOpts{env: env})
			got := h.expect("import ", faultTimeout)
			code, msg, _ := strings.Cut(got, " ")
			if code != "code="+strconv.Itoa(int(tc.code)) || !strings.Contains(msg, tc.inMessage) {
				t.Fatalf("import with %s=%q: %s, want code=%d saying %q", CacheBytesEnv, tc.value, got, tc.code, tc.inMessage)
			}
			want := fmt.Sprintf("limit=%d entries=%d", tc.limit, tc.kept)
			if got := h.expect("cache ", faultTimeout); got != want {
				t.Fatalf("the cache with %s=%q: %s, want %s", CacheBytesEnv, tc.value, got, want)
			}
		})
	}
}

// TestCacheConfirmLater: with ImportConfirmLater a hit returns at once and
// its use is spent in the background, one authenticated session per ticket:
// every grant ends once its confirmation ran, none before the receiver
// asked. A forged ticket of the same buffer (another secret) still hits
// the mapping this process has, but its confirmation fails, is counted,
// and spends no other grant's use.
func TestCacheConfirmLater(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	anchor := registerCounting(t, s, cacheSize, 9, RegisterOptions{Uses: 0})
	first := importHost(t, anchor.tk, ImportOptions{})
	const grants = 8
	tickets := make([]*Ticket, grants)
	for i := range tickets {
		var err error
		if tickets[i], err = s.RegisterAgain(anchor.tk, RegisterOptions{Uses: 1}); err != nil {
			t.Fatal(err)
		}
	}
	forged := *tickets[0]
	forged.Secret[0] ^= 1
	later := ImportOptions{ConfirmLater: true}
	refs := []Ref{importHost(t, &forged, later)}
	for _, tk := range tickets {
		refs = append(refs, importHost(t, tk, later))
	}
	for _, r := range refs {
		if r.Base != first.Base {
			t.Fatalf("a deferred hit is at %#x, the mapping at %#x", r.Base, first.Base)
		}
	}
	if anchor.exports.Load() != cachePages {
		t.Fatalf("deferred hits made %d descriptors", anchor.exports.Load()-cachePages)
	}
	if !waitUntil(10*time.Second, func() bool { pending, _ := confirms.counts(); return pending == 0 }) {
		t.Fatal("confirmations still pending after 10 s")
	}
	for i, tk := range tickets {
		if err := s.Wait(tk, 5*time.Second); err != nil {
			t.Fatalf("grant %d did not end after its deferred confirmation: %v", i, err)
		}
	}
	expectCache(t, "after the confirmations", before, CacheInfo{Entries: 1, ReferencedBytes: cacheSize,
		Hits: 1 + grants, Misses: 1, ConfirmsFailed: 1})
	for _, r := range refs {
		unmapRef(t, r)
	}
	if err := verifyAndUnmap(first, 9); err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(anchor.tk); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(1500*time.Millisecond, func() bool { return GetCacheInfo().Entries == 0 }) {
		t.Fatalf("the mapping of an ended buffer is still cached: %+v", GetCacheInfo())
	}
	expectCache(t, "the anchor ended", before, CacheInfo{Hits: 1 + grants, Misses: 1, Invalidations: 1, ConfirmsFailed: 1})
	expectMapped(t, "the anchor ended", 0)
}

// TestConfirmSpendsOneUse: Confirm spends one use of a ticket and makes no
// descriptor; a ticket with a wrong secret is refused and spends nothing of
// the real one; a used-up ticket is ENOENT.
func TestConfirmSpendsOneUse(t *testing.T) {
	s := newTestServer(t)
	anchor := registerCounting(t, s, cacheSize, 10, RegisterOptions{Uses: 0})
	grant, err := s.RegisterAgain(anchor.tk, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	forged := *grant
	forged.Secret[31] ^= 0x80
	if err := Confirm(&forged, ImportOptions{}); CodeOf(err) != EAUTH {
		t.Fatalf("confirming a forged ticket: %v, want EAUTH", err)
	}
	if err := s.Wait(grant, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT {
		t.Fatalf("the real grant after a forged confirmation: %v, want it still live", err)
	}
	if err := Confirm(grant, ImportOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(grant, 5*time.Second); err != nil {
		t.Fatalf("the grant did not end after its confirmation: %v", err)
	}
	if err := Confirm(grant, ImportOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("confirming a used-up ticket: %v, want ENOENT", err)
	}
	if anchor.exports.Load() != 0 {
		t.Fatalf("confirmations made %d descriptors", anchor.exports.Load())
	}
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
	if !waitUntil(10*time.Second, func() bool { pending, _ := confirms.counts(); return pending == 0 }) {
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
	expectCache(t, "the buffer ended", before, CacheInfo{Hits: 2, Misses: 1, Invalidations: 1})
}
