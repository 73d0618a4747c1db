package core

import (
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The exporter spends table hits' uses from its receivers' spend logs when
// it grants again (spendlogs.go harvest), and the receiver's confirmer
// answers them from their records, without a session (confirmer.go).

// TestReSentHitsAreHarvested: a buffer re-sent in a loop (a new grant,
// then a table hit on it, every 1.1 ms, as a pickle re-sent through a
// queue) has its hits' uses spent by the exporter at its next grants: all
// of them spent, none failed, all but the first and the last harvested,
// and no record left in the log.
func TestReSentHitsAreHarvested(t *testing.T) {
	before, s, anchor, first := streamFixture(t, 33)
	live := s.Live()
	// Each hit's next grant comes harvestEvery later, within the default
	// gathering's 10 ms; a loaded machine may take longer between two
	// steps of this loop, so the confirmer waits longer here.
	gatherNs.Store(int64(50 * time.Millisecond))
	defer gatherNs.Store(0)
	start, taken := confirmSessions(), s.reg.spends.taken.Load()
	const hits = 60
	for range hits {
		if base := hitGrant(t, s, anchor); base != first.Base {
			t.Fatalf("a hit at %#x, not the cached %#x", base, first.Base)
		}
		time.Sleep(harvestEvery + 100*time.Microsecond) // each grant harvests
	}
	got := cacheDelta(before) // waits for the confirmer
	if got.TableHits != hits || got.ConfirmsFailed != 0 {
		t.Fatalf("%d table hits and %d failed confirmations, want %d and 0", got.TableHits, got.ConfirmsFailed, hits)
	}
	if !waitUntil(5*time.Second, func() bool { return s.Live() == live }) {
		t.Fatalf("%d grants still live after their hits were spent", s.Live()-live)
	}
	sessions, harvested := confirmSessions()-start, s.reg.spends.taken.Load()-taken
	// The first hit goes at once, the last one comes after the last grant.
	if sessions > 3 || harvested < hits-3 {
		t.Fatalf("%d sessions and %d uses harvested for %d re-sent hits, want at most 3 and at least %d", sessions, harvested, hits, hits-3)
	}
	if n := recordsInUse(anchor); n != 0 {
		t.Fatalf("%d spend log records still in use", n)
	}
}

// TestHarvestDeclinedRecord: a record opened for a grant that has ended
// is marked declined by the harvester, which spends nothing; the receiver
// takes it back to spend it on a session.
func TestHarvestDeclinedRecord(t *testing.T) {
	s, anchor, l := harvestServer(t)
	ended := again(t, s, anchor, RegisterOptions{Uses: 1})
	kept := again(t, s, anchor, RegisterOptions{Uses: 2})
	s.Unregister(ended)
	mem := harvestLog(t, l, true)
	defer unix.Munmap(mem)
	writeRecord(mem, 1, ended.RegID, spendProof(ended.Secret, ended.RegID), 1)
	writeRecord(mem, 2, kept.RegID, spendProof(kept.Secret, kept.RegID), 2)
	writeRecord(mem, 3, kept.RegID, spendProof(kept.Secret, kept.RegID), 3) // not opened
	openRecord(mem, 1)
	openRecord(mem, 2)
	l.harvest()
	if send, spent, _, _ := takeRecord(mem, 1); !send || spent {
		t.Fatalf("the ended grant's record: send %v spent %v, want it back to send", send, spent)
	}
	if send, spent, lives, _ := takeRecord(mem, 2); send || !spent || !lives {
		t.Fatalf("the live grant's record: send %v spent %v lives %v, want spent, living on", send, spent, lives)
	}
	if send, _, _, _ := takeRecord(mem, 3); !send {
		t.Fatal("a record never opened was not the receiver's")
	}
	l.harvest() // nothing new opened: nothing read
	if s.Wait(kept, 0) == nil {
		t.Fatal("the grant of two uses ended after one")
	}
	if n := l.taken.Load(); n != 2 {
		t.Fatalf("%d records harvested, want 2", n)
	}
	s.Unregister(kept)
}

// TestHarvestEndsQuietGrantsAtOnce: a use harvested at a grant that uses
// up a grant without a release callback ends it before the harvest
// returns, on the granting thread (no goroutine, no thread woken per
// grant); one with a callback is ended too, but its callback runs on a
// library thread, never the granting one (a caller may hold a lock that
// the callback takes).
func TestHarvestEndsQuietGrantsAtOnce(t *testing.T) {
	s, anchor, l := harvestServer(t)
	quiet := again(t, s, anchor, RegisterOptions{Uses: 1})
	gate, ran := make(chan struct{}), make(chan struct{})
	letGo := sync.OnceFunc(func() { close(gate) })
	defer letGo() // a failure must not leave the callback stuck
	loud := again(t, s, anchor, RegisterOptions{Uses: 1, OnRelease: func() {
		<-gate // would stop the harvest were it run there
		close(ran)
	}})
	mem := harvestLog(t, l, true)
	defer unix.Munmap(mem)
	writeRecord(mem, 1, quiet.RegID, spendProof(quiet.Secret, quiet.RegID), 1)
	writeRecord(mem, 2, loud.RegID, spendProof(loud.Secret, loud.RegID), 2)
	openRecord(mem, 1)
	openRecord(mem, 2)
	done := make(chan struct{})
	go func() { l.harvest(); close(done) }()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("the harvest waited for a release callback")
	}
	if err := s.Wait(quiet, 0); err != nil {
		t.Fatalf("the used-up grant without a callback, right after the harvest: %v; want it ended and released", err)
	}
	if _, err := s.reg.lookup(loud.RegID); CodeOf(err) != ENOENT {
		t.Fatalf("the used-up grant with a callback, right after the harvest: %v; want it ended", err)
	}
	letGo()
	select {
	case <-ran:
	case <-time.After(5 * time.Second):
		t.Fatal("the release callback never ran")
	}
	if err := s.Wait(loud, 5*time.Second); err != nil {
		t.Fatal(err)
	}
}

