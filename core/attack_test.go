package core

import (
	"encoding/hex"
	"fmt"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Attacks on the trust model of the header's "Trust" section (issue 10):
// processes that take the exporter's place, corrupted tickets, connection
// storms and idle peers. Each asserts that the receiver fails at once (or is
// served), that the attacker learns nothing it could use, and that nothing
// leaks: descriptors, mappings, registrations.

// importOutcome is what one import attempt came to.
type importOutcome struct {
	err  error
	took time.Duration
}

// tryImport imports tk with the default timeout (30 s), which an attack
// must never make the receiver wait out, and checks that a failed import
// left nothing behind.
func tryImport(t *testing.T, tk *Ticket) importOutcome {
	t.Helper()
	fdsBefore := ourFDs().settled(t)
	entries := GetCacheInfo().Entries
	start := time.Now()
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	o := importOutcome{err, time.Since(start)}
	if err == nil {
		Unmap(r.ID, r.Base)
		t.Fatalf("imported %s from an impostor (after %v)", tk, o.took)
	}
	if o.took > promptly {
		t.Fatalf("the receiver took %v to refuse an impostor (timeout %v): %v", o.took, DefaultTimeout, err)
	}
	ourFDs().waitFor(t, fdsBefore, "after refusing an impostor")
	if n := GetCacheInfo().Entries; n != entries {
		t.Fatalf("%d mappings in the library's table after a refused import, %d before", n, entries)
	}
	expectNoMemfdMappings(t, "after refusing an impostor")
	return o
}

// expectCode fails unless o failed with one of codes and its message
// contains want.
func expectCode(t *testing.T, o importOutcome, want string, codes ...Code) {
	t.Helper()
	for _, c := range codes {
		if CodeOf(o.err) == c && strings.Contains(o.err.Error(), want) {
			return
		}
	}
	t.Fatalf("got %v (%v), want one of %v saying %q", CodeOf(o.err), o.err, codes, want)
}

// impostorLearnedNothing checks what an impostor received: at most hellos
// (a registration id, flags and a fresh nonce, all of which it could read
// from the ticket's owner anyway), no proof of any kind, and not 8 bytes
// of the secret; and that wantConns connections reached it.
func impostorLearnedNothing(t *testing.T, imp *helper, tk *Ticket, wantConns int) {
	t.Helper()
	conns, got := imp.report()
	if conns != wantConns {
		t.Fatalf("the impostor saw %d connections, want %d", conns, wantConns)
	}
	msgs, err := splitMessages(got)
	if err != nil {
		t.Fatalf("the impostor received a malformed byte stream: %v", err)
	}
	for i, m := range msgs {
		if m.Type != msgHello {
			t.Fatalf("the impostor received a %s (message %d of %d): receivers must send nothing but a hello to an exporter that did not prove itself", msgName(m.Type), i, len(msgs))
		}
	}
	if containsSecret(got, tk.Secret) {
		t.Fatal("the impostor received bytes of the ticket's secret")
	}
}

// TestImpostorAfterExporterExited: the exporter exits and another process
// binds its abstract address. The receiver fails at once (the ticket's pid
// is gone: EIO from the liveness check, before connecting), and the
// impostor gets nothing.
func TestImpostorAfterExporterExited(t *testing.T) {
	sender := startHelper(t, partSender, helperOpts{})
	tk := sender.register(4, 4096, 1, -1, 1)
	sender.kill()
	imp := startHelper(t, partImpostor, helperOpts{env: []string{envAddr + "=" + tk.Address, envListenMode + "=fakeproof"}})
	imp.expect("listening", faultTimeout)
	o := tryImport(t, tk)
	expectCode(t, o, "has exited", EIO)
	impostorLearnedNothing(t, imp, tk, 0)
	t.Logf("refused after %v: %v", o.took, o.err)
}

// TestImpostorAfterExec: the exporter execs another program, which binds
// the address. Same pid, same start time: the liveness check and
// SO_PEERCRED pass, and only the server proof stops the receiver. The
// impostor answers with a random proof, with a real challenge it captured
// from the exporter for another receiver (a replay), or skips the proof and
// pushes a descriptor.
func TestImpostorAfterExec(t *testing.T) {
	for _, tc := range []struct {
		mode, want string
		code       Code
	}{
		{"fakeproof", "could not prove", EAUTH},
		{"replay", "could not prove", EAUTH},
		{"skipauth", "descriptor with its welcome", EINVAL},
	} {
		t.Run(tc.mode, func(t *testing.T) {
			sender := startHelper(t, partSender, helperOpts{})
			tk := sender.register(4, 4096, 1, -1, 1)
			cmd := "exec impostor " + tc.mode
			if tc.mode == "replay" {
				s, m := rawHello(t, tk, 0) // the exporter's real challenge, for our nonce
				if m.Type != msgChallenge {
					t.Fatalf("hello answered with %s", describeMsg(m))
				}
				unix.Close(s.fd)
				cmd += " " + hex.EncodeToString(s.challenge)
			}
			sender.send(cmd)
			pid, err := strconv.Atoi(sender.expect("listening ", faultTimeout))
			if err != nil {
				t.Fatal(err)
			}
			st, err := processStartTime(pid)
			if err != nil || pid != sender.pid() || st != tk.StartTime {
				t.Fatalf("the exec'd impostor is pid %d started at %d (%v); the ticket says pid %d started at %d", pid, st, err, tk.Pid, tk.StartTime)
			}
			o := tryImport(t, tk)
			expectCode(t, o, tc.want, tc.code)
			impostorLearnedNothing(t, sender, tk, 1)
			if tc.mode == "fakeproof" {
				t.Logf("refused after %v: %v", o.took, o.err)
			}
		})
	}
}

// TestImpostorReusesPid: in a new pid namespace, the exporter exits and an
// impostor is given its pid (ns_last_pid) and binds its address. The
// receiver, in the same namespace, fails at once: the start time differs
// (EIO), or, should both have started in the same clock tick, the proof
// does (EAUTH). The impostor learns nothing.
func TestImpostorReusesPid(t *testing.T) {
	wrap := []string{"unshare", "--pid", "--fork", "--kill-child", "--map-root-user", "--mount-proc"}
	if out, err := exec.Command(wrap[0], append(wrap[1:], "true")...).CombinedOutput(); err != nil {
		t.Skipf("cannot make a pid namespace here (%s true: %v: %s); the pid-reuse attack needs unshare and unprivileged user namespaces", strings.Join(wrap, " "), err, strings.TrimSpace(string(out)))
	}
	ns := startHelper(t, partPidNS, helperOpts{wrap: wrap})
	tk := decodeTicketHex(t, ns.expect("ticket ", faultTimeout))
	var result string
	select {
	case l, ok := <-ns.lines:
		switch {
		case !ok:
			t.Fatalf("the namespace helper ended (%v) without a result", ns.exitErr())
		case strings.HasPrefix(l, "skip "):
			t.Skip(strings.TrimPrefix(l, "skip "))
		case strings.HasPrefix(l, "result "):
			result = strings.TrimPrefix(l, "result ")
		default:
			t.Fatalf("the namespace helper said %q", l)
		}
	case <-time.After(faultTimeout):
		t.Fatal("no result from the namespace helper")
	}
	var code, took int
	var tickStart, impStart uint64
	var report string
	if _, err := fmt.Sscanf(result, "code=%d took=%d ticket-start=%d impostor-start=%d report=%s", &code, &took, &tickStart, &impStart, &report); err != nil {
		t.Fatalf("result %q: %v", result, err)
	}
	switch {
	case Code(code) == EIO && tickStart != impStart && strings.Contains(result, "now belongs to another process"):
	case Code(code) == EAUTH && tickStart == impStart && strings.Contains(result, "could not prove"):
	default:
		t.Fatalf("the receiver facing an impostor with the exporter's pid: %s", result)
	}
	if time.Duration(took)*time.Millisecond > promptly {
		t.Fatalf("the receiver took %d ms to refuse the impostor", took)
	}
	_, got := parseReport(t, report)
	if msgs, err := splitMessages(got); err != nil || len(msgs) > 1 || (len(msgs) == 1 && msgs[0].Type != msgHello) || containsSecret(got, tk.Secret) {
		t.Fatalf("the impostor received %d bytes (%v) beyond a hello, or some of the secret", len(got), err)
	}
	t.Logf("pid %d reused in a pid namespace: %s", tk.Pid, result)
}

// forkListenerCases: a child of the exporter holds a duplicate of its
// listening socket and answers in its place (mode), while the exporter
// closes its own listener and lives on, or exits (then).
var forkListenerCases = []struct {
	then, mode, want string
	code             Code
	conns            int
}{
	{"close", "fakeproof", "could not prove", EAUTH, 1},
	{"exit", "silent", "has exited", EIO, 0},
}

// forkListener has a sender helper fork such a child and then close its
// listener or exit (exited tells when it has).
// The child and the sender share stdout, so the child's "listening" may
// come before the sender's "forked". A child in our PID namespace is killed
// when the test ends, first, whatever fails: it holds the sender's stdout,
// and would outlive the test. (One in a container dies with its pid 1.)
func (h *helper) forkListener(mode, then string, exited func() bool) {
	h.t.Helper()
	h.send("fork-listener " + mode + " " + then)
	lines := []string{"forked ", "listening "}
	if then == "close" {
		lines = append(lines, "closed")
	}
	got := map[string]string{}
	h.t.Cleanup(func() { // registered after the sender's kill, so run before it
		if child, err := strconv.Atoi(got["forked "]); err == nil && child > 0 && !h.inNS {
			_ = unix.Kill(child, unix.SIGKILL)
		}
	})
	h.expectAll(faultTimeout, got, lines...)
	if child, err := strconv.Atoi(got["forked "]); err != nil || child <= 0 {
		h.t.Fatalf("the sender said it forked %q", got["forked "])
	}
	if then == "exit" && !waitUntil(faultTimeout, exited) {
		h.t.Fatal("the exporter did not exit")
	}
}

// TestImpostorInheritsListener: a child of the exporter holds a duplicate
// of its listening socket (a fork without exec, or a leaked descriptor)
// and answers in its place. SO_PEERCRED names the exporter (the kernel
// records the listener's creator), so while the exporter lives only the
// proof stops the receiver (EAUTH); once it has exited, the liveness check
// does, at once, even though the child keeps the address alive and never
// answers (which used to make receivers wait their whole timeout).
func TestImpostorInheritsListener(t *testing.T) {
	for _, tc := range forkListenerCases {
		t.Run(tc.then, func(t *testing.T) {
			sender := startHelper(t, partSender, helperOpts{})
			tk := sender.register(4, 4096, 1, -1, 1)
			exited := func() bool {
				select {
				case <-sender.done:
					return true
				default:
					return false
				}
			}
			sender.forkListener(tc.mode, tc.then, exited)
			o := tryImport(t, tk)
			expectCode(t, o, tc.want, tc.code)
			impostorLearnedNothing(t, sender, tk, tc.conns)
			t.Logf("refused after %v: %v", o.took, o.err)
		})
	}
}

// TestEverySingleByteCorruption changes each of the 256 bytes of a ticket
// to several other values. Every variant is refused (EINVAL when decoding,
// or EINVAL, EAUTH, ENOENT or EIO when importing), none is imported, none
// spends the registration's only use, and nothing leaks. Bytes of the
// device-UUID field of a host ticket are refused by the decoder itself.
func TestEverySingleByteCorruption(t *testing.T) {
	flushCache(t)
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, 6))
	tk := registerFile(t, s, fd, 4*4096, 4096, RegisterOptions{Uses: 1})
	unix.Close(fd)
	good, err := tk.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	fdsBefore := ourFDs().settled(t)
	entries := GetCacheInfo().Entries
	outcomes := map[string]int{}
	var slowest time.Duration
	for pos := 0; pos < TicketSize; pos++ {
		for _, v := range corruptions(good[pos]) {
			b := good
			b[pos] = v
			bad, err := DecodeTicket(b[:])
			if err != nil {
				if CodeOf(err) != EINVAL {
					t.Fatalf("byte %d = %#x: decode failed with %v, want EINVAL: %v", pos, v, CodeOf(err), err)
				}
				outcomes["decode EINVAL"]++
				continue
			}
			if pos >= offUUID && pos < offUUID+16 {
				t.Fatalf("byte %d (device UUID) = %#x: a host ticket with a device UUID decoded", pos, v)
			}
			start := time.Now()
			r, err := Import(bad, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: 2 * time.Second}}, nil)
			took := time.Since(start)
			slowest = max(slowest, took)
			switch CodeOf(err) {
			case EINVAL, EAUTH, ENOENT, EIO:
				outcomes["import "+CodeOf(err).String()[:strings.IndexByte(CodeOf(err).String(), ':')]]++
			case OK:
				Unmap(r.ID, r.Base)
				t.Fatalf("byte %d = %#x: the corrupted ticket imported", pos, v)
			default:
				t.Fatalf("byte %d = %#x: import failed with %v, want EINVAL, EAUTH, ENOENT or EIO: %v", pos, v, CodeOf(err), err)
			}
			if took > promptly {
				t.Fatalf("byte %d = %#x: refused only after %v: %v", pos, v, took, err)
			}
		}
	}
	ourFDs().waitFor(t, fdsBefore, "after every corrupted ticket")
	if n := GetCacheInfo().Entries; n != entries {
		t.Fatalf("%d mappings in the library's table, %d before", n, entries)
	}
	expectNoMemfdMappings(t, "after every corrupted ticket")
	if s.Live() != 1 {
		t.Fatalf("%d live registrations, want the 1", s.Live())
	}
	r := importHost(t, tk, ImportOptions{}) // the only use is still there
	if err := verifyAndUnmap(r, 6); err != nil {
		t.Fatal(err)
	}
	t.Logf("outcomes %v; slowest refusal after an import attempt %v", outcomes, slowest)
}

