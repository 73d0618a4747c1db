package core

import (
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A cached mapping is the sender's buffer as it is now: undone once the
// buffer is unregistered or its exporter dies, showing the sender's
// in-place writes, never hit by a restarted exporter's new buffer.

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
