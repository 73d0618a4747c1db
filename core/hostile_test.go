package core

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Hostile peers: each is refused with the right status, gets no descriptor,
// and costs the exporter nothing it does not give back.

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

// TestHostileReceiverSendsDescriptor: descriptors sent to the server, with
// the hello, with the proof or while streaming, are closed by it and the
// receiver refused.
func TestHostileReceiverSendsDescriptor(t *testing.T) {
	for _, tc := range []struct {
		name   string
		stage  int // 0: with the hello, 1: with the proof, 2: with the second pull
		chunks int
	}{
		{"with hello", 0, 0},
		{"with the proof", 1, 0},
		{"with a pull", 2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileSetup(t)
			file := newMemfd(t, 4096, pattern(4096, 1))
			var fd int
			var with []byte
			switch tc.stage {
			case 0:
				var err error
				if fd, err = rawDial(h.s.Addr()); err != nil {
					t.Fatal(err)
				}
				nr, _ := newNonce()
				with = helloMsg{RegID: h.tk.RegID, Nonce: nr}.encode()
			case 1:
				s, _ := rawHello(t, h.tk, 0)
				fd, with = s.fd, s.proof(h.tk.Secret)
			case 2:
				fd = rawAuthenticate(t, h.tk, 0)
				if err := rawWrite(fd, pullMsg{0, 1}.encode()); err != nil {
					t.Fatal(err)
				}
				time.Sleep(20 * time.Millisecond) // let the server act on it first
				with = pullMsg{1, 1}.encode()
			}
			if err := sendWithFDs(fd, with, []fdAttach{{0, 1}}, file); err != nil {
				t.Fatal(err)
			}
			unix.Close(file)
			_ = unix.Shutdown(fd, unix.SHUT_WR)
			msgs, r := readReply(t, fd)
			unix.Close(fd)
			expectRefused(t, msgs, r, EINVAL, "must not send descriptors", tc.chunks)
			for _, m := range msgs {
				if tc.stage < 2 && (m.Type == msgWelcome || m.Type == msgChunk) {
					t.Fatalf("a %s reached a receiver that sent a descriptor before authenticating", msgName(m.Type))
				}
			}
			h.check(t) // counts descriptors: the server closed the one we sent
		})
	}
}

