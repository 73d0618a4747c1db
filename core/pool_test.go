package core

import (
	"fmt"
	"math/rand"
	"sort"
	"strings"
	"sync"
	"testing"
)

// fakeDevice stands in for the CUDA driver under a Pool: it checks every
// call against what a driver would allow (maps only inside the
// reservation, never twice at one address, unmaps only what is mapped with
// its own handle, nothing mapped when the range is freed) and can run out
// of memory or fail on request.
type fakeDevice struct {
	mu        sync.Mutex
	t         *testing.T
	base      uint64
	size      uint64
	capacity  int               // chunks that fit in "device memory"; 0 = unlimited
	mapped    map[uint64]uint64 // addr -> handle
	sizes     map[uint64]uint64 // addr -> size
	next      uint64
	syncs     int
	unsynced  bool // chunks were mapped or unmapped since the last Sync... only mapping
	failMapAt int  // the Map call (1-based) that fails; 0 = none
	maps      int
	failUnmap bool
	freed     bool
	problems  []string
}

const fakeBase = 0x7f0000000000

func newFakeDevice(t *testing.T) *fakeDevice {
	return &fakeDevice{t: t, mapped: map[uint64]uint64{}, sizes: map[uint64]uint64{}, next: 0x100}
}

func (d *fakeDevice) problem(format string, args ...any) {
	d.problems = append(d.problems, fmt.Sprintf(format, args...))
}

func (d *fakeDevice) Reserve(size uint64) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.size != 0 {
		d.problem("Reserve called twice")
	}
	d.base, d.size = fakeBase, size
	return d.base, nil
}

func (d *fakeDevice) Map(addr, size uint64) (uint64, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.maps++
	if addr < d.base || addr+size > d.base+d.size {
		d.problem("Map [%#x, +%d) outside the reservation", addr, size)
	}
	for a, s := range d.sizes {
		if addr < a+s && a < addr+size {
			d.problem("Map [%#x, +%d) overlaps the chunk mapped at %#x", addr, size, a)
		}
	}
	if d.failMapAt == d.maps {
		return 0, Errorf(ECUDA, "cuMemMap: CUDA_ERROR_INVALID_VALUE (injected)")
	}
	if d.capacity > 0 && len(d.mapped) >= d.capacity {
		return 0, Errorf(ENOMEM, "cuMemCreate: CUDA_ERROR_OUT_OF_MEMORY")
	}
	d.next++
	d.mapped[addr], d.sizes[addr] = d.next, size
	return d.next, nil
}

func (d *fakeDevice) Sync() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.syncs++
	d.unsynced = false
	return nil
}

func (d *fakeDevice) Unmap(addr, size, handle uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.failUnmap {
		return Errorf(ECUDA, "cuMemUnmap: CUDA_ERROR_UNKNOWN (injected)")
	}
	if h, ok := d.mapped[addr]; !ok || h != handle || d.sizes[addr] != size {
		d.problem("Unmap(%#x, %d, handle %d): mapped there is handle %d of %d bytes", addr, size, handle, h, d.sizes[addr])
	}
	delete(d.mapped, addr)
	delete(d.sizes, addr)
	return nil
}

func (d *fakeDevice) Free(base, size uint64) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if base != d.base || size != d.size {
		d.problem("Free(%#x, %d) of a reservation [%#x, +%d)", base, size, d.base, d.size)
	}
	if len(d.mapped) > 0 {
		d.problem("Free with %d chunk(s) still mapped", len(d.mapped))
	}
	d.freed = true
	return nil
}

func (d *fakeDevice) chunks() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.mapped)
}

func (d *fakeDevice) check() {
	d.t.Helper()
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, p := range d.problems {
		d.t.Error("backend: " + p)
	}
	d.problems = nil
}

const (
	kib = uint64(1) << 10
	mib = uint64(1) << 20
)

// newTestPool makes a pool of chunk-byte chunks over slots of them on a
// fake device with 2 MiB granularity.
func newTestPool(t *testing.T, chunk uint64, slots int, keep uint64) (*Pool, *fakeDevice) {
	t.Helper()
	d := newFakeDevice(t)
	p, err := NewPool(d, PoolConfig{Chunk: chunk, Granularity: 2 * mib, Reserve: uint64(slots) * chunk, Keep: keep})
	if err != nil {
		t.Fatal(err)
	}
	return p, d
}

