package core

import (
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// holdFixture is an anchor (uses 0) on a host buffer and a way to grant
// holdable uses of it whose release is observed.
type holdFixture struct {
	s      *Server
	anchor *Ticket
	before CacheInfo // the cache as the test started (cacheTest)
}

// newHoldFixture starts every hold test: from an empty cache (cacheTest),
// with a server of its own.
func newHoldFixture(t *testing.T) holdFixture {
	t.Helper()
	// The receiver's holds and leases are the process's: an earlier test's
	// (a stopped or dead exporter's, let go of off its path) must be gone
	// before this one counts its own.
	if !waitUntil(5*time.Second, func() bool { i := GetCacheInfo(); return i.Holds == 0 && i.HolderSessions == 0 }) {
		i := GetCacheInfo()
		t.Fatalf("an earlier test left %d holds on %d leases in this process", i.Holds, i.HolderSessions)
	}
	before := cacheTest(t)
	s := newTestServer(t)
	a := registerCounting(t, s, cacheSize, 21, RegisterOptions{Uses: 0})
	return holdFixture{s: s, anchor: a.tk, before: before}
}

// grant registers one more use of the anchor; released flips when its
// release (the owner's OnRelease) runs.
func (f holdFixture) grant(t *testing.T, hold bool) (*Ticket, *atomic.Bool) {
	t.Helper()
	var released atomic.Bool
	g, err := f.s.RegisterAgain(f.anchor, RegisterOptions{Uses: 1, Hold: hold, OnRelease: func() { released.Store(true) }})
	if err != nil {
		t.Fatal(err)
	}
	return g, &released
}

// stillHeld fails unless g's release has not run for a while.
func stillHeld(t *testing.T, f holdFixture, g *Ticket, what string) {
	t.Helper()
	if err := f.s.Wait(g, 100*time.Millisecond); CodeOf(err) != ETIMEDOUT {
		t.Fatalf("%s: the grant was released (Wait: %v) while a receiver holds it", what, err)
	}
}

func releasedSoon(t *testing.T, f holdFixture, g *Ticket, what string) {
	t.Helper()
	if err := f.s.Wait(g, 5*time.Second); err != nil {
		t.Fatalf("%s: the grant was not released: %v", what, err)
	}
}

// letGo releases the receiver's hold on g and fails unless the grant is
// then released.
func letGo(t *testing.T, f holdFixture, g *Ticket, what string) {
	t.Helper()
	if err := Release(g); err != nil {
		t.Fatalf("%s: Release: %v", what, err)
	}
	releasedSoon(t, f, g, what)
}

var holdImport = ImportOptions{Hold: true}

// serverIdle waits (at most 5 s) until s serves no connection: a session
// closes the server's end of its socket after the receiver has its
// answer, which in one process a descriptor count can catch.
func serverIdle(s *Server) {
	waitUntil(5*time.Second, func() bool {
		s.adm.mu.Lock()
		defer s.adm.mu.Unlock()
		return s.adm.held == 0
	})
}

// TestHoldKeepsTheSenderUntilLetGo: a holdable grant used by a receiver
// that holds is used up (no second receiver) but not released until the
// receiver lets go; a cache hit holds on the same lease, and leaves no
// descriptor behind; the counts on both sides follow.
func TestHoldKeepsTheSenderUntilLetGo(t *testing.T) {
	f := newHoldFixture(t)
	g1, rel1 := f.grant(t, true)
	r := importHost(t, g1, holdImport)
	defer Unmap(r.ID, r.Base)
	if err := verifyRef(r, 21); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, g1, "after the import")
	// A second use of the used-up grant would be a cache hit: held, it
	// waits for the exporter's answer, which refuses it (ENOENT, as a
	// miss would be): nothing more is held on either side. (860d711
	// returned OK here and counted the refusal later.)
	if _, err := Import(g1, DeviceHost, holdImport, nil); CodeOf(err) != ENOENT {
		t.Fatalf("a held hit on a used-up grant: %v, want ENOENT", err)
	}
	if f.s.Holds() != 1 || GetCacheInfo().Holds != 1 {
		t.Fatalf("holds: server %d, receiver %d, want 1 and 1", f.s.Holds(), GetCacheInfo().Holds)
	}
	sessions := GetCacheInfo().HolderSessions
	serverIdle(f.s) // the refused hit's session closes its socket after the receiver has its answer
	fdsBefore := ourFDs().now(t)

	g2, rel2 := f.grant(t, true)
	r2 := importHost(t, g2, holdImport) // a hit: one short session, held on the lease
	defer Unmap(r2.ID, r2.Base)
	if d := cacheDelta(f.before); d.Hits != 1 {
		t.Fatalf("the third import was not a cache hit: %+v", d)
	}
	if got := GetCacheInfo().HolderSessions; got > sessions { // earlier tests' may close meanwhile
		t.Fatalf("a hit took another lease: %d, had %d", got, sessions)
	}
	serverIdle(f.s) // and so does the hit's: a one-round answer comes before its session ends
	if now := ourFDs().now(t); now != fdsBefore {
		t.Fatalf("a held hit changed the descriptors from %d to %d", fdsBefore, now)
	}
	stillHeld(t, f, g2, "after the hit")
	if !waitUntil(5*time.Second, func() bool { return f.s.Holds() == 2 }) {
		t.Fatalf("server holds %d, want 2", f.s.Holds())
	}

	letGo(t, f, g1, "after Release")
	stillHeld(t, f, g2, "the other hold after the first was let go")
	if rel2.Load() || !rel1.Load() {
		t.Fatalf("released: first %v, second %v; want true, false", rel1.Load(), rel2.Load())
	}
	if err := Release(g1); CodeOf(err) != ENOENT {
		t.Fatalf("releasing twice: %v, want ENOENT", err)
	}
	letGo(t, f, g2, "after the second Release")
	if !waitUntil(5*time.Second, func() bool { return f.s.Holds() == 0 && GetCacheInfo().Holds == 0 }) {
		t.Fatalf("holds left: server %d, receiver %d", f.s.Holds(), GetCacheInfo().Holds)
	}
}

