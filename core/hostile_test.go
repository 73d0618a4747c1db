package core

import (
	"fmt"
	"net"
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
	fd, err := patternMemfd(hostileChunks*4096, 5)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	sizes, _ := FileChunks(fd, hostileChunks*4096, 4096)
	tk, err := s.Register(sizes, &FileExporter{FD: fd, ChunkSize: 4096}, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	return &hostileSetup{s: s, tk: tk, fdsBefore: settledFDs(t)}
}

// exchange sends msg on a fresh raw connection, half-closes, and returns the
// server's messages and where descriptors arrived.
func (h *hostileSetup) exchange(t *testing.T, msg []byte) ([]rawMsg, rawReply) {
	t.Helper()
	fd, err := rawDial(h.s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	_ = rawWrite(fd, msg)
	_ = unix.Shutdown(fd, unix.SHUT_WR)
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
	waitFDs(t, h.fdsBefore)
	m, err := importRetry(h.tk)
	if err != nil {
		t.Fatalf("a legitimate receiver after the hostile one: %v", err)
	}
	verr := verifyMapping(m, 5)
	if err := Unmap(m.ID, m.Base); err != nil {
		t.Fatal(err)
	}
	if verr != nil {
		t.Fatal(verr)
	}
	waitFDs(t, h.fdsBefore) // the server closes its end of our stream too
}

func (h *hostileSetup) hello() []byte {
	return helloMsg{RegID: h.tk.RegID, Secret: h.tk.Secret}.encode()
}

func cat(bs ...[]byte) []byte {
	var out []byte
	for _, b := range bs {
		out = append(out, b...)
	}
	return out
}

func TestHostileWrongSecret(t *testing.T) {
	h := newHostileSetup(t)
	bad := h.tk.Secret
	bad[31] ^= 1
	msgs, r := h.exchange(t, cat(helloMsg{RegID: h.tk.RegID, Secret: bad}.encode(), pullMsg{0, hostileChunks}.encode()))
	expectRefused(t, msgs, r, EAUTH, "wrong secret", 0)
	if len(msgs) != 1 {
		t.Fatalf("the server sent %d messages to a client with a wrong secret", len(msgs))
	}
	msgs, r = h.exchange(t, helloMsg{RegID: h.tk.RegID + 99, Secret: h.tk.Secret}.encode())
	expectRefused(t, msgs, r, ENOENT, "unknown", 0)
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
		after  []byte // sent after a valid hello
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
		{"sends an error", errorMsg{Code: EIO, Text: "x"}.encode(), 0, "unexpected error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileSetup(t)
			msgs, r := h.exchange(t, cat(h.hello(), tc.after))
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
		{"wrong version", hdr(helloMsg{}.encode(), func(b []byte) { b[4] = 9 }), "version 9"},
		{"reserved bits", hdr(helloMsg{}.encode(), func(b []byte) { b[13] = 1 }), "reserved"},
		{"oversized body", hdr(helloMsg{}.encode(), func(b []byte) { b[8], b[9] = 0, 0x40 }), "hello message body of 16384 bytes"},
		{"4 GiB body", hdr(helloMsg{}.encode(), func(b []byte) { b[8], b[9], b[10], b[11] = 0xff, 0xff, 0xff, 0xff }), "body of 4294967295 bytes"},
		{"short hello", hdr(helloMsg{}.encode()[:headerSize+47], func(b []byte) { b[8] = 47 }), "hello message body of 47 bytes"},
		{"hello flags", helloMsg{Flags: 1}.encode(), "flags"},
		{"pull first", pullMsg{0, 1}.encode(), "expected hello, got pull"},
		{"unknown type", hdr(encodeMsg(msgDone, nil), func(b []byte) { b[5] = 42 }), "unknown message type 42"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileSetup(t)
			msgs, r := h.exchange(t, tc.msg)
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
// the hello or while streaming, are closed by it and the receiver refused.
func TestHostileReceiverSendsDescriptor(t *testing.T) {
	for _, tc := range []struct {
		name   string
		before []byte // sent plain first
		with   []byte // sent with the descriptors attached
		chunks int
	}{
		{"with hello", nil, nil, 0},
		{"with a pull", pullMsg{0, 1}.encode(), pullMsg{1, 1}.encode(), 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHostileSetup(t)
			fd, err := rawDial(h.s.Addr())
			if err != nil {
				t.Fatal(err)
			}
			file, err := patternMemfd(4096, 1)
			if err != nil {
				t.Fatal(err)
			}
			first, with := h.hello(), tc.with
			if tc.before != nil {
				first = cat(h.hello(), tc.before)
			} else {
				first, with = nil, h.hello()
			}
			if err := rawWrite(fd, first); err != nil {
				t.Fatal(err)
			}
			if tc.before != nil {
				time.Sleep(20 * time.Millisecond) // let the server act on it first
			}
			if err := sendWithFDs(fd, with, []fdAttach{{0, 1}}, file); err != nil {
				t.Fatal(err)
			}
			unix.Close(file)
			_ = unix.Shutdown(fd, unix.SHUT_WR)
			r := rawReadAll(fd, 5*time.Second)
			msgs, err := splitMessages(r.Data)
			if err != nil {
				t.Fatal(err)
			}
			if err := checkFDsOnChunks(msgs, r.FDAt); err != nil {
				t.Fatal(err)
			}
			expectRefused(t, msgs, r, EINVAL, "must not send descriptors", tc.chunks)
			unix.Close(fd)
			h.check(t) // counts descriptors: the server closed the one we sent
		})
	}
}

// TestHostileSilentClient: a client that connects and never speaks does not
// hold up other receivers, and is dropped after the hello timeout.
func TestHostileSilentClient(t *testing.T) {
	saved := helloTimeout
	helloTimeout = 2 * time.Second
	h := newHostileSetup(t)
	defer func() {
		// Restore only once no serve goroutine is left to read it (s.mu
		// orders their exit before our write).
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) {
			h.s.mu.Lock()
			n := h.s.conns
			h.s.mu.Unlock()
			if n == 0 {
				break
			}
			time.Sleep(time.Millisecond)
		}
		helloTimeout = saved
	}()
	silent, err := rawDial(h.s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	m, err := ImportStream(h.tk, &HostImporter{}, -1, OpenOptions{})
	if err != nil {
		t.Fatalf("a receiver next to a silent client: %v", err)
	}
	took := time.Since(start)
	verr := verifyMapping(m, 5)
	Unmap(m.ID, m.Base)
	if verr != nil {
		t.Fatal(verr)
	}
	if took > helloTimeout/2 {
		t.Fatalf("a receiver next to a silent client took %v", took)
	}
	r := rawReadAll(silent, 5*time.Second)
	if r.Err != nil || len(r.FDAt) != 0 || len(r.Data) != 0 {
		t.Fatalf("the silent client got %d bytes, %d descriptors, err %v; want a plain close", len(r.Data), len(r.FDAt), r.Err)
	}
	if d := time.Since(start); d > helloTimeout+promptly {
		t.Fatalf("the silent client was dropped after %v, hello timeout %v", d, helloTimeout)
	}
	unix.Close(silent)
	waitFDs(t, h.fdsBefore)
}

// TestHostileConnectionFlood opens 2000 connections to a sender process and
// holds them open. Its descriptor count must stay bounded (the server
// refuses connections beyond maxConns), and once the flood ends a
// legitimate receiver gets the whole buffer.
func TestHostileConnectionFlood(t *testing.T) {
	const flood = 2000
	sender := startHelper(t, roleSender, nil, nil, "")
	tk := sender.register(64, 4096, 1, -1, 3)
	base := procFDs(t, sender.pid())
	baseG := sender.goroutines(1 << 30)
	bound := base + maxConns + 8
	fdsBefore := settledFDs(t)

	stopSampling := samplePeakFDs(sender.pid())
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
	for _, fd := range conns {
		unix.Close(fd)
	}
	if got := waitProcFDs(t, sender.pid(), base); got > base {
		t.Fatalf("after the flood the sender holds %d descriptors, %d before", got, base)
	}
	if g := sender.goroutines(baseG); g > baseG {
		t.Fatalf("after the flood the sender runs %d goroutines, %d before", g, baseG)
	}
	m, err := ImportStream(tk, &HostImporter{}, -1, OpenOptions{})
	if err != nil {
		t.Fatalf("a legitimate receiver after the flood: %v", err)
	}
	verr := verifyMapping(m, 3)
	Unmap(m.ID, m.Base)
	if verr != nil {
		t.Fatal(verr)
	}
	waitFDs(t, fdsBefore)
	t.Logf("%d connections: the sender peaked at %d descriptors (%d before, bound %d)", flood, most, base, bound)
}

// TestHostileForeignSocket: the ticket's address belongs to a process other
// than the ticket's pid. The receiver refuses it with EAUTH before saying
// anything (the listener reads 0 bytes), and takes no descriptor from it.
func TestHostileForeignSocket(t *testing.T) {
	addr := fmt.Sprintf("@vmmipc-test-foreign-%d-%d", os.Getpid(), randIndex(1<<30))
	l := startHelper(t, roleListener, []string{"VMMIPC_TEST_ADDR=" + addr, "VMMIPC_TEST_LISTEN_MODE=count"}, nil, "")
	l.expect("listening", faultTimeout)
	fdsBefore := settledFDs(t)
	for _, pid := range []uint32{uint32(os.Getpid()), 1, uint32(l.pid()) + 1} {
		tk := sampleTicket()
		tk.Address, tk.Pid = addr, pid
		_, err := ImportStream(tk, &HostImporter{}, -1, OpenOptions{Timeout: faultTimeout})
		if CodeOf(err) != EAUTH || !strings.Contains(err.Error(), fmt.Sprintf("belongs to pid %d", l.pid())) {
			t.Fatalf("ticket claiming pid %d: got %v, want EAUTH", pid, err)
		}
		if n := l.expect("read ", faultTimeout); n != "0" {
			t.Fatalf("the receiver sent %s bytes (its hello?) to a socket it does not trust", n)
		}
	}
	waitFDs(t, fdsBefore)
}

// TestHostileSenderPushesDescriptor: a process that is the ticket's pid but
// speaks nonsense (a welcome with a descriptor attached): the receiver
// refuses it with EINVAL and closes the descriptor.
func TestHostileSenderPushesDescriptor(t *testing.T) {
	addr := fmt.Sprintf("@vmmipc-test-pushfd-%d-%d", os.Getpid(), randIndex(1<<30))
	l := startHelper(t, roleListener, []string{"VMMIPC_TEST_ADDR=" + addr, "VMMIPC_TEST_LISTEN_MODE=pushfd"}, nil, "")
	l.expect("listening", faultTimeout)
	tk := sampleTicket()
	tk.Address, tk.Pid, tk.Count, tk.Total = addr, uint32(l.pid()), 1, 4096
	fdsBefore := settledFDs(t)
	_, err := ImportStream(tk, &HostImporter{}, -1, OpenOptions{Timeout: faultTimeout})
	if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), "descriptor") {
		t.Fatalf("got %v, want EINVAL about a descriptor", err)
	}
	waitFDs(t, fdsBefore)
	checkRangeUnmapped(t, 0, 0)
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
	bin := filepath.Join(dir, "core.test")
	data, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}
	h := newHostileSetup(t)
	o := startHelper(t, roleOpener, []string{"VMMIPC_TEST_TICKET=" + ticketHex(t, h.tk), "TMPDIR=" + dir, "HOME=" + dir, "GOCACHE=off"},
		&syscall.Credential{Uid: 65534, Gid: 65534}, bin)
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
	fdsBefore := settledFDs(t)
	sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	file, err := patternMemfd(4096, 1)
	if err != nil {
		t.Fatal(err)
	}
	msg := chunkMsg{Index: 0, Offset: 0, Size: 4096}.encode()
	if err := sendWithFDs(sp[1], msg, []fdAttach{{0, n}}, file); err != nil {
		t.Fatal(err)
	}
	unix.Close(file)
	osf := os.NewFile(uintptr(sp[0]), "two-fds")
	nc, err := net.FileConn(osf)
	osf.Close()
	if err != nil {
		t.Fatal(err)
	}
	c, err := newConn(nc.(*net.UnixConn), time.Second, "receiver")
	if err != nil {
		t.Fatal(err)
	}
	f, err := c.recv()
	c.Close()
	if CodeOf(err) != EINVAL || f.FD >= 0 {
		t.Fatalf("%d descriptors with one message: got %v (fd %d), want EINVAL", n, err, f.FD)
	}
	unix.Close(sp[1])
	waitFDs(t, fdsBefore)
}
