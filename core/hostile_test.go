package core

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Hostile peers: each is refused with the right status, gets no descriptor,
// and costs the exporter nothing it does not give back. Here the setup and
// the messages of a session gone wrong (proofs, pulls, malformed bytes);
// descriptors where none belong in hostile_descriptors_test.go; silent,
// flooding, foreign and other-uid peers in hostile_peers_test.go.

// hostileSetup is an in-process server with a uses=1 registration of 8
// chunks; check() proves afterwards that the registration still serves a
// legitimate receiver in full and that no descriptor leaked.
type hostileSetup struct {
	s         *Server
	tk        *Ticket
	fdsBefore int
}

const hostileChunks = 8

func newHostileSetup(t *testing.T) *hostileSetup {
	t.Helper()
	s := newTestServer(t)
	fd := newMemfd(t, hostileChunks*4096, pattern(hostileChunks*4096, 5))
	tk := registerFile(t, s, fd, hostileChunks*4096, 4096, RegisterOptions{Uses: 1})
	unix.Close(fd)
	return &hostileSetup{s: s, tk: tk, fdsBefore: ourFDs().settled(t)}
}

// exchange sends msg on a connection (authenticated first, when authed),
// half-closes, and returns the server's messages and where descriptors
// arrived.
func (h *hostileSetup) exchange(t *testing.T, authed bool, msg []byte) ([]rawMsg, rawReply) {
	t.Helper()
	var fd int
	if authed {
		fd = rawAuthenticate(t, h.tk, 0)
	} else {
		var err error
		if fd, err = rawDial(h.s.Addr()); err != nil {
			t.Fatal(err)
		}
	}
	defer unix.Close(fd)
	_ = rawWrite(fd, msg)
	_ = unix.Shutdown(fd, unix.SHUT_WR)
	return readReply(t, fd)
}

// readReply reads a server's reply until it closes and checks that it is
// well formed, with descriptors only on chunk messages.
func readReply(t *testing.T, fd int) ([]rawMsg, rawReply) {
	t.Helper()
	r := rawReadAll(fd, 5*time.Second)
	if r.Err != nil {
		t.Fatalf("reading the server's answer: %v", r.Err)
	}
	msgs, err := splitMessages(r.Data)
	if err != nil {
		t.Fatalf("the server's answer is malformed: %v", err)
	}
	if err := checkFDsOnChunks(msgs, r.FDAt); err != nil {
		t.Fatal(err)
	}
	return msgs, r
}

// expectRefused checks that msgs ends with an error of code whose text
// contains want, after exactly chunks chunk messages.
func expectRefused(t *testing.T, msgs []rawMsg, r rawReply, code Code, want string, chunks int) {
	t.Helper()
	m, ok := lastError(msgs)
	if !ok {
		t.Fatalf("no error message; got %d messages", len(msgs))
	}
	if m.Code != code || !strings.Contains(m.Text, want) {
		t.Fatalf("refused with %v %q, want %v containing %q", m.Code, m.Text, code, want)
	}
	if len(r.FDAt) != chunks {
		t.Fatalf("%d descriptors arrived, want %d", len(r.FDAt), chunks)
	}
}

func (h *hostileSetup) check(t *testing.T) {
	t.Helper()
	ourFDs().waitFor(t, h.fdsBefore, "after the hostile peer")
	m, err := importRetry(h.tk)
	if err != nil {
		t.Fatalf("a legitimate receiver after the hostile one: %v", err)
	}
	if err := verifyAndUnmap(m, 5); err != nil {
		t.Fatal(err)
	}
	// The registration's descriptor is closed now that its use is spent.
	ourFDs().waitFor(t, h.fdsBefore-1, "after the legitimate receiver")
}

