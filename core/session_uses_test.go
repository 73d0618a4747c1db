package core

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// rawMoreUses opens a confirming session for tks[0] by hand (helloMore) and
// reads up to its done-ack; the caller sends further uses on the returned
// session and closes its fd.
func rawMoreUses(t *testing.T, tks []*Ticket) *rawSession {
	t.Helper()
	s, m := rawHello(t, tks[0], helloConfirm|helloMore)
	if m.Type != msgChallenge {
		unix.Close(s.fd)
		t.Fatalf("hello answered with %s, want a challenge", describeMsg(m))
	}
	if err := rawWrite(s.fd, s.proof(tks[0].Secret)); err != nil {
		t.Fatal(err)
	}
	for m.Type != msgDoneAck {
		var err error
		if m, _, err = rawRecv(s.fd, 5*time.Second); err != nil {
			t.Fatalf("waiting for the first use's done-ack: %v", err)
		}
	}
	return s
}

// use is the use message of tk on session s.
func (s *rawSession) use(t *testing.T, tk *Ticket) []byte {
	t.Helper()
	digest, err := tk.Digest()
	if err != nil {
		t.Fatal(err)
	}
	ut := s.tr.forUse(tk.RegID, digest)
	return useMsg{RegID: tk.RegID, Proof: ut.proof(tk.Secret, roleReceiver)}.encode()
}

// expectUseAck reads the next message: a use-ack of tk that says OK.
func (s *rawSession) expectUseAck(t *testing.T, tk *Ticket, what string) {
	t.Helper()
	m, _, err := rawRecv(s.fd, 5*time.Second)
	if err != nil {
		t.Fatalf("%s: no answer: %v", what, err)
	}
	if m.Type != msgUseAck {
		t.Fatalf("%s: got %s, want a use-ack", what, describeMsg(m))
	}
	ack, err := parseUseAck(m.Body)
	if err != nil || ack.RegID != tk.RegID || ack.Code != OK {
		t.Fatalf("%s: use-ack %+v (%v), want OK for registration %d", what, ack, err, tk.RegID)
	}
}

// TestMoreUsesAnsweredWhenNothingWaits: the exporter answers the further
// uses it has read once nothing more waits to be read (session_uses.go), so
// a receiver that sends one use at a time and waits for its answer before
// the next gets each answer; and the answers of uses read before a
// malformed message go out before the refusal, in order.
func TestMoreUsesAnsweredWhenNothingWaits(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), pattern(int(pageSize), 3))
	tks := make([]*Ticket, 4)
	for i := range tks {
		tks[i] = registerFile(t, s, fd, pageSize, pageSize, RegisterOptions{Uses: 1})
	}
	rs := rawMoreUses(t, tks)
	defer unix.Close(rs.fd)
	for _, tk := range tks[1:3] { // one at a time: no done follows until answered
		if err := rawWrite(rs.fd, rs.use(t, tk)); err != nil {
			t.Fatal(err)
		}
		rs.expectUseAck(t, tk, "a use sent alone")
	}
	batch := append(rs.use(t, tks[3]), encodeMsg(msgStatus, nil)...) // no status here, and of the wrong size
	if err := rawWrite(rs.fd, batch); err != nil {
		t.Fatal(err)
	}
	rs.expectUseAck(t, tks[3], "a use before a malformed message")
	m, _, err := rawRecv(rs.fd, 5*time.Second)
	if err != nil || m.Type != msgError {
		t.Fatalf("after the malformed message: %s, %v; want the refusal", describeMsg(m), err)
	}
	for i, tk := range tks { // a used-up registration ends once its answer is out
		if !waitUntil(5*time.Second, func() bool { _, err := s.reg.lookup(tk.RegID); return err != nil }) {
			t.Errorf("registration %d (use %d) was not used up", tk.RegID, i)
		}
	}
}
