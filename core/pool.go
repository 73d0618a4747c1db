package core

import (
	"sort"
	"sync"
)

// A Pool hands out memory made for sharing: one address range reserved once,
// backed by large physical chunks mapped side by side as they are needed, so
// that what is allocated in it spans few allocation handles (a receiver's
// cost is per handle, not per byte: import, map and set access). The Pool is
// the bookkeeping only; a PoolBackend does the memory (cuda/pool.go: the
// CUDA driver; tests: a stand-in).
//
// Placement: an allocation goes where it needs the fewest new chunks, and
// among those places at the lowest address (address-ordered first fit, which
// fragments about as little as best fit and keeps the used part of the range
// dense, so that growth lands next to what is there). Unmapped slots of the
// range count as free space that costs a chunk, so an allocation larger than
// a chunk, or one that does not fit in what is mapped, maps the chunks it
// needs contiguously, after the free tail of the memory before it.
//
// Giving back: a chunk goes back to the backend (unmap, release) only when
// no allocation touches it, and only beyond the keep bound: after each Free,
// wholly free chunks beyond Keep bytes are given back, the highest addresses
// first (placement prefers low ones). Trim gives back down to any bound.
// Before unmapping, the backend waits for the device (Sync), as cudaFree
// does.
type Pool struct {
	mu      sync.Mutex
	b       PoolBackend
	chunk   uint64
	keep    uint64
	base    uint64
	size    uint64            // bytes reserved at base: len(slots) * chunk
	slots   []poolSlot        // one per chunk-sized slot of the range
	free    []poolExtent      // free offsets of the range, sorted, coalesced; unmapped slots included
	live    map[uint64]uint64 // offset -> size of each allocation
	used    uint64            // bytes allocated
	mapped  uint64            // slots mapped
	created uint64            // chunks mapped since the pool began
	gone    uint64            // chunks given back since the pool began
	closed  bool
}

type poolSlot struct {
	mapped bool
	handle uint64
	used   uint64 // allocated bytes inside this slot
}

type poolExtent struct{ off, end uint64 }

// PoolInfo is what a Pool holds now, and has done.
type PoolInfo struct {
	Base, Reserved        uint64 // the address range
	ChunkSize, KeepBytes  uint64
	MappedBytes           uint64 // chunks mapped now, in bytes
	AllocatedBytes        uint64 // bytes of live allocations (rounded sizes)
	Allocations           uint64 // live allocations
	ChunksMapped          uint64 // chunks mapped since the pool began
	ChunksReleased        uint64 // chunks given back since the pool began
	WhollyFreeMappedBytes uint64 // mapped chunks no allocation touches
}

// NewPool checks cfg, reserves the address range (after checking that
// RLIMIT_AS leaves room for it) and returns an empty pool. Nothing is mapped
// until the first Alloc.
func NewPool(b PoolBackend, cfg PoolConfig) (*Pool, error) {
	if cfg.Chunk == 0 {
		cfg.Chunk = DefaultPoolChunk
	}
	if cfg.Granularity == 0 || cfg.Granularity%PoolAlignment != 0 {
		return nil, Errorf(EINTERNAL, "pool: allocation granularity %d is not a multiple of %d", cfg.Granularity, PoolAlignment)
	}
	if cfg.Chunk%cfg.Granularity != 0 {
		return nil, Errorf(EINVAL, "pool: chunk size %d is not a multiple of the device's allocation granularity %d (%s): pick a multiple of it, or 0 for the default %s",
			cfg.Chunk, cfg.Granularity, sizeStr(cfg.Granularity), sizeStr(DefaultPoolChunk))
	}
	size, ok := RoundUp(cfg.Reserve, cfg.Chunk)
	if !ok || size == 0 || size/cfg.Chunk > MaxChunks {
		return nil, Errorf(EINVAL, "pool: chunk size %d and address range %d bytes give no range of at most %d chunks", cfg.Chunk, cfg.Reserve, MaxChunks)
	}
	if err := checkAddressSpace(size, "pool", " or make the pool's range smaller"); err != nil {
		return nil, err
	}
	base, err := b.Reserve(size)
	if err != nil {
		return nil, WrapErr(ECUDA, err, "pool: reserving %s of address space", sizeStr(size))
	}
	return &Pool{b: b, chunk: cfg.Chunk, keep: cfg.Keep, base: base, size: size,
		slots: make([]poolSlot, size/cfg.Chunk), free: []poolExtent{{0, size}},
		live: map[uint64]uint64{}}, nil
}

