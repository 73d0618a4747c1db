package core

import (
	"encoding/hex"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Attacks on the trust model of the header's "Trust" section (issue 10):
// here processes that take the exporter's place (one given its pid in
// attack_pidreuse_test.go); tampered tickets in attack_tamper_test.go,
// connection storms and idle peers in attack_storm_test.go, status queries
// in attack_status_test.go. Each asserts that the receiver fails at once
// (or is served), that the attacker learns nothing it could use, and that
// nothing leaks: descriptors, mappings, registrations.

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
	// A one-round hello comes with its proof and, for a host import, the
	// pull-run of every chunk: a request, which tells nothing.
	for i, m := range msgs {
		ok := m.Type == msgHello ||
			(i > 0 && oneRoundProofOfOurs(t, tk, msgs[i-1], m)) ||
			(i > 1 && m.Type == msgPullRun && oneRoundProofOfOurs(t, tk, msgs[i-2], msgs[i-1]))
		if !ok {
			t.Fatalf("the impostor received a %s (message %d of %d): receivers must send nothing but a hello to an exporter that did not prove itself (with a one-round hello, its proof bound to this process)", msgName(m.Type), i, len(msgs))
		}
	}
	if containsSecret(got, tk.Secret) {
		t.Fatal("the impostor received bytes of the ticket's secret")
	}
}

// twoRoundsOnlyInThisTest makes this process's receivers use the two-round
// handshake until the test ends.
func twoRoundsOnlyInThisTest(t *testing.T) {
	oneRoundEnabled = false
	t.Cleanup(func() { oneRoundEnabled = true })
}

// oneRoundProofOfOurs reports whether m is the proof of a one-round hello
// (handshake.go) bound to this process's pid and start time: only this
// process can use it, so an impostor that gets it learns nothing it could
// use elsewhere.
func oneRoundProofOfOurs(t *testing.T, tk *Ticket, hello, m rawMsg) bool {
	t.Helper()
	if hello.Type != msgHello || m.Type != msgProof {
		return false
	}
	h, err := parseHello(hello.Body)
	if err != nil || h.Flags&helloOneRound == 0 {
		return false
	}
	p, err := parseProof(m.Body)
	digest, derr := tk.Digest()
	if err != nil || derr != nil {
		return false
	}
	tr := transcript{RegID: h.RegID, Flags: h.Flags, Socket: uint64(os.Getpid()),
		TicketDigest: digest, ReceiverNonce: h.Nonce, StartTime: ourStartTime()}
	return tr.verify(tk.Secret, roleReceiver, p.Proof)
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
			sender.forkListener(tc.mode, tc.then, sender.exited)
			o := tryImport(t, tk)
			expectCode(t, o, tc.want, tc.code)
			impostorLearnedNothing(t, sender, tk, tc.conns)
			t.Logf("refused after %v: %v", o.took, o.err)
		})
	}
}
