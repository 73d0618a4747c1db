package core

import (
	"fmt"
	"sort"
	"sync"
	"testing"
)

// What the Pool's tests run on: a fake device that checks every driver
// call, a pool over it, and checkPool, the pool's invariants.

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
