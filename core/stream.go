package core

import (
	"context"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultTimeout is how long a receiver waits on a silent exporter.
const DefaultTimeout = 30 * time.Second

// DefaultWindow is how many chunk requests a receiver keeps in flight by
// default. Descriptors in flight sit in the socket (the kernel's), not in
// either process's table.
const DefaultWindow = 16

// OpenOptions are the receiver-side options.
type OpenOptions struct {
	Timeout time.Duration // 0 = DefaultTimeout
	Window  uint32        // 0 = DefaultWindow; 1 = lockstep
}

// Chunk is one received chunk. The receiver of a Chunk owns FD.
type Chunk struct {
	Index, Offset, Size, FileOffset uint64
	FD                              int
}

// Stream is a receiver's connection to one registration. It pulls chunks in
// order, at most Window requests ahead. Methods are safe for concurrent use
// but chunks come out one at a time.
type Stream struct {
	mu        sync.Mutex
	c         *conn
	t         *Ticket
	window    uint64
	requested uint64 // chunks asked for so far
	received  uint64 // chunks handed out so far
	offset    uint64 // expected offset of the next chunk
	err       error  // sticky: once broken, always broken
	done      bool
	closed    bool
	closing   atomic.Bool // set once by Close, before it takes mu
}

// Open connects to the ticket's exporter, verifies that the socket belongs to
// the ticket's pid, authenticates and claims one use.
func Open(t *Ticket, opts OpenOptions) (*Stream, error) {
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	if opts.Window == 0 {
		opts.Window = DefaultWindow
	}
	uc, err := dial(t.Address, opts.Timeout)
	if err != nil {
		return nil, err
	}
	cred, err := peerCred(uc)
	if err != nil {
		_ = uc.Close()
		return nil, Errorf(EAUTH, "open: cannot read the exporter's credentials (SO_PEERCRED): %v", err)
	}
	if me := uint32(os.Getuid()); cred.Uid != me && cred.Uid != 0 && me != 0 {
		_ = uc.Close()
		return nil, Errorf(EAUTH, "open: the socket %s belongs to uid %d; only our own uid or root may export to us", t.Address, cred.Uid)
	}
	if uint32(cred.Pid) != t.Pid {
		_ = uc.Close()
		return nil, Errorf(EAUTH, "open: the socket %s belongs to pid %d, but the ticket was issued by pid %d; refusing to trust it (the exporter exited and another process took its address, or the ticket is forged)", t.Address, cred.Pid, t.Pid)
	}
	c, err := newConn(uc, opts.Timeout, "receiver")
	if err != nil {
		_ = uc.Close()
		return nil, err
	}
	s := &Stream{c: c, t: t, window: uint64(opts.Window)}
	if err := s.handshake(); err != nil {
		_ = c.Close()
		return nil, err
	}
	return s, nil
}

func dial(addr string, timeout time.Duration) (*net.UnixConn, error) {
	d := net.Dialer{Timeout: timeout}
	conn, err := d.DialContext(context.Background(), "unix", addr)
	if err != nil {
		return nil, &Error{Code: ioCode(err), Msg: "open: cannot connect to the exporter at " + addr + " (has it exited?)", Err: err}
	}
	return conn.(*net.UnixConn), nil
}

func (s *Stream) handshake() error {
	if err := s.c.send(helloMsg{RegID: s.t.RegID, Secret: s.t.Secret}.encode(), -1); err != nil {
		// A server that refuses us at once (our uid) hangs up after
		// saying why: read that rather than report a bare EPIPE.
		return s.pendingError(err)
	}
	f, err := s.c.recv()
	if err != nil {
		return err
	}
	if f.FD >= 0 {
		closeFD(&f.FD)
		return Errorf(EINVAL, "protocol: the exporter sent a descriptor with its %s message", msgName(f.Type))
	}
	switch f.Type {
	case msgError:
		return remoteError(f.Body)
	case msgWelcome:
	default:
		return Errorf(EINVAL, "protocol: expected welcome, got %s", msgName(f.Type))
	}
	w, err := parseWelcome(f.Body)
	if err != nil {
		return err
	}
	if w.Count != s.t.Count || w.Total != s.t.Total || w.Kind != s.t.Kind {
		return Errorf(EINVAL, "protocol: the exporter describes %d chunks / %d bytes / kind %d, the ticket %d / %d / %d", w.Count, w.Total, w.Kind, s.t.Count, s.t.Total, s.t.Kind)
	}
	return nil
}

// remoteError turns the server's error message into a local error.
func remoteError(body []byte) error {
	m, err := parseError(body)
	if err != nil {
		return err
	}
	return &Error{Code: m.Code, Msg: "exporter: " + m.Text}
}

// Ticket returns the ticket the stream was opened with.
func (s *Stream) Ticket() *Ticket { return s.t }

// Next returns the next chunk, or End (as an *Error with Code End) once every
// chunk has arrived, at which point the use is consumed. After any other
// error the stream is broken and Next keeps returning that error.
func (s *Stream) Next() (Chunk, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	switch {
	case s.closed:
		return Chunk{FD: -1}, Errorf(EBADF, "stream is closed")
	case s.err != nil:
		return Chunk{FD: -1}, s.err
	case s.done:
		return Chunk{FD: -1}, errEnd
	}
	ch, err := s.next()
	if err != nil && err != errEnd {
		s.err = err
	}
	return ch, err
}

var errEnd = &Error{Code: End, Msg: "stream finished"}

// IsEnd reports whether err marks the end of a stream.
func IsEnd(err error) bool { return err == errEnd }

func (s *Stream) next() (Chunk, error) {
	count := s.t.Count
	if s.received == count {
		if s.offset != s.t.Total {
			return Chunk{FD: -1}, Errorf(EINVAL, "protocol: chunks cover %d bytes, the ticket says %d", s.offset, s.t.Total)
		}
		if err := s.c.send(encodeMsg(msgDone, nil), -1); err != nil {
			return Chunk{FD: -1}, err
		}
		f, err := s.c.recv()
		if err != nil {
			return Chunk{FD: -1}, wrapErr(EIO, err, "waiting for the exporter to confirm")
		}
		closeFD(&f.FD)
		switch f.Type {
		case msgDoneAck:
		case msgError:
			return Chunk{FD: -1}, remoteError(f.Body)
		default:
			return Chunk{FD: -1}, Errorf(EINVAL, "protocol: expected done-ack, got %s", msgName(f.Type))
		}
		s.done = true
		return Chunk{FD: -1}, errEnd
	}
	// Top up the requests in flight once half the window has drained, so
	// the exporter never waits on us and requests go out in batches.
	if inFlight := s.requested - s.received; inFlight <= s.window/2 && s.requested < count {
		n := min(s.window-inFlight, count-s.requested)
		if sendErr := s.c.send(pullMsg{First: s.requested, Count: n}.encode(), -1); sendErr != nil {
			// The exporter may have hung up after telling us why: what it
			// sent before closing is still queued for us to read.
			if inFlight == 0 {
				return Chunk{FD: -1}, s.chunkErr(s.pendingError(sendErr))
			}
		} else {
			s.requested += n
		}
	}
	f, err := s.c.recv()
	if err != nil {
		return Chunk{FD: -1}, s.chunkErr(err)
	}
	switch f.Type {
	case msgChunk:
	case msgError:
		closeFD(&f.FD)
		return Chunk{FD: -1}, remoteError(f.Body)
	default:
		closeFD(&f.FD)
		return Chunk{FD: -1}, Errorf(EINVAL, "protocol: expected chunk %d, got %s", s.received, msgName(f.Type))
	}
	m, err := parseChunk(f.Body)
	if err == nil {
		err = s.checkChunk(m, f.FD)
	}
	if err != nil {
		closeFD(&f.FD)
		return Chunk{FD: -1}, err
	}
	s.received++
	s.offset += m.Size
	return Chunk{Index: m.Index, Offset: m.Offset, Size: m.Size, FileOffset: m.FileOffset, FD: f.FD}, nil
}

// pendingError returns the exporter's queued error message if there is one,
// else fallback.
func (s *Stream) pendingError(fallback error) error {
	f, err := s.c.recv()
	if err != nil {
		return fallback
	}
	closeFD(&f.FD)
	if f.Type == msgError {
		return remoteError(f.Body)
	}
	return fallback
}

// checkChunk verifies that a chunk message is the one we expect and that
// it fits the ticket, so a confused or hostile exporter cannot make us map
// outside the range we reserved.
func (s *Stream) checkChunk(m chunkMsg, fd int) error {
	switch {
	case fd < 0:
		return Errorf(EINVAL, "protocol: chunk %d arrived without a descriptor", m.Index)
	case m.Index != s.received:
		return Errorf(EINVAL, "protocol: got chunk %d, expected %d", m.Index, s.received)
	case m.Offset != s.offset:
		return Errorf(EINVAL, "protocol: chunk %d at offset %d, expected %d", m.Index, m.Offset, s.offset)
	case m.Size == 0 || m.Size > s.t.Total-s.offset:
		return Errorf(EINVAL, "protocol: chunk %d of size %d does not fit the %d bytes left", m.Index, m.Size, s.t.Total-s.offset)
	case m.Index == s.t.Count-1 && m.Offset+m.Size != s.t.Total:
		return Errorf(EINVAL, "protocol: chunks end at %d, the ticket says %d", m.Offset+m.Size, s.t.Total)
	}
	return nil
}

// chunkErr prefixes an error with the chunk we were waiting for.
func (s *Stream) chunkErr(err error) error {
	return wrapErr(EIO, err, "chunk %d of %d", s.received, s.t.Count)
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
	err := s.c.Close()
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return err
}
