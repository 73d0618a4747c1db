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

// TestHoldKeepsTheSenderUntilLetGo: a holdable grant used by a receiver
// that holds is used up (no second receiver) but not released until the
// receiver lets go; a cache hit holds on the same session, with no new
// connection; the counts on both sides follow.
func TestHoldKeepsTheSenderUntilLetGo(t *testing.T) {
	f := newHoldFixture(t)
	g1, rel1 := f.grant(t, true)
	r := importHost(t, g1, holdImport)
	defer Unmap(r.ID, r.Base)
	if err := verifyRef(r, 21); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, g1, "after the import")
	// A second use of the used-up grant is a cache hit: its use goes out
	// without waiting for the answer, which refuses it: counted as failed,
	// and nothing more is held on either side.
	again := importHost(t, g1, holdImport)
	Unmap(again.ID, again.Base)
	if !waitUntil(5*time.Second, func() bool { return cacheDelta(f.before).ConfirmsFailed == 1 }) {
		t.Fatalf("the refused use was not counted: %+v", cacheDelta(f.before))
	}
	if f.s.Holds() != 1 || GetCacheInfo().Holds != 1 {
		t.Fatalf("holds: server %d, receiver %d, want 1 and 1", f.s.Holds(), GetCacheInfo().Holds)
	}
	sessions := GetCacheInfo().HolderSessions
	fdsBefore := ourFDs().now(t)

	g2, rel2 := f.grant(t, true)
	r2 := importHost(t, g2, holdImport) // a hit: one use message on the session
	defer Unmap(r2.ID, r2.Base)
	if d := cacheDelta(f.before); d.Hits != 2 {
		t.Fatalf("the third import was not a cache hit: %+v", d)
	}
	if got := GetCacheInfo().HolderSessions; got > sessions { // earlier tests' may close meanwhile
		t.Fatalf("a hit opened a holder session: %d, had %d", got, sessions)
	}
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

