package core

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"runtime"
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
// first byte of a chunk (or run) message, or of a table message that says
// it has one, one per such message and none elsewhere.
func checkFDsOnChunks(msgs []rawMsg, fdAt []int) error {
	onChunk := map[int]bool{}
	for _, m := range msgs {
		if m.Type == msgChunk || m.Type == msgRun {
			onChunk[m.At] = true
		}
		if tm, err := parseTable(m.Body); m.Type == msgTable && err == nil && tm.Slots != 0 {
			onChunk[m.At] = true // the grant table's one read-only descriptor
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

// describeMsg names a message, with the text of an error.
func describeMsg(m rawMsg) string {
	if m.Type == msgError {
		if e, err := parseError(m.Body); err == nil {
			return fmt.Sprintf("error %v %q", e.Code, e.Text)
		}
	}
	return msgName(m.Type)
}