// checkPool asserts the pool's invariants: the free extents and the live
// allocations tile the range exactly; every slot's used count is the bytes
// of live allocations in it; every allocation lies on mapped chunks, which
// the backend has at those addresses with those handles.
func checkPool(t *testing.T, p *Pool, d *fakeDevice) {
	t.Helper()
	d.check()
	p.mu.Lock()
	defer p.mu.Unlock()
	type iv struct {
		off, end uint64
		live     bool
	}
	var all []iv
	for _, e := range p.free {
		all = append(all, iv{e.off, e.end, false})
	}
	for off, n := range p.live {
		all = append(all, iv{off, off + n, true})
		if off%PoolAlignment != 0 || n%PoolAlignment != 0 {
			t.Errorf("allocation [%d, +%d) not aligned to %d", off, n, PoolAlignment)
		}
	}
	sort.Slice(all, func(i, j int) bool { return all[i].off < all[j].off })
	at := uint64(0)
	for i, x := range all {
		if x.off != at || x.end <= x.off {
			t.Fatalf("extents and allocations do not tile the range at %d: %+v", at, all)
		}
		if i > 0 && !x.live && !all[i-1].live {
			t.Fatalf("two free extents side by side at %d: not coalesced", x.off)
		}
		at = x.end
	}
	if at != p.size {
		t.Fatalf("tiling ends at %d, the range at %d", at, p.size)
	}
	used := make([]uint64, len(p.slots))
	var total uint64
	for off, n := range p.live {
		total += n
		for i := off / p.chunk; i*p.chunk < off+n; i++ {
			used[i] += min(off+n, (i+1)*p.chunk) - max(off, i*p.chunk)
			if !p.slots[i].mapped {
				t.Fatalf("allocation [%d, +%d) lies on slot %d, which is not mapped", off, n, i)
			}
		}
	}
	if total != p.used {
		t.Fatalf("used %d, live allocations hold %d", p.used, total)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	var mapped uint64
	for i, s := range p.slots {
		if s.used != used[i] {
			t.Fatalf("slot %d: used %d, allocations in it %d", i, s.used, used[i])
		}
		addr := p.base + uint64(i)*p.chunk
		h, ok := d.mapped[addr]
		if s.mapped != ok || (ok && h != s.handle) {
			t.Fatalf("slot %d: pool says mapped=%v handle %d, backend has %v handle %d", i, s.mapped, s.handle, ok, h)
		}
		if s.mapped {
			mapped++
		}
	}
	if mapped != p.mapped || int(mapped) != len(d.mapped) {
		t.Fatalf("pool counts %d mapped chunks, its slots %d, the backend %d", p.mapped, mapped, len(d.mapped))
	}
}

func mustAlloc(t *testing.T, p *Pool, n uint64) uint64 {
	t.Helper()
	a, err := p.Alloc(n)
	if err != nil {
		t.Fatalf("Alloc(%d): %v", n, err)
	}
	return a
}

func mustFree(t *testing.T, p *Pool, a uint64) {
	t.Helper()
	if _, err := p.Free(a); err != nil {
		t.Fatalf("Free(%#x): %v", a, err)
	}
}

func TestPoolPacksSmallAllocationsInOneChunk(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 8, 0)
	var addrs []uint64
	for _, n := range []uint64{1, 512, 513, 4 * kib, 2 * mib, 20 * mib} {
		a := mustAlloc(t, p, n)
		if (a-fakeBase)%PoolAlignment != 0 {
			t.Fatalf("Alloc(%d) = %#x, not aligned to %d", n, a, PoolAlignment)
		}
		addrs = append(addrs, a)
	}
	// Sizes round up to 512: 1 -> 512, 513 -> 1024; side by side from the base.
	want := []uint64{0, 512, 1024, 2048, 2048 + 4*kib, 2048 + 4*kib + 2*mib}
	for i := range want {
		if addrs[i] != fakeBase+want[i] {
			t.Fatalf("addresses %#x, want offsets %v", addrs, want)
		}
	}
	if d.chunks() != 1 || p.Info().ChunksMapped != 1 {
		t.Fatalf("%d chunks mapped for 22 MiB in 64 MiB chunks", d.chunks())
	}
	checkPool(t, p, d)
}

