package core

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
)

// What the import cache keeps: at most its byte bound, evicting the least
// recently used; never what ends with this use, is larger than the bound or
// bypasses the cache; and the bound VMMIPC_CACHE_BYTES sets.

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
	expectCache(t, "3 hits", before, CacheInfo{Entries: 3, UnreferencedBytes: 3 * cacheSize, Hits: 3, TableHits: 3, Misses: 5, Evictions: 2})
	// Buffer 4 is now the least recently used: importing buffer 0 again
	// (a miss) evicts it.
	r := importHost(t, regs[0].tk, ImportOptions{})
	if err := verifyRef(r, 10); err != nil {
		t.Fatal(err)
	}
	unmapRef(t, r)
	expectCache(t, "an evicted buffer again", before, CacheInfo{Entries: 3, UnreferencedBytes: 3 * cacheSize, Hits: 3, TableHits: 3, Misses: 6, Evictions: 3})
	r = importHost(t, regs[4].tk, ImportOptions{})
	unmapRef(t, r)
	if got := cacheDelta(before); got.Misses != 7 {
		t.Fatalf("buffer 4, the least recently used, was not the one evicted: %+v", got)
	}
	// Lowering the bound evicts at once.
	if err := SetCacheLimit(cacheSize); err != nil {
		t.Fatal(err)
	}
	expectCache(t, "bound lowered to one buffer", before, CacheInfo{Entries: 1, UnreferencedBytes: cacheSize, Hits: 3, TableHits: 3, Misses: 7, Evictions: 6})
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
	expectCache(t, "a bound smaller than the kept mapping", before, CacheInfo{Hits: 1, TableHits: 1, Misses: 3, Evictions: 1})
	big := registerCounting(t, s, cacheSize, 7, RegisterOptions{})
	unmapRef(t, importHost(t, big.tk, ImportOptions{}))
	expectCache(t, "larger than the bound", before, CacheInfo{Hits: 1, TableHits: 1, Misses: 4, Evictions: 1})
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
	expectCache(t, "cache off", before, CacheInfo{Hits: 1, TableHits: 1, Misses: 6, Evictions: 1})
	expectMapped(t, "cache off", 0)
}

// TestCacheBytesEnv: VMMIPC_CACHE_BYTES sets the bound (read once per
// process, so each value runs in a helper process of its own); a bad value
// makes imports fail with ECONFIG (a configuration error, not a bad
// argument) naming the variable.
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
		{"bogus", ECONFIG, DefaultCacheBytes, 0, "VMMIPC_CACHE_BYTES=\"bogus\""},
		{"-1", ECONFIG, DefaultCacheBytes, 0, "VMMIPC_CACHE_BYTES=\"-1\""},
		{"99999999999T", ECONFIG, DefaultCacheBytes, 0, "too large"},
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
