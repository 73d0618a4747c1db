package core

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestHostFileRoundTrip(t *testing.T) {
	s := newTestServer(t)
	const chunks = 4096
	size := chunks * int(pageSize)
	fd := newMemfd(t, size, pattern(size, 7))
	defer unix.Close(fd)
	var released atomic.Int32
	before := ourFDs().settled(t)
	tk := registerFile(t, s, fd, uint64(size), pageSize, RegisterOptions{Uses: 1, OnRelease: func() { released.Add(1) }})
	// One duplicate of the memfd, whatever the chunk count; nothing else.
	if got := ourFDs().settled(t); got != before+1 {
		t.Fatalf("registering %d chunks opened %d descriptors, want 1 (the library's duplicate of the memfd)", chunks, got-before)
	}
	raw, _ := tk.Marshal()
	tk2, err := DecodeTicket(raw[:])
	if err != nil {
		t.Fatal(err)
	}
	m := importHost(t, tk2, ImportOptions{OpenOptions: OpenOptions{Window: 8}})
	got := bytesAt(m.Base, m.Size)
	want := make([]byte, size)
	if _, err := unix.Pread(fd, want, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("imported bytes differ")
	}
	got[12345] ^= 0xff // shared: the sender's file sees the write
	var b [1]byte
	unix.Pread(fd, b[:], 12345)
	if b[0] != got[12345] {
		t.Fatal("write through the mapping not visible in the file")
	}
	if err := Unmap(m.ID, m.Base); err != nil {
		t.Fatal(err)
	}
	if err := Unmap(m.ID, m.Base); CodeOf(err) != EINVAL {
		t.Fatalf("second unmap: %v", err)
	}
	if !waitUntil(5*time.Second, func() bool { return released.Load() != 0 }) || released.Load() != 1 {
		t.Fatalf("release ran %d times", released.Load())
	}
	ourFDs().waitFor(t, before, "after the only use, the library's duplicate of the memfd")
	// Used up: a second receiver is refused.
	if _, err := Open(tk2, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "used up") {
		t.Fatalf("second use: %v", err)
	}
}

// TestExportFailureNamesChunk: whatever made a chunk's export fail (the
// exporter's own status, a descriptor limit, the driver), the receiver gets
// EEXPORT naming the chunk and the cause, never the cause's status, which
// would read as its own trouble (ENFILE) or as none the call lists (ECUDA).
func TestExportFailureNamesChunk(t *testing.T) {
	s := newTestServer(t)
	for _, cause := range []error{
		Errorf(EEXPORT, "injected failure"),
		&Error{Code: ioCode(unix.EMFILE), Msg: "duplicating the registered file", Err: unix.EMFILE}, // FileExporter at its limit
		Errorf(ECUDA, "cuCtxPushCurrent failed"),
	} {
		fd := newMemfd(t, 64*int(pageSize), pattern(64*int(pageSize), 1))
		spec := hookedFile(t, fd, 64*pageSize, pageSize, func(i uint64) error {
			if i == 17 {
				return cause
			}
			return nil
		})
		unix.Close(fd)
		tk, err := s.Register(spec, RegisterOptions{Uses: 1})
		if err != nil {
			t.Fatal(err)
		}
		before := ourFDs().settled(t)
		_, err = Import(tk, DeviceHost, ImportOptions{}, nil)
		if CodeOf(err) != EEXPORT || !strings.Contains(err.Error(), "chunk 17 of 64") ||
			!strings.Contains(err.Error(), cause.Error()) {
			t.Fatalf("an export failing with %q: got %v (%s), want EEXPORT naming the chunk and the cause", cause, err, CodeOf(err))
		}
		ourFDs().waitFor(t, before, "after the failed import") // the in-process server closes its end asynchronously
		// The failed stream gave its use back.
		st, err := Open(tk, OpenOptions{})
		if err != nil {
			t.Fatalf("use not given back: %v", err)
		}
		st.Close()
		if err := s.Unregister(tk); err != nil {
			t.Fatal(err)
		}
	}
}

func TestWrongSecretAndUnregister(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), pattern(int(pageSize), 1))
	defer unix.Close(fd)
	var released atomic.Int32
	tk := registerFile(t, s, fd, pageSize, pageSize, RegisterOptions{OnRelease: func() { released.Add(1) }})
	bad := *tk
	bad.Secret[3] ^= 1
	if _, err := Open(&bad, OpenOptions{}); CodeOf(err) != EAUTH || !strings.Contains(err.Error(), "could not prove") {
		t.Fatalf("wrong secret: %v", err)
	}
	if err := s.Unregister(&bad); CodeOf(err) != EAUTH {
		t.Fatalf("unregister with a wrong secret: %v, want EAUTH", err)
	}
	if err := s.Unregister(tk); err != nil {
		t.Fatal(err)
	}
	if released.Load() != 1 {
		t.Fatal("release did not run on unregister")
	}
	if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "unregistered") {
		t.Fatalf("after unregister: %v", err)
	}
	if err := s.Unregister(tk); CodeOf(err) != ENOENT {
		t.Fatalf("second unregister: %v, want ENOENT", err)
	}
}

