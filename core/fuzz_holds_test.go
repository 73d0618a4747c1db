package core

import (
	"encoding/binary"
	"math/rand/v2"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// FuzzHolderSession: whatever a receiver sends on its holder session (use,
// release, or any bytes at all), the server never crashes, never lets go of
// a hold that is not the session's, answers only use-acks (or one final
// error), and once the connection ends nothing is held, no descriptor and
// no goroutine is left.
func FuzzHolderSession(f *testing.F) {
	f.Add([]byte{}, uint8(0))
	f.Add(releaseMsg{RegIDs: []uint64{1, 2, 3}}.encode(), uint8(0))
	f.Add(useMsg{RegID: 1}.encode(), uint8(1))
	f.Add(cat(useMsg{RegID: 2}.encode(), releaseMsg{RegIDs: []uint64{2}}.encode()), uint8(2))
	f.Add(encodeMsg(msgRelease, make([]byte, 8)), uint8(0))
	f.Add(cat(tokenMsg{}.encode(msgHoldFor), encodeMsg(msgDone, nil)), uint8(3))
	f.Fuzz(holderSessionCase)
}

// holderSessionCase is one input of FuzzHolderSession.
func holderSessionCase(t *testing.T, data []byte, mode uint8) {
	{
		if len(data) > 64<<10 {
			return
		}
		s, anchor := fuzzServer(t)
		fdsStart := ourFDs().now(t)
		// A victim hold of another session (this process as the receiver):
		// nothing the fuzzed session sends may let go of it.
		victim, err := s.RegisterAgain(anchor, RegisterOptions{Uses: 1, Hold: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := Confirm(victim, ImportOptions{Hold: true}); err != nil {
			t.Fatal(err)
		}
		mine, err := s.RegisterAgain(anchor, RegisterOptions{Uses: 2, Hold: true})
		if err != nil {
			t.Fatal(err)
		}
		fdsBefore, gBefore := ourFDs().now(t), runtime.NumGoroutine()
		rs, m := rawHello(t, mine, helloConfirm|helloHolder)
		if m.Type != msgChallenge {
			unix.Close(rs.fd)
			t.Fatalf("hello answered with %s", describeMsg(m))
		}
		if err := rawWrite(rs.fd, rs.proof(mine.Secret)); err != nil {
			unix.Close(rs.fd)
			t.Fatal(err)
		}
		send := data
		if mode&1 != 0 { // a well-proved use of mine first, then the fuzz
			tr := rs.tr
			tr.RegID, tr.Flags, tr.TicketDigest = mine.RegID, useProofFlag, mustDigestTB(t, mine)
			send = cat(useMsg{RegID: mine.RegID, Proof: tr.proof(mine.Secret, roleReceiver)}.encode(), data)
		}
		if mode&2 != 0 { // and release everything, the victim's id too
			send = cat(send, releaseMsg{RegIDs: []uint64{victim.RegID, mine.RegID, mine.RegID}}.encode())
		}
		// Read while writing: the server answers each use as it reads it,
		// and a peer that only writes would fill both sockets' buffers.
		// Then end the writing side: the server reads to the end, answers
		// and hangs up, so the read ends at once (no waiting out a silence:
		// an input is milliseconds, which the fuzzer's minimizing needs).
		replies := make(chan rawReply, 1)
		go func() { replies <- rawReadAll(rs.fd, 2*time.Second) }()
		_ = rawWrite(rs.fd, send)
		_ = unix.Shutdown(rs.fd, unix.SHUT_WR)
		reply := <-replies
		if reply.Err != nil {
			unix.Close(rs.fd)
			t.Fatalf("the server neither answered nor hung up: %v", reply.Err)
		}
		unix.Close(rs.fd)
		msgs, err := splitMessages(reply.Data)
		if err != nil {
			t.Fatalf("the server sent a malformed stream: %v", err)
		}
		if len(reply.FDAt) != 0 {
			t.Fatalf("the server sent %d descriptor(s) on a holder session", len(reply.FDAt))
		}
		for i, msg := range msgs {
			switch {
			case i < 3 && msg.Type == []uint8{msgWelcome, msgDoneAck, msgHolding}[i]:
			case i >= 3 && msg.Type == msgUseAck:
			case i == len(msgs)-1 && msg.Type == msgError:
			default:
				t.Fatalf("message %d of the holder session: %s", i, describeMsg(msg))
			}
		}
		// The server hung up after reading everything: the session's holds
		// are being let go of, and nothing it sent may reach the victim's.
		if !waitUntil(5*time.Second, func() bool { return s.Holds() == 1 }) {
			t.Fatalf("%d holds after the fuzzed session ended, want the victim's 1", s.Holds())
		}
		if err := s.Wait(victim, time.Millisecond); CodeOf(err) != ETIMEDOUT {
			t.Fatalf("another session's hold was let go of: %v", err)
		}
		if err := Release(victim); err != nil {
			t.Fatal(err)
		}
		if err := s.Wait(victim, 5*time.Second); err != nil {
			t.Fatalf("the victim's own release: %v", err)
		}
		_ = s.reg.lookupAndEnd(mine.RegID)
		ourFDs().waitFor(t, fdsBefore, "after the fuzzed holder session")
		// The victim's holder session: the fuzz server lives as long as
		// the process, and so would it, in later tests' cache counts.
		// Its end closes a descriptor on each side (the server's, later):
		// the next input must start from the same count.
		endHolderSessions(victim)
		if !waitUntil(3*time.Second, func() bool { return ourFDs().now(t) <= fdsStart }) {
			t.Fatalf("%d descriptors after the victim's holder session ended, %d before the input", ourFDs().now(t), fdsStart)
		}
		if !waitUntil(2*time.Second, func() bool { return runtime.NumGoroutine() <= gBefore }) {
			t.Fatalf("goroutines: %d, were %d", runtime.NumGoroutine(), gBefore)
		}
	}
}

// endHolderSessions closes this process's holder sessions to tk's exporter
// (tests), as its hanging up would.
func endHolderSessions(tk *Ticket) {
	for _, h := range holdersOf(tk.exporterKey()) {
		h.mu.Lock()
		h.fail(Errorf(EIO, "holder session closed by its test"))
		h.mu.Unlock()
	}
}

func mustDigestTB(t testing.TB, tk *Ticket) [32]byte {
	t.Helper()
	d, err := tk.Digest()
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// lookupAndEnd ends registration id if it lives (tests).
func (r *Registry) lookupAndEnd(id uint64) error {
	g, err := r.lookup(id)
	if err != nil {
		return err
	}
	g.end("ended by its test")
	return nil
}

// FuzzHoldMessages: the parsers of the hold messages accept exactly what
// their encoders make, and refuse everything else without panicking.
func FuzzHoldMessages(f *testing.F) {
	f.Add(uint8(msgUse), useMsg{RegID: 7}.encode()[headerSize:])
	f.Add(uint8(msgUseAck), useAckMsg{RegID: 7, Code: ENOENT, Text: "gone"}.encode()[headerSize:])
	f.Add(uint8(msgRelease), releaseMsg{RegIDs: []uint64{1, 2}}.encode()[headerSize:])
	f.Add(uint8(msgHolding), make([]byte, tokenSize))
	f.Fuzz(func(t *testing.T, typ uint8, body []byte) {
		switch typ % 4 {
		case 0:
			if m, err := parseUse(body); err == nil {
				if got := m.encode()[headerSize:]; string(got) != string(body) {
					t.Fatalf("use does not round-trip: %x -> %+v -> %x", body, m, got)
				}
			}
		case 1:
			if m, err := parseUseAck(body); err == nil {
				if m.Code != OK && !m.Code.IsError() {
					t.Fatalf("use-ack with status %d accepted", m.Code)
				}
			}
		case 2:
			if m, err := parseRelease(body); err == nil {
				if len(m.RegIDs) == 0 || len(m.RegIDs) > maxReleaseBatch {
					t.Fatalf("release of %d ids accepted", len(m.RegIDs))
				}
				if got := m.encode()[headerSize:]; string(got) != string(body) {
					t.Fatalf("release does not round-trip")
				}
			}
		case 3:
			if _, err := parseToken(msgHolding, body); (err == nil) != (len(body) == tokenSize) {
				t.Fatalf("a token of %d bytes: %v", len(body), err)
			}
		}
	})
}

// TestHolderSessionRandomInputs runs FuzzHolderSession's check over seeded
// random inputs (messages with valid headers of every hold type, and raw
// bytes) in every go test, so that CI runs it beyond the seeds.
func TestHolderSessionRandomInputs(t *testing.T) {
	r := rand.New(rand.NewPCG(24, 27))
	for i := 0; i < trials(300, 40); i++ {
		n := r.IntN(600)
		b := make([]byte, n)
		for j := range b {
			b[j] = byte(r.IntN(256))
		}
		if r.IntN(2) == 0 && n >= headerSize {
			copy(b, encodeMsg(msgHoldFor+uint8(r.IntN(5)), nil)[:headerSize])
			binary.LittleEndian.PutUint32(b[8:], uint32(n-headerSize))
		}
		holderSessionCase(t, b, uint8(r.IntN(4)))
	}
}
