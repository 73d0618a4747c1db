package core

import (
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Fuzz target for a real receiver's handshake against a fuzzed fake
// exporter in this process, and what that exporter needs.

// What FuzzReceiverHandshake's fake exporter answers a hello with (mode & 3).
const (
	answerFuzzed     = iota // fuzzed bytes (descriptors attached per plan)
	answerBadProof          // a challenge with a fuzzed nonce and proof, then the bytes
	answerNearlyGood        // a challenge with a real HMAC of a transcript that differs
	answerGood              // the right challenge; the receiver's proof is checked; then the bytes
)

// FuzzReceiverHandshake is a fuzzed fake exporter answering a real
// receiver's hello. The exporter lives in this process, so the ticket's
// pid, start time and SO_PEERCRED all check out and only the handshake
// stands between the receiver and whatever it is sent. Mode bit 3 makes
// the receiver a one-round confirmation (its proof comes with its hello)
// instead of Open; bit 4 leaves the answer to a request for the grant
// table to the fuzzed bytes (else it is "none"). Without the right server proof, Open (or confirm) must
// fail, the receiver must not send its own proof
// (or anything else after its hello), and every descriptor it was sent must
// be closed. With it, the receiver's proof must check out, and the stream
// that follows must hand out only chunks that fit the ticket.
func FuzzReceiverHandshake(f *testing.F) {
	quietFDs(f)
	const count, total = 2, 2 * 4096
	welcome := welcomeMsg{Count: count, Total: total, Kind: MemoryHost, BufferID: sampleTicket().BufferID}.encode()
	chunks, plan := streamTranscript(total, count)
	good := cat(welcome, chunks)
	goodPlan := shiftPlan(plan, len(welcome))
	for _, m := range []uint8{answerFuzzed, answerBadProof, answerGood} {
		f.Add(m, make([]byte, challengeSize), good, goodPlan)
	}
	for how := byte(0); how < nearMisses; how++ {
		f.Add(uint8(answerNearlyGood), []byte{how}, good, goodPlan)
	}
	f.Add(uint8(answerFuzzed), []byte{}, cat(challengeMsg{}.encode(), good), shiftPlan(goodPlan, headerSize+challengeSize))
	f.Add(uint8(answerFuzzed), []byte{}, encodeMsg(msgBusy, nil), []byte{})
	f.Add(uint8(answerFuzzed), []byte{}, errorMsg{Code: ENOENT, Text: "used up"}.encode(), []byte{})
	f.Add(uint8(answerFuzzed), []byte{}, welcome, []byte{0, 0, 1})
	f.Add(uint8(answerGood), []byte{}, cat(welcomeMsg{Count: 3, Total: total, Kind: MemoryHost}.encode(), chunks), goodPlan)
	f.Add(uint8(answerGood), []byte{}, cat(errorMsg{Code: EAUTH, Text: "no"}.encode()), []byte{})
	runs, runPlan := runTranscript(total, count, count)
	f.Add(uint8(answerGood|4), []byte{}, cat(welcome, runs), shiftPlan(runPlan, len(welcome)))
	f.Add(uint8(answerGood|4), []byte{}, good, goodPlan)
	// Bit 3: the receiver confirms in one round trip (handshake.go).
	doneAck := doneAckMsg{Flags: ackBufferLives}.encode()
	f.Add(uint8(answerGood|8), []byte{}, cat(welcome, doneAck), []byte{})
	// Bit 4: the fuzzed bytes answer the table request too.
	table := tableMsg{Slots: tableSlots, FD: 3}.encode()
	f.Add(uint8(answerGood|16), []byte{}, cat(table, good), append([]byte{0, 0, 1}, shiftPlan(goodPlan, len(table))...))
	f.Add(uint8(answerGood|8|16), []byte{}, cat(table, welcome, doneAck), []byte{0, 0, 1})
	f.Add(uint8(answerGood|8|16), []byte{}, cat(tableMsg{}.encode(), welcome, doneAck), []byte{0, 0, 2})
	f.Add(uint8(answerGood|8), []byte{}, cat(welcome, doneAck), []byte{0, 0, 1})
	f.Add(uint8(answerGood|8), []byte{}, doneAck, []byte{})
	f.Add(uint8(answerGood|8), []byte{}, errorMsg{Code: ENOENT, Text: "used up"}.encode(), []byte{})
	f.Add(uint8(answerFuzzed|8), []byte{}, cat(challengeMsg{}.encode(), welcome, doneAck), []byte{})
	f.Add(uint8(answerFuzzed|8), []byte{}, errorMsg{Code: EAUTH, Text: "no"}.encode(), []byte{})
	f.Add(uint8(answerBadProof|8), make([]byte, challengeSize), cat(welcome, doneAck), []byte{})
	for how := byte(0); how < nearMisses; how++ {
		f.Add(uint8(answerNearlyGood|8), []byte{how}, cat(welcome, doneAck), []byte{})
	}
	f.Fuzz(func(t *testing.T, mode uint8, challenge, data, rawPlan []byte) {
		if len(data) > 64<<10 {
			return
		}
		oneRound := mode&8 != 0
		fdsBefore := ourFDs().now(t) // the last iteration ended with every descriptor closed
		file := newMemfd(t, total, pattern(total, 5))
		var proofChecked bool
		var after []byte // what the receiver sent after its hello
		fake := newFakeExporter(t, count, total, func(uc *net.UnixConn, tk *Ticket) {
			c, err := newConn(uc, 5*time.Second, "server")
			if err != nil {
				t.Error(err)
				return
			}
			body, ok := recvFromReceiver(t, c, msgHello, "at first")
			if !ok {
				return
			}
			hello, err := parseHello(body)
			wantFlags := uint64(0)
			if oneRound {
				wantFlags = helloConfirm | helloOneRound
			}
			// A receiver asks for the grant table of an exporter it has
			// none of (granttable_view.go), within its bounds.
			if err != nil || hello.RegID != tk.RegID || hello.Flags&^helloTable != wantFlags {
				t.Errorf("the receiver's hello %+v, %v", hello, err)
				return
			}
			tr := serverTranscript(t, uc, tk, hello)
			if oneRound {
				// The proof came with the hello, bound to the receiver (this
				// process): check it first, as the exporter does.
				tr.Socket, tr.StartTime = uint64(os.Getpid()), ourStartTime()
				body, ok := recvFromReceiver(t, c, msgProof, "with a one-round hello")
				if !ok {
					return
				}
				pm, err := parseProof(body)
				if err != nil || !tr.verify(tk.Secret, roleReceiver, pm.Proof) {
					t.Errorf("the receiver's one-round proof does not check out (%v)", err)
					return
				}
				proofChecked = true
			}
			raw, _ := uc.SyscallConn()
			var sendErr error
			send := func(b []byte, plan []fdAttach) {
				_ = raw.Write(func(s uintptr) bool {
					sendErr = sendWithFDs(int(s), b, plan, file)
					return true
				})
			}
			plan := parseFDPlan(rawPlan, len(data))
			if hello.Flags&helloTable != 0 && mode&16 == 0 {
				// "None"; with mode bit 4 the fuzzed bytes answer it
				// (table messages, with whatever descriptors the plan adds).
				data = cat(tableMsg{}.encode(), data)
				plan = shiftPlan2(plan, headerSize+tableMsgSize)
			}
			switch answer := mode & 3; {
			case answer == answerFuzzed:
				send(data, plan)
			case answer == answerBadProof:
				var m challengeMsg
				copy(m.Nonce[:], challenge)
				copy(m.Proof[:], challenge[min(len(challenge), nonceSize):])
				send(cat(m.encode(), data), shiftPlan2(plan, headerSize+challengeSize))
			case answer == answerNearlyGood:
				if !oneRound {
					tr.ServerNonce, _ = newNonce()
				}
				m := challengeMsg{Nonce: tr.ServerNonce, Proof: nearMissProof(tr, tk.Secret, roleServer, challenge)}
				send(cat(m.encode(), data), shiftPlan2(plan, headerSize+challengeSize))
			case answer == answerGood && oneRound:
				send(cat(challengeMsg{Proof: tr.proof(tk.Secret, roleServer)}.encode(), data), shiftPlan2(plan, headerSize+challengeSize))
			case answer == answerGood:
				tr.ServerNonce, _ = newNonce()
				send(challengeMsg{Nonce: tr.ServerNonce, Proof: tr.proof(tk.Secret, roleServer)}.encode(), nil)
				body, ok := recvFromReceiver(t, c, msgProof, "after the right challenge")
				if !ok {
					return
				}
				pm, err := parseProof(body)
				if err != nil || !tr.verify(tk.Secret, roleReceiver, pm.Proof) {
					t.Errorf("the receiver's proof does not check out (%v)", err)
					return
				}
				proofChecked = true
				send(data, plan)
			}
			_ = sendErr // EPIPE once the receiver gave up is fine
			_ = uc.CloseWrite()
			_ = uc.SetReadDeadline(time.Now().Add(5 * time.Second))
			var buf [4096]byte
			for {
				n, err := uc.Read(buf[:])
				after = append(after, buf[:n]...)
				if err != nil {
					break
				}
			}
		})
		start := time.Now()
		var err error
		if oneRound {
			_, err = confirm(fake.tk, 2*time.Second)
		} else {
			var s *Stream
			if s, err = Open(fake.tk, OpenOptions{Timeout: 2 * time.Second, Window: 2}); err == nil {
				checkStreamChunks(t, s, fake.tk, mode&4 != 0)
				s.Close()
			}
		}
		took := time.Since(start)
		fake.close()
		if mode&3 != answerGood {
			if err == nil {
				t.Fatalf("Open accepted an exporter that never proved it knows the secret (mode %d)", mode&3)
			}
			if msgs, _ := splitMessages(after); len(after) > 0 {
				t.Fatalf("the receiver sent %d bytes (%d messages, first %s) after its hello to an exporter that did not prove itself", len(after), len(msgs), firstName(msgs))
			}
		} else if msgs, _ := splitMessages(after); oneRound && len(after) > 0 && !(len(msgs) == 1 && msgs[0].Type == msgSpendLog) {
			// Its answer to a table (mode bit 4) is all it may send.
			t.Fatalf("a one-round confirmation sent %d bytes after its hello and proof", len(after))
		} else if !proofChecked && !t.Failed() {
			t.Fatal("the fake exporter never checked the receiver's proof")
		}
		if took > 2*time.Second+3*time.Second {
			t.Fatalf("the receiver took %v with a timeout of 2 s", took)
		}
		unix.Close(file)
		ourFDs().waitFor(t, fdsBefore, "after a fuzzed exporter")
	})
}

// recvFromReceiver reads what FuzzReceiverHandshake's fake exporter
// expects next: a message of type want, whose body it returns, closing any
// descriptor attached. Anything else is an error of the test (t.Errorf,
// since the exporter runs on a goroutine of its own), and ok is false.
func recvFromReceiver(t *testing.T, c *conn, want uint8, when string) (body []byte, ok bool) {
	t.Helper()
	f, err := c.recv()
	closeFD(&f.FD)
	if err != nil || f.Type != want {
		t.Errorf("%s the receiver sent %s, %v; want a %s", when, msgName(f.Type), err, msgName(want))
		return nil, false
	}
	return f.Body, true
}

func firstName(msgs []rawMsg) string {
	if len(msgs) == 0 {
		return "none whole"
	}
	return msgName(msgs[0].Type)
}

// shiftPlan moves the offsets of a raw descriptor plan (3-byte entries) by
// delta bytes.
func shiftPlan(plan []byte, delta int) []byte {
	out := append([]byte(nil), plan...)
	for i := 0; i+3 <= len(out); i += 3 {
		at := int(out[i]) | int(out[i+1])<<8
		out[i], out[i+1] = byte(at+delta), byte((at+delta)>>8)
	}
	return out
}

// shiftPlan2 moves a parsed descriptor plan by delta bytes.
func shiftPlan2(plan []fdAttach, delta int) []fdAttach {
	out := make([]fdAttach, len(plan))
	for i, p := range plan {
		out[i] = fdAttach{p.at + delta, p.n}
	}
	return out
}