// corruptions are the values a ticket byte b is changed to: one low and one
// high bit flipped, every bit flipped, and zero or 0xff.
func corruptions(b byte) []byte {
	out := []byte{b ^ 0x01, b ^ 0x80, b ^ 0xff}
	if b != 0 && b != 0xff {
		out = append(out, 0)
	}
	return out
}

// raiseNoFile raises this process's soft RLIMIT_NOFILE to at least n (up
// to the hard limit), for the test's duration, or skips.
func raiseNoFile(t *testing.T, n uint64) {
	t.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur >= n {
		return
	}
	if lim.Max < n {
		t.Skipf("needs %d descriptors here; RLIMIT_NOFILE's hard limit is %d", n, lim.Max)
	}
	saved := lim
	lim.Cur = n
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &saved) })
}

// TestThousandReceiversAtOnce: 1024 receivers (goroutines here, each with
// its own connection) import the same unlimited registration at the same
// instant from a sender whose RLIMIT_NOFILE is 1024, so it serves C = 256
// at a time and holds at most 64 unauthenticated connections. Every
// receiver gets every byte; the sender never comes near its descriptor
// limit and gives everything back.
func TestThousandReceiversAtOnce(t *testing.T) {
	const receivers, chunks = 1024, 16
	raiseNoFile(t, 3*receivers)
	flushCache(t)
	sender := startHelper(t, partSender, helperOpts{env: []string{envNoFile + "=1024"}})
	senderFDs := fdsOf(sender.pid())
	tk := sender.register(chunks, 4096, 0, -1, 12)
	base := senderFDs.settled(t)
	limit := 1024 / 4
	bound := base + 2*(limit+pendingLimit(limit)) // a socket and a chunk in hand per connection
	fdsBefore := ourFDs().settled(t)

	took, most := receiversAtOnce(t, senderFDs, tk, receivers, ImportOptions{OpenOptions: OpenOptions{Timeout: time.Minute}, NoCache: true}, 12)
	if most > bound {
		t.Fatalf("the sender held %d descriptors at its peak, bound %d (its limit is 1024)", most, bound)
	}
	senderFDs.waitFor(t, base, "the sender, after 1024 receivers")
	if live := sender.live(); live != 1 {
		t.Fatalf("the sender holds %d registrations, want its 1", live)
	}
	ourFDs().waitFor(t, fdsBefore, "after 1024 receivers")
	expectNoMemfdMappings(t, "after 1024 receivers")
	t.Logf("%d receivers in %v; the sender peaked at %d descriptors (%d idle, bound %d)", receivers, took, most, base, bound)
}