func TestPoolGrowthPastOneChunkIsContiguous(t *testing.T) {
	// A model of 100 tensors of 30 MiB in 1 GiB chunks: 2930 MiB on 3
	// chunks, side by side with no gap, one range for a receiver.
	p, d := newTestPool(t, 1<<30, 16, 0)
	prev := uint64(0)
	for i := 0; i < 100; i++ {
		a := mustAlloc(t, p, 30*mib)
		if i > 0 && a != prev+30*mib {
			t.Fatalf("tensor %d at %#x, not right after the one before (%#x)", i, a, prev)
		}
		prev = a
	}
	if d.chunks() != 3 {
		t.Fatalf("%d chunks for 2930 MiB in 1 GiB chunks, want 3", d.chunks())
	}
	// One allocation larger than a chunk takes the free tail and new chunks
	// right after it.
	big := mustAlloc(t, p, 2<<30+5*mib)
	if big != prev+30*mib {
		t.Fatalf("a 2 GiB allocation at %#x, not after the last tensor (%#x)", big, prev+30*mib)
	}
	if d.chunks() != 5 { // 2930 MiB + 2053 MiB = 4983 MiB: 4.9 chunks
		t.Fatalf("%d chunks after growth, want 5", d.chunks())
	}
	checkPool(t, p, d)
}

func TestPoolFreeAndReuse(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 4, 64*mib)
	a := mustAlloc(t, p, 10*mib)
	b := mustAlloc(t, p, 10*mib)
	mustFree(t, p, a)
	if got := mustAlloc(t, p, 10*mib); got != a {
		t.Fatalf("reallocating the freed size: %#x, want the freed %#x", got, a)
	}
	mustFree(t, p, b)
	// b's space joined the free tail: 54 MiB fit there, and nothing new is mapped.
	if got := mustAlloc(t, p, 54*mib); got != b {
		t.Fatalf("54 MiB at %#x, want %#x (b's space and the tail, joined)", got, b)
	}
	if p.Info().ChunksMapped != 1 {
		t.Fatalf("%d chunks mapped in all, want 1", p.Info().ChunksMapped)
	}
	checkPool(t, p, d)
}

func TestPoolCoalescesFreedNeighbours(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 4, 64*mib)
	var a [4]uint64
	for i := range a {
		a[i] = mustAlloc(t, p, 16*mib) // fills the first chunk exactly
	}
	for _, i := range []int{0, 2, 1} { // the middle one last: three extents join
		mustFree(t, p, a[i])
		checkPool(t, p, d)
	}
	if len(p.free) != 2 || p.free[0] != (poolExtent{0, 48 * mib}) {
		t.Fatalf("free extents %+v, want [0, 48 MiB) and the range after the last allocation", p.free)
	}
	if got := mustAlloc(t, p, 48*mib); got != a[0] {
		t.Fatalf("48 MiB at %#x, want the joined space at %#x", got, a[0])
	}
	checkPool(t, p, d)
}

func TestPoolGivesBackWhollyFreeChunks(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 8, 0)
	a := mustAlloc(t, p, 100*mib) // chunks 0 and 1
	b := mustAlloc(t, p, 100*mib) // ends of 1, 2, 3
	if d.chunks() != 4 {
		t.Fatalf("%d chunks for 200 MiB of 64 MiB chunks, want 4", d.chunks())
	}
	mustFree(t, p, a) // chunk 0 is wholly free; chunk 1 still holds b's start
	if d.chunks() != 3 || d.syncs != 1 {
		t.Fatalf("after freeing a: %d chunks, %d syncs; want 3 and 1 (a sync before unmapping)", d.chunks(), d.syncs)
	}
	if _, ok := d.mapped[fakeBase]; ok {
		t.Fatal("chunk 0, wholly free, is still mapped")
	}
	mustFree(t, p, b)
	if d.chunks() != 0 || p.Info().MappedBytes != 0 || p.Info().ChunksReleased != 4 {
		t.Fatalf("after freeing all: %d chunks mapped, info %+v", d.chunks(), p.Info())
	}
	checkPool(t, p, d)
	// The range is whole again: the next allocation starts at the base.
	if got := mustAlloc(t, p, mib); got != fakeBase {
		t.Fatalf("after giving all back, Alloc = %#x, want the base", got)
	}
	checkPool(t, p, d)
}

