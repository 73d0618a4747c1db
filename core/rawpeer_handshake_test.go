package core

import (
	"bytes"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

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

// rawOneRound is the first write of a one-round confirmation (handshake.go)
// of tk, proved under secret as if from the process pid started at tick
// start, and its transcript.
func rawOneRound(t testing.TB, tk *Ticket, secret Secret, pid uint32, start uint64) ([]byte, transcript) {
	t.Helper()
	tr := transcript{RegID: tk.RegID, Flags: helloConfirm | helloOneRound, Socket: uint64(pid), StartTime: start}
	var err error
	if tr.ReceiverNonce, err = newNonce(); err != nil {
		t.Fatal(err)
	}
	if tr.TicketDigest, err = tk.Digest(); err != nil {
		t.Fatal(err)
	}
	first := helloMsg{RegID: tk.RegID, Flags: tr.Flags, Nonce: tr.ReceiverNonce}.encode()
	return append(first, proofMsg{Proof: tr.proof(secret, roleReceiver)}.encode()...), tr
}

// rawOneRoundAuthenticate runs a one-round confirmation of tk by hand and
// returns the connection, on which the server's next message is the
// welcome (its proof was read and checked). The caller closes it.
func rawOneRoundAuthenticate(t testing.TB, tk *Ticket) int {
	t.Helper()
	first, tr := rawOneRound(t, tk, tk.Secret, uint32(os.Getpid()), ourStartTime())
	fd, err := rawDial(tk.Address)
	if err != nil {
		t.Fatal(err)
	}
	if err := rawWrite(fd, first); err != nil {
		unix.Close(fd)
		t.Fatal(err)
	}
	m, descriptors, err := rawRecv(fd, 5*time.Second)
	if err != nil || descriptors != 0 || m.Type != msgChallenge {
		unix.Close(fd)
		t.Fatalf("a one-round confirmation answered with %s, %d descriptor(s), %v; want a challenge", describeMsg(m), descriptors, err)
	}
	ch, err := parseChallenge(m.Body)
	if err != nil || ch.Nonce != (nonce{}) || !tr.verify(tk.Secret, roleServer, ch.Proof) {
		unix.Close(fd)
		t.Fatalf("the server's one-round proof does not check out (%v)", err)
	}
	return fd
}
