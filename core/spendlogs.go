package core

import (
	"errors"
	"io/fs"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// The exporter's side of spend logs (spendlog.go): the logs its receivers
// sent, each with its owner's pid and start time; the harvester, which
// spends the open records of live receivers when the exporter next grants
// (harvestNow); and the scanner that spends the records of owners that have
// exited.

const (
	maxSpendLogs       = 256 // receivers' logs one exporter maps at once
	maxSpendLogsPerPid = 4   // ...of one receiver process, so that one asking in a loop cannot take every other's room
)

// spendScanInterval is how often the scanner looks for exited owners: a
// use left in a dead receiver's log is spent within about this long.
var spendScanInterval = 250 * time.Millisecond

type spendLog struct {
	mem      []byte
	writable bool // mapped writable: its open records can be harvested
	pid      uint32
	start    uint64
	seen     uint64 // the header's count of opened records when last harvested
}

type spendLogs struct {
	// What the registry lends: spending a record's use, waiting at most
	// grace for a use claimed by receivers being served (spent: it was a
	// live grant's that holds nothing, with its proof; lives: its buffer
	// lives on; usedUp: the registration it used up, for the caller to
	// end), and whether any grant is published (else nothing could be
	// spent).
	spend     func(id uint64, proof [32]byte, grace time.Duration) (spent, lives bool, usedUp *registration)
	published func() bool

	mu       sync.Mutex
	logs     []*spendLog
	scanning bool
	closed   bool

	// One harvest at a time (harvesting); unmapping excludes it from a log
	// being unmapped.
	harvesting  bool
	lastHarvest time.Time // when the last harvest began
	next        int       // the log where the last harvest ran out of budget
	unmapping   sync.RWMutex
	taken       atomic.Uint64 // records the harvester took (spent or refused), for tests
}

// adopt maps a receiver's log (fd stays the caller's) for the process pid
// started at start; false when it cannot (bounds, a log that is not one).
func (l *spendLogs) adopt(fd int, pid uint32, start uint64) bool {
	if pid == 0 || start == 0 {
		return false // its exit could not be told
	}
	l.mu.Lock()
	if len(l.logs) >= maxSpendLogs {
		l.mu.Unlock()
		l.drainExited() // room, if some owners have gone
		l.mu.Lock()
	}
	defer l.mu.Unlock()
	if l.closed || len(l.logs) >= maxSpendLogs {
		return false
	}
	mine := 0
	for _, s := range l.logs {
		if s.pid == pid && s.start == start {
			mine++
		}
	}
	if mine >= maxSpendLogsPerPid {
		return false
	}
	mem, writable, err := mapSpendLog(fd)
	if err != nil {
		return false
	}
	l.logs = append(l.logs, &spendLog{mem: mem, writable: writable, pid: pid, start: start})
	if !l.scanning {
		l.scanning = true
		go l.scan()
	}
	return true
}

// harvestEvery is how often at most a grant harvests: the receivers'
// confirmers wait 10 ms (confirmGatherDefault) before they spend a streamed
// hit's use themselves, so a harvest every millisecond reaches every hit of
// a stream (TestHarvestComesBeforeTheConfirmer), and the grants between two
// harvests cost nothing more.
const harvestEvery = time.Millisecond

// harvestBudget is how many records one harvest takes at most: two logs'
// worth (the granting thread checks each one's proof).
const harvestBudget = 2 * spendRecords

// harvestNow harvests on the caller's thread (the exporter has just
// granted), unless another harvest runs: then that one, or the next
// grant's, reads what this one would have.
func (l *spendLogs) harvestNow() {
	now := time.Now()
	l.mu.Lock()
	if len(l.logs) == 0 || l.closed || l.harvesting || now.Sub(l.lastHarvest) < harvestEvery {
		l.mu.Unlock()
		return
	}
	l.harvesting, l.lastHarvest = true, now
	l.mu.Unlock()
	l.harvest()
	l.mu.Lock()
	l.harvesting = false
	l.mu.Unlock()
}

// harvest spends the open records of every writable log that opened one
// since the last harvest: a stream of table hits is spent without
// sessions. The receivers learn it from their records (takeRecord).
func (l *spendLogs) harvest() {
	// No log is unmapped meanwhile. A drain of dead receivers' logs may
	// hold the lock while it waits for claims: a grant does not wait for
	// it, the next one harvests.
	if !l.unmapping.TryRLock() {
		return
	}
	defer l.unmapping.RUnlock()
	// On a granting thread: a use that others have claimed is left to the
	// receiver's session, which waits for them, and the registrations used
	// up are ended here, but what of their ends would run the library
	// user's code (release callbacks) runs on a goroutine.
	var rests []func()
	spendAtOnce := func(id uint64, proof [32]byte) (spent, lives bool) {
		spent, lives, usedUp := l.spend(id, proof, 0)
		if usedUp != nil {
			if rest, _ := usedUp.endQuiet(usedUp.usedUpWhy()); rest != nil {
				rests = append(rests, rest)
			}
		}
		return spent, lives
	}
	l.mu.Lock()
	logs := append([]*spendLog(nil), l.logs...)
	l.mu.Unlock()
	// From where the last harvest stopped, and at most harvestBudget
	// records: a receiver that opens records in a loop (their proofs
	// checked one by one) costs a grant a bounded time and cannot keep
	// the others' logs from being read.
	budget := harvestBudget
	for k := range logs {
		at := (l.next + k) % len(logs)
		s := logs[at]
		if !s.writable {
			continue
		}
		opened := atomic.LoadUint64(word64(s.mem, logOpened))
		if opened == s.seen { // one harvest at a time writes seen
			continue
		}
		s.seen = opened
		i := 1
		for ; i <= spendRecords && budget > 0; i++ {
			if harvestRecord(s.mem, i, spendAtOnce) {
				l.taken.Add(1)
				budget--
			}
		}
		if budget == 0 {
			l.next = at + 1 // the next harvest starts after this log...
			if i <= spendRecords {
				s.seen, l.next = opened-1, at // ...or here, with records not read yet
			}
			break
		}
	}
	if len(rests) > 0 {
		go func() { // a library thread: owners' release callbacks
			for _, rest := range rests {
				rest()
			}
		}()
	}
}

// scan drains the logs of exited owners every spendScanInterval while
// there are logs.
func (l *spendLogs) scan() {
	for {
		time.Sleep(spendScanInterval)
		l.mu.Lock()
		if len(l.logs) == 0 || l.closed {
			l.scanning = false
			l.mu.Unlock()
			return
		}
		l.mu.Unlock()
		l.drainExited()
	}
}

// drainExited spends the records of every log whose owner has exited (a
// record can spend nothing while no grant is published), and unmaps those
// logs.
func (l *spendLogs) drainExited() {
	l.mu.Lock()
	var gone []*spendLog
	kept := l.logs[:0]
	for _, s := range l.logs {
		if ownerExited(s) {
			gone = append(gone, s)
		} else {
			kept = append(kept, s)
		}
	}
	clear(l.logs[len(kept):])
	l.logs = kept
	l.mu.Unlock()
	spendable := len(gone) > 0 && l.published()
	if len(gone) > 0 {
		l.unmapping.Lock() // the harvester is done with them
		defer l.unmapping.Unlock()
	}
	for _, s := range gone {
		for i := 1; spendable && i <= spendRecords; i++ {
			if id, proof, claim := readRecord(s.mem, i); id != 0 && unspent(claim) {
				if _, _, usedUp := l.spend(id, proof, claimGrace); usedUp != nil {
					usedUp.endUsedUp() // the scanner's goroutine
				}
			}
		}
		_ = unix.Munmap(s.mem)
	}
}

// unspent reports whether a dead receiver's record with this claim may
// still need spending: the exporter has not spent or refused it.
func unspent(claim uint64) bool {
	switch claimState(claim) {
	case claimLegacy, claimOpen, claimReceiver:
		return true
	}
	return false
}

// ownerExited: the log's owner is gone (no process with its pid, or one
// started at another time). A /proc that cannot tell keeps the log.
func ownerExited(s *spendLog) bool {
	st, err := processStartTime(int(s.pid))
	return errors.Is(err, fs.ErrNotExist) || (err == nil && st != s.start)
}

// close unmaps every log (Server.Close).
func (l *spendLogs) close() {
	l.unmapping.Lock()
	defer l.unmapping.Unlock()
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	for _, s := range l.logs {
		_ = unix.Munmap(s.mem)
	}
	l.logs = nil
}
