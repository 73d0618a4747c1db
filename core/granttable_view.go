package core

import (
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// A receiver's side of the grant table (granttable.go): the tables of the
// exporters whose buffers it has mapped, each mapped read-only (no
// descriptor kept), and the uses it took on table hits that the exporter
// has not answered yet.

const (
	maxTables  = 64          // exporters whose tables one process maps at once
	tableRetry = time.Second // an exporter whose table did not come is asked again after this
)

type tableView struct {
	mem     []byte
	mine    map[uint64]uint32 // registration id → uses this process took on the table that the exporter has not counted yet
	pending map[uint64]uint32 // ...of those, the ones whose spend is queued or in flight
	// The tid in the table's lifeline word while the exporter's image that
	// made it lives (lifeline.go); 0: it has none, and /proc tells instead.
	life uint32
	// Where the exporter's own descriptor of the table is, and the file's
	// identity: the exporter's image that made it lives while /proc shows
	// that file there (CLOEXEC: an exec closes it, as the exit does).
	holder   string
	dev, ino uint64
	// This process's spend log at that exporter (spendlog.go), nil until
	// the exporter took it: no hit is believed from the table without it.
	log  []byte
	used [spendRecords + 1]bool // records written, not yet cleared
	gen  uint64                 // records written so far: each one's generation (spendlog.go)
	// When the exporter was last found alive in /proc
	// (checkExporterAlive), on CLOCK_MONOTONIC: exporterAlive reads /proc
	// again only aliveRecheck later.
	aliveAt atomic.Uint64
}

// aliveRecheck is how long a table hit trusts the exporter's last liveness
// check in /proc (exporterAlive). Within it, the lifeline (lifeline.go),
// or without one the holder check, that vouched for the
// hit tells what that check would: an exit (a zombie's too) or an exec
// closes the table's descriptor, and another process shows it there only
// if, within that time, it got the exporter's pid after the exporter died
// and holds the table at that number (a forked child's child, say). Pids
// are handed out in turn over at least 300 of them; only a process
// privileged over the PID namespace can ask for a given one (clone3's
// set_tid). Even then the hit maps nothing new: the mapping is this
// process's already. A variable for tests.
var aliveRecheck = 50 * time.Millisecond

var tables = struct {
	mu      sync.Mutex
	m       map[string]*tableView // by exporter (Ticket.exporterKey)
	asked   map[string]time.Time
	settled chan struct{} // closed and replaced whenever a use taken on a table is answered
}{m: map[string]*tableView{}, asked: map[string]time.Time{}, settled: make(chan struct{})}

// tableUsable reports whether this process can check t's grant in its
// exporter's table: a grant that holds nothing, of an exporter in our PID
// namespace (its liveness is read in /proc) and time namespace (the ttl
// deadline is CLOCK_MONOTONIC).
func tableUsable(t *Ticket) bool {
	return !t.Holds && t.NS.pidNS() == nsSame && sameClock(t)
}

// wantTable reports whether a session with t's exporter should ask for its
// table (helloTable), and notes that it asked.
func wantTable(t *Ticket) bool {
	if !tableUsable(t) {
		return false
	}
	key := t.exporterKey()
	now := time.Now()
	tables.mu.Lock()
	defer tables.mu.Unlock()
	if len(tables.m) >= maxTables {
		sweepTables()
	}
	if tables.m[key] != nil || len(tables.m) >= maxTables {
		return false
	}
	if at, ok := tables.asked[key]; ok && now.Sub(at) < tableRetry {
		return false
	}
	if len(tables.asked) >= 4*maxTables {
		for k, at := range tables.asked {
			if now.Sub(at) >= tableRetry {
				delete(tables.asked, k)
			}
		}
		if len(tables.asked) >= 4*maxTables {
			return false
		}
	}
	tables.asked[key] = now
	return true
}

// recvTable reads the exporter's answer to helloTable: its table, or none;
// a table is answered with a spend log (sendSpendLog), which tail follows.
// A table this process cannot use (a broken or hostile exporter's) is left
// unused; only a message out of order fails the session.
func recvTable(c *conn, t *Ticket, tail []byte) error {
	f, err := c.recv()
	if err != nil {
		return err
	}
	if f.Type != msgTable {
		closeFD(&f.FD)
		switch f.Type {
		case msgError:
			return remoteError(f.Body, beforeChunks)
		case msgBusy: // dropped before it counted as authenticated: connect retries
			return errBusy
		}
		return Errorf(EINVAL, "protocol: expected table, got %s", msgName(f.Type))
	}
	m, err := parseTable(f.Body)
	if err != nil {
		closeFD(&f.FD)
		return err
	}
	if m.Slots == 0 {
		closeFD(&f.FD)
		if len(tail) > 0 {
			return c.send(tail, -1)
		}
		return nil // none: asked again after tableRetry
	}
	key := t.exporterKey()
	taken := false
	if f.FD >= 0 && m.Slots == tableSlots && m.FD <= 1<<31 {
		taken = takeTable(key, f.FD, int(t.Pid), m.FD) == nil
	}
	closeFD(&f.FD)
	return sendSpendLog(c, key, taken, tail)
}

// sendSpendLog answers the exporter's table with this process's spend log
// for it (or none, when the table was not taken or no log can be made)
// and reads whether the exporter took it: only then are hits believed
// from the table. tail goes out with it.
func sendSpendLog(c *conn, key string, taken bool, tail []byte) error {
	fd, mem := -1, []byte(nil)
	if taken {
		var err error
		if fd, mem, err = newSpendLog(); err != nil {
			fd, mem = -1, nil
		}
	}
	m := spendLogMsg{}
	if fd >= 0 {
		m.Records = spendRecords
	}
	err := c.send(append(m.encode(), tail...), fd)
	closeFD(&fd)
	var ack logAckMsg
	if err == nil {
		var f frame
		if f, err = recvControl(c, "log-ack"); err == nil {
			ack, err = parseLogAck(f.Body)
		}
	}
	tables.mu.Lock()
	defer tables.mu.Unlock()
	v := tables.m[key]
	if mem != nil && err == nil && ack.Taken && v != nil && v.log == nil {
		v.log = mem
		return nil
	}
	if mem != nil {
		_ = unix.Munmap(mem)
	}
	if taken && v != nil && v.log == nil { // useless without a log: asked again after tableRetry
		v.unmap()
		delete(tables.m, key)
	}
	return err
}

// takeTable maps the grant table fd (the caller's, to close) for exporter
// key, after checking that it is what granttable.go makes: a file of
// tableSize bytes that cannot shrink (a mapping past its end would kill
// us with SIGBUS) and that nobody but its exporter can write. ownFD is
// the exporter's own descriptor of it, which /proc shows under pid.
func takeTable(key string, fd, pid int, ownFD uint64) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != tableSize {
		return Errorf(EINVAL, "protocol: the exporter's grant table is not a file of %d bytes", tableSize)
	}
	need := unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_FUTURE_WRITE
	if seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err != nil || seals&need != need {
		return Errorf(EINVAL, "protocol: the exporter's grant table is not sealed against resizing and writing")
	}
	mem, err := unix.Mmap(fd, 0, tableSize, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return Errorf(ioCode(err), "grant table: mapping it: %w", err)
	}
	_ = unix.Madvise(mem, unix.MADV_DONTFORK) // a forked child has no Go to read it
	if atomic.LoadUint32(word32(mem, 0)) != tableMagic || atomic.LoadUint32(word32(mem, 4)) != tableVersion ||
		atomic.LoadUint64(word64(mem, 8)) != tableSlots {
		_ = unix.Munmap(mem)
		return Errorf(EINVAL, "protocol: the exporter's grant table is of another version")
	}
	life, ok := lifelineOf(mem)
	if !ok {
		_ = unix.Munmap(mem)
		return Errorf(EIO, "grant table: its exporter has ended (its lifeline is marked)")
	}
	if life != 0 && unix.Access(fmt.Sprintf("/proc/%d/task/%d", pid, life), unix.F_OK) != nil {
		life = 0 // not a thread of the exporter's: /proc tells instead
	}
	holder := fmt.Sprintf("/proc/%d/fd/%d", pid, ownFD)
	tables.mu.Lock()
	defer tables.mu.Unlock()
	if tables.m[key] != nil || len(tables.m) >= maxTables {
		_ = unix.Munmap(mem)
		return Errorf(EIO, "grant table: no room for another")
	}
	tables.m[key] = &tableView{mem: mem, mine: map[uint64]uint32{}, pending: map[uint64]uint32{}, life: life, holder: holder, dev: st.Dev, ino: st.Ino}
	return nil
}