// TestHoldEndsWithTheReceiversLease: the end of the receiver's lock on its
// lease (what its death does: the kernel drops it) lets go of every hold
// on it, however taken, within the exporter's poll.
func TestHoldEndsWithTheReceiversLease(t *testing.T) {
	f := newHoldFixture(t)
	g1, _ := f.grant(t, true)
	r := importHost(t, g1, holdImport)
	defer Unmap(r.ID, r.Base)
	g2, _ := f.grant(t, true)
	if err := Confirm(g2, holdImport); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, g1, "stream")
	stillHeld(t, f, g2, "confirmation")
	l := leaseOf(g1)
	if l == nil {
		t.Fatal("no lease after a held import")
	}
	l.mu.Lock()
	l.m.end() // as the kernel does when the receiver dies
	l.m = nil
	l.mu.Unlock()
	releasedSoon(t, f, g1, "after the receiver's lock went")
	releasedSoon(t, f, g2, "after the receiver's lock went")
	if f.s.Holds() != 0 {
		t.Fatalf("server holds %d after the lock went", f.s.Holds())
	}
	// The next use names the lease, is told it is gone, and gets another.
	g3, _ := f.grant(t, true)
	if err := Confirm(g3, holdImport); err != nil {
		t.Fatalf("a use after the lease ended: %v", err)
	}
	stillHeld(t, f, g3, "a use on the new lease")
	letGo(t, f, g3, "release on the new lease")
}

// leaseOf is this process's first lease to t's exporter, or nil.
func leaseOf(t *Ticket) *clientLease {
	if l := leasesOf(t); len(l) > 0 {
		return l[0]
	}
	return nil
}

// leaseHolding is this process's lease that holds a use of t, or nil: a
// lease that has ended may still be listed first for a moment (its
// goroutine unmaps it, then unlists it).
func leaseHolding(t *Ticket) *clientLease {
	for _, l := range leasesOf(t) {
		l.mu.Lock()
		holds := l.held[t.RegID] > 0
		l.mu.Unlock()
		if holds {
			return l
		}
	}
	return nil
}

func leasesOf(t *Ticket) []*clientLease {
	leases.mu.Lock()
	defer leases.mu.Unlock()
	return append([]*clientLease(nil), leases.m[t.exporterKey()]...)
}