// TestHostileWrongProof: peers that cannot prove they know the secret get
// nothing but a refusal, and spend no use.
func TestHostileWrongProof(t *testing.T) {
	h := newHostileSetup(t)
	bad := h.tk.Secret
	bad[31] ^= 1
	// A proof under another secret.
	s, first := rawHello(t, h.tk, 0)
	if first.Type != msgChallenge {
		t.Fatalf("hello answered with %s", describeMsg(first))
	}
	_ = rawWrite(s.fd, cat(s.proof(bad), pullMsg{0, hostileChunks}.encode()))
	_ = unix.Shutdown(s.fd, unix.SHUT_WR)
	msgs, r := readReply(t, s.fd)
	unix.Close(s.fd)
	expectRefused(t, msgs, r, EAUTH, "does not check out", 0)
	if len(msgs) != 1 {
		t.Fatalf("the server sent %d messages to a client with a wrong proof", len(msgs))
	}
	// The server's own proof sent back as the receiver's (reflection).
	s, _ = rawHello(t, h.tk, 0)
	ch, _ := parseChallenge(s.challenge[headerSize:])
	_ = rawWrite(s.fd, proofMsg{Proof: ch.Proof}.encode())
	_ = unix.Shutdown(s.fd, unix.SHUT_WR)
	msgs, r = readReply(t, s.fd)
	unix.Close(s.fd)
	expectRefused(t, msgs, r, EAUTH, "does not check out", 0)
	// No proof at all: a pull right after the challenge.
	s, _ = rawHello(t, h.tk, 0)
	_ = rawWrite(s.fd, pullMsg{0, hostileChunks}.encode())
	_ = unix.Shutdown(s.fd, unix.SHUT_WR)
	msgs, r = readReply(t, s.fd)
	unix.Close(s.fd)
	expectRefused(t, msgs, r, EINVAL, "expected proof, got pull", 0)
	// An unknown registration is refused before any challenge.
	msgs, r = h.exchange(t, false, helloMsg{RegID: h.tk.RegID + 99}.encode())
	expectRefused(t, msgs, r, ENOENT, "unknown", 0)
	if len(msgs) != 1 {
		t.Fatalf("the server sent %d messages for an unknown registration", len(msgs))
	}
	// A receiver with a forged secret refuses the real server (whose proof
	// it cannot check) before sending anything but its hello.
	forged := *h.tk
	forged.Secret = bad
	if _, err := Open(&forged, OpenOptions{}); CodeOf(err) != EAUTH {
		t.Fatalf("Open with a wrong secret: %v, want EAUTH", err)
	}
	h.check(t)
}

func TestHostilePulls(t *testing.T) {
	for _, tc := range []struct {
		name   string
		after  []byte // sent after the handshake
		chunks int    // chunk descriptors before the refusal
		want   string
	}{
		{"skips chunk 0", pullMsg{1, 1}.encode(), 0, "out of order"},
		{"zero count", pullMsg{0, 0}.encode(), 0, "out of order or out of range"},
		{"past the end", pullMsg{0, hostileChunks + 1}.encode(), 0, "out of range"},
		{"index far out of range", pullMsg{1 << 63, 1}.encode(), 0, "out of range"},
		{"count wraps around", pullMsg{0, ^uint64(0)}.encode(), 0, "out of range"},
		{"asks again for chunk 0", cat(pullMsg{0, 2}.encode(), pullMsg{0, 1}.encode()), 2, "out of order"},
		{"goes back", cat(pullMsg{0, 3}.encode(), pullMsg{2, 1}.encode()), 3, "out of order"},
		{"done too early", cat(pullMsg{0, 3}.encode(), encodeMsg(msgDone, nil)), 3, "done after 3 of 8"},
		{"second hello", cat(pullMsg{0, 1}.encode(), helloMsg{}.encode()), 1, "unexpected hello"},
		{"second proof", cat(pullMsg{0, 1}.encode(), proofMsg{}.encode()), 1, "unexpected proof"},
		{"a status query", statusMsg{BufferID: 1}.encode(), 0, "unexpected status"},
		{"pull-run skips chunk 0", pullMsg{1, 1}.encodeRun(), 0, "pull-run of chunks [1, 1+1) out of order"},
		{"pull-run of zero", pullMsg{0, 0}.encodeRun(), 0, "out of order or out of range"},
		{"pull-run past the end", pullMsg{0, hostileChunks + 1}.encodeRun(), 0, "out of range"},
		{"pull-run wraps around", pullMsg{1 << 63, 1 << 63}.encodeRun(), 0, "out of range"},
		{"pull-run after a run", cat(pullMsg{0, 2}.encodeRun(), pullMsg{0, 1}.encodeRun()), 1, "out of order"},
		{"pull after a run", cat(pullMsg{0, 2}.encodeRun(), pullMsg{1, 1}.encode()), 1, "out of order"},
		{"done after a partial run", cat(pullMsg{0, 3}.encodeRun(), encodeMsg(msgDone, nil)), 1, "done after 3 of 8"},
		{"sends an error", errorMsg{Code: EIO, Text: "x"}.encode(), 0, "unexpected error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileSetup(t)
			msgs, r := h.exchange(t, true, tc.after)
			if msgs[0].Type != msgWelcome {
				t.Fatalf("first answer is %s, want welcome", msgName(msgs[0].Type))
			}
			expectRefused(t, msgs, r, EINVAL, tc.want, tc.chunks)
			h.check(t) // the broken stream gave its use back
		})
	}
}