// sweepTables unmaps the tables whose exporters' images have gone (exited,
// or exec'd), to make room. Called with tables.mu held.
func sweepTables() {
	for key, v := range tables.m {
		if !v.alive() {
			v.unmap()
			delete(tables.m, key)
		}
	}
}

// unmap unmaps the table and the spend log. Called with tables.mu held.
func (v *tableView) unmap() {
	_ = unix.Munmap(v.mem)
	if v.log != nil {
		_ = unix.Munmap(v.log)
	}
}

// dropTable unmaps the table of an exporter that has exited.
func dropTable(key string) {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	if v := tables.m[key]; v != nil {
		v.unmap()
		delete(tables.m, key)
	}
}

// tableAnswer is what the table says of a hit's ticket.
type tableAnswer int

const (
	tableAsk       tableAnswer = iota // it cannot vouch for it: ask the exporter
	tableVouched                      // a use is taken on it: spend it with the exporter, then settle
	tableSpentHere                    // this process has taken every use left already
)

// vouchedUse is the use vouch took on a table: its spend record, the file
// the grant's slot names, and the table it was taken on.
type vouchedUse struct {
	record int
	file   backingFile
	view   *tableView
}

// vouch checks t's grant in its exporter's table and, when it is published
// with this very ticket, within its ttl and with a use left that this
// process has not taken, and the exporter's image that made the table
// is still alive (tableView.alive), takes that use: it writes it to its
// spend log (record u.record, which settle clears once the exporter
// answered). With needFile, only for a grant whose slot names the file
// that holds its buffer (u.file), which a miss opens (tablemiss.go). That
// the pid is still the exporter's is the caller's to check
// (u.exporterAlive: the lifeline said so already, if the table has one).
func vouch(t *Ticket, needFile bool) (answer tableAnswer, u vouchedUse) {
	answer, u.file = tableAsk, noFile
	if !tableUsable(t) {
		return
	}
	digest, err := t.Digest()
	if err != nil {
		return
	}
	tag := grantTag(digest)
	now := monotonicNanos()
	tables.mu.Lock()
	defer tables.mu.Unlock()
	v := tables.m[t.exporterKey()]
	if v == nil || v.log == nil {
		return
	}
	s, ok := v.read(slotIndex(t.RegID))
	if !ok || s.state != slotPublished || s.regID != t.RegID || s.tag != tag ||
		(s.deadline != 0 && (now == 0 || now >= s.deadline)) || (needFile && s.file.fd < 0) {
		return
	}
	if !v.alive() {
		return
	}
	// The uses this process took that the exporter has not answered: those
	// in flight (pending) may be in the slot's spent count already (the
	// exporter counts a use before its answer arrives), the others not.
	// Used up only when it is so either way; where it depends on them, the
	// exporter judges (tableAsk), after them.
	mine, inFlight := v.mine[t.RegID], v.pending[t.RegID]
	if s.uses != 0 && uint64(s.spent)+uint64(mine) >= uint64(s.uses) {
		if mine > inFlight && uint64(s.spent)+uint64(mine-inFlight) >= uint64(s.uses) {
			answer = tableSpentHere
		}
		return
	}
	record := 0
	for i := 1; i <= spendRecords && record == 0; i++ {
		if !v.used[i] {
			record = i
		}
	}
	if record == 0 {
		return // every record waits for an answer: ask the exporter
	}
	v.used[record] = true
	v.gen++
	writeRecord(v.log, record, t.RegID, spendProof(t.Secret, t.RegID), v.gen)
	v.mine[t.RegID] = mine + 1
	v.pending[t.RegID]++
	return tableVouched, vouchedUse{record: record, file: s.file, view: v}
}