// TestHoldNeedsBothSides: a grant made without Hold is released as soon as
// it is used up, whoever asks to hold; a receiver that does not ask to hold
// holds nothing.
func TestHoldNeedsBothSides(t *testing.T) {
	f := newHoldFixture(t)
	plain, _ := f.grant(t, false)
	r := importHost(t, plain, holdImport)
	defer Unmap(r.ID, r.Base)
	releasedSoon(t, f, plain, "a grant without Hold")
	if err := Release(plain); CodeOf(err) != ENOENT {
		t.Fatalf("releasing a use that was not held: %v, want ENOENT", err)
	}
	holdable, _ := f.grant(t, true)
	if err := Confirm(holdable, ImportOptions{}); err != nil {
		t.Fatal(err)
	}
	releasedSoon(t, f, holdable, "a receiver that did not ask to hold")
	if f.s.Holds() != 0 {
		t.Fatalf("server holds %d", f.s.Holds())
	}
	var o ImportOptions
	if err := o.SetFlags(ImportHold | ImportConfirmLater); CodeOf(err) != EINVAL {
		t.Fatalf("hold with confirm-later: %v, want EINVAL", err)
	}
}

// TestNoReceiverReleasesAnothersHold: a peer that does not know a lease's
// token (another receiver, by hand) can neither release what is held on
// it nor hold on it: both are answered lease-gone and nothing changes.
func TestNoReceiverReleasesAnothersHold(t *testing.T) {
	f := newHoldFixture(t)
	victim, err := f.s.RegisterAgain(f.anchor, RegisterOptions{Uses: 2, Hold: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := Confirm(victim, holdImport); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, victim, "the victim's hold")
	l := leaseOf(victim)
	if l == nil {
		t.Fatal("no lease after a held use")
	}
	for _, slot := range []uint64{l.slot, l.slot + 1} {
		forged := l.token
		forged[5] ^= 1
		for _, msg := range [][]byte{
			releaseMsg{Slot: slot, Token: forged, Flags: releaseEnd, RegIDs: []uint64{victim.RegID}}.encode(),
			leaseRefMsg{Slot: slot, Token: forged}.encode(msgHoldOn),
		} {
			fd, err := rawDial(victim.Address)
			if err != nil {
				t.Fatal(err)
			}
			if err := rawWrite(fd, msg); err != nil {
				t.Fatal(err)
			}
			got, _, err := rawRecv(fd, 5*time.Second)
			unix.Close(fd)
			if err != nil || got.Type != msgLeaseGone {
				t.Fatalf("a forged token: %s (%v), want lease-gone", describeMsg(got), err)
			}
		}
	}
	stillHeld(t, f, victim, "after forged releases")
	if f.s.Holds() != 1 {
		t.Fatalf("server holds %d, want the victim's 1", f.s.Holds())
	}
	if err := Release(victim); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(5*time.Second, func() bool { return f.s.Holds() == 0 }) {
		t.Fatalf("server holds %d after the victim's release, want 0", f.s.Holds())
	}
	if err := f.s.Unregister(victim); err != nil {
		t.Fatal(err)
	}
	releasedSoon(t, f, victim, "the victim, unregistered")
}

// TestHeldReleasesInBatches: many holds let go of at once all arrive (in
// messages of at most maxReleaseBatch ids) and nothing stays held.
func TestHeldReleasesInBatches(t *testing.T) {
	f := newHoldFixture(t)
	const n = 3*maxReleaseBatch/2 + 7
	grants := make([]*Ticket, n)
	for i := range grants {
		grants[i], _ = f.grant(t, true)
		if err := Confirm(grants[i], holdImport); err != nil {
			t.Fatalf("use %d: %v", i, err)
		}
	}
	if !waitUntil(5*time.Second, func() bool { return f.s.Holds() == n }) {
		t.Fatalf("server holds %d, want %d", f.s.Holds(), n)
	}
	for _, g := range grants {
		if err := Release(g); err != nil {
			t.Fatal(err)
		}
	}
	for _, g := range grants {
		releasedSoon(t, f, g, "a batched release")
	}
	if f.s.Holds() != 0 || GetCacheInfo().Holds != 0 {
		t.Fatalf("holds left: server %d, receiver %d", f.s.Holds(), GetCacheInfo().Holds)
	}
}

// TestHoldOnAnEndedLease: a hold-on that names a lease the exporter does
// not know is answered lease-gone before anything is spent, and the
// receiver gets a new lease, on which its use is held.
func TestHoldOnAnEndedLease(t *testing.T) {
	f := newHoldFixture(t)
	g1, _ := f.grant(t, true)
	if err := Confirm(g1, holdImport); err != nil {
		t.Fatal(err)
	}
	old := leaseOf(g1)
	if old == nil {
		t.Fatal("no lease after a held use")
	}
	old.token[0] ^= 0xff // the exporter no longer knows it
	g2, _ := f.grant(t, true)
	r := importHost(t, g2, holdImport) // a miss: a stream, with hold-on
	defer Unmap(r.ID, r.Base)
	if err := verifyRef(r, 21); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, g2, "a use whose hold-on named an ended lease")
	if n := len(leasesOf(g2)); n != 1 || leaseOf(g2) == old {
		t.Fatalf("%d leases to the exporter, want only the new one", n)
	}
	letGo(t, f, g2, "the use held on the new lease")
	// The old lease's holds ended with its lock: its unmapping.
	releasedSoon(t, f, g1, "the use held on the old lease")
}