// TestIdleConnectionsDoNotLockOut: 300 same-uid connections that never
// speak are held open to a sender at RLIMIT_NOFILE 1024 (C = 256, at most 64
// unauthenticated), each re-dialled as soon as the sender drops it, so the
// pressure never lets up. A legitimate receiver still imports within 1 s
// (only its import is timed), and no idle connection ever gets a
// descriptor.
func TestIdleConnectionsDoNotLockOut(t *testing.T) {
	const idle = 300
	raiseNoFile(t, 2*idle+64)
	flushCache(t)
	sender := startHelper(t, partSender, helperOpts{env: []string{envNoFile + "=1024"}})
	senderFDs := fdsOf(sender.pid())
	tk := sender.register(64, 4096, 1, -1, 13)
	base := senderFDs.settled(t)
	fdsBefore := ourFDs().settled(t)

	stop := make(chan struct{})
	var attackers sync.WaitGroup
	var mu sync.Mutex
	var dials, descriptors int
	var dialErr error
	for i := 0; i < idle; i++ {
		attackers.Add(1)
		go func() {
			defer attackers.Done()
			for {
				fd, err := rawDial(tk.Address)
				mu.Lock()
				dials++
				dialErr = cmpOr(dialErr, err)
				mu.Unlock()
				if err != nil {
					return
				}
				// Idle until the sender drops us (a "busy" message at
				// most), or the test ends.
				closed := make(chan struct{})
				go func() {
					defer close(closed)
					r := rawReadAll(fd, time.Minute)
					mu.Lock()
					descriptors += len(r.FDAt)
					mu.Unlock()
				}()
				select {
				case <-closed:
					unix.Close(fd)
				case <-stop:
					unix.Shutdown(fd, unix.SHUT_RDWR)
					<-closed
					unix.Close(fd)
					return
				}
			}
		}()
	}
	time.Sleep(300 * time.Millisecond) // the sender fills its unauthenticated bound
	start := time.Now()
	r, err := Import(tk, DeviceHost, ImportOptions{}, nil)
	took := time.Since(start)
	close(stop)
	attackers.Wait()
	if err != nil {
		t.Fatalf("a legitimate receiver among %d idle connections: %v", idle, err)
	}
	if err := verifyAndUnmap(r, 13); err != nil {
		t.Fatal(err)
	}
	if dialErr != nil {
		t.Fatalf("an idle connection could not even connect: %v", dialErr)
	}
	if descriptors != 0 {
		t.Fatalf("idle connections received %d descriptors", descriptors)
	}
	if took > time.Second {
		t.Fatalf("the legitimate receiver took %v among %d idle connections, want at most 1 s", took, idle)
	}
	senderFDs.waitFor(t, base-1, "the sender, after the idle connections and the only use")
	if live := sender.live(); live != 0 {
		t.Fatalf("the sender holds %d registrations after the only use", live)
	}
	ourFDs().waitFor(t, fdsBefore, "after the idle connections")
	t.Logf("imported in %v among %d idle connections (%d dials in all)", took, idle, dials)
}

