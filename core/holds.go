package core

import (
	"crypto/rand"
	"crypto/subtle"
	"fmt"
	"sync"
	"time"
)

// Holds: the server's half of "memory a receiver holds is never handed out
// again" (the receiver's half is holder.go).
//
// torch.multiprocessing promises that a tensor a receiver rebuilt stays
// valid while the receiver holds it, whatever the sender does with its own
// copy: the sender's allocator must not hand the memory out again until
// every receiver has let go. A registration made with RegisterOptions.Hold
// keeps that promise (its tickets say so: Ticket.Holds). Each use spent by
// a receiver that asked to hold (ImportOptions.Hold) is a *hold*, and the
// registration's release (its OnRelease, where the owner drops what it kept
// alive for receivers) waits until every hold is let go
// (registration.go release/unhold).
//
// Holds live on a *lease*: a slot of the exporter's lease file (leasefile.go)
// that one receiver process keeps locked for as long as it lives, named by
// the slot and a random token. No connection stays open for it on either
// side: a held use is an ordinary short session that names its lease
// (hold-on) or asks for one (helloLease: the lease comes on the
// authenticated session, with one descriptor that the receiver locks, maps
// and closes); releases ride on the receiver's next held use, or come in
// batches on short connections of their own, proved by the token
// (wire_holds.go). The exporter learns that a receiver
// died (SIGKILL included) when the kernel drops its lock, which a goroutine
// polls while leases live (leases.go); then every hold on the lease is let
// go. A lease lets go only of its own holds: no receiver can release what
// another holds, and only the process a lease was granted to (SO_PEERCRED)
// may name it.
//
// So an exporter keeps one descriptor (the lease file) whatever the number
// of its receivers, and a receiver none (a mapping of one page per exporter
// it holds from). This file has one lease's holds, then the table of an
// exporter's leases.
type lease struct {
	slot  uint64
	token leaseToken
	pid   int32 // the receiver's (0: in another PID namespace)

	// Guarded by the table's mu.
	verified  bool // the receiver's lock was seen
	ended     bool
	inUse     int // sessions that name it now
	held      map[uint64]*heldUse
	nheld     int
	idleSince time.Time
}

type heldUse struct {
	g *registration
	n int // uses of g held on this lease
}

// Bounds on what an exporter keeps for its receivers (holds.go's issue:
// one receiver must not lock the others out).
var (
	maxLeasesPerPid  = 4       // live leases of one receiver process
	maxLeases        = 4096    // live leases in all
	maxHoldsPerLease = 1 << 20 // uses held on one lease
	leaseIdle        = 30 * time.Second
	leasePoll        = 20 * time.Millisecond
)

func newLease(slot uint64, pid int32) (*lease, error) {
	l := &lease{slot: slot, pid: pid, held: map[uint64]*heldUse{}, idleSince: time.Now()}
	if _, err := rand.Read(l.token[:]); err != nil {
		return nil, WrapErr(EINTERNAL, err, "lease token")
	}
	return l, nil
}

// names reports whether m names l for a receiver of pid.
func (l *lease) names(m leaseRefMsg, pid int32) bool {
	return subtle.ConstantTimeCompare(l.token[:], m.Token[:]) == 1 && (l.pid == 0 || l.pid == pid)
}

// take holds one use of g on l, unless g does not hold, l has ended or g
// has ended (registration.go hold). Called with the table's mu held (hold
// runs no callback).
func (l *lease) take(g *registration) bool {
	if !g.holdable || l.ended || l.nheld >= maxHoldsPerLease || !g.hold() {
		return false
	}
	u := l.held[g.id]
	if u == nil {
		u = &heldUse{g: g}
		l.held[g.id] = u
	}
	u.n++
	l.nheld++
	return true
}

// letGo forgets one use of registration id held on l and returns it, for
// the caller to unhold once the table's mu is let go (a release may run
// the owner's callback); nil if l holds none. Called with the table's mu
// held.
func (l *lease) letGo(id uint64) *registration {
	u := l.held[id]
	if u == nil {
		return nil
	}
	if u.n--; u.n == 0 {
		delete(l.held, id)
	}
	if l.nheld--; l.nheld == 0 {
		l.idleSince = time.Now()
	}
	return u.g
}

// end marks l ended and returns every use it held, to unhold. Called with
// the table's mu held.
func (l *lease) end() []*registration {
	l.ended = true
	var all []*registration
	for _, u := range l.held {
		for ; u.n > 0; u.n-- {
			all = append(all, u.g)
		}
	}
	l.held, l.nheld = nil, 0
	return all
}

func unholdAll(gs []*registration) {
	for _, g := range gs {
		g.unhold()
	}
}

// An exporter's leases (holds.go has the why): its one lease file, made
// when the first receiver asks for a lease, the live leases by slot, and a
// goroutine that, while any lease lives, checks every leasePoll that each
// receiver that holds something still holds its lock (else it died or let
// go: its holds go) and ends leases idle for leaseIdle (their receivers
// just get new ones).
type leaseTable struct {
	mu      sync.Mutex
	fdMu    sync.RWMutex // keeps fd open while the poller asks without mu; close takes it after mu
	fd      int          // the lease file; -1 until the first lease, and after close
	bySlot  map[uint64]*lease
	perPid  map[int32]int
	polling bool
	closed  bool
}

