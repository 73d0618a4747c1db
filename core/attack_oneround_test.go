package core

import (
	"net"
	"os"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The one-round confirmation (handshake.go) against a live server, by
// hand: what a receiver gets for its one write, and what a replay, a
// relay, a stale start time or a wrong secret get instead.

// oneRoundTicket is a fresh registration's ticket on a server of its own,
// with uses unlimited.
func oneRoundTicket(t *testing.T) *Ticket {
	t.Helper()
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), pattern(int(pageSize), 7))
	defer unix.Close(fd)
	spec, err := HostFile(fd, pageSize, pageSize)
	if err != nil {
		t.Fatal(err)
	}
	tk, err := s.Register(spec, RegisterOptions{Uses: 0})
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// sendOneRound dials tk's exporter, sends first in one write and returns
// everything the server says until it closes.
func sendOneRound(t *testing.T, tk *Ticket, first []byte) []rawMsg {
	t.Helper()
	fd, err := rawDial(tk.Address)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := rawWrite(fd, first); err != nil {
		t.Fatal(err)
	}
	r := rawReadAll(fd, 5*time.Second)
	if len(r.FDAt) != 0 {
		t.Fatalf("the server sent %d descriptor(s) to a confirmation", len(r.FDAt))
	}
	msgs, err := splitMessages(r.Data)
	if err != nil {
		t.Fatal(err)
	}
	return msgs
}

// TestOneRoundConfirmAnswersAtOnce: hello and proof in one write, bound to
// our pid and start time, get the server's proof, the welcome and the
// done-ack, with nothing asked in between.
func TestOneRoundConfirmAnswersAtOnce(t *testing.T) {
	tk := oneRoundTicket(t)
	first, tr := rawOneRound(t, tk, tk.Secret, uint32(os.Getpid()), ourStartTime())
	msgs := sendOneRound(t, tk, first)
	if len(msgs) != 3 || msgs[0].Type != msgChallenge || msgs[1].Type != msgWelcome || msgs[2].Type != msgDoneAck {
		var got []string
		for _, m := range msgs {
			got = append(got, describeMsg(m))
		}
		t.Fatalf("a one-round confirmation got %v, want challenge, welcome, done-ack", got)
	}
	ch, err := parseChallenge(msgs[0].Body)
	if err != nil {
		t.Fatal(err)
	}
	if ch.Nonce != (nonce{}) || !tr.verify(tk.Secret, roleServer, ch.Proof) {
		t.Fatal("the server's one-round proof does not check out over our transcript")
	}
	if _, err := parseDoneAck(msgs[2].Body); err != nil {
		t.Fatal(err)
	}
}

// wantOneRoundRefused checks that msgs is one EAUTH error and nothing else.
func wantOneRoundRefused(t *testing.T, msgs []rawMsg, what string) {
	t.Helper()
	e, ok := lastError(msgs)
	if len(msgs) != 1 || !ok || e.Code != EAUTH {
		var got []string
		for _, m := range msgs {
			got = append(got, describeMsg(m))
		}
		t.Fatalf("%s: the server answered %v, want one EAUTH error", what, got)
	}
}

// TestOneRoundReplayFromAnotherPid: the bytes another process (our parent,
// alive, with its real start time) would send, sent on a connection of
// ours, as a relay or a replay would: refused EAUTH, with no proof of the
// server's, no welcome and no use spent.
func TestOneRoundReplayFromAnotherPid(t *testing.T) {
	tk := oneRoundTicket(t)
	ppid := os.Getppid()
	start, err := processStartTime(ppid)
	if err != nil {
		t.Skipf("cannot read our parent's start time: %v", err)
	}
	first, _ := rawOneRound(t, tk, tk.Secret, uint32(ppid), start)
	wantOneRoundRefused(t, sendOneRound(t, tk, first), "another process's hello and proof")
}

// TestOneRoundStaleStartTime: our pid with a start time that is not ours
// (a process that had our pid before us): refused EAUTH.
func TestOneRoundStaleStartTime(t *testing.T) {
	tk := oneRoundTicket(t)
	for _, st := range []uint64{ourStartTime() - 1, ourStartTime() + 1, 0} {
		first, _ := rawOneRound(t, tk, tk.Secret, uint32(os.Getpid()), st)
		wantOneRoundRefused(t, sendOneRound(t, tk, first), "a stale start time")
	}
}

// TestOneRoundWrongProof: a proof under another secret, and a proof of the
// two-round form's transcript: refused EAUTH.
func TestOneRoundWrongProof(t *testing.T) {
	tk := oneRoundTicket(t)
	var other Secret
	other[0] = 1
	first, _ := rawOneRound(t, tk, other, uint32(os.Getpid()), ourStartTime())
	wantOneRoundRefused(t, sendOneRound(t, tk, first), "a wrong secret")
	// The same transcript without the one-round flag's start time.
	first, tr := rawOneRound(t, tk, tk.Secret, uint32(os.Getpid()), ourStartTime())
	tr.Flags &^= helloOneRound
	first = append(first[:headerSize+helloSize], proofMsg{Proof: tr.proof(tk.Secret, roleReceiver)}.encode()...)
	wantOneRoundRefused(t, sendOneRound(t, tk, first), "a two-round proof")
}

// TestOneRoundFallsBack: an exporter that cannot check a receiver's pid
// and start time refuses the one-round form; a confirmation then succeeds
// in two rounds.
func TestOneRoundFallsBack(t *testing.T) {
	tk := oneRoundTicket(t)
	if !oneRoundWorks(tk) {
		t.Skip("the one-round form does not apply here")
	}
	var asked atomic.Int32
	refuse := func(uc *net.UnixConn) (uint32, uint64, error) {
		asked.Add(1)
		return 0, 0, Errorf(EAUTH, "no SO_PEERPIDFD here")
	}
	peerIdentityForTest.Store(&refuse)
	defer peerIdentityForTest.Store(nil)
	if _, err := confirm(tk, 5*time.Second); err != nil {
		t.Fatalf("a confirmation that the exporter refused in one round: %v", err)
	}
	if n := asked.Load(); n != 1 {
		t.Fatalf("the exporter was asked %d times for the receiver's identity, want 1", n)
	}
	// Once refused, that exporter is asked in two rounds from the start.
	if _, err := confirm(tk, 5*time.Second); err != nil {
		t.Fatalf("a second confirmation to an exporter that refused the one-round form: %v", err)
	}
	if n := asked.Load(); n != 1 {
		t.Fatalf("the exporter was asked %d times after it refused the one-round form, want still 1", n)
	}
	oneRoundRefusers.Delete(tk.exporterKey())
	peerIdentityForTest.Store(nil)
	if _, err := confirm(tk, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	var wrong Ticket = *tk
	wrong.Secret[0] ^= 1
	if _, err := confirm(&wrong, 5*time.Second); CodeOf(err) != EAUTH {
		t.Fatalf("a confirmation with a damaged secret: %v, want EAUTH", err)
	}
}