// TestHoldOnASecondStream: a second new mapping from the same exporter (a
// stream that names the lease with hold-on) is held there too,
// and its Release lets go of it.
func TestHoldOnASecondStream(t *testing.T) {
	f := newHoldFixture(t)
	other := registerCounting(t, f.s, cacheSize, 22, RegisterOptions{Uses: 0})
	g1, _ := f.grant(t, true)
	r1 := importHost(t, g1, holdImport) // the lease
	defer Unmap(r1.ID, r1.Base)
	var released atomic.Bool
	g2, err := f.s.RegisterAgain(other.tk, RegisterOptions{Uses: 1, Hold: true, OnRelease: func() { released.Store(true) }})
	if err != nil {
		t.Fatal(err)
	}
	r2 := importHost(t, g2, holdImport) // a miss: its own stream, hold-on
	defer Unmap(r2.ID, r2.Base)
	if err := verifyRef(r2, 22); err != nil {
		t.Fatal(err)
	}
	if n := len(leasesOf(g1)); n != 1 || GetCacheInfo().Holds != 2 {
		t.Fatalf("%d leases at the exporter, holds %d; want 1 and 2", n, GetCacheInfo().Holds)
	}
	stillHeld(t, f, g2, "a stream held through hold-on")
	letGo(t, f, g2, "a use held through hold-on")
	if !released.Load() {
		t.Fatal("OnRelease did not run")
	}
	letGo(t, f, g1, "after Release")
}

// TestLeaseEndsWithItsExporter: when the exporter goes (here its server
// closes, as its exit would), the receiver's release finds it gone and
// drops the lease: nothing is left mapped for it.
func TestLeaseEndsWithItsExporter(t *testing.T) {
	f := newHoldFixture(t)
	g, _ := f.grant(t, true)
	if err := Confirm(g, holdImport); err != nil {
		t.Fatal(err)
	}
	if leaseOf(g) == nil {
		t.Fatal("no lease after a held use")
	}
	f.s.Close()
	if err := Release(g); err != nil {
		t.Fatalf("releasing after the exporter went: %v (it is queued)", err)
	}
	if !waitUntil(5*time.Second, func() bool { return leaseOf(g) == nil }) {
		t.Fatal("the lease outlived its exporter's server")
	}
	if err := Release(g); CodeOf(err) != ENOENT {
		t.Fatalf("releasing again: %v, want ENOENT", err)
	}
}

// TestLiveManyEndedWhileHeld: a grant used up while a receiver holds its
// use has ended, though its release waits for the hold (vmmipc_wait says
// ETIMEDOUT): vmmipc_live_many counts it as ended.
func TestLiveManyEndedWhileHeld(t *testing.T) {
	f := newHoldFixture(t)
	g := heldImport(t, f)
	if !waitUntil(5*time.Second, func() bool { return !f.s.LiveMany([]*Ticket{g})[0] }) {
		t.Fatal("a used-up grant that a receiver holds is still live")
	}
	stillHeld(t, f, g, "used up and held")
	letGo(t, f, g, "the hold of a used-up grant")
}
