package core

import (
	"errors"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Stream is a receiver's connection to one registration. It pulls chunks in
// order, at most Window requests ahead. Methods are safe for concurrent use
// but chunks come out one at a time.
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

// errBusy is the server's "too many unauthenticated peers, retry".
var errBusy = Errorf(EIO, "the exporter is busy with other connections (its bound of connections not yet authenticated is full)")

// connect runs the start of a session: reachability and liveness, dial,
// peer check and handshake, retrying a full listen backlog and "busy"
// answers until timeout. It returns the authenticated connection, welcome
// checked.
func connect(t *Ticket, timeout time.Duration, flags uint64, pre []byte) (*conn, transcript, error) {
	if err := checkBeforeDial(t); err != nil {
		return nil, transcript{}, err
	}
	bound, err := bindingFlag(t)
	if err != nil {
		return nil, transcript{}, err
	}
	flags |= bound
	digest, err := t.Digest()
	if err != nil {
		return nil, transcript{}, err
	}
	deadline := time.Now().Add(timeout)
	for backoff := time.Millisecond; ; backoff = min(2*backoff, 50*time.Millisecond) {
		c, err := dialConn(t, deadline, timeout)
		if err != nil {
			return nil, transcript{}, err
		}
		tr, err := handshake(c, t, digest, flags, pre)
		if err == nil {
			return c, tr, nil
		}
		_ = c.Close()
		if err != errBusy {
			return nil, transcript{}, err
		}
		if !time.Now().Add(backoff).Before(deadline) {
			return nil, transcript{}, WrapErr(EIO, err, "open: gave up after %v", timeout)
		}
		time.Sleep(backoff)
	}
}

// dialExporter connects to the ticket's address, retrying while the listen
// backlog is full (EAGAIN from a Unix connect), and checks with SO_PEERCRED
// who holds the socket (checkExporter).
func dialExporter(t *Ticket, deadline time.Time) (*net.UnixConn, error) {
	for backoff := 100 * time.Microsecond; ; backoff = min(2*backoff, 20*time.Millisecond) {
		d := net.Dialer{Deadline: deadline}
		nc, err := d.Dial("unix", t.Address)
		if err == nil {
			uc := nc.(*net.UnixConn)
			if err := checkExporter(uc, t); err != nil {
				_ = uc.Close()
				return nil, err
			}
			return uc, nil
		}
		full := errors.Is(err, syscall.EAGAIN)
		switch {
		case full && time.Now().Add(backoff).Before(deadline):
			time.Sleep(backoff)
			continue
		case full:
			return nil, &Error{Code: EIO, Msg: "open: the exporter's listen backlog stayed full until the timeout: it is serving its maximum of receivers at once and many more are waiting; raise timeout_ms", Err: err}
		case errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT):
			return nil, &Error{Code: EIO, Msg: "open: nothing listens at " + t.Address + ": " + nobodyListens(t, err), Err: err}
		default:
			return nil, &Error{Code: ioCode(err), Msg: "open: cannot connect to the exporter at " + t.Address, Err: err}
		}
	}
}

// dialConn is dialExporter with the socket framed as a receiver's conn.
func dialConn(t *Ticket, deadline time.Time, timeout time.Duration) (*conn, error) {
	uc, err := dialExporter(t, deadline)
	if err != nil {
		return nil, err
	}
	c, err := newConn(uc, timeout, "receiver")
	if err != nil {
		_ = uc.Close()
		return nil, err
	}
	return c, nil
}

// nobodyListens says why a connect found no listener at t's address.
func nobodyListens(t *Ticket, err error) string {
	switch {
	case strings.HasPrefix(t.Address, "@") && t.NS.netNS() == nsSame:
		return "the exporter closed its server or exited"
	case strings.HasPrefix(t.Address, "@"):
		return "the exporter closed its server or exited, or it is in another network namespace: abstract sockets do not cross network namespaces; set " + SocketDirEnv + " to a directory both sides mount"
	case errors.Is(err, syscall.ENOENT):
		return "no such socket file: the exporter closed its server, or this process does not see its socket directory (mount the same directory at the same path on both sides)"
	}
	return "the exporter exited or closed its server, leaving its socket file behind"
}

// checkExporter is the first filter before the handshake proves anything:
// the socket's owner must be our uid or root, and, where the ticket's pid
// means something here (the exporter's PID namespace), that pid. Across
// PID namespaces the kernel reports a pid of ours for the exporter, or 0
// when it cannot see it: no evidence either way, so only the uid, the
// exporter's lock (liveness.go) and the handshake decide.
func checkExporter(uc *net.UnixConn, t *Ticket) error {
	cred, err := peerCred(uc)
	if err != nil {
		return Errorf(EAUTH, "open: cannot read the exporter's credentials (SO_PEERCRED): %v", err)
	}
	if me := uint32(os.Getuid()); cred.Uid != me && cred.Uid != 0 && me != 0 {
		return Errorf(EAUTH, "open: the socket %s belongs to uid %d; only our own uid or root may export to us%s", t.Address, cred.Uid, overflowUIDNote(cred.Uid))
	}
	if t.NS.pidNS() == nsSame && uint32(cred.Pid) != t.Pid {
		return Errorf(EAUTH, "open: the socket %s belongs to pid %d, but the ticket was issued by pid %d; refusing to trust it (the exporter exited and another process took its address, or the ticket is forged)", t.Address, cred.Pid, t.Pid)
	}
	return nil
}