// TestHostileSilentClient: clients that connect and never finish their
// handshake (silent, stopping after the hello, or dribbling a hello a byte
// at a time) do not hold up other receivers, and are dropped once the
// handshake deadline passes (counted from the connection, not per byte),
// without a word.
func TestHostileSilentClient(t *testing.T) {
	h := newHostileSetup(t)
	start := time.Now()
	silent, err := rawDial(h.s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	stalled, _ := rawHello(t, h.tk, 0) // challenged, never proves
	dribbler, err := rawDial(h.s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	dribbled := make(chan struct{})
	go func() {
		defer close(dribbled)
		nr, _ := newNonce()
		hello := helloMsg{RegID: h.tk.RegID, Nonce: nr}.encode()
		for _, b := range hello {
			if rawWrite(dribbler, []byte{b}) != nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
	}()

	importStart := time.Now()
	m, err := Import(h.tk, DeviceHost, ImportOptions{}, nil)
	took := time.Since(importStart)
	if err != nil {
		t.Fatalf("a receiver next to idle clients: %v", err)
	}
	if err := verifyAndUnmap(m, 5); err != nil {
		t.Fatal(err)
	}
	if took > handshakeTimeout/2 {
		t.Fatalf("a receiver next to idle clients took %v", took)
	}
	for _, c := range []struct {
		name string
		fd   int
	}{{"silent", silent}, {"stalled after its hello", stalled.fd}, {"dribbling", dribbler}} {
		r := rawReadAll(c.fd, 5*time.Second)
		d := time.Since(start)
		// Out of time before it proved anything: one "busy" (a libvmmipc
		// receiver would retry), no descriptor, then the close.
		msgs, perr := splitMessages(r.Data)
		if r.Err != nil || len(r.FDAt) != 0 || perr != nil || len(msgs) != 1 || msgs[0].Type != msgBusy {
			t.Fatalf("the %s client got %d bytes (%v, %v), %d descriptors, err %v; want one busy message, then the close", c.name, len(r.Data), msgs, perr, len(r.FDAt), r.Err)
		}
		if d > handshakeTimeout+promptly {
			t.Fatalf("the %s client was dropped after %v, handshake timeout %v", c.name, d, handshakeTimeout)
		}
		if d < handshakeTimeout-100*time.Millisecond {
			t.Fatalf("the %s client was dropped after %v, before the handshake timeout %v", c.name, d, handshakeTimeout)
		}
		unix.Close(c.fd)
	}
	<-dribbled
	ourFDs().waitFor(t, h.fdsBefore-1, "after the idle clients (and the only use)")
}

// TestHostileConnectionFlood opens 2000 connections to a sender process and
// holds them open. Its descriptor count must stay bounded (the server holds
// at most connLimit connections), no flooding connection gets a
// descriptor, and once the flood ends a legitimate receiver gets the whole
// buffer.
func TestHostileConnectionFlood(t *testing.T) {
	const flood = 2000
	sender := startHelper(t, partSender, helperOpts{})
	senderFDs := fdsOf(sender.pid())
	tk := sender.register(64, 4096, 1, -1, 3)
	base := senderFDs.settled(t)
	baseG := sender.goroutines(1 << 30)
	bound := base + maxConns + 8
	fdsBefore := ourFDs().settled(t)

	stopSampling := senderFDs.samplePeak()
	var conns []int
	for i := 0; i < flood; i++ {
		fd, err := rawDial(tk.Address)
		if err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		conns = append(conns, fd)
	}
	time.Sleep(100 * time.Millisecond) // let the server accept what it will
	most := stopSampling()
	if most > bound {
		t.Fatalf("the sender held %d descriptors during the flood, bound %d", most, bound)
	}
	for i, fd := range conns {
		var b [64]byte
		_ = unix.SetNonblock(fd, true)
		if _, oobn, _, _, err := unix.Recvmsg(fd, b[:], make([]byte, unix.CmsgSpace(4)), unix.MSG_CMSG_CLOEXEC); err == nil && oobn > 0 {
			t.Fatalf("flooding connection %d received a descriptor", i)
		}
		unix.Close(fd)
	}
	senderFDs.waitFor(t, base, "the sender, after the flood")
	if g := sender.goroutines(baseG); g > baseG {
		t.Fatalf("after the flood the sender runs %d goroutines, %d before", g, baseG)
	}
	m, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	if err != nil {
		t.Fatalf("a legitimate receiver after the flood: %v", err)
	}
	if err := verifyAndUnmap(m, 3); err != nil {
		t.Fatal(err)
	}
	ourFDs().waitFor(t, fdsBefore, "after the flood")
	t.Logf("%d connections: the sender peaked at %d descriptors (%d before, bound %d)", flood, most, base, bound)
}

// TestHostileForeignSocket: the ticket's address belongs to a process other
// than the ticket's pid. The receiver refuses it with EAUTH before saying
// anything (the listener reads 0 bytes), and takes no descriptor from it. A
// ticket whose pid no longer exists is refused at once, without connecting.
func TestHostileForeignSocket(t *testing.T) {
	addr := fmt.Sprintf("@vmmipc-test-foreign-%d-%d", os.Getpid(), randIndex(1<<30))
	l := startHelper(t, partImpostor, helperOpts{env: []string{envAddr + "=" + addr, envListenMode + "=count"}})
	l.expect("listening", faultTimeout)
	fdsBefore := ourFDs().settled(t)
	for _, pid := range []int{os.Getpid(), 1, os.Getppid()} {
		tk := ticketOf(t, pid, addr) // alive, with its true start time
		_, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: faultTimeout}}, nil)
		if CodeOf(err) != EAUTH || !strings.Contains(err.Error(), fmt.Sprintf("belongs to pid %d", l.pid())) {
			t.Fatalf("ticket claiming pid %d: got %v, want EAUTH", pid, err)
		}
		if n := l.expect("read ", faultTimeout); n != "0" {
			t.Fatalf("the receiver sent %s bytes (its hello?) to a socket it does not trust", n)
		}
	}
	tk := ticketOf(t, os.Getpid(), addr)
	tk.Pid = 1<<31 - 7 // above any pid_max: no such process
	start := time.Now()
	_, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: faultTimeout}}, nil)
	if CodeOf(err) != EIO || !strings.Contains(err.Error(), "has exited") || time.Since(start) > promptly {
		t.Fatalf("ticket of a pid that does not exist: got %v after %v, want EIO at once", err, time.Since(start))
	}
	if conns, _ := l.report(); conns != 3 {
		t.Fatalf("the listener saw %d connections, want the 3 refused by SO_PEERCRED and none for the dead pid", conns)
	}
	ourFDs().waitFor(t, fdsBefore, "after the foreign sockets")
}