// TestRegisteredFileNotItsNumber: the owner's descriptor of the registered
// file is closed and its number taken by another memfd with other bytes.
// Receivers get the registered file's bytes: the library holds a duplicate
// of its own, not a number.
func TestRegisteredFileNotItsNumber(t *testing.T) {
	s := newTestServer(t)
	const size = 8 * 4096
	fd := newMemfd(t, size, pattern(size, 21))
	before := ourFDs().settled(t)
	tk := registerFile(t, s, fd, size, 4096, RegisterOptions{Uses: 2})
	// Close the registered descriptor and put another file at its number,
	// in one step: close-then-open would race with the library's own
	// goroutines for the freed number.
	other := newMemfd(t, size, pattern(size, 22))
	if err := unix.Dup3(other, fd, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(other)
	for i := 0; i < 2; i++ {
		r := importHost(t, tk, ImportOptions{NoCache: true})
		if err := verifyAndUnmap(r, 21); err != nil {
			t.Fatalf("import %d after the descriptor number was reused: %v", i, err)
		}
	}
	// Registering the new file at the same number is another buffer.
	tk2 := registerFile(t, s, fd, size, 4096, RegisterOptions{Uses: 1})
	if tk2.BufferID == tk.BufferID {
		t.Fatalf("another file at the same descriptor number joined buffer %d", tk.BufferID)
	}
	r := importHost(t, tk2, ImportOptions{})
	if err := verifyAndUnmap(r, 22); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	ourFDs().waitFor(t, before-1, "after both registrations were used up (the library's duplicates closed)")
}

// TestReceiverHandshakeTimesOut: exporters that go silent during the
// handshake (after the hello, or after a valid challenge) make the receiver
// give up after its timeout with EIO, holding nothing.
func TestReceiverHandshakeTimesOut(t *testing.T) {
	const timeout = 300 * time.Millisecond
	for _, tc := range []struct {
		name      string
		challenge bool
		want      string
	}{
		{"silent after the hello", false, "did not answer within"},
		{"silent after the challenge", true, "timed out"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fdsBefore := ourFDs().settled(t)
			released := make(chan struct{})
			fake := newFakeExporter(t, 1, 4096, func(uc *net.UnixConn, tk *Ticket) {
				c, _ := newConn(uc, 5*time.Second, "server")
				f, err := c.recv()
				if err == nil && tc.challenge {
					hello, _ := parseHello(f.Body)
					tr := serverTranscript(t, uc, tk, hello)
					tr.ServerNonce, _ = newNonce()
					_ = c.send(challengeMsg{Nonce: tr.ServerNonce, Proof: tr.proof(tk.Secret, roleServer)}.encode(), -1)
				}
				<-released
			})
			start := time.Now()
			_, err := Import(fake.tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: timeout}}, nil)
			took := time.Since(start)
			close(released)
			fake.close()
			if CodeOf(err) != EIO || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want EIO saying %q", err, tc.want)
			}
			if took < timeout || took > timeout+promptly {
				t.Fatalf("gave up after %v with a timeout of %v", took, timeout)
			}
			ourFDs().waitFor(t, fdsBefore, "after the silent exporter")
		})
	}
}