// bindingFlag says what this receiver's handshakes bind the connection by:
// the exporter's socket (no flag), or, without sock_diag, its own pid, which
// only the exporter's PID namespace can check (sockends.go).
func bindingFlag(t *Ticket) (uint64, error) {
	err := sockDiagWorks()
	switch {
	case err == nil:
		return 0, nil
	case CodeOf(err) == ENFILE:
		return 0, err
	case t.NS.pidNS() == nsOther:
		return 0, Errorf(EIO, "open: this process cannot ask the kernel which socket is its peer (NETLINK_SOCK_DIAG for unix sockets: %w), which the handshake needs across PID namespaces, and the exporter (pid %d in its own) is in another one; the kernel needs unix_diag (CONFIG_UNIX_DIAG; modprobe unix_diag), and a seccomp profile must allow netlink sockets", err, t.Pid)
	}
	return helloPidBound, nil
}

// handshake runs the receiver's half of handshake.go and checks the welcome.
func handshake(c *conn, t *Ticket, digest [32]byte, flags uint64, pre []byte) (transcript, error) {
	var tr transcript
	nr, err := newNonce()
	if err != nil {
		return tr, err
	}
	if pre != nil {
		if err := c.send(pre, -1); err != nil {
			return tr, pendingError(c, err)
		}
	}
	if err := c.send(helloMsg{RegID: t.RegID, Flags: flags, Nonce: nr}.encode(), -1); err != nil {
		// A server that refuses us at once hangs up after saying why:
		// read that rather than report a bare EPIPE.
		return tr, pendingError(c, err)
	}
	f, err := recvControl(c, "challenge")
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) || isTimeout(err) {
			return tr, Errorf(EIO, "open: connected, but the exporter did not answer within %v: it may be serving its maximum of receivers at once (the rest wait their turn), or be hung; raise timeout_ms if it is just busy", c.timeout)
		}
		return tr, err
	}
	ch, err := parseChallenge(f.Body)
	if err != nil {
		return tr, err
	}
	// The exporter has accepted the connection (it answered): its socket
	// is a socket now, with its inode and cookie.
	sock := uint64(os.Getpid())
	if flags&helloPidBound == 0 {
		sock, err = exporterSocket(c.raw, roleReceiver)
	}
	if errors.Is(err, errNoPeer) {
		return tr, pendingError(c, err) // evicted after the challenge: "busy"
	}
	if err != nil {
		return tr, WrapErr(EIO, err, "open")
	}
	tr = transcript{
		RegID: t.RegID, Flags: flags, Socket: sock,
		TicketDigest: digest, ReceiverNonce: nr, ServerNonce: ch.Nonce,
	}
	if !tr.verify(t.Secret, roleServer, ch.Proof) {
		return tr, Errorf(EAUTH, "open: the process at %s could not prove that it knows this ticket's secret for this connection: the ticket is corrupted or forged, or another process is impersonating the exporter or relaying to it; nothing was accepted from it", t.Address)
	}
	if err := c.send(proofMsg{Proof: tr.proof(t.Secret, roleReceiver)}.encode(), -1); err != nil {
		return tr, pendingError(c, err)
	}
	f, err = recvControl(c, "welcome")
	if err != nil {
		return tr, err
	}
	w, err := parseWelcome(f.Body)
	if err != nil {
		return tr, err
	}
	if w.Count != t.Count || w.Total != t.Total || w.Kind != t.Kind || w.BufferID != t.BufferID {
		return tr, Errorf(EINVAL, "protocol: the exporter describes %d chunks / %d bytes / kind %d / buffer %d, the ticket %d / %d / %d / %d", w.Count, w.Total, w.Kind, w.BufferID, t.Count, t.Total, t.Kind, t.BufferID)
	}
	return tr, nil
}

// recvControl receives a message of type want (no descriptor allowed),
// turning error and busy messages into errors.
func recvControl(c *conn, want string) (frame, error) {
	f, err := c.recv()
	if err != nil {
		return f, err
	}
	if f.FD >= 0 {
		closeFD(&f.FD)
		return f, Errorf(EINVAL, "protocol: the exporter sent a descriptor with its %s message", msgName(f.Type))
	}
	switch {
	case f.Type == msgError:
		return f, remoteError(f.Body)
	case f.Type == msgBusy:
		return f, errBusy
	case msgName(f.Type) != want:
		return f, Errorf(EINVAL, "protocol: expected %s, got %s", want, msgName(f.Type))
	}
	return f, nil
}

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// remoteError turns the server's error message into a local error.
func remoteError(body []byte) error {
	m, err := parseError(body)
	if err != nil {
		return err
	}
	return &Error{Code: m.Code, Msg: "exporter: " + m.Text}
}