func TestPoolKeepBoundAndTrim(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 8, 128*mib) // keeps two wholly free chunks
	var as []uint64
	for i := 0; i < 4; i++ {
		as = append(as, mustAlloc(t, p, 64*mib))
	}
	for _, a := range as {
		mustFree(t, p, a)
	}
	if d.chunks() != 2 {
		t.Fatalf("%d chunks kept, want 2 (128 MiB keep bound)", d.chunks())
	}
	// The lowest ones stay (placement prefers them): chunks 0 and 1.
	for i := uint64(0); i < 2; i++ {
		if _, ok := d.mapped[fakeBase+i*64*mib]; !ok {
			t.Fatalf("chunk %d was given back, a higher one kept", i)
		}
	}
	// Reusing a kept chunk maps nothing.
	created := p.Info().ChunksMapped
	a := mustAlloc(t, p, 64*mib)
	if p.Info().ChunksMapped != created || a != fakeBase {
		t.Fatalf("reuse of a kept chunk: at %#x, %d chunks mapped in all (was %d)", a, p.Info().ChunksMapped, created)
	}
	mustFree(t, p, a)
	got, err := p.Trim(0)
	if err != nil || got != 128*mib || d.chunks() != 0 {
		t.Fatalf("Trim(0) = %d, %v; %d chunks left", got, err, d.chunks())
	}
	if got, err := p.Trim(0); err != nil || got != 0 {
		t.Fatalf("Trim of an empty pool = %d, %v", got, err)
	}
	checkPool(t, p, d)
}

func TestPoolRefillsHolesFirst(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 8, 0)
	a := mustAlloc(t, p, 64*mib)
	b := mustAlloc(t, p, 64*mib)
	c := mustAlloc(t, p, 64*mib)
	mustFree(t, p, b) // a hole at chunk 1
	if d.chunks() != 2 {
		t.Fatalf("%d chunks, want 2", d.chunks())
	}
	// One chunk's worth costs one chunk anywhere: the lowest place, the hole.
	if got := mustAlloc(t, p, 32*mib); got != b {
		t.Fatalf("32 MiB at %#x, want the hole at %#x", got, b)
	}
	// 96 MiB cannot fit in the hole's 32 MiB rest: it goes after c.
	if got := mustAlloc(t, p, 96*mib); got != c+64*mib {
		t.Fatalf("96 MiB at %#x, want after c (%#x)", got, c+64*mib)
	}
	_ = a
	checkPool(t, p, d)
}

func TestPoolPrefersAKeptChunkToANewOne(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 8, 64*mib) // keeps one
	a := mustAlloc(t, p, 64*mib)              // chunk 0
	b := mustAlloc(t, p, 64*mib)              // chunk 1
	c := mustAlloc(t, p, 16*mib)              // chunk 2
	mustFree(t, p, a)                         // chunk 0 kept (keep bound)
	mustFree(t, p, b)                         // chunk 1 given back: one kept at most
	if _, ok := d.mapped[fakeBase]; !ok || d.chunks() != 2 {
		t.Fatalf("want chunk 0 kept and chunk 2 mapped, have %d chunks", d.chunks())
	}
	// 64 MiB: the free extent [0, 128 MiB) starts with the kept chunk 0:
	// no new chunk. Not chunk 2's tail + chunk 3 (one new chunk).
	created := p.Info().ChunksMapped
	if got := mustAlloc(t, p, 64*mib); got != fakeBase || p.Info().ChunksMapped != created {
		t.Fatalf("64 MiB at %#x with %d new chunks, want the kept chunk at the base and none", got, p.Info().ChunksMapped-created)
	}
	_ = c
	checkPool(t, p, d)
}

// TestPoolSkipsAHoleForAMappedChunkFurtherOn: the extent's start would need
// a new chunk (a hole), a mapped idle chunk later in the same extent needs
// none: that one wins, although its address is higher.
func TestPoolSkipsAHoleForAMappedChunkFurtherOn(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 8, 0)
	mustAlloc(t, p, 16*mib)       // chunk 0's first quarter stays allocated
	y := mustAlloc(t, p, 112*mib) // chunk 0's rest and chunk 1
	z := mustAlloc(t, p, 64*mib)  // chunk 2
	mustAlloc(t, p, 16*mib)       // chunk 3
	mustFree(t, p, y)             // chunk 1 given back: a hole
	d.failUnmap = true
	if _, err := p.Free(z); CodeOf(err) != ECUDA { // chunk 2 stays mapped, idle
		t.Fatalf("Free with a failing unmap: %v", err)
	}
	d.failUnmap = false
	created := p.Info().ChunksMapped
	// [16 MiB, 192 MiB) is one free extent: at its start 64 MiB would map
	// chunk 1 again; at chunk 2 it maps nothing.
	if got := mustAlloc(t, p, 64*mib); got != z || p.Info().ChunksMapped != created {
		t.Fatalf("64 MiB at %#x with %d new chunk(s), want the idle chunk 2 at %#x and none", got, p.Info().ChunksMapped-created, z)
	}
	checkPool(t, p, d)
}

