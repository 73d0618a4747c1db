package core

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// conn frames messages over a Unix stream socket and carries at most one
// descriptor per message. It talks to the socket with sendmsg/recvmsg
// directly (through the runtime poller, so deadlines work) because the net
// package neither sends with MSG_NOSIGNAL (a vanished peer must be EPIPE, not
// a SIGPIPE that kills a host process whose SIGPIPE is at its default) nor
// checks MSG_CTRUNC.
type conn struct {
	uc       *net.UnixConn
	raw      syscall.RawConn
	timeout  time.Duration // per message; 0 = none
	deadline time.Time     // when set, for every message instead of timeout
	what     string        // "server" or "receiver", for messages
	queued   []byte        // messages that go out with the next send (queue)
}

// answerWait is how long a receiver waits for an answer in its own thread
// before it leaves the wait to the runtime's poller.
const answerWait = 2 * time.Millisecond

// pollHere waits up to answerWait (less if the deadline comes first) for s
// to be readable, blocked in poll(2) in this thread: the exporter's answer
// then wakes this thread directly, where the runtime's poller would take a
// wake-up of its own thread and a hand-over to this goroutine, each a
// scheduling delay of the host. Only receivers wait so (their caller waits
// anyway); a server's sessions wait on the poller, taking no thread.
func (c *conn) pollHere(s uintptr) bool {
	wait := answerWait
	if d := c.until(); !d.IsZero() {
		wait = min(wait, time.Until(d))
	}
	if wait <= 0 {
		return false
	}
	fds := []unix.PollFd{{Fd: int32(s), Events: unix.POLLIN}}
	ts := unix.NsecToTimespec(int64(wait))
	n, err := unix.Ppoll(fds, &ts, nil)
	return err == nil && n > 0
}

// queue keeps msg to go out with the next send, in one write: a one-round
// answer's proof, welcome and done-ack reach the receiver together
// (handshake.go). Nothing queued is sent if no send follows.
func (c *conn) queue(msg []byte) { c.queued = append(c.queued, msg...) }

// readable reports whether bytes wait to be read now (SIOCINQ; false if
// it cannot tell).
func (c *conn) readable() bool {
	n := 0
	err := c.raw.Control(func(s uintptr) {
		n, _ = unix.IoctlGetInt(int(s), unix.SIOCINQ)
	})
	return err == nil && n > 0
}

// until is the deadline of the next message; zero = none.
func (c *conn) until() time.Time {
	if !c.deadline.IsZero() {
		return c.deadline
	}
	if c.timeout > 0 {
		return time.Now().Add(c.timeout)
	}
	return time.Time{}
}

func newConn(uc *net.UnixConn, timeout time.Duration, what string) (*conn, error) {
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, Errorf(EIO, "socket: %w", err)
	}
	return &conn{uc: uc, raw: raw, timeout: timeout, what: what}, nil
}

func (c *conn) Close() error { return c.uc.Close() }

// send writes one message; if fd >= 0 it travels attached to the message's
// first byte, in the same sendmsg. The caller keeps ownership of fd.
func (c *conn) send(msg []byte, fd int) error {
	if q := c.queued; len(q) > 0 {
		c.queued = nil
		if fd >= 0 { // the descriptor must go with its own message's first byte
			if err := c.send(q, -1); err != nil {
				return err
			}
		} else {
			msg = append(q, msg...)
		}
	}
	deadline := c.until()
	_ = c.uc.SetWriteDeadline(deadline)
	var oob []byte
	if fd >= 0 {
		oob = unix.UnixRights(fd)
	}
	for backoff := 50 * time.Microsecond; ; backoff = min(2*backoff, 5*time.Millisecond) {
		var opErr error
		err := c.raw.Write(func(s uintptr) bool {
			for len(msg) > 0 {
				n, err := unix.SendmsgN(int(s), msg, oob, nil, unix.MSG_NOSIGNAL)
				switch {
				case err == unix.EINTR:
					continue
				case err == unix.EAGAIN:
					return false // wait until writable
				case err != nil:
					opErr = err
					return true
				}
				msg, oob = msg[n:], nil // the descriptor went with the first byte
			}
			return true
		})
		if err == nil {
			err = opErr
		}
		// ETOOMANYREFS: the kernel counts descriptors in flight in unix
		// sockets against the sending user's RLIMIT_NOFILE, so many
		// receivers with windows of descriptors queued can hit it. They
		// drain as receivers read: wait and retry rather than fail.
		if err == unix.ETOOMANYREFS && !deadline.IsZero() && time.Now().Before(deadline) {
			time.Sleep(backoff)
			continue
		}
		if err != nil {
			return c.ioError("sending to", err)
		}
		return nil
	}
}

// frame is one received message. fd is -1 unless a descriptor came with it;
// the receiver of a frame owns fd and must close it.
type frame struct {
	Type uint8
	Body []byte
	FD   int
}

