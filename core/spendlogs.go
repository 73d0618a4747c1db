package core

import (
	"errors"
	"io/fs"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// The exporter's side of spend logs (spendlog.go): the logs its receivers
// sent, each with its owner's pid and start time, and the scanner that
// spends the records of owners that have exited.

const (
	maxSpendLogs       = 256 // receivers' logs one exporter maps at once
	maxSpendLogsPerPid = 4   // ...of one receiver process, so that one asking in a loop cannot take every other's room
)

// spendScanInterval is how often the scanner looks for exited owners: a
// use left in a dead receiver's log is spent within about this long.
var spendScanInterval = 250 * time.Millisecond

type spendLog struct {
	mem   []byte
	pid   uint32
	start uint64
}

type spendLogs struct {
	// What the registry lends: spending a record's use, and whether any
	// grant is published (else nothing could be spent).
	spend     func(id uint64, proof [32]byte)
	published func() bool

	mu       sync.Mutex
	logs     []*spendLog
	scanning bool
	closed   bool
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
	mem, err := mapSpendLog(fd)
	if err != nil {
		return false
	}
	l.logs = append(l.logs, &spendLog{mem: mem, pid: pid, start: start})
	if !l.scanning {
		l.scanning = true
		go l.scan()
	}
	return true
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
	for _, s := range gone {
		for i := 1; spendable && i <= spendRecords; i++ {
			if id, proof := readRecord(s.mem, i); id != 0 {
				l.spend(id, proof)
			}
		}
		_ = unix.Munmap(s.mem)
	}
}

// ownerExited: the log's owner is gone (no process with its pid, or one
// started at another time). A /proc that cannot tell keeps the log.
func ownerExited(s *spendLog) bool {
	st, err := processStartTime(int(s.pid))
	return errors.Is(err, fs.ErrNotExist) || (err == nil && st != s.start)
}

// close unmaps every log (Server.Close).
func (l *spendLogs) close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.closed = true
	for _, s := range l.logs {
		_ = unix.Munmap(s.mem)
	}
	l.logs = nil
}