// TestConfirmerWaitsForAHarvestWithinItsTimeout: a record the exporter
// took and never marked (an exporter stopped mid-harvest) is waited for
// within the batch's timeout, then answered EIO, record kept; one marked
// meanwhile is answered from its record.
func TestConfirmerWaitsForAHarvestWithinItsTimeout(t *testing.T) {
	_, s, anchor, _ := streamFixture(t, 35)
	tk := again(t, s, anchor, RegisterOptions{Uses: 1})
	answer, u := vouch(tk, false)
	if answer != tableVouched {
		t.Fatalf("vouch: %d, want vouched", answer)
	}
	word := word64(u.view.log, uint64(u.record*spendRecordSize)+recordClaim)
	gen := atomic.LoadUint64(word) >> 8
	atomic.StoreUint64(word, claimWord(gen, claimHarvesting)) // as an exporter that stopped
	batch := []pendingConfirm{{t: tk, record: u.record, timeout: 30 * time.Millisecond}}
	acks, errs := make([]uint64, 1), make([]error, 1)
	start := time.Now()
	send := confirms.harvested(batch, batch[0].timeout, acks, errs)
	if took := time.Since(start); len(send) != 0 || CodeOf(errs[0]) != EIO || took < 30*time.Millisecond || took > time.Second {
		t.Fatalf("a record stuck in the exporter's hands: send %v, %v after %v; want EIO after the 30ms timeout", send, errs[0], took)
	}
	go func() {
		time.Sleep(10 * time.Millisecond)
		atomic.StoreUint64(word, claimWord(gen, claimLives)) // the exporter went on
	}()
	errs[0] = nil
	batch[0].timeout = 5 * time.Second
	if send := confirms.harvested(batch, batch[0].timeout, acks, errs); len(send) != 0 || errs[0] != nil || acks[0] != ackBufferLives {
		t.Fatalf("a record marked spent while waited for: send %v, err %v, acks %#x", send, errs[0], acks[0])
	}
	settle(tk, u.record, false)
	if err := s.Unregister(tk); err != nil {
		t.Fatal(err)
	}
}

