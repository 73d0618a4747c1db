package core

import (
	"strings"
	"testing"
)

// A Pool when something goes wrong: the device's memory runs out or a
// driver call fails, the caller passes bad input or a bad configuration, or
// the address space would not hold the reservation. Each fails cleanly and
// leaves the pool as it was.

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
