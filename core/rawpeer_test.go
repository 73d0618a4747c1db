package core

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// A raw peer talks to a server through plain system calls, so a test sees
// exactly which bytes and which descriptors arrive, with nothing in between
// that could close or hide a descriptor.

// rawDial connects a blocking Unix stream socket to addr ("@name" or a path).
func rawDial(addr string) (int, error) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	sa := &unix.SockaddrUnix{Name: addr}
	if addr[0] == '@' {
		sa.Name = "\x00" + addr[1:]
	}
	if err := unix.Connect(fd, sa); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}

// rawWrite writes all of b (MSG_NOSIGNAL: a server that hung up is EPIPE).
func rawWrite(fd int, b []byte) error {
	for len(b) > 0 {
		n, err := unix.SendmsgN(fd, b, nil, nil, unix.MSG_NOSIGNAL)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// rawReply is everything a raw peer read until the other side closed.
type rawReply struct {
	Data      []byte
	FDAt      []int // byte offset in Data where each received descriptor arrived
	Truncated bool  // MSG_CTRUNC was seen
	Err       error // what ended the read other than a clean close (timeout...)
}

// rawReadAll reads until end of stream, or until timeout passes with the
// peer silent. It reads message by message, asking for exactly the bytes of
// the current header or body, so that a descriptor is seen with the read
// that starts at the byte it was attached to: FDAt is exact. Every
// descriptor received is recorded and closed at once.
func rawReadAll(fd int, timeout time.Duration) rawReply {
	var r rawReply
	tv := unix.NsecToTimeval(timeout.Nanoseconds())
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	for {
		start := len(r.Data)
		if !r.readN(fd, headerSize) {
			return r
		}
		n := int(binary.LittleEndian.Uint32(r.Data[start+8:]))
		if n > errorHead+maxErrorText {
			n = 64 << 10 // not a valid header: read the rest in lumps
		}
		if !r.readN(fd, n) {
			return r
		}
	}
}

// readN appends exactly n bytes to r.Data; false at end of stream or error.
func (r *rawReply) readN(fd int, n int) bool {
	buf := make([]byte, n)
	oob := make([]byte, unix.CmsgSpace(4*64))
	for got := 0; got < n; {
		k, oobn, flags, _, err := unix.Recvmsg(fd, buf[got:], oob, unix.MSG_CMSG_CLOEXEC)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			if !errors.Is(err, unix.ECONNRESET) {
				r.Err = err
			}
			r.Data = append(r.Data, buf[:got]...)
			return false
		}
		if flags&unix.MSG_CTRUNC != 0 {
			r.Truncated = true
		}
		if oobn > 0 {
			msgs, perr := unix.ParseSocketControlMessage(oob[:oobn])
			if perr != nil {
				r.Err = perr
			}
			for i := range msgs {
				fds, _ := unix.ParseUnixRights(&msgs[i])
				for _, f := range fds {
					r.FDAt = append(r.FDAt, len(r.Data)+got)
					unix.Close(f)
				}
			}
		}
		if k == 0 {
			r.Data = append(r.Data, buf[:got]...)
			return false
		}
		got += k
	}
	r.Data = append(r.Data, buf...)
	return true
}

// rawMsg is one message split out of a raw reply.
type rawMsg struct {
	At   int // byte offset of its header
	Type uint8
	Body []byte
}

// splitMessages cuts a server's byte stream into messages; it fails on
// anything that is not a well-formed sequence (a server must only ever send
// well-formed messages, whatever it was sent).
func splitMessages(b []byte) ([]rawMsg, error) {
	var out []rawMsg
	for at := 0; at < len(b); {
		if len(b)-at < headerSize {
			return out, fmt.Errorf("%d trailing bytes at %d are not a whole header", len(b)-at, at)
		}
		h, err := parseHeader(b[at : at+headerSize])
		if err != nil {
			return out, fmt.Errorf("at %d: %v", at, err)
		}
		end := at + headerSize + int(h.Len)
		if end > len(b) {
			return out, fmt.Errorf("%s message at %d cut short", msgName(h.Type), at)
		}
		out = append(out, rawMsg{At: at, Type: h.Type, Body: b[at+headerSize : end]})
		at = end
	}
	return out, nil
}

// checkFDsOnChunks fails unless every received descriptor arrived on the
// first byte of a chunk (or run) message, one per such message and none
// elsewhere.
func checkFDsOnChunks(msgs []rawMsg, fdAt []int) error {
	onChunk := map[int]bool{}
	for _, m := range msgs {
		if m.Type == msgChunk || m.Type == msgRun {
			onChunk[m.At] = true
		}
	}
	seen := map[int]bool{}
	for _, at := range fdAt {
		if !onChunk[at] {
			return fmt.Errorf("a descriptor arrived at byte %d, which is not the start of a chunk message", at)
		}
		if seen[at] {
			return fmt.Errorf("two descriptors arrived with the chunk message at byte %d", at)
		}
		seen[at] = true
	}
	if len(seen) != len(onChunk) {
		return fmt.Errorf("%d chunk messages but %d descriptors", len(onChunk), len(seen))
	}
	return nil
}

// lastError returns the error message a reply ends with, if any.
func lastError(msgs []rawMsg) (errorMsg, bool) {
	if len(msgs) == 0 || msgs[len(msgs)-1].Type != msgError {
		return errorMsg{}, false
	}
	m, err := parseError(msgs[len(msgs)-1].Body)
	return m, err == nil
}

// waitGoroutines waits up to 2 s for the goroutine count to drop to want.
func waitGoroutines(t testing.TB, want int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for runtime.NumGoroutine() > want && time.Now().Before(deadline) {
		time.Sleep(200 * time.Microsecond)
	}
	if got := runtime.NumGoroutine(); got > want {
		buf := make([]byte, 1<<16)
		buf = buf[:runtime.Stack(buf, true)]
		t.Fatalf("goroutines: %d alive, want at most %d\n%s", got, want, buf)
	}
}

// rawRecv reads exactly one message from fd, waiting at most timeout. It
// closes any descriptor that came with it and reports how many did.
func rawRecv(fd int, timeout time.Duration) (m rawMsg, descriptors int, err error) {
	var r rawReply
	tv := unix.NsecToTimeval(timeout.Nanoseconds())
	_ = unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	if !r.readN(fd, headerSize) {
		return m, len(r.FDAt), cmpOr(r.Err, io.ErrUnexpectedEOF)
	}
	h, err := parseHeader(r.Data)
	if err != nil {
		return m, len(r.FDAt), err
	}
	if !r.readN(fd, int(h.Len)) {
		return m, len(r.FDAt), cmpOr(r.Err, io.ErrUnexpectedEOF)
	}
	return rawMsg{Type: h.Type, Body: r.Data[headerSize:]}, len(r.FDAt), nil
}

func cmpOr(err, otherwise error) error {
	if err != nil {
		return err
	}
	return otherwise
}

// The receiver's side of the handshake (handshake.go) done by hand, so that
// a test can then send anything at all, or prove wrongly on purpose.

// rawSession is one raw connection to a server, after its hello.
type rawSession struct {
	fd        int
	tr        transcript // what both proofs cover, from both nonces
	challenge []byte     // the server's challenge message, as received
}

// rawHello connects to tk's exporter and sends a hello for tk with flags
// and a fresh nonce. It returns the server's answer: a challenge (then the
// session's transcript is complete and the server's proof checked out) or
// the refusal. The caller closes s.fd.
func rawHello(t testing.TB, tk *Ticket, flags uint64) (*rawSession, rawMsg) {
	t.Helper()
	fd, err := rawDial(tk.Address)
	if err != nil {
		t.Fatalf("dialing %s: %v", tk.Address, err)
	}
	s := &rawSession{fd: fd}
	if s.tr.ReceiverNonce, err = newNonce(); err != nil {
		t.Fatal(err)
	}
	if s.tr.TicketDigest, err = tk.Digest(); err != nil {
		t.Fatal(err)
	}
	s.tr.RegID, s.tr.Flags = tk.RegID, flags
	if err := rawWrite(fd, helloMsg{RegID: tk.RegID, Flags: flags, Nonce: s.tr.ReceiverNonce}.encode()); err != nil {
		t.Fatalf("sending hello: %v", err)
	}
	m, descriptors, err := rawRecv(fd, 5*time.Second)
	if err != nil {
		t.Fatalf("reading the answer to hello: %v", err)
	}
	if descriptors != 0 {
		t.Fatalf("the server sent %d descriptor(s) with its answer to a hello", descriptors)
	}
	if m.Type == msgChallenge {
		ch, err := parseChallenge(m.Body)
		if err != nil {
			t.Fatal(err)
		}
		s.tr.ServerNonce = ch.Nonce
		s.tr.Socket = uint64(os.Getpid())
		if flags&helloPidBound == 0 {
			if s.tr.Socket, err = exporterSocketOf(fd, roleReceiver); err != nil {
				t.Fatal(err)
			}
		}
		if !s.tr.verify(tk.Secret, roleServer, ch.Proof) {
			t.Fatal("the server's proof does not check out for a ticket it issued")
		}
		s.challenge = ch.encode()
	}
	return s, m
}

// proof is the receiver's proof for this session under secret.
func (s *rawSession) proof(secret Secret) []byte {
	return proofMsg{Proof: s.tr.proof(secret, roleReceiver)}.encode()
}

// rawAuthenticate runs the receiver's whole handshake for tk by hand and
// returns the connection, on which the server's next message is the
// welcome. The caller closes it.
func rawAuthenticate(t testing.TB, tk *Ticket, flags uint64) int {
	t.Helper()
	s, m := rawHello(t, tk, flags)
	if m.Type != msgChallenge {
		unix.Close(s.fd)
		t.Fatalf("hello for %s answered with %s, want a challenge", tk, describeMsg(m))
	}
	if err := rawWrite(s.fd, s.proof(tk.Secret)); err != nil {
		unix.Close(s.fd)
		t.Fatalf("sending the proof: %v", err)
	}
	return s.fd
}

// describeMsg names a message, with the text of an error.
func describeMsg(m rawMsg) string {
	if m.Type == msgError {
		if e, err := parseError(m.Body); err == nil {
			return fmt.Sprintf("error %v %q", e.Code, e.Text)
		}
	}
	return msgName(m.Type)
}

// containsSecret reports whether b holds any 8 consecutive bytes of the
// secret (random bytes: a chance match is 1 in 2^64 per position).
func containsSecret(b []byte, s Secret) bool {
	for i := 0; i+8 <= len(s); i++ {
		if bytes.Contains(b, s[i:i+8]) {
			return true
		}
	}
	return false
}

// recordingProxy relays connections between receivers and a server, bytes
// and descriptors alike, and records the bytes in each direction.
type recordingProxy struct {
	addr   string
	ln     *net.UnixListener
	relays sync.WaitGroup

	mu                   sync.Mutex
	toServer, toReceiver []byte
	fds                  int // descriptors relayed, both ways
}

func newRecordingProxy(t testing.TB, target string) *recordingProxy {
	t.Helper()
	p := &recordingProxy{addr: fmt.Sprintf("@vmmipc-test-proxy-%d-%d", os.Getpid(), randIndex(1<<30))}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: p.addr, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	p.ln = ln
	p.relays.Add(1)
	go func() {
		defer p.relays.Done()
		for {
			rc, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			sc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: target, Net: "unix"})
			if err != nil {
				rc.Close()
				continue
			}
			p.relays.Add(1)
			go func() {
				defer p.relays.Done()
				var both sync.WaitGroup
				both.Add(2)
				go func() { defer both.Done(); p.relay(rc, sc, &p.toServer) }()
				go func() { defer both.Done(); p.relay(sc, rc, &p.toReceiver) }()
				both.Wait()
				rc.Close()
				sc.Close()
			}()
		}
	}()
	t.Cleanup(func() { p.recorded(t) })
	return p
}