// TestHoldEndsWithTheReceiversConnection: the end of the holder session's
// connection (what a receiver's death does: the kernel closes it) lets go
// of every hold on it, however taken.
func TestHoldEndsWithTheReceiversConnection(t *testing.T) {
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
	h := holderFor(g1)
	if h == nil {
		t.Fatal("no holder session after a held import")
	}
	h.mu.Lock()
	_ = h.c.Close() // as the kernel does when the receiver dies
	h.mu.Unlock()
	releasedSoon(t, f, g1, "after the holder's connection closed")
	releasedSoon(t, f, g2, "after the holder's connection closed")
	if f.s.Holds() != 0 {
		t.Fatalf("server holds %d after the holder closed", f.s.Holds())
	}
	// The next use finds the session broken and opens another.
	g3, _ := f.grant(t, true)
	if err := Confirm(g3, holdImport); err != nil {
		t.Fatalf("a use after the holder session broke: %v", err)
	}
	stillHeld(t, f, g3, "a use on the new session")
	letGo(t, f, g3, "release on the new session")
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

// TestNoReceiverReleasesAnothersHold: a second receiver (raw, by hand)
// with its own holder session cannot let go of the first one's holds,
// neither with a release of their ids nor with a forged use; a use needs
// the used registration's own secret.
func TestNoReceiverReleasesAnothersHold(t *testing.T) {
	f := newHoldFixture(t)
	// Two uses: one held, one left, so that only the proof can refuse the
	// forged use below (a used-up registration is refused with ENOENT
	// whatever the proof).
	victim, err := f.s.RegisterAgain(f.anchor, RegisterOptions{Uses: 2, Hold: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := Confirm(victim, holdImport); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, victim, "the victim's hold")

	mine, _ := f.grant(t, true)
	s, m := rawHello(t, mine, helloConfirm|helloHolder)
	defer unix.Close(s.fd)
	if m.Type != msgChallenge {
		t.Fatalf("hello answered with %s", describeMsg(m))
	}
	if err := rawWrite(s.fd, s.proof(mine.Secret)); err != nil {
		t.Fatal(err)
	}
	for _, want := range []uint8{msgWelcome, msgDoneAck, msgHolding} {
		got, _, err := rawRecv(s.fd, 5*time.Second)
		if err != nil || got.Type != want {
			t.Fatalf("expected %s, got %s (%v)", msgName(want), describeMsg(got), err)
		}
	}
	if err := rawWrite(s.fd, releaseMsg{RegIDs: []uint64{victim.RegID, victim.RegID, mine.RegID}}.encode()); err != nil {
		t.Fatal(err)
	}
	releasedSoon(t, f, mine, "the attacker's own hold")
	stillHeld(t, f, victim, "after another receiver released its id")

	// A use of the victim's registration proved without its secret.
	tr := s.tr
	tr.RegID, tr.Flags, tr.TicketDigest = victim.RegID, useProofFlag, mustDigestTB(t, victim)
	forged := useMsg{RegID: victim.RegID, Proof: tr.proof(mine.Secret, roleReceiver)}
	if err := rawWrite(s.fd, forged.encode()); err != nil {
		t.Fatal(err)
	}
	got, _, err := rawRecv(s.fd, 5*time.Second)
	if err != nil || got.Type != msgUseAck {
		t.Fatalf("a forged use answered with %s (%v)", describeMsg(got), err)
	}
	if ack, err := parseUseAck(got.Body); err != nil || ack.Code != EAUTH {
		t.Fatalf("a forged use: %+v (%v), want EAUTH", ack, err)
	}
	stillHeld(t, f, victim, "after a forged use")
	if f.s.Holds() != 1 {
		t.Fatalf("server holds %d, want the victim's 1", f.s.Holds())
	}
	if err := Release(victim); err != nil {
		t.Fatal(err)
	}
	// Its use left is not spent: it lives on until the test ends it.
	stillHeld(t, f, victim, "the victim with a use left")
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

// TestHoldForAnEndedSession: a stream that names a holder session which no
// longer lives is refused with ENOENT before anything is spent, and the
// receiver becomes a holder itself.
func TestHoldForAnEndedSession(t *testing.T) {
	f := newHoldFixture(t)
	var token holderToken
	token[0] = 1
	fd, err := rawDial(f.anchor.Address)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := rawWrite(fd, tokenMsg{Token: token}.encode(msgHoldFor)); err != nil {
		t.Fatal(err)
	}
	got, _, err := rawRecv(fd, 5*time.Second)
	if err != nil || got.Type != msgError {
		t.Fatalf("hold-for an unknown session: %s (%v), want an error", describeMsg(got), err)
	}
	if em, _ := parseError(got.Body); em.Code != ENOENT {
		t.Fatalf("hold-for an unknown session: %+v, want ENOENT", em)
	}

	// The receiver's side: its holder session names a token the exporter
	// no longer knows (the session ended there first); the new stream is
	// refused so, and opens again as a holder session of its own, on which
	// its use is held.
	g1, _ := f.grant(t, true)
	if err := Confirm(g1, holdImport); err != nil {
		t.Fatal(err)
	}
	old := holderFor(g1)
	if old == nil {
		t.Fatal("no holder session after a held use")
	}
	old.token[0] ^= 0xff
	g2, _ := f.grant(t, true)
	r := importHost(t, g2, holdImport) // a miss: a stream, with hold-for
	defer Unmap(r.ID, r.Base)
	if err := verifyRef(r, 21); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, g2, "a use whose hold-for named an ended session")
	if n := len(holdersOf(g2.exporterKey())); n != 2 {
		t.Fatalf("%d holder sessions to the exporter, want the old one and the new", n)
	}
	letGo(t, f, g2, "the use held on the new session")
	letGo(t, f, g1, "the use held on the old session")
}

// TestHoldOnASecondStream: a second new mapping from the same exporter (a
// stream that names the holder session with hold-for) is held there too,
// and its Release lets go of it.
func TestHoldOnASecondStream(t *testing.T) {
	f := newHoldFixture(t)
	other := registerCounting(t, f.s, cacheSize, 22, RegisterOptions{Uses: 0})
	g1, _ := f.grant(t, true)
	r1 := importHost(t, g1, holdImport) // the holder session
	defer Unmap(r1.ID, r1.Base)
	var released atomic.Bool
	g2, err := f.s.RegisterAgain(other.tk, RegisterOptions{Uses: 1, Hold: true, OnRelease: func() { released.Store(true) }})
	if err != nil {
		t.Fatal(err)
	}
	r2 := importHost(t, g2, holdImport) // a miss: its own stream, hold-for
	defer Unmap(r2.ID, r2.Base)
	if err := verifyRef(r2, 22); err != nil {
		t.Fatal(err)
	}
	// This exporter's sessions (another test's may be closing meanwhile).
	if n := len(holdersOf(g1.exporterKey())); n != 1 || GetCacheInfo().Holds != 2 {
		t.Fatalf("%d holder sessions to the exporter, holds %d; want 1 and 2", n, GetCacheInfo().Holds)
	}
	stillHeld(t, f, g2, "a stream held through hold-for")
	letGo(t, f, g2, "a use held through hold-for")
	if !released.Load() {
		t.Fatal("OnRelease did not run")
	}
	letGo(t, f, g1, "after Release")
}

// TestHolderSessionEndsWithItsExporter: when the exporter goes (here its
// server closes, as its exit would), the receiver's holder session is
// closed at once, not kept open until its next use.
func TestHolderSessionEndsWithItsExporter(t *testing.T) {
	f := newHoldFixture(t)
	sessions := GetCacheInfo().HolderSessions
	g, _ := f.grant(t, true)
	if err := Confirm(g, holdImport); err != nil {
		t.Fatal(err)
	}
	if holderFor(g) == nil {
		t.Fatal("no holder session after a held use")
	}
	f.s.Close()
	if !waitUntil(5*time.Second, func() bool { return holderFor(g) == nil }) {
		t.Fatal("the holder session outlived its exporter's server")
	}
	if got := GetCacheInfo().HolderSessions; got > sessions { // earlier tests' may close meanwhile
		t.Fatalf("holder sessions %d after the exporter went, had %d before", got, sessions)
	}
	if err := Release(g); CodeOf(err) != ENOENT {
		t.Fatalf("releasing after the exporter went: %v, want ENOENT", err)
	}
}