func TestTTLExpires(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), pattern(int(pageSize), 1))
	defer unix.Close(fd)
	released := make(chan struct{})
	tk := registerFile(t, s, fd, pageSize, pageSize, RegisterOptions{TTL: 20 * time.Millisecond, OnRelease: func() { close(released) }})
	select {
	case <-released:
	case <-time.After(5 * time.Second):
		t.Fatal("ttl did not release")
	}
	if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("after ttl: %v", err)
	}
}

// TestLiveMany: one call tells which tickets name live registrations of
// this server, byte for byte as issued; everything else is not live.
func TestLiveMany(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), pattern(int(pageSize), 1))
	defer unix.Close(fd)
	anchor := registerFile(t, s, fd, pageSize, pageSize, RegisterOptions{})
	grant := func(o RegisterOptions) *Ticket {
		g, err := s.RegisterAgain(anchor, o)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	live, used, unregistered, expired := grant(RegisterOptions{Uses: 1}), grant(RegisterOptions{Uses: 1}),
		grant(RegisterOptions{Uses: 1}), grant(RegisterOptions{Uses: 1, TTL: time.Millisecond})
	r := importHost(t, used, ImportOptions{NoCache: true})
	if err := Unmap(r.ID, r.Base); err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(unregistered); err != nil {
		t.Fatal(err)
	}
	wrongSecret, otherBytes := *live, *live
	wrongSecret.Secret[0] ^= 1
	otherBytes.Total++
	other := registerFile(t, newTestServer(t), fd, pageSize, pageSize, RegisterOptions{})
	ts := []*Ticket{anchor, live, used, unregistered, expired, &wrongSecret, &otherBytes, other, nil}
	want := []bool{true, true, false, false, false, false, false, false, false}
	if !waitUntil(5*time.Second, func() bool { return slices.Equal(s.LiveMany(ts), want) }) {
		t.Fatalf("live: %v, want %v (anchor, live, used, unregistered, expired, wrong secret, other bytes, another server's, nil)",
			s.LiveMany(ts), want)
	}
	// An ended anchor's grants live on.
	if err := s.Unregister(anchor); err != nil {
		t.Fatal(err)
	}
	if got := s.LiveMany([]*Ticket{anchor, live}); !slices.Equal(got, []bool{false, true}) {
		t.Fatalf("after the anchor ended: %v, want [false true]", got)
	}
}

// TestUseSpentWhenAllSent: a receiver that pulls every chunk and hangs up
// without saying done has still used the registration up; one that hangs up
// earlier gives its use back.
func TestUseSpentWhenAllSent(t *testing.T) {
	s := newTestServer(t)
	const chunks = 8
	fd := newMemfd(t, chunks*int(pageSize), pattern(chunks*int(pageSize), 3))
	defer unix.Close(fd)
	released := make(chan struct{})
	tk := registerFile(t, s, fd, chunks*pageSize, pageSize, RegisterOptions{Uses: 1, OnRelease: func() { close(released) }})
	// Early hang-up, window 1: only the first chunk was sent. Use given back.
	st, err := Open(tk, OpenOptions{Window: 1})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := st.Next()
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	st.Close()
	// Every chunk pulled, then a hang-up without done: the use is spent.
	st, err = Open(tk, OpenOptions{Window: 1})
	if err != nil {
		t.Fatalf("early hang-up did not give the use back: %v", err)
	}
	for range chunks {
		ch, err := st.Next()
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ch.FD)
	}
	st.Close()
	select {
	case <-released:
	case <-time.After(5 * time.Second):
		t.Fatal("registration not released after every chunk was sent")
	}
	if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("third receiver: %v, want ENOENT", err)
	}
}

