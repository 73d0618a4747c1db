package core

import (
	"sync"
	"sync/atomic"
	"time"
)

// Stream is a receiver's connection to one registration. It pulls chunks in
// order, at most Window requests ahead. Methods are safe for concurrent use
// but chunks come out one at a time.
//
// This file has the stream's life: Open (with the use's hold), finish (done
// and the done-ack) and Close; pull.go pulls the chunks in between.
type Stream struct {
	mu          sync.Mutex
	c           *conn
	t           *Ticket
	window      uint64
	requested   uint64 // chunks asked for so far
	received    uint64 // chunks handed out so far
	offset      uint64 // expected offset of the next chunk
	err         error  // sticky: once broken, always broken
	done        bool
	bufferLives bool // the exporter said the buffer outlives this use
	perChunk    bool // NextRun: the exporter sends one chunk per descriptor
	ackFollows  bool // a run completed the stream: the done-ack comes unasked
	closed      bool
	closing     atomic.Bool // set once by Close, before it takes mu
	tr          transcript  // the handshake's (a holder session's uses are bound to it)
	hold        uint64      // helloHolder: the connection becomes a holder session after done-ack
	heldBy      *holder     // hold-for: the holder session the use is held on
	adopted     atomic.Bool // it did: c belongs to holders now
}

// Open checks that the ticket's exporter is alive, connects to it, proves
// the secret both ways (handshake.go) and claims one use.
func Open(t *Ticket, opts OpenOptions) (*Stream, error) {
	return open(t, opts, false)
}

// open is Open; with hold, the use is held (holder.go): on this process's
// holder session to the exporter (named first with hold-for), or, with
// none, this connection becomes that session after its done-ack.
func open(t *Ticket, opts OpenOptions, hold bool) (*Stream, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	var pre []byte
	var flags uint64
	var heldBy *holder
	if hold {
		if heldBy = holderFor(t); heldBy != nil {
			pre = tokenMsg{Token: heldBy.token}.encode(msgHoldFor)
		} else {
			flags = helloHolder
		}
	}
	c, tr, err := connect(t, opts.Timeout, flags, pre)
	if err != nil && pre != nil && CodeOf(err) == ENOENT {
		// The session named has just ended: be the holder session instead.
		flags, heldBy = helloHolder, nil
		c, tr, err = connect(t, opts.Timeout, flags, nil)
	}
	if err != nil {
		return nil, err
	}
	return &Stream{c: c, t: t, window: uint64(opts.Window), tr: tr, hold: flags, heldBy: heldBy}, nil
}

// Ticket returns the ticket the stream was opened with.
func (s *Stream) Ticket() *Ticket { return s.t }

var errEnd = &Error{Code: End, Msg: "stream finished"}

// IsEnd reports whether err marks the end of a stream.
func IsEnd(err error) bool { return err == errEnd }

// finish says done and reads the exporter's done-ack: the use is spent.
func (s *Stream) finish() error {
	if s.offset != s.t.Total {
		return Errorf(EINVAL, "protocol: chunks cover %d bytes, the ticket says %d", s.offset, s.t.Total)
	}
	if !s.ackFollows {
		if err := s.c.send(encodeMsg(msgDone, nil), -1); err != nil {
			return err
		}
	}
	ack, err := readDoneAckFlags(s.c)
	if err != nil {
		return err
	}
	switch {
	case s.hold != 0:
		if _, err := adoptHolder(s.t, s.c, s.tr, ack&ackHeld != 0); err != nil {
			return err
		}
		s.adopted.Store(true)
	case s.heldBy != nil && ack&ackHeld != 0:
		s.heldBy.took(s.t.RegID)
	}
	s.done, s.bufferLives = true, ack&ackBufferLives != 0
	return errEnd
}

// Close ends the stream. A stream closed before End gives its use back to
// the registration.
//
// Close does not wait for a Next in progress on another thread: closing the
// socket wakes it, and it returns an error.
func (s *Stream) Close() error {
	if !s.closing.CompareAndSwap(false, true) {
		return Errorf(EBADF, "stream is already closed")
	}
	s.letGoUnread()
	var err error
	if !s.adopted.Load() { // else the connection is this process's holder session now
		err = s.c.Close()
	}
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return err
}

// letGoUnread lets go of a use held on another session (hold-for) whose
// done-ack came unasked after the stream's last run and was never read:
// the exporter spent and held the use when it sent the ack, but the
// receiver failed before reading it (mapping the run), so nothing here
// knows of the hold, which would last as long as this process. (A use held
// on this connection itself ends with it; one whose ack is asked for with
// done is never held without it: session.go serveUse.)
func (s *Stream) letGoUnread() {
	if !s.mu.TryLock() {
		return // a Next in progress reads it, or fails once Close closes the socket
	}
	defer s.mu.Unlock()
	if s.heldBy == nil || !s.ackFollows || s.done || s.err != nil || s.closed {
		return
	}
	// It was sent right after the run: a short wait is enough.
	s.c.deadline = time.Now().Add(time.Second)
	flags, err := readDoneAckFlags(s.c)
	s.err = Errorf(EBADF, "stream is closed")
	if err == nil && flags&ackHeld != 0 {
		s.heldBy.letGo(s.t.RegID)
	}
}