// exporterAlive is checkExporterAlive(t) for a use vouch has just taken
// on t's table (a hit's, or a first import's): the table's lifeline, and
// /proc, trusted for aliveRecheck after a check passed (it reads
// /proc/<pid>/stat, once the costliest step of a table hit).
func (u vouchedUse) exporterAlive(t *Ticket) error {
	if u.view.life != 0 && !u.view.alive() {
		return Errorf(EIO, "open: the exporter (pid %d) has exited or exec'd: its grant table's lifeline is marked", t.Pid)
	}
	// Also with a lifeline: an exporter killed a moment ago may be a zombie
	// (its main thread ended) before its lifeline thread has ended and
	// marked the word; /proc says so.
	now := monotonicNanos()
	if last := u.view.aliveAt.Load(); now != 0 && last != 0 && now-last < uint64(aliveRecheck) {
		return nil
	}
	if err := checkExporterAlive(t); err != nil {
		return err
	}
	u.view.aliveAt.Store(now)
	return nil
}

// settle ends the spend of a use vouch took: answered by the exporter (the
// table shows it spent from then on), or, with keep, not (the exporter
// could not be asked). Kept, the use stays taken here, so this process
// does not take it again from the table, and so does its record, which the
// exporter spends should this process exit first.
func settle(t *Ticket, record int, keep bool) {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	v := tables.m[t.exporterKey()]
	if v == nil {
		return
	}
	decrement(v.pending, t.RegID)
	if !keep {
		decrement(v.mine, t.RegID)
	}
	close(tables.settled)
	tables.settled = make(chan struct{})
	if !keep && record > 0 && v.log != nil {
		clearRecord(v.log, record)
		v.used[record] = false
	}
}