// TestHostileSenderPushesDescriptor: a process that is the ticket's pid but
// speaks nonsense (a welcome with a descriptor attached, before any
// challenge): the receiver refuses it with EINVAL and closes the
// descriptor.
func TestHostileSenderPushesDescriptor(t *testing.T) {
	flushCache(t)
	addr := fmt.Sprintf("@vmmipc-test-pushfd-%d-%d", os.Getpid(), randIndex(1<<30))
	l := startHelper(t, partImpostor, helperOpts{env: []string{envAddr + "=" + addr, envListenMode + "=pushfd"}})
	l.expect("listening", faultTimeout)
	tk := ticketOf(t, l.pid(), addr)
	tk.Count, tk.Total = 1, 4096
	fdsBefore := ourFDs().settled(t)
	_, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: faultTimeout}}, nil)
	if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), "descriptor") {
		t.Fatalf("got %v, want EINVAL about a descriptor", err)
	}
	ourFDs().waitFor(t, fdsBefore, "after the exporter that pushed a descriptor")
	expectNoMemfdMappings(t, "after the exporter that pushed a descriptor")
}

// TestHostileOtherUID: a process of another uid holding a valid ticket is
// refused with EAUTH and receives no descriptor. Needs root to drop to
// uid/gid 65534.
func TestHostileOtherUID(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to start a helper as uid 65534; run the tests as root to cover this")
	}
	// The helper must be able to execute the test binary: copy it to a
	// directory anyone may read.
	dir, err := os.MkdirTemp("", "vmmipc-uid-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "core.test")
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	h := newHostileSetup(t)
	o := startHelper(t, partOpener, helperOpts{
		env:  []string{envTicket + "=" + ticketHex(t, h.tk), "TMPDIR=" + dir, "HOME=" + dir, "GOCACHE=off"},
		cred: &syscall.Credential{Uid: 65534, Gid: 65534}, bin: bin,
	})
	if got := o.expect("open ", faultTimeout); got != fmt.Sprintf("code=%d", EAUTH) {
		t.Fatalf("Open as uid 65534: %s, want code=%d", got, EAUTH)
	}
	if got := o.expect("raw ", faultTimeout); got != fmt.Sprintf("code=%d fds=0", EAUTH) {
		t.Fatalf("raw hello as uid 65534: %s, want code=%d fds=0", got, EAUTH)
	}
	h.check(t)
}

// TestHostileManyDescriptorsInOneMessage: a peer that attaches several
// descriptors to one message broke the protocol (EINVAL, not "out of
// descriptors"), and none of them stays open. Two still fit the control
// buffer; three overflow it (MSG_CTRUNC).
func TestHostileManyDescriptorsInOneMessage(t *testing.T) {
	for n := 2; n <= 5; n++ {
		t.Run(strconv.Itoa(n), func(t *testing.T) { testManyDescriptors(t, n) })
	}
}

func testManyDescriptors(t *testing.T, n int) {
	fdsBefore := ourFDs().settled(t)
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	file := newMemfd(t, 4096, pattern(4096, 1))
	msg := chunkMsg{Index: 0, Offset: 0, Size: 4096}.encode()
	if err := sendWithFDs(sp[1], msg, []fdAttach{{0, n}}, file); err != nil {
		t.Fatal(err)
	}
	unix.Close(file)
	c := socketConn(t, sp[0], "receiver")
	f, err := c.recv()
	c.Close()
	if CodeOf(err) != EINVAL || f.FD >= 0 {
		t.Fatalf("%d descriptors with one message: got %v (fd %d), want EINVAL", n, err, f.FD)
	}
	unix.Close(sp[1])
	ourFDs().waitFor(t, fdsBefore, "after a message with "+itoa(n)+" descriptors")
}