// Alloc returns the address of size bytes (rounded up to PoolAlignment),
// mapping the chunks it needs. On an error nothing is left mapped for it.
func (p *Pool) Alloc(size uint64) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, Errorf(EBADF, "pool: allocating %d bytes: the pool is destroyed", size)
	}
	n, ok := RoundUp(size, PoolAlignment)
	if size == 0 || !ok || n > p.size {
		return 0, Errorf(EINVAL, "pool: cannot allocate %d bytes: the size must be between 1 and the pool's address range, %d bytes", size, p.size)
	}
	off, ok := p.place(n)
	if !ok {
		return 0, Errorf(ENOMEM, "pool: no run of %s is free in the pool's %s address range (%s allocated): free or trim first, or use a second pool",
			sizeStr(n), sizeStr(p.size), sizeStr(p.used))
	}
	if err := p.mapRange(off, n); err != nil {
		return 0, err
	}
	p.take(off, n)
	return p.base + off, nil
}

// place finds where n bytes go: the fewest unmapped slots, then the lowest
// offset. The candidates in a free extent are its start and the start of
// each mapped run inside it (a kept chunk that costs nothing).
func (p *Pool) place(n uint64) (uint64, bool) {
	best, bestCost, found := uint64(0), uint64(0), false
	consider := func(off uint64, e poolExtent) {
		if off < e.off || e.end-off < n {
			return
		}
		cost := p.unmappedIn(off, n, bestCost, found)
		if !found || cost < bestCost {
			best, bestCost, found = off, cost, true
		}
	}
	for _, e := range p.free {
		if e.end-e.off < n {
			continue
		}
		consider(e.off, e)
		if found && bestCost == 0 {
			return best, true // nothing lower can cost less
		}
		first := e.off/p.chunk + 1
		for i := first; i*p.chunk < e.end && i < uint64(len(p.slots)); i++ {
			if p.slots[i].mapped && !p.slots[i-1].mapped {
				consider(i*p.chunk, e)
			}
		}
		if found && bestCost == 0 {
			return best, true
		}
	}
	return best, found
}

// unmappedIn counts the unmapped slots under [off, off+n), stopping once it
// cannot beat bound (when have is set).
func (p *Pool) unmappedIn(off, n, bound uint64, have bool) uint64 {
	var c uint64
	for i := off / p.chunk; i*p.chunk < off+n; i++ {
		if !p.slots[i].mapped {
			c++
			if have && c >= bound {
				return c
			}
		}
	}
	return c
}

// mapRange maps every unmapped slot under [off, off+n); on an error it
// unmaps those it mapped.
func (p *Pool) mapRange(off, n uint64) error {
	var done []uint64
	for i := off / p.chunk; i*p.chunk < off+n; i++ {
		if p.slots[i].mapped {
			continue
		}
		h, err := p.b.Map(p.base+i*p.chunk, p.chunk)
		if err != nil {
			for _, j := range done { // nothing used them yet: no Sync needed
				_ = p.b.Unmap(p.base+j*p.chunk, p.chunk, p.slots[j].handle)
				p.slots[j] = poolSlot{}
				p.mapped--
				p.created--
			}
			return WrapErr(ECUDA, err, "pool: mapping a %s chunk at %#x for %d bytes", sizeStr(p.chunk), p.base+i*p.chunk, n)
		}
		p.slots[i] = poolSlot{mapped: true, handle: h}
		p.mapped++
		p.created++
		done = append(done, i)
	}
	return nil
}

// take records the allocation [off, off+n), which lies in one free extent.
func (p *Pool) take(off, n uint64) {
	i := sort.Search(len(p.free), func(i int) bool { return p.free[i].end > off })
	e := p.free[i]
	var repl []poolExtent
	if e.off < off {
		repl = append(repl, poolExtent{e.off, off})
	}
	if off+n < e.end {
		repl = append(repl, poolExtent{off + n, e.end})
	}
	p.free = append(p.free[:i], append(repl, p.free[i+1:]...)...)
	p.live[off] = n
	p.used += n
	p.account(off, n, true)
}

// account adds (or removes) the bytes of [off, off+n) to the slots under it.
func (p *Pool) account(off, n uint64, add bool) {
	for i := off / p.chunk; i*p.chunk < off+n; i++ {
		lo, hi := max(off, i*p.chunk), min(off+n, (i+1)*p.chunk)
		if add {
			p.slots[i].used += hi - lo
		} else {
			p.slots[i].used -= hi - lo
		}
	}
}

