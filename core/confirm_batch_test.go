package core

import (
	"testing"
	"time"
)

// The confirmer (confirmer.go) spends the uses of hits that come as a stream
// together: one session for many, each use proved and answered on its own.

// streamFixture is a test server whose grant table this process has taken
// (its anchor of pattern(seed) mapped: first, unmapped when the test ends),
// and the cache's counters from before.
func streamFixture(t *testing.T, seed byte) (before CacheInfo, s *Server, anchor *Ticket, first Ref) {
	t.Helper()
	before = cacheTest(t)
	s = newTestServer(t)
	anchor, first = tableGrant(t, s, seed)
	t.Cleanup(func() { unmapRef(t, first) })
	return before, s, anchor, first
}

// confirmSessions counts the confirmer's sessions so far.
func confirmSessions() uint64 {
	confirms.mu.Lock()
	defer confirms.mu.Unlock()
	return confirms.sessions
}

// TestStreamedHitsShareSessions: 60 table hits in a row, one new grant
// each (a buffer re-sent in a loop), are all spent, with fewer sessions
// than hits; 60 uses queued at once go on a few sessions; a lone hit later
// is spent too.
func TestStreamedHitsShareSessions(t *testing.T) {
	before, s, anchor, first := streamFixture(t, 31)
	live := s.Live()
	start := confirmSessions()
	const hits = 60
	for range hits {
		if base := hitGrant(t, s, anchor); base != first.Base {
			t.Fatalf("a hit at %#x, not the cached %#x", base, first.Base)
		}
	}
	got := cacheDelta(before) // waits for the confirmer
	if got.TableHits != hits || got.ConfirmsFailed != 0 {
		t.Fatalf("%d table hits and %d failed confirmations, want %d and 0", got.TableHits, got.ConfirmsFailed, hits)
	}
	if !waitUntil(5*time.Second, func() bool { return s.Live() == live }) {
		t.Fatalf("%d grants still live after their hits were confirmed", s.Live()-live)
	}
	if n := confirmSessions() - start; n >= hits {
		t.Fatalf("%d sessions for %d streamed hits: they were not gathered", n, hits)
	}

	start = confirmSessions()
	queued := make([]*Ticket, hits)
	for i := range queued {
		queued[i] = again(t, s, anchor, RegisterOptions{Uses: 1})
	}
	for _, tk := range queued {
		confirms.add(tk, 5*time.Second, nil)
	}
	for _, tk := range queued {
		if err := s.Wait(tk, 5*time.Second); err != nil {
			t.Fatalf("a queued use was not spent: %v", err)
		}
	}
	// The first goes at once; the rest join the next session or two.
	if n := confirmSessions() - start; n > 3 {
		t.Fatalf("%d sessions for %d uses queued at once, want at most 3", n, hits)
	}

	time.Sleep(2 * confirmLinger) // the worker has gone: the next hit is a lone one
	lone := again(t, s, anchor, RegisterOptions{Uses: 1})
	r, err := Import(lone, DeviceHost, ImportOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	unmapRef(t, r)
	if err := s.Wait(lone, 5*time.Second); err != nil {
		t.Fatalf("a lone hit's use was not spent: %v", err)
	}
}

// TestSpacedHitsShareSessions: table hits 3 ms apart, with no grant between
// them whose harvest would spend their uses (a sender that made its grants
// ahead, as the Python package does in a loop), are spent on a session per
// gather (confirmGatherDefault), not one each: with a 2 ms gather every hit
// took its own.
func TestSpacedHitsShareSessions(t *testing.T) {
	before, s, anchor, first := streamFixture(t, 33)
	const hits = 30
	grants := make([]*Ticket, hits)
	for i := range grants {
		grants[i] = again(t, s, anchor, RegisterOptions{Uses: 1})
	}
	start := confirmSessions()
	for _, g := range grants {
		time.Sleep(3 * time.Millisecond)
		if base := hit(t, g); base != first.Base {
			t.Fatalf("a hit at %#x, not the cached %#x", base, first.Base)
		}
	}
	got := cacheDelta(before) // waits for the confirmer
	if got.TableHits != hits || got.ConfirmsFailed != 0 {
		t.Fatalf("%d table hits and %d failed confirmations, want %d and 0", got.TableHits, got.ConfirmsFailed, hits)
	}
	for _, g := range grants {
		if err := s.Wait(g, 5*time.Second); err != nil {
			t.Fatalf("a spaced hit's use was not spent: %v", err)
		}
	}
	// 30 hits over about 90 ms: a session per 10 ms, and the first alone.
	if n := confirmSessions() - start; n > hits/2 {
		t.Fatalf("%d sessions for %d hits 3 ms apart: they were not gathered", n, hits)
	}
}

// TestConfirmBatchAnswersEachUse: a batch whose uses include an ended
// grant (first and in the middle) and a ticket changed in its secret
// spends every other use, and each item gets its own answer.
func TestConfirmBatchAnswersEachUse(t *testing.T) {
	cacheTest(t)
	s := newTestServer(t)
	anchor, first := tableGrant(t, s, 32)
	defer unmapRef(t, first)
	ended := func() *Ticket {
		tk := again(t, s, anchor, RegisterOptions{Uses: 1})
		if err := s.Unregister(tk); err != nil {
			t.Fatal(err)
		}
		return tk
	}
	forged := *again(t, s, anchor, RegisterOptions{Uses: 1})
	forged.Secret[3] ^= 1
	ts := []*Ticket{ended(), again(t, s, anchor, RegisterOptions{Uses: 1}), ended(), &forged,
		again(t, s, anchor, RegisterOptions{Uses: 2})}
	want := []Code{ENOENT, OK, ENOENT, EAUTH, OK}
	got := make([]error, len(ts))
	lives := make([]bool, len(ts))
	batch := make([]pendingConfirm, len(ts))
	for i, tk := range ts {
		batch[i] = pendingConfirm{t: tk, timeout: 5 * time.Second, at: time.Now(),
			then: func(l bool, err error) { lives[i], got[i] = l, err }}
	}
	if failed := confirms.confirmBatch(batch); failed != 3 {
		t.Fatalf("%d failed, want 3: %v", failed, got)
	}
	for i := range ts {
		if CodeOf(got[i]) != want[i] {
			t.Fatalf("use %d: %v, want %v", i, got[i], want[i])
		}
		if got[i] == nil && !lives[i] {
			t.Fatalf("use %d: the buffer was said to end, while its anchor lives", i)
		}
	}
	if err := s.Wait(ts[1], 5*time.Second); err != nil {
		t.Fatalf("the one-use grant was not spent: %v", err)
	}
	if s.Wait(ts[4], 100*time.Millisecond) == nil {
		t.Fatal("the two-use grant ended after one use")
	}
}

// TestABacklogOfHitsGoesAtHalfALog: hits of grants made beforehand (the
// exporter grants nothing meanwhile, so it harvests nothing), one every
// 200 us, while the confirmer gathers a stream with a window of a second:
// once half a spend log's records wait, the worker sends them at once, so
// the log never fills and no hit asks the exporter on a session of its own.
func TestABacklogOfHitsGoesAtHalfALog(t *testing.T) {
	before, s, anchor, first := streamFixture(t, 33)
	gatherNs.Store(int64(time.Second))
	defer gatherNs.Store(0)
	const hits = 3 * spendRecords
	grants := make([]*Ticket, hits)
	for i := range grants {
		grants[i] = again(t, s, anchor, RegisterOptions{Uses: 1})
	}
	for _, g := range grants {
		if base := hit(t, g); base != first.Base {
			t.Fatalf("a hit at %#x, not the cached %#x", base, first.Base)
		}
		time.Sleep(200 * time.Microsecond)
	}
	got := cacheDelta(before) // waits for the confirmer
	if got.ConfirmsFailed != 0 {
		t.Fatalf("%d confirmations failed", got.ConfirmsFailed)
	}
	if got.TableHits != hits {
		t.Fatalf("%d of %d hits were vouched by the table: the rest found the spend log full and asked the exporter (cache: %+v)", got.TableHits, hits, got)
	}
}
