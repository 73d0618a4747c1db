package core

import (
	"errors"
	"time"
)

// Holds, the receiver's half (holds.go has the server's and the why).
//
// A receiver that imports or confirms with ImportOptions.Hold a ticket
// whose registration holds (Ticket.Holds) holds the use on its lease at
// that exporter: one per exporter as a rule (threads that need one at once
// wait for the first to get it, within their own timeouts). The first held
// use asks for the lease (its session brings it); later ones name it
// (hold-on). Each is an ordinary short session whose done-ack says whether
// the use is held: nothing is believed before the exporter answered.
// Release queues the registration id and returns; the next held use to
// that exporter carries what is queued in its first message (connect.go),
// or, releaseDelay later, a timer sends it in batches, each on a short
// connection of its own proved by the lease's token. A lease that holds
// nothing and has no use in flight ends leaseLinger after its last use:
// the last release says so and the mapping goes (its lock with it). The
// receiver's death drops the lock, which lets go of everything it held:
// nothing else is needed for that.
// clientlease.go has a lease's own life.

// leaseFor returns a live lease to t's exporter, counted in flight; or nil
// and acquire: this thread asks for one (then it must call acquired).
// Another thread getting one is waited for until deadline.
func leaseFor(t *Ticket, deadline time.Time) (l *clientLease, acquire bool, err error) {
	key := t.exporterKey()
	for {
		leases.mu.Lock()
		for _, l := range leases.m[key] {
			l.mu.Lock()
			ok := !l.ending && !l.gone && !l.lost
			if ok {
				l.inflight++
			}
			l.mu.Unlock()
			if ok {
				leases.mu.Unlock()
				return l, false, nil
			}
		}
		ch := leases.acquiring[key]
		if ch == nil {
			leases.acquiring[key] = make(chan struct{})
			leases.mu.Unlock()
			return nil, true, nil
		}
		leases.mu.Unlock()
		wait := time.Until(deadline)
		if wait <= 0 {
			return nil, false, Errorf(EIO, "hold: timed out waiting for this process's lease at the exporter (another thread is getting it); raise timeout_ms if the exporter is just slow")
		}
		timer := time.NewTimer(wait)
		select {
		case <-ch:
		case <-timer.C:
		}
		timer.Stop()
	}
}

// acquired ends a thread's asking for key's lease; l is what it got (or
// nil), published for the other threads.
func acquired(key string, l *clientLease) {
	leases.mu.Lock()
	defer leases.mu.Unlock()
	if l != nil {
		leases.m[key] = append(leases.m[key], l)
	}
	if ch := leases.acquiring[key]; ch != nil {
		close(ch)
		delete(leases.acquiring, key)
	}
}

// connectHeld is connect (tail included) for a use held on this process's
// lease to t's exporter: it names the lease, or asks for one, and asks once
// more for a new one when the exporter no longer knows the one named. The lease
// returned counts the use in flight: the caller settles it (useDone,
// useLost).
func connectHeld(t *Ticket, timeout time.Duration, flags uint64, tail []byte) (*conn, transcript, *clientLease, error) {
	deadline := time.Now().Add(timeout)
	key := t.exporterKey()
	for retried := false; ; retried = true {
		l, acquire, err := leaseFor(t, deadline)
		if err != nil {
			return nil, transcript{}, nil, err
		}
		ask := &holdAsk{on: l}
		left := time.Until(deadline)
		if left <= 0 {
			err = Errorf(EIO, "hold: timed out after %v", timeout)
		} else {
			var c *conn
			var tr transcript
			c, tr, err = connect(t, left, flags, ask, tail)
			if err == nil {
				if acquire {
					acquired(key, ask.got)
				}
				if l == nil {
					l = ask.got
				}
				return c, tr, l, nil
			}
		}
		if acquire {
			acquired(key, nil)
		}
		if ask.got != nil { // the session failed after the lease came: no use spent
			ask.got.useDone(0, false)
		}
		gone := errors.Is(err, errLeaseGone)
		if l != nil {
			if gone || checkExporterAlive(t) != nil {
				l.drop() // the exporter let go of what it held
			} else {
				l.useDone(0, false)
			}
		}
		if gone && !retried {
			continue
		}
		if gone {
			err = Errorf(EIO, "hold: the exporter ended this process's lease twice in a row; try again")
		}
		return nil, transcript{}, nil, err
	}
}

// useHeld spends one use of t held on this process's lease to its
// exporter, and returns once the exporter answered; lives says whether the
// buffer lives on after it. A ticket whose registration does not hold takes
// no lease: a plain confirmation.
func useHeld(t *Ticket, timeout time.Duration) (lives bool, err error) {
	if !t.Holds {
		return confirm(t, timeout)
	}
	deadline := time.Now().Add(timeout) // the whole use, not each wait
	c, _, l, err := connectHeld(t, timeout, helloConfirm, nil)
	if err != nil {
		return false, err
	}
	defer c.Close()
	// An answer already here is read even if connecting took the whole
	// timeout (a read past its deadline does not look).
	c.deadline = deadline
	if soon := time.Now().Add(10 * time.Millisecond); deadline.Before(soon) {
		c.deadline = soon
	}
	flags, err := readDoneAckFlags(c)
	if err != nil {
		if CodeOf(err) == EIO { // no answer: it may have been held
			l.useLost()
		} else {
			l.useDone(0, false)
		}
		return false, err
	}
	l.useDone(t.RegID, flags&ackHeld != 0)
	return flags&ackBufferLives != 0, nil
}

// Release lets go of one held use of t (taken by Import or Confirm with
// Hold): its id is queued and sent, with others, by the lease's goroutine.
// ENOENT if this process holds no use of it (never held, let go already,
// or its exporter ended the lease: then it let go itself).
func Release(t *Ticket) error {
	leases.mu.Lock()
	list := append([]*clientLease(nil), leases.m[t.exporterKey()]...)
	leases.mu.Unlock()
	for _, l := range list {
		l.mu.Lock()
		ok := !l.gone && l.held[t.RegID] > 0
		if ok {
			l.releaseLocked(t.RegID)
		}
		l.mu.Unlock()
		if ok {
			return nil
		}
	}
	return Errorf(ENOENT, "release: this process holds no use of registration %d (never held, let go of already, or its exporter has gone, which let go of it)", t.RegID)
}