// TestGrantDoesNotWaitForADrain: while the scanner holds the logs to drain
// a dead receiver's (it may wait up to a second for claims per record), a
// grant returns at once, without harvesting.
func TestGrantDoesNotWaitForADrain(t *testing.T) {
	_, s, anchor, _ := streamFixture(t, 37)
	s.reg.spends.unmapping.Lock() // as drainExited does
	granted := make(chan *Ticket, 1)
	go func() {
		tk, err := s.RegisterAgain(anchor, RegisterOptions{Uses: 1})
		if err != nil {
			t.Error(err)
		}
		granted <- tk
	}()
	select {
	case tk := <-granted:
		s.reg.spends.unmapping.Unlock()
		if tk != nil {
			s.Unregister(tk)
		}
	case <-time.After(5 * time.Second):
		s.reg.spends.unmapping.Unlock()
		t.Fatal("a grant waited for the drain of spend logs")
	}
}

// TestHarvestComesBeforeTheConfirmer: a stream's exporter harvests at
// least twice within the time a receiver's confirmer waits before it
// spends a hit's use on a session itself.
func TestHarvestComesBeforeTheConfirmer(t *testing.T) {
	if 2*harvestEvery > confirmGatherDefault {
		t.Fatalf("harvests every %v, confirmations gathered for %v: hits of a stream would go on sessions", harvestEvery, confirmGatherDefault)
	}
}

// recordsInUse counts the spend log records this process has not freed at
// tk's exporter.
func recordsInUse(tk *Ticket) (n int) {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	if v := tables.m[tk.exporterKey()]; v != nil {
		for _, used := range v.used {
			if used {
				n++
			}
		}
	}
	return n
}

// harvestServer is a test server with a one-page host buffer (its anchor)
// and spend logs of its own (closed when the test ends) that spend from it.
func harvestServer(t *testing.T) (*Server, *Ticket, *spendLogs) {
	t.Helper()
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 1))
	t.Cleanup(func() { closeFD(&fd) })
	anchor := registerFile(t, s, fd, 4096, 4096, RegisterOptions{})
	l := &spendLogs{spend: s.reg.spendRecorded, published: func() bool { return true }}
	t.Cleanup(l.close)
	return s, anchor, l
}

// harvestLog is a receiver's spend log adopted by l, as this process (the
// caller unmaps mem and closes l).
func harvestLog(t *testing.T, l *spendLogs, writable bool) []byte {
	t.Helper()
	fd, mem, err := newSpendLog()
	if err != nil {
		t.Fatal(err)
	}
	defer closeFD(&fd)
	send := fd
	if !writable { // a description of its own that cannot write
		if send, err = unix.Open(fmt.Sprintf("/proc/self/fd/%d", fd), unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
			t.Fatal(err)
		}
		defer closeFD(&send)
	}
	if !l.adopt(send, uint32(os.Getpid()), ourStartTime()) {
		t.Fatal("a well-made log was refused")
	}
	return mem
}