func TestPoolOutOfMemoryLeavesNothingBehind(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 8, 0)
	d.capacity = 3
	a := mustAlloc(t, p, 16*mib) // chunk 0
	before := p.Info()
	// Needs chunk 0's tail and 3 more: the third new one does not fit.
	_, err := p.Alloc(48*mib + 3*64*mib)
	if CodeOf(err) != ENOMEM || !strings.Contains(err.Error(), "CUDA_ERROR_OUT_OF_MEMORY") {
		t.Fatalf("Alloc past the device's memory: %v (%v), want ENOMEM naming the driver's error", CodeOf(err), err)
	}
	if d.chunks() != 1 || p.Info() != before {
		t.Fatalf("after the failed Alloc: %d chunks mapped, info %+v (before %+v)", d.chunks(), p.Info(), before)
	}
	checkPool(t, p, d)
	// An injected failure of a driver call, not out of memory: ECUDA, same cleanup.
	d.capacity, d.failMapAt = 0, d.maps+2
	if _, err := p.Alloc(3 * 64 * mib); CodeOf(err) != ECUDA {
		t.Fatalf("Alloc with a failing cuMemMap: %v (%v), want ECUDA", CodeOf(err), err)
	}
	if d.chunks() != 1 || p.Info() != before {
		t.Fatalf("after the failed map: %d chunks, info %+v", d.chunks(), p.Info())
	}
	// What fits still works afterwards.
	mustFree(t, p, mustAlloc(t, p, 40*mib))
	mustFree(t, p, a)
	checkPool(t, p, d)
}

func TestPoolRefusesBadInput(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 4, 0)
	a := mustAlloc(t, p, mib)
	for _, c := range []struct {
		name string
		err  error
		code Code
		says string
	}{
		{"Alloc(0)", second(p.Alloc(0)), EINVAL, "between 1 and"},
		{"Alloc(larger than the range)", second(p.Alloc(256*mib + 1)), EINVAL, "between 1 and"},
		{"Alloc(2^64-1)", second(p.Alloc(^uint64(0))), EINVAL, "between 1 and"},
		{"Free(inside an allocation)", second(p.Free(a + 512)), EINVAL, "not an allocation of this pool"},
		{"Free(below the range)", second(p.Free(1)), EINVAL, "not an allocation of this pool"},
		{"Close with a live allocation", p.Close(), EINVAL, "1 allocation(s) of 1.0 MiB in total still live"},
	} {
		if CodeOf(c.err) != c.code || !strings.Contains(c.err.Error(), c.says) {
			t.Errorf("%s: %v (%v), want %v saying %q", c.name, CodeOf(c.err), c.err, c.code, c.says)
		}
	}
	checkPool(t, p, d) // nothing was touched
	mustFree(t, p, a)
	if _, err := p.Free(a); CodeOf(err) != EINVAL || !strings.Contains(err.Error(), "freed already") {
		t.Fatalf("double free: %v", err)
	}
	if err := p.Close(); err != nil || !d.freed || d.chunks() != 0 {
		t.Fatalf("Close: %v; range freed %v, %d chunks", err, d.freed, d.chunks())
	}
	d.check()
	for name, err := range map[string]error{"Alloc": second(p.Alloc(1)), "Free": second(p.Free(a)),
		"Trim": second(p.Trim(0)), "Close": p.Close()} {
		if CodeOf(err) != EBADF {
			t.Errorf("%s after Close: %v, want EBADF", name, err)
		}
	}
}

func second[T any](_ T, err error) error { return err }

