package core

import (
	"errors"
	"sync"
	"syscall"
	"time"
)

// A receiver's lease at one exporter (holder.go has how held uses use it,
// holds.go the why): what it holds, the uses in flight on it, the releases
// queued, the timer that sends them (unless a held use carries them first)
// and its end, a while after it last held anything.
type clientLease struct {
	t     *Ticket // a ticket of the exporter: where releases go
	key   string  // the exporter (Ticket.exporterKey)
	slot  uint64
	token leaseToken

	mu       sync.Mutex
	m        leaseMapping // nil once gone
	held     map[uint64]int
	nheld    int
	inflight int         // uses sent on it whose answers have not come yet
	queued   []uint64    // registration ids to let go of, oldest first
	lastUse  time.Time   // a use settled or a hold let go: it ends leaseLinger later if it then holds nothing
	timer    *time.Timer // runs flush at due
	due      time.Time   // zero: flush is not scheduled
	flushing bool        // flush runs (and looks at everything again before it stops)
	ending   bool        // takes no new use: it ends once its releases went
	gone     bool        // ended: unmapped and forgotten
	lost     bool        // a use's answer never came: end it once what is known is let go
}

// leases are this process's leases, by exporter, and the exporters a
// thread is getting one from.
var leases = struct {
	mu        sync.Mutex
	m         map[string][]*clientLease
	acquiring map[string]chan struct{}
}{m: map[string][]*clientLease{}, acquiring: map[string]chan struct{}{}}

// releaseTimeout bounds each wait of a release connection (they run off
// every caller's path, and are tried again while the exporter lives).
var releaseTimeout = 5 * time.Second

// releaseDelay is how long a release waits for a held use to the same
// exporter to carry it (holder.go) before it goes on a connection of its
// own: a loop of one-tensor sends then costs one connection per tensor, not
// two. It bounds how much later than vmmipc_release the exporter lets go.
var releaseDelay = 2 * time.Millisecond

// leaseLinger is how long a lease that holds nothing is kept for the next
// held use: taking a lease costs a round trip, a descriptor passed, a
// lock and a mapping, which a loop of held uses would otherwise pay each
// time. It costs nothing but the one-page mapping and the exporter's slot
// (which the exporter may reclaim: the next use then asks for a new one).
var leaseLinger = 250 * time.Millisecond

// holdAsk is what a held use's session asks for: to hold on the lease on,
// or, with none, a new lease (which the handshake puts in got).
type holdAsk struct {
	on  *clientLease
	got *clientLease
}

// adoptLease takes the lease the exporter sent with fd (closed on every
// path): the lock on its slot, the mapping that keeps it. It starts with
// one use in flight (the session's).
func adoptLease(t *Ticket, m leaseRefMsg, fd int) (*clientLease, error) {
	mapping, err := takeLease(fd, m.Slot)
	if err != nil {
		return nil, err
	}
	return &clientLease{
		t: t, key: t.exporterKey(), slot: m.Slot, token: m.Token, m: mapping,
		held: map[uint64]int{}, inflight: 1,
	}, nil
}

// takeSessionLease takes the lease the exporter sends after the proof and
// tells it the slot is locked (with tail: connect).
func takeSessionLease(c *conn, t *Ticket, tail []byte) (*clientLease, error) {
	f, err := c.recv()
	if err != nil {
		return nil, err
	}
	if f.Type != msgLease {
		closeFD(&f.FD)
		if f.Type == msgError {
			return nil, remoteError(f.Body, beforeChunks)
		}
		return nil, Errorf(EINVAL, "protocol: expected lease, got %s", msgName(f.Type))
	}
	if f.FD < 0 {
		return nil, Errorf(EINVAL, "protocol: a lease came without its descriptor")
	}
	m, err := parseLeaseRef(msgLease, f.Body)
	if err != nil {
		closeFD(&f.FD)
		return nil, err
	}
	l, err := adoptLease(t, m, f.FD)
	if err != nil {
		return nil, err
	}
	if err := c.send(append(encodeMsg(msgLeased, nil), tail...), -1); err != nil {
		l.useDone(0, false)
		return nil, pendingError(c, err, beforeChunks)
	}
	return l, nil
}