// proxyInFront puts a recording proxy in front of s: the tickets s issues
// from now on name the proxy's address, so receivers connect to it.
func proxyInFront(t testing.TB, s *Server) *recordingProxy {
	t.Helper()
	p := newRecordingProxy(t, s.Addr())
	s.reg.mu.Lock()
	s.reg.addr = p.addr
	s.reg.mu.Unlock()
	return p
}

// relay copies from one connection to the other until end of stream,
// descriptors included, then half-closes the other.
func (p *recordingProxy) relay(from, to *net.UnixConn, record *[]byte) {
	buf := make([]byte, 64<<10)
	oob := make([]byte, unix.CmsgSpace(4*8))
	for {
		n, oobn, _, _, err := from.ReadMsgUnix(buf, oob)
		var fds []int
		if oobn > 0 {
			if msgs, perr := unix.ParseSocketControlMessage(oob[:oobn]); perr == nil {
				for i := range msgs {
					got, _ := unix.ParseUnixRights(&msgs[i])
					fds = append(fds, got...)
				}
			}
		}
		if n > 0 {
			p.mu.Lock()
			*record = append(*record, buf[:n]...)
			p.fds += len(fds)
			p.mu.Unlock()
			var rights []byte
			if len(fds) > 0 {
				rights = unix.UnixRights(fds...)
			}
			for rest := buf[:n]; len(rest) > 0 && err == nil; rights = nil {
				var k int
				k, _, err = to.WriteMsgUnix(rest, rights, nil)
				rest = rest[k:]
			}
		}
		closeAll(fds)
		if err != nil || n == 0 {
			_ = to.CloseWrite()
			_ = from.CloseRead()
			return
		}
	}
}

// recorded stops the proxy, waits for every relay to end and returns what
// crossed it.
func (p *recordingProxy) recorded(t testing.TB) (toServer, toReceiver []byte) {
	p.ln.Close()
	done := make(chan struct{})
	go func() { p.relays.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a proxied connection is still open 10 s after the proxy was stopped")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.toServer, p.toReceiver
}

// descriptors is how many descriptors crossed the proxy.
func (p *recordingProxy) descriptors() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.fds
}