// recv reads exactly one message. A descriptor may only arrive with the
// message's first bytes; a second descriptor, a truncated control message or
// one that arrives mid-body is a protocol error, and every descriptor seen is
// closed before returning it.
func (c *conn) recv() (frame, error) {
	f := frame{FD: -1}
	_ = c.uc.SetReadDeadline(c.until())
	var hdr [headerSize]byte
	if err := c.readFull(hdr[:], &f.FD, true); err != nil {
		closeFD(&f.FD)
		return f, err
	}
	h, err := parseHeader(hdr[:])
	if err != nil {
		closeFD(&f.FD)
		return f, err
	}
	f.Type = h.Type
	f.Body = make([]byte, h.Len)
	if err := c.readFull(f.Body, &f.FD, false); err != nil {
		closeFD(&f.FD)
		return f, err
	}
	return f, nil
}

// readFull fills b with recvmsg calls, collecting at most one descriptor
// into *fd (only while fdAllowed).
func (c *conn) readFull(b []byte, fd *int, fdAllowed bool) error {
	oob := make([]byte, unix.CmsgSpace(4))
	for got := 0; got < len(b); {
		var n, oobn, flags int
		var opErr error
		waited := false
		err := c.raw.Read(func(s uintptr) bool {
			for {
				n, oobn, flags, _, opErr = unix.Recvmsg(int(s), b[got:], oob, unix.MSG_CMSG_CLOEXEC)
				switch {
				case opErr == unix.EINTR:
					continue
				case opErr == unix.EAGAIN && c.what == "receiver" && !waited:
					waited = true
					if c.pollHere(s) {
						continue
					}
				}
				return opErr != unix.EAGAIN
			}
		})
		if err == nil {
			err = opErr
		}
		if err != nil {
			return c.ioError("receiving from", err)
		}
		fds, cerr := parseRights(oob[:oobn])
		if flags&unix.MSG_CTRUNC != 0 && len(fds) > 0 {
			// Some descriptors arrived and the rest did not fit: the peer
			// sent more than one (out of descriptors, none would arrive).
			closeAll(fds)
			return Errorf(EINVAL, "protocol: the %s sent more than one descriptor with a message (exactly one per chunk message allowed)", c.peer())
		}
		if flags&unix.MSG_CTRUNC != 0 {
			closeAll(fds)
			return Errorf(ENFILE, "%s: a descriptor was dropped by the kernel (MSG_CTRUNC): out of file descriptors? raise RLIMIT_NOFILE or close some", c.what)
		}
		if cerr != nil {
			closeAll(fds)
			return cerr
		}
		if len(fds) > 0 {
			if !fdAllowed || *fd >= 0 || len(fds) > 1 {
				closeAll(fds)
				return Errorf(EINVAL, "protocol: %d unexpected descriptor(s) from the %s (exactly one per chunk message allowed)", len(fds), c.peer())
			}
			*fd = fds[0]
		}
		if n == 0 {
			return c.ioError("receiving from", io.EOF)
		}
		got += n
		fdAllowed = false // a descriptor only rides on a message's first bytes
	}
	return nil
}

func (c *conn) peer() string {
	if c.what == "server" {
		return "receiver"
	}
	return "sender"
}

// ioError turns a socket error into EIO (or ENFILE), saying so when it was a
// timeout.
func (c *conn) ioError(op string, err error) error {
	if errors.Is(err, os.ErrDeadlineExceeded) {
		msg := fmt.Sprintf("%s: timed out after %v %s the %s (raise timeout_ms if it is just slow)", c.what, c.timeout, op, c.peer())
		if !c.deadline.IsZero() {
			msg = fmt.Sprintf("%s: timed out %s the %s: the handshake took too long", c.what, op, c.peer())
		}
		return &Error{Code: EIO, Msg: msg, inMsg: err} // errors.Is(err, os.ErrDeadlineExceeded) holds
	}
	if errors.Is(err, net.ErrClosed) { // our own side closed it (Stream.Close, a registration's end)
		return Errorf(EIO, "%s: the connection was closed on this side while %s the %s", c.what, op, c.peer())
	}
	if errors.Is(err, io.EOF) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
		if c.what == "receiver" { // an exporter that exits drops its receivers this way
			return Errorf(EIO, "%s: the %s closed the connection (it exited, or ended this registration)", c.what, c.peer())
		}
		return Errorf(EIO, "%s: the %s closed the connection", c.what, c.peer())
	}
	return &Error{Code: ioCode(err), Msg: fmt.Sprintf("%s: %s the %s", c.what, op, c.peer()), Err: err}
}

// parseRights extracts every SCM_RIGHTS descriptor from a control buffer.
// Non-rights messages are an error (we never ask for them).
func parseRights(oob []byte) ([]int, error) {
	if len(oob) == 0 {
		return nil, nil
	}
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, Errorf(EINVAL, "protocol: malformed control message: %w", err)
	}
	var fds []int
	var bad error
	for i := range msgs {
		got, err := unix.ParseUnixRights(&msgs[i])
		if err != nil {
			bad = Errorf(EINVAL, "protocol: unexpected control message (level %d type %d)", msgs[i].Header.Level, msgs[i].Header.Type)
			continue
		}
		fds = append(fds, got...)
	}
	return fds, bad
}

// peerCred returns the credentials of the process at the other end of uc,
// as the kernel recorded them at connect time.
func peerCred(uc *net.UnixConn) (*unix.Ucred, error) {
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, err
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(s uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(s), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, err
	}
	return cred, credErr
}