// pendingError returns the exporter's queued error message if there is one,
// else fallback.
func pendingError(c *conn, fallback error) error {
	f, err := c.recv()
	if err != nil {
		return fallback
	}
	closeFD(&f.FD)
	switch f.Type {
	case msgError:
		return remoteError(f.Body)
	case msgBusy:
		return errBusy
	}
	return fallback
}

// Ticket returns the ticket the stream was opened with.
func (s *Stream) Ticket() *Ticket { return s.t }

// Next returns the next chunk, or End (as an *Error with Code End) once every
// chunk has arrived, at which point the use is consumed. After any other
// error the stream is broken and Next keeps returning that error.
func (s *Stream) Next() (Chunk, error) {
	r, err := s.advance(false)
	return r.Chunk, err
}

var errEnd = &Error{Code: End, Msg: "stream finished"}

// IsEnd reports whether err marks the end of a stream.
func IsEnd(err error) bool { return err == errEnd }

func (s *Stream) next() (Chunk, error) {
	count := s.t.Count
	if s.received == count {
		return Chunk{FD: -1}, s.finish()
	}
	// Top up the requests in flight once half the window has drained, so
	// the exporter never waits on us and requests go out in batches.
	if inFlight := s.requested - s.received; inFlight <= s.window/2 && s.requested < count {
		n := min(s.window-inFlight, count-s.requested)
		if sendErr := s.c.send(pullMsg{First: s.requested, Count: n}.encode(), -1); sendErr != nil {
			// The exporter may have hung up after telling us why: what it
			// sent before closing is still queued for us to read.
			if inFlight == 0 {
				return Chunk{FD: -1}, s.chunkErr(pendingError(s.c, sendErr))
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

// readDoneAck reads the done-ack and says whether the buffer lives on.
func readDoneAck(c *conn) (bool, error) {
	flags, err := readDoneAckFlags(c)
	return flags&ackBufferLives != 0, err
}

// readDoneAckFlags reads the done-ack and returns its flags.
func readDoneAckFlags(c *conn) (uint64, error) {
	f, err := recvControl(c, "done-ack")
	if err != nil {
		return 0, WrapErr(EIO, err, "waiting for the exporter to confirm")
	}
	ack, err := parseDoneAck(f.Body)
	if err != nil {
		return 0, err
	}
	return ack.Flags, nil
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
	case m.Size == 0 || m.Size > s.t.Total-s.offset || s.t.Total-s.offset-m.Size < s.t.Count-1-m.Index:
		// Every chunk holds at least one byte, those after this one too.
		return Errorf(EINVAL, "protocol: chunk %d of size %d does not fit the %d bytes left for %d chunks", m.Index, m.Size, s.t.Total-s.offset, s.t.Count-m.Index)
	case m.Index == s.t.Count-1 && m.Offset+m.Size != s.t.Total:
		return Errorf(EINVAL, "protocol: chunks end at %d, the ticket says %d", m.Offset+m.Size, s.t.Total)
	case m.FileOffset+m.Size < m.FileOffset:
		return Errorf(EINVAL, "protocol: chunk %d at file offset %d of %d bytes overflows", m.Index, m.FileOffset, m.Size)
	}
	return nil
}

// chunkErr prefixes an error with the chunk we were waiting for.
func (s *Stream) chunkErr(err error) error {
	return WrapErr(EIO, err, "chunk %d of %d", s.received, s.t.Count)
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
	var err error
	if !s.adopted.Load() { // else the connection is this process's holder session now
		err = s.c.Close()
	}
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return err
}

// confirm is a cache hit's whole session: authenticate with the confirm
// flag, which spends a use without sending anything; it reports whether the
// buffer lives on after the use.
func confirm(t *Ticket, timeout time.Duration) (bool, error) {
	c, _, err := connect(t, timeout, helloConfirm, nil)
	if err != nil {
		return false, err
	}
	defer c.Close()
	return readDoneAck(c)
}

// bufferStatus asks t's exporter which of the buffer ids are still live.
// The answer is unauthenticated: it only decides when to drop cached
// mappings early, never whether to use one.
func bufferStatus(t *Ticket, ids []uint64, timeout time.Duration) (map[uint64]bool, error) {
	if err := checkBeforeDial(t); err != nil {
		return nil, err
	}
	c, err := dialConn(t, time.Now().Add(timeout), timeout)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	out := make(map[uint64]bool, len(ids))
	for _, id := range ids {
		if err := c.send(statusMsg{BufferID: id}.encode(), -1); err != nil {
			return nil, err
		}
		f, err := recvControl(c, "status-ack")
		if err != nil {
			return nil, err
		}
		ack, err := parseStatusAck(f.Body)
		if err != nil {
			return nil, err
		}
		if ack.BufferID != id {
			return nil, Errorf(EINVAL, "protocol: status of buffer %d answered for buffer %d", id, ack.BufferID)
		}
		out[id] = ack.Alive
	}
	return out, nil
}
