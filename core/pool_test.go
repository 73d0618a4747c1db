package core

import "testing"

// A Pool over a fake device (pool_harness_test.go): where it places
// allocations, how it grows, frees, reuses and coalesces, and which chunks
// it gives back, keeps or trims.

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