// useDone settles a use in flight on l: held (registration id) or not.
func (l *clientLease) useDone(id uint64, held bool) {
	l.mu.Lock()
	l.inflight--
	if held && !l.gone {
		l.held[id]++
		l.nheld++
	}
	l.lastUse = time.Now()
	l.endWhenIdleLocked()
	l.mu.Unlock()
}

// moreInFlight counts n more uses in flight on l (a session's further
// uses: confirm_many.go); each is settled like the first.
func (l *clientLease) moreInFlight(n int) {
	l.mu.Lock()
	l.inflight += n
	l.mu.Unlock()
}

// useLost settles a use in flight on l whose answer never came: the
// exporter may hold it without our knowing, so l takes no new use and ends
// (which lets go of everything on it) once what we know is let go.
func (l *clientLease) useLost() {
	l.mu.Lock()
	l.inflight--
	l.lost = true
	l.endWhenIdleLocked()
	l.mu.Unlock()
}

// markLost makes l take no new use and end once it holds nothing: releases
// it sent may or may not have been let go of (a held use carried them, and
// its session failed before the exporter answered), and sent again they
// could let go of other holds of the same registrations.
func (l *clientLease) markLost() {
	l.mu.Lock()
	l.lost = true
	l.endWhenIdleLocked()
	l.mu.Unlock()
}

// releaseLocked queues the let-go of one hold of id, sent by flush after
// releaseDelay unless a held use carries it first (takeQueued). Called
// with l.mu held.
func (l *clientLease) releaseLocked(id uint64) {
	if l.held[id]--; l.held[id] == 0 {
		delete(l.held, id)
	}
	l.nheld--
	l.queued = append(l.queued, id)
	l.lastUse = time.Now()
	l.flushByLocked(l.lastUse.Add(releaseDelay))
}

// takeQueued takes up to max queued releases for a held use's session to
// carry (handshake.go); nil if there are none or l is ending.
func (l *clientLease) takeQueued(max int) []uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.gone || l.ending || len(l.queued) == 0 {
		return nil
	}
	n := min(len(l.queued), max)
	ids := append([]uint64(nil), l.queued[:n]...)
	l.queued = l.queued[n:]
	return ids
}

// endWhenIdleLocked schedules l's end if it holds nothing and has nothing
// in flight: leaseLinger after its last use, at once if it is lost. Called
// with l.mu held.
func (l *clientLease) endWhenIdleLocked() {
	if l.gone || l.nheld != 0 || l.inflight != 0 {
		return
	}
	at := l.lastUse.Add(leaseLinger)
	if l.lost {
		at = time.Now()
	}
	l.flushByLocked(at)
}

// flushByLocked makes flush run at at, or earlier if it was due earlier;
// a flush that runs looks at everything again before it stops. Called
// with l.mu held.
func (l *clientLease) flushByLocked(at time.Time) {
	if l.gone || l.flushing || (!l.due.IsZero() && !at.Before(l.due)) {
		return
	}
	l.due = at
	if l.timer == nil {
		l.timer = time.AfterFunc(time.Until(at), l.flush)
	} else {
		l.timer.Reset(time.Until(at))
	}
}