func newLeaseTable() *leaseTable {
	return &leaseTable{fd: -1, bySlot: map[uint64]*lease{}, perPid: map[int32]int{}}
}

// grant makes a new lease for a receiver of pid and a descriptor of the
// lease file for it (the caller sends and closes it). The lease counts as
// in use (done lets go) and is not believed until verify.
func (lt *leaseTable) grant(pid int32) (*lease, int, error) {
	lt.mu.Lock()
	defer lt.mu.Unlock()
	if lt.closed {
		return nil, -1, Errorf(ENOENT, "the exporter has closed its server")
	}
	if lt.fd < 0 {
		fd, err := newLeaseFile()
		if err != nil {
			return nil, -1, err
		}
		lt.fd = fd
	}
	if pid != 0 && lt.perPid[pid] >= maxLeasesPerPid {
		lt.reclaim(func(l *lease) bool { return l.pid == pid })
	}
	if len(lt.bySlot) >= maxLeases {
		lt.reclaim(func(*lease) bool { return true })
	}
	switch {
	case pid != 0 && lt.perPid[pid] >= maxLeasesPerPid:
		return nil, -1, Errorf(EIO, "hold: this receiver process (pid %d) already has %d leases at the exporter, the most one process may have, and all hold something: release what it holds (vmmipc_release), or import without VMMIPC_IMPORT_HOLD", pid, maxLeasesPerPid)
	case len(lt.bySlot) >= maxLeases:
		return nil, -1, Errorf(EIO, "hold: the exporter has %d leases, the most it keeps, and all hold something: its receivers must release what they hold, or import without VMMIPC_IMPORT_HOLD", maxLeases)
	}
	slot, err := lt.freeSlot()
	if err != nil {
		return nil, -1, err
	}
	l, err := newLease(slot, pid)
	if err != nil {
		return nil, -1, err
	}
	fd, err := reopenLeaseFile(lt.fd)
	if err != nil {
		return nil, -1, err
	}
	l.inUse = 1
	lt.bySlot[slot] = l
	lt.perPid[pid]++
	lt.startPolling()
	return l, fd, nil
}

// freeSlot is the lowest slot that no lease has and nobody locks (a
// receiver whose lease ended may not have unmapped it yet). Called with
// lt.mu held.
func (lt *leaseTable) freeSlot() (uint64, error) {
	for s := uint64(0); s < uint64(2*maxLeases); s++ {
		if lt.bySlot[s] != nil {
			continue
		}
		locked, err := slotLocked(lt.fd, s)
		if err != nil {
			return 0, err
		}
		if !locked {
			return s, nil
		}
	}
	return 0, Errorf(EIO, "hold: every slot of the exporter's lease file is taken")
}

// reclaim ends the leases chosen by which whose receivers are gone, and
// those that hold nothing and are not in use. Called with lt.mu held; the
// leases it ends hold nothing to unhold but those of dead receivers,
// unheld off the caller's path.
func (lt *leaseTable) reclaim(which func(*lease) bool) {
	var gone []*registration
	for _, l := range lt.bySlot {
		if !which(l) || l.inUse > 0 {
			continue
		}
		if l.nheld == 0 || (l.verified && !lt.lockedBy(l)) {
			gone = append(gone, lt.endLocked(l)...)
		}
	}
	if len(gone) > 0 {
		go unholdAll(gone)
	}
}

// lockedBy reports whether l's receiver still holds its lock. Called with
// lt.mu or lt.fdMu held.
func (lt *leaseTable) lockedBy(l *lease) bool {
	locked, err := slotLocked(lt.fd, l.slot)
	return err != nil || locked // on error, believe the receiver lives
}

// verify believes l once its receiver's lock is there.
func (lt *leaseTable) verify(l *lease) error {
	lt.mu.Lock()
	defer lt.mu.Unlock()
	if l.ended {
		return Errorf(ENOENT, "hold: the lease ended before it was taken")
	}
	if !lt.lockedBy(l) {
		return Errorf(EINVAL, "protocol: the receiver said leased, but slot %d of the lease file is not locked", l.slot)
	}
	l.verified = true
	return nil
}

// use finds the live lease m names for a receiver of pid and counts it in
// use (done lets go); errLeaseGone if there is none. A lease that holds its
// most is refused for a use that would hold more (toHold).
func (lt *leaseTable) use(m leaseRefMsg, pid int32, toHold bool) (*lease, error) {
	lt.mu.Lock()
	defer lt.mu.Unlock()
	l := lt.bySlot[m.Slot]
	if l == nil || !l.verified || !l.names(m, pid) {
		return nil, errLeaseGone
	}
	if toHold {
		if err := l.full(); err != nil {
			return nil, err
		}
	}
	l.inUse++
	return l, nil
}

