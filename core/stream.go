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
	closing     atomic.Bool  // set once by Close, before it takes mu
	lease       *clientLease // the lease the use is held on, until its answer settles it
	sentDone    bool         // done went out: the exporter may have held the use
	runAsked    bool         // a pull-run of every chunk went out with the handshake (open)
}

// Open checks that the ticket's exporter is alive, connects to it, proves
// the secret both ways (handshake.go) and claims one use.
func Open(t *Ticket, opts OpenOptions) (*Stream, error) {
	return open(t, opts, false, false)
}

// open is Open; with hold, a use of a registration that holds
// (Ticket.Holds) is held on this process's lease to the exporter
// (holder.go). With askRun, a pull-run of every chunk goes out with the
// handshake's last message, so that the first NextRun's answer (all of a
// host file's chunks, one descriptor) follows the welcome at once: an
// import whose range is reserved already asks so.
func open(t *Ticket, opts OpenOptions, hold, askRun bool) (*Stream, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	waitSpent(t, opts.Timeout) // this process's table hits of t first
	var tail []byte
	if askRun {
		tail = pullMsg{First: 0, Count: t.Count}.encodeRun()
	}
	var c *conn
	var l *clientLease
	var err error
	if hold && t.Holds {
		c, _, l, err = connectHeld(t, opts.Timeout, 0, tail)
	} else {
		c, _, err = connect(t, opts.Timeout, 0, nil, tail)
	}
	if err != nil {
		return nil, err
	}
	return &Stream{c: c, t: t, window: uint64(opts.Window), lease: l, runAsked: askRun}, nil
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
		s.sentDone = true
		if err := s.c.send(encodeMsg(msgDone, nil), -1); err != nil {
			return err
		}
	}
	ack, err := readDoneAckFlags(s.c)
	if err != nil {
		return err
	}
	if s.lease != nil {
		s.lease.useDone(s.t.RegID, ack&ackHeld != 0)
		s.lease = nil
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
	if s.mu.TryLock() { // else a Next in progress reads it, or fails once the socket closes
		s.settleUnread()
		s.mu.Unlock()
	}
	err := s.c.Close()
	s.mu.Lock()
	s.closed = true
	if l := s.lease; l != nil {
		// No answer came. Chunk by chunk, the exporter holds the use only
		// once it sends the done-ack, which waits for done; the last run
		// brings it unasked.
		s.lease = nil
		if s.sentDone || s.ackFollows {
			l.useLost()
		} else {
			l.useDone(0, false)
		}
	}
	s.mu.Unlock()
	return err
}

// settleUnread reads the done-ack that came unasked after the stream's
// last run but was never read (the receiver failed mapping the run, say):
// the exporter spent and held the use when it sent it, so the hold is let
// go at once rather than kept until the lease ends. It was sent right
// after the run: a short wait is enough. Called with s.mu held.
func (s *Stream) settleUnread() {
	l := s.lease
	if l == nil || !s.ackFollows || s.done || s.err != nil || s.closed {
		return
	}
	s.c.deadline = time.Now().Add(time.Second)
	flags, err := readDoneAckFlags(s.c)
	s.err = Errorf(EBADF, "stream is closed")
	if err != nil {
		return // Close counts it lost
	}
	s.lease = nil
	held := flags&ackHeld != 0
	l.useDone(s.t.RegID, held)
	if held {
		_ = Release(s.t)
	}
}
