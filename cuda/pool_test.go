package cuda

import (
	"strings"
	"testing"

	"github.com/libvmmipc/libvmmipc/core"
)

// TestPoolWithoutDriver: without a driver, making a pool (and the torch
// pool behind the torch hooks) is ECUDA naming the library, and leaves no
// torch pool behind to be found later.
func TestPoolWithoutDriver(t *testing.T) {
	if driverPresent(t) {
		t.Skip("a CUDA driver is installed here: the no-driver path cannot be tested")
	}
	t.Setenv(LibraryEnv, "/nonexistent/libcuda.so.1")
	for name, f := range map[string]func() (*core.Pool, error){
		"NewPool":   func() (*core.Pool, error) { return NewPool(0, 0, 0) },
		"TorchPool": func() (*core.Pool, error) { return TorchPool(0, 64<<20) },
	} {
		p, err := f()
		if p != nil || core.CodeOf(err) != core.ECUDA || !strings.Contains(err.Error(), "/nonexistent/libcuda.so.1") {
			t.Errorf("%s: %v, %v; want ECUDA naming the library", name, p, err)
		}
	}
	if torchPools.pools[0] != nil {
		t.Fatal("a failed TorchPool left a pool behind")
	}
}

func TestPoolArgumentsBeforeDriver(t *testing.T) {
	t.Setenv(LibraryEnv, "/nonexistent/libcuda.so.1")
	for _, d := range []int32{-1, -2} {
		if _, err := NewPool(d, 0, 0); core.CodeOf(err) != core.EINVAL || !strings.Contains(err.Error(), "not a CUDA device ordinal") {
			t.Errorf("NewPool(device %d): %v, want EINVAL before any driver is loaded", d, err)
		}
	}
}

// TestPoolSubRangeIsItsChunks: in a pool every chunk is mapped on its own,
// so the driver reports one allocation per chunk. A tensor inside one 1 GiB
// chunk is covered by exactly that chunk (what vmmipc_cuda_query_range
// answers and vmmipc_register_cuda then registers: one handle, the tensor
// at its offset in it); one across a chunk boundary by the two chunks.
func TestPoolSubRangeIsItsChunks(t *testing.T) {
	const gib = 1 << 30
	const base = 0x7f0000000000
	rangeAt := fakeRanges(base, gib, gib, gib) // three chunks side by side
	cover := func(dptr, size uint64) (uint64, uint64) {
		lo, _, err := rangeAt(dptr) // QueryRange's arithmetic
		if err != nil {
			t.Fatal(err)
		}
		hiBase, hiSize, err := rangeAt(dptr + size - 1)
		if err != nil {
			t.Fatal(err)
		}
		return lo, hiBase + hiSize - lo
	}
	for _, c := range []struct {
		dptr, size uint64
		chunks     int
		offset     uint64
	}{
		{base + gib + 4096, 64 << 20, 1, 4096},        // inside the second chunk
		{base + gib - 1<<20, 2 << 20, 2, gib - 1<<20}, // across the first boundary
		{base, 3 * gib, 3, 0},                         // all of it
	} {
		lo, n := cover(c.dptr, c.size)
		spans, err := walkRange(lo, n, rangeAt)
		if err != nil || len(spans) != c.chunks || c.dptr-lo != c.offset {
			t.Errorf("[%#x, +%d): covered by %d allocation(s) from %#x (offset %d), %v; want %d at offset %d",
				c.dptr, c.size, len(spans), lo, c.dptr-lo, err, c.chunks, c.offset)
		}
	}
	// The sub-range itself is not on allocation boundaries: registering it
	// as it is is refused, saying so.
	if _, err := walkRange(base+gib+4096, 64<<20, rangeAt); core.CodeOf(err) != core.EINVAL ||
		!strings.Contains(err.Error(), "must start on an allocation boundary") {
		t.Fatalf("registering the bare sub-range: %v", err)
	}
}