// holdsItsMost refuses a use to hold on l (in use already: a release
// carried by a held use, let go of first) if l holds its most.
func (lt *leaseTable) holdsItsMost(l *lease) error {
	lt.mu.Lock()
	defer lt.mu.Unlock()
	return l.full()
}

func (l *lease) full() error {
	if l.nheld >= maxHoldsPerLease {
		return Errorf(EIO, "hold: this process holds %d uses on its lease at the exporter, the most one lease may: release some (vmmipc_release)", l.nheld)
	}
	return nil
}

// done ends a session's use of l; a lease that never got its lock (the
// session failed before leased) ends with it.
func (lt *leaseTable) done(l *lease) {
	lt.mu.Lock()
	l.inUse--
	var gone []*registration
	if !l.verified && !l.ended {
		gone = lt.endLocked(l)
	}
	lt.mu.Unlock()
	unholdAll(gone)
}

// take holds one use of g on l (holds.go take).
func (lt *leaseTable) take(l *lease, g *registration) bool {
	lt.mu.Lock()
	defer lt.mu.Unlock()
	return l.take(g)
}

// letGo lets go of the uses of ids held on l (ids it does not hold are
// ignored) and, with end, of the lease; it returns how many were let go.
func (lt *leaseTable) letGo(l *lease, ids []uint64, end bool) int {
	var gs []*registration
	lt.mu.Lock()
	for _, id := range ids {
		if g := l.letGo(id); g != nil {
			gs = append(gs, g)
		}
	}
	n := len(gs)
	if end && !l.ended {
		gs = append(gs, lt.endLocked(l)...)
	}
	lt.mu.Unlock()
	unholdAll(gs)
	return n
}

// endLocked ends l and frees its slot; it returns what l held, to unhold.
// Called with lt.mu held.
func (lt *leaseTable) endLocked(l *lease) []*registration {
	if lt.bySlot[l.slot] == l {
		delete(lt.bySlot, l.slot)
		if lt.perPid[l.pid]--; lt.perPid[l.pid] <= 0 {
			delete(lt.perPid, l.pid)
		}
	}
	return l.end()
}

// startPolling starts the poller unless it runs. Called with lt.mu held.
func (lt *leaseTable) startPolling() {
	if !lt.polling {
		lt.polling = true
		go lt.poll()
	}
}

// poll checks the leases every leasePoll until none is left. Each
// F_OFD_GETLK walks the file's locks, so a pass costs the square of the
// leases asked about (8 ms for 1100 on a loaded 2-core machine): only those
// that hold something are asked, without lt.mu (the descriptor is kept
// open by fdMu meanwhile), and the next pass waits at least ten times what
// this one took, so the poller takes at most a tenth of a core.
func (lt *leaseTable) poll() {
	wait := leasePoll
	for {
		time.Sleep(wait)
		lt.mu.Lock()
		if len(lt.bySlot) == 0 || lt.closed {
			lt.polling = false
			lt.mu.Unlock()
			return
		}
		var gone []*registration
		var ask []*lease
		for _, l := range lt.bySlot {
			switch {
			case l.verified && l.nheld > 0:
				ask = append(ask, l)
			case l.inUse == 0 && l.nheld == 0 && time.Since(l.idleSince) > leaseIdle:
				gone = append(gone, lt.endLocked(l)...)
			}
		}
		lt.mu.Unlock()
		start := time.Now()
		dead := lt.deadOf(ask)
		wait = max(leasePoll, 10*time.Since(start))
		lt.mu.Lock()
		for _, l := range dead {
			if !l.ended { // a lock gone stays gone: its slot is not reused before the end
				gone = append(gone, lt.endLocked(l)...)
			}
		}
		lt.mu.Unlock()
		unholdAll(gone)
	}
}

// deadOf returns the leases of ls whose receivers no longer hold their
// locks.
func (lt *leaseTable) deadOf(ls []*lease) []*lease {
	lt.fdMu.RLock()
	defer lt.fdMu.RUnlock()
	var dead []*lease
	for _, l := range ls {
		if lt.fd >= 0 && !lt.lockedBy(l) {
			dead = append(dead, l)
		}
	}
	return dead
}

// close ends every lease, as the exporter's exit would, and closes the
// lease file.
func (lt *leaseTable) close() {
	lt.mu.Lock()
	lt.closed = true
	var gone []*registration
	for _, l := range lt.bySlot {
		gone = append(gone, lt.endLocked(l)...)
	}
	lt.fdMu.Lock()
	closeFD(&lt.fd)
	lt.fdMu.Unlock()
	lt.mu.Unlock()
	unholdAll(gone)
}

// count reports the live leases and the holds on them.
func (lt *leaseTable) count() (leases, holds int) {
	lt.mu.Lock()
	defer lt.mu.Unlock()
	for _, l := range lt.bySlot {
		holds += l.nheld
	}
	return len(lt.bySlot), holds
}

func (l *lease) String() string { return fmt.Sprintf("lease %d of pid %d", l.slot, l.pid) }
