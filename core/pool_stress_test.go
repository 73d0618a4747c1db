package core

import (
	"fmt"
	"math/rand"
	"sync"
	"testing"
)

// A Pool under many operations: random sequences checked against its
// invariants after each step, and concurrent callers.

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
