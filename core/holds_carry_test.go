package core

import (
	"testing"
	"time"
)

// withReleaseDelay sets releaseDelay for one test: with an hour, a release
// reaches the exporter only by riding on a held use.
func withReleaseDelay(t *testing.T, d time.Duration) {
	old := releaseDelay
	releaseDelay = d
	t.Cleanup(func() { releaseDelay = old })
}

// heldImport imports a new grant of f's anchor with a hold (unmapped at
// the test's end).
func heldImport(t *testing.T, f holdFixture) *Ticket {
	g, _ := f.grant(t, true)
	r := importHost(t, g, holdImport)
	t.Cleanup(func() { Unmap(r.ID, r.Base) })
	return g
}

// TestReleasesRideOnTheNextHeldUse: a release waits for the next held use
// to the same exporter, which carries it in its first message (one
// connection for both), on the same lease, kept between uses; the lease
// ends leaseLinger after it last held anything.
func TestReleasesRideOnTheNextHeldUse(t *testing.T) {
	f := newHoldFixture(t)
	withReleaseDelay(t, time.Hour)
	g1 := heldImport(t, f)
	if err := Release(g1); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, g1, "released, no held use since (the release waits for one)")
	for i := range 20 {
		g, _ := f.grant(t, true)
		if _, err := useHeld(g, 5*time.Second); err != nil {
			t.Fatalf("held use %d: %v", i, err)
		}
		// The use carried the release before it: the exporter let go of
		// it before it answered, and holds only this one.
		if got := f.s.Holds(); got != 1 {
			t.Fatalf("after held use %d the exporter holds %d, want 1 (the release before it rode on it)", i, got)
		}
		if i == 0 {
			releasedSoon(t, f, g1, "the first release, carried by the next use")
		}
		if n := GetCacheInfo().HolderSessions; n != 1 {
			t.Fatalf("held use %d: %d leases here, want the one kept between uses", i, n)
		}
		if err := Release(g); err != nil {
			t.Fatal(err)
		}
	}
	// The last release has no use to ride on: it goes on its own once due.
	releaseDelay = time.Millisecond
	g, _ := f.grant(t, true)
	if _, err := useHeld(g, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := Release(g); err != nil {
		t.Fatal(err)
	}
	releasedSoon(t, f, g, "the last release, on a connection of its own")
	if n := GetCacheInfo().HolderSessions; n != 1 && time.Since(start) < leaseLinger/2 {
		t.Fatalf("the lease ended %v after its last release, before its linger (%v)", time.Since(start), leaseLinger)
	}
	if !waitUntil(leaseLinger+5*time.Second, func() bool { return GetCacheInfo().HolderSessions == 0 }) {
		t.Fatal("the lease outlived its linger")
	}
	if !waitUntil(5*time.Second, func() bool { return f.s.Holds() == 0 }) {
		t.Fatalf("the exporter still holds %d", f.s.Holds())
	}
}

// TestACarriedReleaseOnARefusedUse: a held use that carries a release and
// is refused (a hit on a grant that has ended) still lets go of what it
// carried; the lease, which cannot tell whether it did, takes no new use,
// lets go of everything by ending, and the next held use gets a new one.
func TestACarriedReleaseOnARefusedUse(t *testing.T) {
	f := newHoldFixture(t)
	withReleaseDelay(t, time.Hour)
	g1 := heldImport(t, f)
	old := leaseOf(g1)
	g2, _ := f.grant(t, true)
	if _, err := useHeld(g2, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := Release(g1); err != nil {
		t.Fatal(err)
	}
	ended, _ := f.grant(t, true)
	if err := f.s.Unregister(ended); err != nil {
		t.Fatal(err)
	}
	if _, err := useHeld(ended, 5*time.Second); CodeOf(err) != ENOENT {
		t.Fatalf("a held use of an ended grant: %v, want ENOENT", err)
	}
	releasedSoon(t, f, g1, "the release the refused use carried")
	stillHeld(t, f, g2, "held on the lease the refused use was on")
	releaseDelay = time.Millisecond
	if err := Release(g2); err != nil {
		t.Fatal(err)
	}
	releasedSoon(t, f, g2, "the last hold of a lease that takes no new use")
	g3, _ := f.grant(t, true)
	if _, err := useHeld(g3, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if l := leaseHolding(g3); l == nil || l == old {
		t.Fatalf("the use after the refused one is on lease %p, the lost one was %p: want a new one", l, old)
	}
	if err := Release(g3); err != nil {
		t.Fatal(err)
	}
	releasedSoon(t, f, g3, "a use on a new lease")
	if !waitUntil(leaseLinger+5*time.Second, func() bool { return GetCacheInfo().HolderSessions == 0 && f.s.Holds() == 0 }) {
		t.Fatalf("left: %d leases here, %d holds at the exporter", GetCacheInfo().HolderSessions, f.s.Holds())
	}
}

// TestReleaseAndLingerDefaults: with the defaults the guarantees cite
// (releaseDelay 2 ms, leaseLinger 250 ms), a release with no held use to
// ride on reaches the exporter on its own well within a second, the lease
// stays for the next use for most of its linger, and then ends.
func TestReleaseAndLingerDefaults(t *testing.T) {
	if releaseDelay != 2*time.Millisecond || leaseLinger != 250*time.Millisecond {
		t.Fatalf("releaseDelay %v, leaseLinger %v: docs/guarantees.md says 2ms and 250ms", releaseDelay, leaseLinger)
	}
	f := newHoldFixture(t)
	g := heldImport(t, f)
	start := time.Now()
	if err := Release(g); err != nil {
		t.Fatal(err)
	}
	if err := f.s.Wait(g, time.Second); err != nil {
		t.Fatalf("a lone release did not reach the exporter within a second of a %v delay: %v", releaseDelay, err)
	}
	if took := time.Since(start); took < releaseDelay {
		t.Fatalf("the release went after %v, before its delay of %v (nothing waited for a use to carry it)", took, releaseDelay)
	}
	if n := GetCacheInfo().HolderSessions; n != 1 && time.Since(start) < leaseLinger/2 {
		t.Fatalf("the lease ended %v after its release, before half its linger (%v)", time.Since(start), leaseLinger)
	}
	if !waitUntil(leaseLinger+5*time.Second, func() bool { return GetCacheInfo().HolderSessions == 0 }) {
		t.Fatal("the lease outlived its linger")
	}
}