func TestNewPoolChecksItsConfig(t *testing.T) {
	for _, c := range []struct {
		cfg  PoolConfig
		code Code
		says string
	}{
		{PoolConfig{Chunk: 3 * mib, Granularity: 2 * mib, Reserve: 1 << 30}, EINVAL, "not a multiple of the device's allocation granularity 2097152 (2.0 MiB)"},
		{PoolConfig{Chunk: 2 * mib, Granularity: 2 * mib, Reserve: 0}, EINVAL, "no range"},
		{PoolConfig{Chunk: 2 * mib, Granularity: 2 * mib, Reserve: ^uint64(0)}, EINVAL, "no range"},
		{PoolConfig{Chunk: 2 * mib, Granularity: 2*mib + 3, Reserve: 1 << 30}, EINTERNAL, "granularity"},
	} {
		d := newFakeDevice(t)
		_, err := NewPool(d, c.cfg)
		if CodeOf(err) != c.code || !strings.Contains(err.Error(), c.says) {
			t.Errorf("NewPool(%+v): %v (%v), want %v saying %q", c.cfg, CodeOf(err), err, c.code, c.says)
		}
		if d.size != 0 {
			t.Errorf("NewPool(%+v) reserved address space although it failed", c.cfg)
		}
	}
	// Chunk 0 is the default, 1 GiB; the range rounds up to whole chunks.
	p, err := NewPool(newFakeDevice(t), PoolConfig{Granularity: 2 * mib, Reserve: 3<<30 + 1})
	if err != nil || p.Info().ChunkSize != DefaultPoolChunk || p.Info().Reserved != 4<<30 {
		t.Fatalf("defaults: %+v, %v", p.Info(), err)
	}
	// A failed reservation is the backend's error, wrapped.
	_, err = NewPool(failingReserve{}, PoolConfig{Granularity: 2 * mib, Reserve: 1 << 30})
	if CodeOf(err) != ENOMEM || !strings.Contains(err.Error(), "pool: reserving 1.0 GiB of address space: cuMemAddressReserve") {
		t.Fatalf("failed reservation: %v (%v)", CodeOf(err), err)
	}
}

type failingReserve struct{ PoolBackend }

func (failingReserve) Reserve(uint64) (uint64, error) {
	return 0, Errorf(ENOMEM, "cuMemAddressReserve: CUDA_ERROR_OUT_OF_MEMORY")
}

func TestPoolUnmapFailureKeepsTheChunkForLater(t *testing.T) {
	p, d := newTestPool(t, 64*mib, 4, 0)
	a := mustAlloc(t, p, mib)
	d.failUnmap = true
	n, err := p.Free(a)
	if n != mib || CodeOf(err) != ECUDA || !strings.Contains(err.Error(), "giving back the chunk at") {
		t.Fatalf("Free with a failing unmap: %d, %v", n, err)
	}
	if _, err := p.Free(a); CodeOf(err) != EINVAL {
		t.Fatalf("the allocation must be freed even so: a second Free gave %v", err)
	}
	checkPool(t, p, d) // the chunk is still mapped, and the pool says so
	if p.Info().WhollyFreeMappedBytes != 64*mib {
		t.Fatalf("info %+v", p.Info())
	}
	d.failUnmap = false
	if got, err := p.Trim(0); got != 64*mib || err != nil {
		t.Fatalf("a later Trim: %d, %v", got, err)
	}
	checkPool(t, p, d)
}

// TestPoolRandomOperations runs random allocations and frees (sizes from
// 512 bytes to three chunks) with the keep bound and trims, checking every
// invariant after each step, then frees everything: no chunk stays.
func TestPoolRandomOperations(t *testing.T) {
	rng := rand.New(rand.NewSource(25))
	p, d := newTestPool(t, 8*mib, 64, 16*mib)
	d.capacity = 40
	live := map[uint64]uint64{}
	for step := 0; step < 3000; step++ {
		switch r := rng.Intn(10); {
		case r < 5 || len(live) == 0:
			n := uint64(rng.Intn(3*8*1024)+1) * 1024
			if rng.Intn(4) == 0 {
				n = uint64(rng.Intn(4096) + 1)
			}
			a, err := p.Alloc(n)
			if err != nil {
				if c := CodeOf(err); c != ENOMEM {
					t.Fatalf("step %d: Alloc(%d): %v", step, n, err)
				}
				break
			}
			for b, m := range live {
				if a < b+m && b < a+n {
					t.Fatalf("step %d: [%#x, +%d) overlaps the live [%#x, +%d)", step, a, n, b, m)
				}
			}
			live[a] = n
		case r < 9:
			for a := range live {
				mustFree(t, p, a)
				delete(live, a)
				break
			}
		default:
			if _, err := p.Trim(uint64(rng.Intn(3)) * 8 * mib); err != nil {
				t.Fatal(err)
			}
		}
		checkPool(t, p, d)
	}
	for a := range live {
		mustFree(t, p, a)
	}
	if _, err := p.Trim(0); err != nil || d.chunks() != 0 {
		t.Fatalf("after freeing all and Trim(0): %v, %d chunks", err, d.chunks())
	}
	checkPool(t, p, d)
}