// openSpend opens t's record `record` (vouch's) to its exporter, which
// may then spend it when it next grants (spendlog.go); the confirmer takes
// it back with takeSpend.
func openSpend(t *Ticket, record int) {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	if v := tables.m[t.exporterKey()]; v != nil && v.log != nil && record > 0 && v.used[record] {
		openRecord(v.log, record)
	}
}

// takeSpend is the confirmer taking t's record back before it spends the
// use on a session (send), unless the exporter has spent it (spent, and
// whether the buffer lives on) or is spending it now (busy: ask again).
// A table no longer mapped (its exporter gone) is the session's to tell.
func takeSpend(t *Ticket, record int) (send, spent, lives, busy bool) {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	v := tables.m[t.exporterKey()]
	if v == nil || v.log == nil || record <= 0 || !v.used[record] {
		return true, false, false, false
	}
	return takeRecord(v.log, record)
}

// tableAlive reports whether the exporter's image that made t's table
// lives (false also when the table is no longer mapped).
func tableAlive(t *Ticket) bool {
	tables.mu.Lock()
	defer tables.mu.Unlock()
	v := tables.m[t.exporterKey()]
	return v != nil && v.alive()
}

// alive reports whether the exporter's image that made the table lives:
// its lifeline word as it was (one load), or, without one, held().
func (v *tableView) alive() bool {
	if v.life != 0 {
		return atomic.LoadUint32(lifelineWord(v.mem)) == v.life
	}
	return v.held()
}

// held reports whether the exporter's image that made the table still has
// it open where it said: one stat through /proc, which follows the
// descriptor to its file. An exec or exit closed it; a pid handed out
// again cannot show this file, which our mapping keeps from being reused,
// unless a receiver of the exporter kept a descriptor of it there (the
// caller's start-time check is for that).
func (v *tableView) held() bool {
	var st unix.Stat_t
	return unix.Stat(v.holder, &st) == nil && st.Dev == v.dev && st.Ino == v.ino
}

func decrement(m map[uint64]uint32, id uint64) {
	if n := m[id]; n > 1 {
		m[id] = n - 1
	} else {
		delete(m, id)
	}
}

// waitSpent waits, at most timeout, until the uses this process took on t's
// grant from the table have been answered, so that a later use of t by
// this process (a stream, a confirmation, a hit that asks) comes after
// them at the exporter, as it would after hits that asked the exporter. It
// returns what is left of timeout (a millisecond at least), for that use:
// one timeout covers both.
func waitSpent(t *Ticket, timeout time.Duration) (left time.Duration) {
	key := t.exporterKey()
	deadline := time.Now().Add(timeout)
	tables.mu.Lock()
	defer tables.mu.Unlock()
	for {
		v := tables.m[key]
		left = time.Until(deadline)
		if v == nil || v.pending[t.RegID] == 0 || left <= 0 {
			return max(left, time.Millisecond)
		}
		settled := tables.settled
		tables.mu.Unlock()
		timer := time.NewTimer(left)
		select {
		case <-settled:
		case <-timer.C:
		}
		timer.Stop()
		tables.mu.Lock()
	}
}

// slotRead is one slot as read.
type slotRead struct {
	state       uint32
	regID       uint64
	uses, spent uint32
	deadline    uint64
	tag         [32]byte
	file        backingFile
}

// read reads slot i inside its seqlock; false if it was being written.
func (v *tableView) read(i uint64) (slotRead, bool) {
	off := i * tableSlotSize
	seq := word32(v.mem, off+slotSeq)
	s1 := atomic.LoadUint32(seq)
	if s1&1 != 0 {
		return slotRead{}, false
	}
	var r slotRead
	r.state = atomic.LoadUint32(word32(v.mem, off+slotState))
	r.regID = atomic.LoadUint64(word64(v.mem, off+slotRegID))
	u := atomic.LoadUint64(word64(v.mem, off+slotUses))
	r.uses, r.spent = uint32(u), uint32(u>>32)
	r.deadline = atomic.LoadUint64(word64(v.mem, off+slotDeadline))
	r.tag = load32(v.mem, off+slotTag)
	fe := fileEntry(i)
	r.file = backingFile{fd: int(atomic.LoadUint32(word32(v.mem, fe+fileFD))) - 1,
		dev: atomic.LoadUint64(word64(v.mem, fe+fileDev)), ino: atomic.LoadUint64(word64(v.mem, fe+fileIno))}
	return r, atomic.LoadUint32(seq) == s1
}