// TestStatusQueries: before any hello, a peer may ask whether buffer ids
// are live. The answers follow the buffers (live, unregistered, used up,
// kept alive by another registration), a query stream cannot turn into a
// session (no hello, no pull), it is bounded, and it never carries a
// descriptor.
func TestStatusQueries(t *testing.T) {
	s := newTestServer(t)
	const size = 4 * 4096
	fd := newMemfd(t, size, pattern(size, 23))
	defer unix.Close(fd)
	unlimited := registerFile(t, s, fd, size, 4096, RegisterOptions{})
	fd2 := newMemfd(t, size, pattern(size, 24))
	defer unix.Close(fd2)
	once := registerFile(t, s, fd2, size, 4096, RegisterOptions{Uses: 1})
	again, err := s.RegisterAgain(once, RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	const unknown = 999

	conn, err := rawDial(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(conn)
	ask := func(id uint64) bool {
		t.Helper()
		if err := rawWrite(conn, statusMsg{BufferID: id}.encode()); err != nil {
			t.Fatal(err)
		}
		m, n, err := rawRecv(conn, 5*time.Second)
		if err != nil || n != 0 || m.Type != msgStatusAck {
			t.Fatalf("status of buffer %d: %s, %d descriptors, %v", id, describeMsg(m), n, err)
		}
		ack, err := parseStatusAck(m.Body)
		if err != nil || ack.BufferID != id {
			t.Fatalf("status of buffer %d answered for %d (%v)", id, ack.BufferID, err)
		}
		return ack.Alive
	}
	if !ask(unlimited.BufferID) || !ask(once.BufferID) || ask(unknown) {
		t.Fatal("status of live buffers / an unknown buffer is wrong")
	}
	r := importHost(t, once, ImportOptions{NoCache: true}) // uses `once` up
	Unmap(r.ID, r.Base)
	if !ask(once.BufferID) {
		t.Fatal("a buffer is reported ended while a registration made from it with RegisterAgain lives")
	}
	if err := s.Unregister(again); err != nil {
		t.Fatal(err)
	}
	if ask(once.BufferID) {
		t.Fatal("a buffer is reported live after its last registration ended")
	}
	if err := s.Unregister(unlimited); err != nil {
		t.Fatal(err)
	}
	if ask(unlimited.BufferID) {
		t.Fatal("an unregistered buffer is reported live")
	}
	// The receiver's own poller asks the same way.
	got, err := bufferStatus(once, []uint64{once.BufferID, unknown}, time.Second)
	if err != nil || len(got) != 2 || got[once.BufferID] || got[unknown] {
		t.Fatalf("bufferStatus: %v, %v", got, err)
	}

	// A status connection cannot be turned into a session.
	live := registerFile(t, s, fd, size, 4096, RegisterOptions{})
	for _, tc := range []struct {
		name string
		msg  []byte
	}{
		{"hello", helloMsg{RegID: live.RegID}.encode()},
		{"pull", pullMsg{0, 4}.encode()},
		{"proof", proofMsg{}.encode()},
	} {
		c, err := rawDial(s.Addr())
		if err != nil {
			t.Fatal(err)
		}
		_ = rawWrite(c, cat(statusMsg{BufferID: live.BufferID}.encode(), tc.msg))
		_ = unix.Shutdown(c, unix.SHUT_WR)
		msgs, rep := readReply(t, c)
		unix.Close(c)
		if len(msgs) != 2 || msgs[0].Type != msgStatusAck {
			t.Fatalf("status then %s: got %d messages", tc.name, len(msgs))
		}
		expectRefused(t, msgs, rep, EINVAL, "only status queries may follow a status query, got "+tc.name, 0)
	}
	// Bounded: a connection answers maxStatusQueries queries, then closes.
	c, err := rawDial(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	var many []byte
	for i := 0; i < maxStatusQueries+4; i++ {
		many = append(many, statusMsg{BufferID: uint64(i)}.encode()...)
	}
	go func() { _ = rawWrite(c, many); _ = unix.Shutdown(c, unix.SHUT_WR) }()
	msgs, rep := readReply(t, c)
	unix.Close(c)
	if len(msgs) != maxStatusQueries || len(rep.FDAt) != 0 {
		t.Fatalf("%d queries on one connection: %d answers and %d descriptors, want %d and none", maxStatusQueries+4, len(msgs), len(rep.FDAt), maxStatusQueries)
	}
}