// Free frees the allocation at addr and returns its size. Wholly free
// chunks beyond the keep bound then go back to the backend; an error doing
// so is returned, but the allocation is freed either way (a chunk that
// could not be given back stays mapped, for a later Trim).
func (p *Pool) Free(addr uint64) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, Errorf(EBADF, "pool: freeing %#x: the pool is destroyed", addr)
	}
	off := addr - p.base
	n, ok := p.live[off]
	if addr < p.base || !ok {
		return 0, Errorf(EINVAL, "pool: %#x is not an allocation of this pool (never allocated here, or freed already)", addr)
	}
	delete(p.live, off)
	p.used -= n
	p.account(off, n, false)
	p.give(off, n)
	_, err := p.trim(p.keep)
	return n, err
}

// give puts [off, off+n) back among the free extents, joined with its
// neighbours.
func (p *Pool) give(off, n uint64) {
	i := sort.Search(len(p.free), func(i int) bool { return p.free[i].off > off })
	e := poolExtent{off, off + n}
	if i > 0 && p.free[i-1].end == off {
		e.off = p.free[i-1].off
		i--
		p.free = append(p.free[:i], p.free[i+1:]...)
	}
	if i < len(p.free) && p.free[i].off == e.end {
		e.end = p.free[i].end
		p.free = append(p.free[:i], p.free[i+1:]...)
	}
	p.free = append(p.free[:i], append([]poolExtent{e}, p.free[i:]...)...)
}

// Trim gives wholly free chunks back to the backend until at most keep
// bytes of them stay mapped, and returns the bytes given back.
func (p *Pool) Trim(keep uint64) (uint64, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return 0, Errorf(EBADF, "pool: trim: the pool is destroyed")
	}
	return p.trim(keep)
}

func (p *Pool) trim(keep uint64) (uint64, error) {
	var idle []int
	for i := range p.slots {
		if p.slots[i].mapped && p.slots[i].used == 0 {
			idle = append(idle, i)
		}
	}
	kept := int(min(keep/p.chunk, uint64(len(idle))))
	idle = idle[kept:] // the lowest ones stay: placement prefers them
	if len(idle) == 0 {
		return 0, nil
	}
	if err := p.b.Sync(); err != nil {
		return 0, WrapErr(ECUDA, err, "pool: waiting for the device before giving %d chunk(s) back", len(idle))
	}
	var released uint64
	var first error
	for k := len(idle) - 1; k >= 0; k-- {
		i := idle[k]
		if err := p.b.Unmap(p.base+uint64(i)*p.chunk, p.chunk, p.slots[i].handle); err != nil {
			if first == nil {
				first = WrapErr(ECUDA, err, "pool: giving back the chunk at %#x", p.base+uint64(i)*p.chunk)
			}
			continue
		}
		p.slots[i] = poolSlot{}
		p.mapped--
		p.gone++
		released += p.chunk
	}
	return released, first
}

// Info reports what the pool holds.
func (p *Pool) Info() PoolInfo {
	p.mu.Lock()
	defer p.mu.Unlock()
	var idle uint64
	for _, s := range p.slots {
		if s.mapped && s.used == 0 {
			idle += p.chunk
		}
	}
	return PoolInfo{Base: p.base, Reserved: p.size, ChunkSize: p.chunk, KeepBytes: p.keep,
		MappedBytes: p.mapped * p.chunk, AllocatedBytes: p.used, Allocations: uint64(len(p.live)),
		ChunksMapped: p.created, ChunksReleased: p.gone, WhollyFreeMappedBytes: idle}
}

// Close gives every chunk and the address range back. It refuses (EINVAL,
// nothing touched) while allocations live. After a failure of the backend
// the pool is closed all the same and the first failure is returned.
func (p *Pool) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return Errorf(EBADF, "pool: destroyed already")
	}
	if len(p.live) > 0 {
		return Errorf(EINVAL, "pool: %d allocation(s) of %s in total still live: free them before destroying the pool", len(p.live), sizeStr(p.used))
	}
	_, err := p.trim(0)
	for i, s := range p.slots { // those a failed Unmap left
		if s.mapped {
			_ = p.b.Unmap(p.base+uint64(i)*p.chunk, p.chunk, s.handle)
		}
	}
	if ferr := p.b.Free(p.base, p.size); ferr != nil && err == nil {
		err = WrapErr(ECUDA, ferr, "pool: freeing the address range")
	}
	p.closed = true
	p.slots, p.free, p.live = nil, nil, nil
	return err
}
