package core

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Who is at the other end: clients that never finish their handshake, a
// flood of connections, a socket of another process than the ticket's, a
// process of another uid. Each is refused or dropped, and the exporter
// still serves legitimate receivers.

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
