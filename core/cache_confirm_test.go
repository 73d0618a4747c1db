package core

import (
	"testing"
	"time"
)

// Spending a use without importing: ImportConfirmLater's background
// confirmation of a cache hit, and Confirm.

// TestCacheConfirmLater: with ImportConfirmLater a hit returns at once and
// its use is spent in the background, one authenticated session per ticket:
// every grant ends once its confirmation ran, none before the receiver
// asked. A forged ticket of the same buffer (another secret) still hits
// the mapping this process has, but its confirmation fails, is counted,
// and spends no other grant's use.
func TestCacheConfirmLater(t *testing.T) {
	before := cacheTest(t)
	s := newTestServer(t)
	anchor := registerCounting(t, s, cacheSize, 9, RegisterOptions{Uses: 0})
	first := importHost(t, anchor.tk, ImportOptions{})
	const grants = 8
	tickets := make([]*Ticket, grants)
	for i := range tickets {
		var err error
		if tickets[i], err = s.RegisterAgain(anchor.tk, RegisterOptions{Uses: 1}); err != nil {
			t.Fatal(err)
		}
	}
	forged := *tickets[0]
	forged.Secret[0] ^= 1
	later := ImportOptions{ConfirmLater: true}
	refs := []Ref{importHost(t, &forged, later)}
	for _, tk := range tickets {
		refs = append(refs, importHost(t, tk, later))
	}
	for _, r := range refs {
		if r.Base != first.Base {
			t.Fatalf("a deferred hit is at %#x, the mapping at %#x", r.Base, first.Base)
		}
	}
	if anchor.exports.Load() != cachePages {
		t.Fatalf("deferred hits made %d descriptors", anchor.exports.Load()-cachePages)
	}
	if !confirmsAnswered(10 * time.Second) {
		t.Fatal("confirmations still pending after 10 s")
	}
	for i, tk := range tickets {
		if err := s.Wait(tk, 5*time.Second); err != nil {
			t.Fatalf("grant %d did not end after its deferred confirmation: %v", i, err)
		}
	}
	expectCache(t, "after the confirmations", before, CacheInfo{Entries: 1, ReferencedBytes: cacheSize,
		Hits: 1 + grants, Misses: 1, ConfirmsFailed: 1})
	for _, r := range refs {
		unmapRef(t, r)
	}
	if err := verifyAndUnmap(first, 9); err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(anchor.tk); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(1500*time.Millisecond, func() bool { return GetCacheInfo().Entries == 0 }) {
		t.Fatalf("the mapping of an ended buffer is still cached: %+v", GetCacheInfo())
	}
	expectCache(t, "the anchor ended", before, CacheInfo{Hits: 1 + grants, Misses: 1, Invalidations: 1, ConfirmsFailed: 1})
	expectMapped(t, "the anchor ended", 0)
}

// TestConfirmSpendsOneUse: Confirm spends one use of a ticket and makes no
// descriptor; a ticket with a wrong secret is refused and spends nothing of
// the real one; a used-up ticket is ENOENT.
func TestConfirmSpendsOneUse(t *testing.T) {
	s := newTestServer(t)
	anchor := registerCounting(t, s, cacheSize, 10, RegisterOptions{Uses: 0})
	grant, err := s.RegisterAgain(anchor.tk, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	forged := *grant
	forged.Secret[31] ^= 0x80
	if err := Confirm(&forged, ImportOptions{}); CodeOf(err) != EAUTH {
		t.Fatalf("confirming a forged ticket: %v, want EAUTH", err)
	}
	if err := s.Wait(grant, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT {
		t.Fatalf("the real grant after a forged confirmation: %v, want it still live", err)
	}
	if err := Confirm(grant, ImportOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(grant, 5*time.Second); err != nil {
		t.Fatalf("the grant did not end after its confirmation: %v", err)
	}
	if err := Confirm(grant, ImportOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("confirming a used-up ticket: %v, want ENOENT", err)
	}
	if anchor.exports.Load() != 0 {
		t.Fatalf("confirmations made %d descriptors", anchor.exports.Load())
	}
}