func TestHostileMalformedMessages(t *testing.T) {
	hdr := func(b []byte, mutate func([]byte)) []byte {
		b = append([]byte(nil), b...)
		mutate(b)
		return b
	}
	for _, tc := range []struct {
		name string
		msg  []byte
		want string // "" = the server just closes (nothing whole arrived)
	}{
		{"truncated header", helloMsg{}.encode()[:7], ""},
		{"truncated body", helloMsg{}.encode()[:40], ""},
		{"empty", nil, ""},
		{"garbage", []byte("GET / HTTP/1.1\r\nHost: vmmipc\r\n\r\n"), "bad magic"},
		{"protocol 1", hdr(helloMsg{}.encode(), func(b []byte) { b[4] = 1 }), "version 1"},
		{"wrong version", hdr(helloMsg{}.encode(), func(b []byte) { b[4] = 9 }), "version 9"},
		{"reserved bits", hdr(helloMsg{}.encode(), func(b []byte) { b[13] = 1 }), "reserved"},
		{"oversized body", hdr(helloMsg{}.encode(), func(b []byte) { b[8], b[9] = 0, 0x40 }), "hello message body of 16384 bytes"},
		{"4 GiB body", hdr(helloMsg{}.encode(), func(b []byte) { b[8], b[9], b[10], b[11] = 0xff, 0xff, 0xff, 0xff }), "body of 4294967295 bytes"},
		{"short hello", hdr(helloMsg{}.encode()[:headerSize+helloSize-1], func(b []byte) { b[8] = helloSize - 1 }), fmt.Sprintf("hello message body of %d bytes", helloSize-1)},
		{"hello flags", helloMsg{Flags: 1 << 63}.encode(), "flags"},
		{"pull first", pullMsg{0, 1}.encode(), "expected hello, got pull"},
		{"proof first", proofMsg{}.encode(), "expected hello, got proof"},
		{"unknown type", hdr(encodeMsg(msgDone, nil), func(b []byte) { b[5] = 42 }), "unknown message type 42"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileSetup(t)
			msgs, r := h.exchange(t, false, tc.msg)
			if tc.want == "" {
				if len(msgs) != 0 || len(r.FDAt) != 0 {
					t.Fatalf("got %d messages and %d descriptors for a message cut short", len(msgs), len(r.FDAt))
				}
			} else {
				expectRefused(t, msgs, r, EINVAL, tc.want, 0)
			}
			h.check(t)
		})
	}
}