// TestPoolConcurrentUse: torch's allocator calls in from any thread.
// Goroutines allocate, write down and free; no two live allocations ever
// overlap; at the end nothing is mapped. Run with -race.
func TestPoolConcurrentUse(t *testing.T) {
	p, d := newTestPool(t, 4*mib, 256, 0)
	var mu sync.Mutex
	owner := map[uint64]int{} // every 512-byte unit in use -> goroutine
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			rng := rand.New(rand.NewSource(int64(g)))
			type alloc struct{ a, n uint64 }
			var mine []alloc
			release := func(x alloc) error {
				// Forget the units first: once Free returns, another
				// goroutine may be handed them.
				mu.Lock()
				for u := x.a; u < x.a+x.n; u += PoolAlignment {
					delete(owner, u)
				}
				mu.Unlock()
				n, err := p.Free(x.a)
				if err == nil && n != x.n {
					err = fmt.Errorf("Free(%#x) = %d bytes, allocated %d", x.a, n, x.n)
				}
				return err
			}
			for i := 0; i < 300; i++ {
				if len(mine) > 0 && rng.Intn(2) == 0 {
					x := mine[len(mine)-1]
					mine = mine[:len(mine)-1]
					if err := release(x); err != nil {
						errs <- err
						return
					}
					continue
				}
				n := uint64(rng.Intn(6*1024)+1) * 1024
				a, err := p.Alloc(n)
				if err != nil {
					errs <- err
					return
				}
				mine = append(mine, alloc{a, n})
				mu.Lock()
				for u := a; u < a+n; u += PoolAlignment {
					if o, taken := owner[u]; taken {
						mu.Unlock()
						errs <- fmt.Errorf("goroutine %d got %#x, inside memory goroutine %d holds", g, u, o)
						return
					}
					owner[u] = g
				}
				mu.Unlock()
			}
			for _, x := range mine {
				if err := release(x); err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	if d.chunks() != 0 || p.Info().Allocations != 0 {
		t.Fatalf("after all goroutines freed everything: %d chunks, %+v", d.chunks(), p.Info())
	}
	checkPool(t, p, d)
	if err := p.Close(); err != nil {
		t.Fatal(err)
	}
}

func TestPoolAddressSpaceArithmetic(t *testing.T) {
	const gib = 1 << 30
	for _, c := range []struct {
		need, limit, used uint64
		ok                bool
	}{
		{gib, 4 * gib, gib, true},
		{gib, 2*gib + RuntimeHeadroom, gib, true},      // exactly the headroom left
		{gib, 2*gib + RuntimeHeadroom - 1, gib, false}, // a byte short
		{4 * gib, 2 * gib, 0, false},                   // need above the limit
		{gib, 2 * gib, 3 * gib, false},                 // already above the limit
		{^uint64(0), ^uint64(0), 0, false},             // no room for the headroom
	} {
		err := addressSpaceFits(c.need, c.limit, c.used, "pool", "")
		if (err == nil) != c.ok {
			t.Errorf("addressSpaceFits(%d, %d, %d) = %v, want ok=%v", c.need, c.limit, c.used, err, c.ok)
		}
		if err != nil && (CodeOf(err) != ENOMEM || !strings.Contains(err.Error(), "raise RLIMIT_AS")) {
			t.Errorf("message %v", err)
		}
	}
	err := addressSpaceFits(4*gib, 6*gib, 3*gib, "pool", "")
	if err == nil || err.Error() != "pool: reserving 4.0 GiB needs that much address space plus 128.0 MiB kept for the Go runtime, but RLIMIT_AS (6.0 GiB) leaves 3.0 GiB free (3.0 GiB in use), 1152.0 MiB short: raise RLIMIT_AS (ulimit -v)" {
		t.Fatalf("got %v", err)
	}
}