// TestSecretNeverCrossesTheSocket relays a whole import through a proxy
// that records every byte in both directions: the import succeeds, and the
// secret appears nowhere in what crossed (protocol 1 sent it in the hello).
// The handshake binds the connection's sockets, so a relay fails it
// (TestRelayRefused): the helper that records runs with that binding off.
func TestSecretNeverCrossesTheSocket(t *testing.T) {
	h := startHelper(t, partRelayRecord, helperOpts{})
	f := strings.Fields(h.expect("recorded ", faultTimeout))
	if len(f) != 3 {
		t.Fatalf("the recording helper said %q", f)
	}
	var b [3][]byte
	for i := range b {
		var err error
		if b[i], err = hex.DecodeString(f[i]); err != nil {
			t.Fatal(err)
		}
	}
	toServer, toReceiver, secret := b[0], b[1], Secret(b[2])
	msgs, err := splitMessages(toServer)
	if err != nil || len(msgs) < 3 || msgs[0].Type != msgHello || msgs[1].Type != msgProof {
		t.Fatalf("the receiver's side of the session: %d messages, %v", len(msgs), err)
	}
	if m, err := splitMessages(toReceiver); err != nil || len(m) < 3 || m[len(m)-1].Type != msgDoneAck {
		t.Fatalf("the exporter's side of the session: %d messages, %v", len(m), err)
	}
	if containsSecret(toServer, secret) || containsSecret(toReceiver, secret) {
		t.Fatal("the ticket's secret crossed the socket")
	}
	t.Logf("%d bytes to the server, %d to the receiver, no 8 bytes of the secret among them", len(toServer), len(toReceiver))
}

// helperRelayRecord imports a registration of its own server through a
// recording proxy, with the handshake's socket binding off (set before any
// goroutine of the library runs), and reports "recorded <hex to the
// server> <hex to the receiver> <hex secret>".
func helperRelayRecord(t *testing.T, out *lineWriter) error {
	exporterSocketOf = func(int, byte) (uint64, error) { return 0, nil }
	s, err := NewServer("")
	if err != nil {
		return err
	}
	proxy := proxyInFront(t, s)
	const chunks = 16
	fd := newMemfd(t, chunks*int(pageSize), pattern(chunks*int(pageSize), 8))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, chunks*pageSize, pageSize, RegisterOptions{Uses: 1})
	if tk.Address != proxy.addr {
		return fmt.Errorf("the ticket names %s, not the proxy %s", tk.Address, proxy.addr)
	}
	if err := importVerified(tk, ImportOptions{}, 8); err != nil {
		return err
	}
	toServer, toReceiver := proxy.recorded(t)
	out.printf("recorded %s %s %s", hex.EncodeToString(toServer), hex.EncodeToString(toReceiver), hex.EncodeToString(tk.Secret[:]))
	return nil
}

// TestRelayRefused: a process between the receiver and the exporter that
// relays bytes and descriptors both ways. Each side binds the sockets of
// its own connection, so the receiver refuses the exporter's proof (EAUTH)
// and sends no proof of its own: the relay passes a hello and a challenge,
// and no descriptor. The registration's use is not spent. The relay runs
// in this process, so it has the receiver's pid: the two-round form is
// what this tests (a one-round hello binds that pid, which a relay of
// another process cannot pass for: attack_oneround_test.go).
func TestRelayRefused(t *testing.T) {
	twoRoundsOnlyInThisTest(t)
	s := newTestServer(t)
	proxy := proxyInFront(t, s)
	fd := newMemfd(t, 4*int(pageSize), pattern(4*int(pageSize), 9))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, 4*pageSize, pageSize, RegisterOptions{Uses: 1})
	o := tryImport(t, tk)
	expectCode(t, o, "could not prove", EAUTH)
	toServer, toReceiver := proxy.recorded(t)
	if m, err := splitMessages(toServer); err != nil || len(m) != 1 || m[0].Type != msgHello {
		t.Fatalf("the receiver sent %d messages (%v) through the relay, want its hello only", len(m), err)
	}
	if m, err := splitMessages(toReceiver); err != nil || len(m) != 1 || m[0].Type != msgChallenge {
		t.Fatalf("the exporter sent %d messages (%v) through the relay, want its challenge only", len(m), err)
	}
	if n := proxy.descriptors(); n != 0 {
		t.Fatalf("%d descriptors crossed the relay", n)
	}
	if n := s.Live(); n != 1 {
		t.Fatalf("%d live registrations after the relay, want the one, its use not spent", n)
	}
	t.Logf("refused after %v: %v", o.took, o.err)
}

// TestUnregisterWhileExiting: registrations ended once the host said it is
// exiting tell receivers so, not that their owner unregistered them.
func TestUnregisterWhileExiting(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), pattern(int(pageSize), 1))
	defer unix.Close(fd)
	before := registerFile(t, s, fd, pageSize, pageSize, RegisterOptions{})
	after := registerFile(t, s, fd, pageSize, pageSize, RegisterOptions{})
	if err := s.Unregister(before); err != nil {
		t.Fatal(err)
	}
	SetExiting()
	t.Cleanup(func() { exiting.Store(false) })
	if err := s.Unregister(after); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(before, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "was unregistered by its owner") {
		t.Fatalf("unregistered before: %v", err)
	}
	want := fmt.Sprintf("registration %d has ended: its exporter (pid %d) is exiting", after.RegID, os.Getpid())
	if _, err := Open(after, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), want) {
		t.Fatalf("unregistered while exiting: %v, want ENOENT containing %q", err, want)
	}
}