// TestHarvestIsBoundedAndFair: receivers that open every record of their
// logs with proofs that spend nothing cost each harvest at most
// harvestBudget records, and an honest receiver's record among them is
// spent within the harvests it takes to go round.
func TestHarvestIsBoundedAndFair(t *testing.T) {
	s, anchor, l := harvestServer(t)
	honest := again(t, s, anchor, RegisterOptions{Uses: 1})
	var hostile [][]byte
	for range maxSpendLogsPerPid - 1 {
		mem := harvestLog(t, l, true)
		defer unix.Munmap(mem)
		hostile = append(hostile, mem)
	}
	mine := harvestLog(t, l, true)
	defer unix.Munmap(mine)
	writeRecord(mine, 1, honest.RegID, spendProof(honest.Secret, honest.RegID), 1)
	openRecord(mine, 1)
	gen := uint64(1)
	for round := 1; ; round++ {
		for _, mem := range hostile { // every record open again, proofs of nothing
			for i := 1; i <= spendRecords; i++ {
				gen++
				writeRecord(mem, i, anchor.RegID, [32]byte{byte(i)}, gen)
				openRecord(mem, i)
			}
		}
		before := l.taken.Load()
		l.harvest()
		if n := l.taken.Load() - before; n > harvestBudget {
			t.Fatalf("one harvest took %d records, more than %d", n, harvestBudget)
		}
		if _, _, claim := readRecord(mine, 1); claimState(claim) == claimLives || claimState(claim) == claimEnded {
			if err := s.Wait(honest, 5*time.Second); err != nil { // ended on a goroutine
				t.Fatalf("the honest record was spent, its grant did not end: %v", err)
			}
			break
		}
		if want := (len(hostile)*spendRecords)/harvestBudget + 1; round > want {
			t.Fatalf("the honest record was not spent after %d harvests (%d should go round)", round, want)
		}
	}
}

// TestHarvestTakesEachRecordOnce: the exporter harvesting while the
// receiver's confirmer takes the same records back: each record is spent
// by exactly one side, round after round.
func TestHarvestTakesEachRecordOnce(t *testing.T) {
	var spends atomic.Int64
	var l spendLogs
	l.spend = func(uint64, [32]byte, time.Duration) (bool, bool, *registration) {
		spends.Add(1)
		return true, true, nil
	}
	l.published = func() bool { return true }
	defer l.close()
	mem := harvestLog(t, &l, true)
	defer unix.Munmap(mem)
	gen := uint64(0)
	for range 2000 {
		for i := 1; i <= spendRecords; i++ {
			gen++
			writeRecord(mem, i, 7, [32]byte{}, gen)
			openRecord(mem, i)
		}
		before := spends.Load()
		started, done := make(chan struct{}), make(chan struct{})
		go func() { close(started); l.harvest(); close(done) }()
		<-started
		sent, answered := 0, 0
		for i := spendRecords; i >= 1; i-- { // towards the harvest, which goes up
			for {
				send, spent, _, busy := takeRecord(mem, i)
				if busy {
					continue
				}
				if send {
					sent++
				} else if spent {
					answered++
				}
				break
			}
		}
		<-done
		if harvested := int(spends.Load() - before); harvested != answered || sent+answered != spendRecords {
			t.Fatalf("%d records: the exporter spent %d, the receiver read %d spent and took %d back", spendRecords, harvested, answered, sent)
		}
		for i := 1; i <= spendRecords; i++ {
			clearRecord(mem, i)
		}
	}
}

// TestReadOnlyLogIsNotHarvested: a log whose descriptor cannot write is
// mapped read only and never harvested: its opened records stay the
// receiver's to spend.
func TestReadOnlyLogIsNotHarvested(t *testing.T) {
	var l spendLogs
	l.spend = func(uint64, [32]byte, time.Duration) (bool, bool, *registration) { return true, true, nil }
	l.published = func() bool { return true }
	defer l.close()
	mem := harvestLog(t, &l, false)
	defer unix.Munmap(mem)
	if l.logs[0].writable {
		t.Fatal("a read-only descriptor's log was mapped writable")
	}
	writeRecord(mem, 1, 7, [32]byte{}, 1)
	openRecord(mem, 1)
	l.harvest()
	if send, _, _, _ := takeRecord(mem, 1); !send || l.taken.Load() != 0 {
		t.Fatalf("a read-only log's record was harvested (taken %d)", l.taken.Load())
	}
}