// flush sends the queued releases, up to maxReleaseBatch ids a connection,
// until none is left; once l holds nothing, has nothing in flight and its
// linger has passed, the last one ends the lease. A release that fails
// while the exporter lives (stopped, slow) is tried again, backing off; an
// exporter that has gone, or no longer knows the lease, let go of
// everything on it.
func (l *clientLease) flush() {
	l.mu.Lock()
	if l.flushing || l.gone {
		l.mu.Unlock()
		return
	}
	l.flushing, l.due = true, time.Time{}
	l.mu.Unlock()
	backoff := 10 * time.Millisecond
	for {
		l.mu.Lock()
		idle := l.nheld == 0 && l.inflight == 0
		n := min(len(l.queued), maxReleaseBatch)
		end := idle && n == len(l.queued) && (l.lost || !time.Now().Before(l.lastUse.Add(leaseLinger)))
		if l.gone || (n == 0 && !end) {
			l.flushing = false
			if idle {
				l.endWhenIdleLocked()
			}
			l.mu.Unlock()
			return
		}
		if end {
			l.ending = true
		}
		ids := append([]uint64(nil), l.queued[:n]...)
		l.queued = l.queued[n:] // sent below, or put back if they could not be
		l.mu.Unlock()
		if n == 0 { // nothing to say: the unmapping ends it
			l.drop()
			return
		}
		sent, err := l.sendRelease(ids, end)
		switch {
		case err == nil && end, errors.Is(err, errLeaseGone), err != nil && l.exporterGone(err):
			l.drop()
			return
		case err == nil || sent:
			// Sent but not answered, the exporter may have let go of them:
			// sent again, they could let go of other holds of the same
			// registrations. They stay held there until the lease ends,
			// which it does, taking no new use, once it holds nothing.
			if err != nil {
				l.markLost()
			}
			backoff = 10 * time.Millisecond
		default:
			if end { // unmapping ends it too: the exporter sees the lock go
				l.drop()
				return
			}
			l.mu.Lock()
			l.queued = append(ids, l.queued...)
			l.mu.Unlock()
			time.Sleep(backoff)
			backoff = min(2*backoff, time.Second)
		}
	}
}

// sendRelease lets go of ids (and, with end, of the lease) on a connection
// of its own, and reads the answer; sent says that the message went out
// (whatever came of it).
func (l *clientLease) sendRelease(ids []uint64, end bool) (sent bool, err error) {
	if err := checkBeforeDial(l.t); err != nil {
		return false, err
	}
	c, err := dialConn(l.t, time.Now().Add(releaseTimeout), releaseTimeout)
	if err != nil {
		return false, err
	}
	defer c.Close()
	m := releaseMsg{Slot: l.slot, Token: l.token, RegIDs: ids}
	if end {
		m.Flags = releaseEnd
	}
	if err := c.send(m.encode(), -1); err != nil {
		return false, pendingError(c, err, beforeChunks)
	}
	f, err := recvControl(c, "release-ack")
	if err != nil {
		return true, err
	}
	_, err = parseReleaseAck(f.Body)
	return true, err
}

// exporterGone reports whether err says that l's exporter has gone.
func (l *clientLease) exporterGone(err error) bool {
	return checkExporterAlive(l.t) != nil || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT)
}

// drop ends l here: unmapped (its lock goes) and forgotten; what it held
// the exporter lets go of.
func (l *clientLease) drop() {
	l.mu.Lock()
	if l.gone {
		l.mu.Unlock()
		return
	}
	l.gone, l.ending = true, true
	l.held, l.nheld, l.queued = nil, 0, nil
	if l.timer != nil {
		l.timer.Stop()
	}
	m := l.m
	l.m = nil
	l.mu.Unlock()
	m.end()
	leases.mu.Lock()
	defer leases.mu.Unlock()
	list := leases.m[l.key]
	for i, x := range list {
		if x == l {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(leases.m, l.key)
	} else {
		leases.m[l.key] = list
	}
}

// holdCounts reports the uses this process holds and its live leases.
func holdCounts() (held, live uint64) {
	leases.mu.Lock()
	var all []*clientLease
	for _, list := range leases.m {
		all = append(all, list...)
	}
	leases.mu.Unlock()
	for _, l := range all {
		l.mu.Lock()
		held += uint64(l.nheld)
		l.mu.Unlock()
	}
	return held, uint64(len(all))
}
