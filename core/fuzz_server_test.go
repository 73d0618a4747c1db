package core

import (
	"os"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Fuzz targets for a live server against a fuzzed client: its session after
// each kind of start, and its handshake with proofs that are fuzzed, nearly
// right or right.

// Session prefixes chosen by the low bits of FuzzServerSession's mode: only
// the first one authenticates, so only it may ever see a descriptor.
const (
	prefixAuthenticated = iota // the whole handshake, done right
	prefixNone                 // nothing: the fuzzed bytes are the first ones
	prefixWrongSecret          // hello, then a proof under another secret
	prefixUnknownID            // hello for a registration that does not exist
)

// FuzzServerSession connects to a live server, runs the start chosen by
// mode (bit 4: a one-round confirmation) and then sends the fuzzed bytes, reading until the server closes.
// The server must answer with well-formed messages only, never give a
// descriptor, a welcome or a chunk to a client that did not prove it knows
// the secret, attach descriptors only to chunk messages, serve chunks in
// order, and leak no descriptor and no goroutine.
func FuzzServerSession(f *testing.F) {
	quietFDs(f)
	pulls := func(ps ...pullMsg) []byte {
		var b []byte
		for _, p := range ps {
			b = append(b, p.encode()...)
		}
		return b
	}
	full := append(pulls(pullMsg{0, 2}, pullMsg{2, 2}), encodeMsg(msgDone, nil)...)
	f.Add(uint8(prefixAuthenticated), full)
	f.Add(uint8(prefixAuthenticated), pulls(pullMsg{0, 4}))
	f.Add(uint8(prefixAuthenticated), pulls(pullMsg{1, 1}))
	f.Add(uint8(prefixAuthenticated), pulls(pullMsg{0, 5}))
	f.Add(uint8(prefixAuthenticated), append(pulls(pullMsg{0, 1}), encodeMsg(msgDone, nil)...))
	f.Add(uint8(prefixAuthenticated), append(pulls(pullMsg{0, 1}), helloMsg{}.encode()...))
	f.Add(uint8(prefixNone), full)
	f.Add(uint8(prefixNone), helloMsg{RegID: 1}.encode())
	f.Add(uint8(prefixNone), cat(statusMsg{BufferID: 1}.encode(), statusMsg{BufferID: 2}.encode(), pullMsg{0, 1}.encode()))
	f.Add(uint8(prefixWrongSecret), full)
	f.Add(uint8(prefixUnknownID), full)
	f.Add(uint8(prefixNone), []byte("GET / HTTP/1.0\r\n\r\n"))
	f.Add(uint8(prefixAuthenticated|1<<2), full)
	f.Add(uint8(prefixAuthenticated|2<<2), full)
	f.Add(uint8(prefixAuthenticated|3<<2), full)
	f.Add(uint8(prefixNone|1<<2), full)
	runs := func(ps ...pullMsg) []byte {
		var b []byte
		for _, p := range ps {
			b = append(b, p.encodeRun()...)
		}
		return b
	}
	f.Add(uint8(prefixAuthenticated), append(runs(pullMsg{0, 4}), encodeMsg(msgDone, nil)...))
	f.Add(uint8(prefixAuthenticated), cat(runs(pullMsg{0, 1}), pulls(pullMsg{1, 1}), runs(pullMsg{2, 2}), encodeMsg(msgDone, nil)))
	f.Add(uint8(prefixAuthenticated), runs(pullMsg{0, 5}))
	f.Add(uint8(prefixAuthenticated), runs(pullMsg{0, 2}, pullMsg{1, 1}))
	f.Add(uint8(prefixAuthenticated|1<<2), runs(pullMsg{0, 4}))
	// One-round confirmations (bit 4): right, and under a wrong secret.
	f.Add(uint8(prefixAuthenticated|1<<4), []byte{})
	f.Add(uint8(prefixAuthenticated|1<<4), full)
	f.Add(uint8(prefixAuthenticated|1<<4|1<<2), full)
	f.Add(uint8(prefixWrongSecret|1<<4), full)
	f.Fuzz(func(t *testing.T, mode uint8, data []byte) {
		if len(data) > 1<<20 {
			return
		}
		_, tk := fuzzServer(t)
		fdsBefore, gBefore := ourFDs().now(t), runtime.NumGoroutine()
		var fd int
		authed, confirm := false, false
		switch {
		case mode&(1<<4) != 0 && mode%4 == prefixAuthenticated:
			fd = rawOneRoundAuthenticate(t, tk)
			authed, confirm = true, true
		case mode&(1<<4) != 0 && mode%4 == prefixWrongSecret:
			bad := tk.Secret
			bad[0] ^= 0x80
			first, _ := rawOneRound(t, tk, bad, uint32(os.Getpid()), ourStartTime())
			var err error
			if fd, err = rawDial(tk.Address); err != nil {
				t.Fatal(err)
			}
			_ = rawWrite(fd, first)
		case mode%4 == prefixAuthenticated:
			fd = rawAuthenticate(t, tk, 0)
			authed = true
		case mode%4 == prefixNone:
			var err error
			if fd, err = rawDial(tk.Address); err != nil {
				t.Fatal(err)
			}
		case mode%4 == prefixWrongSecret:
			s, m := rawHello(t, tk, 0)
			if m.Type != msgChallenge {
				t.Fatalf("hello answered with %s", describeMsg(m))
			}
			bad := tk.Secret
			bad[0] ^= 0x80
			_ = rawWrite(s.fd, s.proof(bad))
			fd = s.fd
		default: // prefixUnknownID
			other := *tk
			other.RegID += 1000
			s, m := rawHello(t, &other, 0)
			if m.Type != msgError {
				t.Fatalf("hello for an unknown registration answered with %s", describeMsg(m))
			}
			fd = s.fd
		}
		// Bits 2-3 of mode attach descriptors from the client: to the
		// first fuzzed byte, to the middle one, or two to the last. The
		// server must close whatever it receives.
		var plan []fdAttach
		switch mode >> 2 & 3 {
		case 1:
			plan = []fdAttach{{0, 1}}
		case 2:
			plan = []fdAttach{{len(data) / 2, 1}}
		case 3:
			plan = []fdAttach{{len(data) - 1, 2}}
		}
		if len(data) == 0 {
			plan = nil
		}
		file := -1
		if len(plan) > 0 {
			file = newMemfd(t, 4096, pattern(4096, 1))
		}
		wrote := make(chan struct{})
		go func() {
			_ = sendWithFDs(fd, data, plan, file) // EPIPE once the server gave up is fine
			_ = unix.Shutdown(fd, unix.SHUT_WR)
			close(wrote)
		}()
		r := rawReadAll(fd, 5*time.Second)
		<-wrote
		unix.Close(fd)
		if file >= 0 {
			unix.Close(file)
		}
		checkRawReply(t, r, authed, confirm)
		ourFDs().waitFor(t, fdsBefore, "after a fuzzed session")
		waitGoroutines(t, gBefore)
	})
}

// checkRawReply checks everything a raw client read from a server.
func checkRawReply(t *testing.T, r rawReply, authed, confirm bool) {
	t.Helper()
	if r.Err != nil {
		t.Fatalf("reading the server's answer: %v (did the server hang?)", r.Err)
	}
	if r.Truncated {
		t.Fatal("the server sent more than one descriptor with a message")
	}
	msgs, err := splitMessages(r.Data)
	if err != nil {
		t.Fatalf("the server sent a malformed byte stream: %v", err)
	}
	if !authed && len(r.FDAt) > 0 {
		t.Fatalf("the server gave %d descriptor(s) to an unauthenticated client", len(r.FDAt))
	}
	if err := checkFDsOnChunks(msgs, r.FDAt); err != nil {
		t.Fatal(err)
	}
	checkServerReply(t, msgs, authed, confirm)
}

// What FuzzServerHandshake's client sends where the proof goes (mode & 3).
const (
	proofFuzzed     = iota // a proof message holding fuzzed bytes
	proofRaw               // fuzzed bytes, not even a proof message
	proofNearlyGood        // a real HMAC, of a transcript that differs (proof[0] picks how)
	proofGood              // the right proof
)

// FuzzServerHandshake is a fuzzed client transcript against a live server:
// a hello with fuzzed flags (bit 2 of mode: for a registration that does
// not exist), then, if challenged, a proof made as mode says, then fuzzed
// bytes. Unless the client sent the right proof, the server must send no
// welcome, no chunk, no done-ack and no descriptor; whatever it is sent, it
// must not hang, and it must leak no descriptor and no goroutine.
func FuzzServerHandshake(f *testing.F) {
	quietFDs(f)
	full := cat(pullMsg{0, 4}.encode(), encodeMsg(msgDone, nil))
	for _, m := range []uint8{proofFuzzed, proofRaw, proofGood, proofGood | 1<<2} {
		f.Add(m, uint64(0), make([]byte, proofSize), full)
	}
	for how := byte(0); how < nearMisses; how++ {
		f.Add(uint8(proofNearlyGood), uint64(0), []byte{how}, full)
	}
	f.Add(uint8(proofGood), helloConfirm, []byte{}, []byte{})
	f.Add(uint8(proofGood), helloConfirm|helloTable, []byte{}, spendLogMsg{}.encode())
	f.Add(uint8(proofGood), helloTable, []byte{}, cat(spendLogMsg{}.encode(), full))
	f.Add(uint8(proofGood), helloTable, []byte{}, cat(spendLogMsg{Records: spendRecords}.encode(), full))
	f.Add(uint8(proofNearlyGood), helloConfirm, []byte{2}, []byte{})
	f.Add(uint8(proofRaw), uint64(0), statusMsg{BufferID: 1}.encode(), full)
	f.Add(uint8(proofRaw), uint64(0), pullMsg{0, 4}.encode(), full)
	f.Add(uint8(proofFuzzed|1<<3), uint64(2), []byte{}, full)
	oneRound := helloConfirm | helloOneRound
	for _, m := range []uint8{proofFuzzed, proofRaw, proofGood, proofGood | 1<<2} {
		f.Add(m, oneRound, make([]byte, proofSize), []byte{})
	}
	for how := byte(0); how < nearMisses; how++ {
		f.Add(uint8(proofNearlyGood), oneRound, []byte{how}, []byte{})
	}
	f.Add(uint8(proofGood), oneRound|helloMore, []byte{}, encodeMsg(msgDone, nil))
	f.Add(uint8(proofGood), helloOneRound, []byte{}, full)
	f.Add(uint8(proofGood), oneRound|helloPidBound, []byte{}, []byte{})
	f.Fuzz(func(t *testing.T, mode uint8, flags uint64, proof, tail []byte) {
		if len(tail) > 1<<20 || len(proof) > 1<<16 {
			return
		}
		_, tk := fuzzServer(t)
		if mode&(1<<3) == 0 {
			flags &= helloKnown // mostly known flags, else most runs stop at the hello
		}
		flags &^= helloLease // a lease's grant rightly carries a descriptor (FuzzLeaseSession covers it)
		target := tk
		if mode&(1<<2) != 0 {
			other := *tk
			other.RegID += 1 + uint64(mode>>4)
			target = &other
		}
		fdsBefore, gBefore := ourFDs().now(t), runtime.NumGoroutine()
		if flags&helloOneRound != 0 {
			fuzzOneRoundHandshake(t, tk, target, mode, flags, proof, tail)
			ourFDs().waitFor(t, fdsBefore, "after a fuzzed one-round handshake")
			waitGoroutines(t, gBefore)
			return
		}
		s, first := rawHello(t, target, flags)
		authed := false
		var send []byte
		if first.Type == msgChallenge {
			switch mode & 3 {
			case proofFuzzed:
				var m proofMsg
				copy(m.Proof[:], proof)
				send = m.encode()
			case proofRaw:
				send = proof
			case proofNearlyGood:
				send = proofMsg{Proof: nearMissProof(s.tr, tk.Secret, roleReceiver, proof)}.encode()
			case proofGood:
				send, authed = s.proof(tk.Secret), true
			}
		} else if first.Type != msgError && first.Type != msgBusy {
			t.Fatalf("hello answered with %s", describeMsg(first))
		}
		wrote := make(chan struct{})
		go func() {
			_ = rawWrite(s.fd, cat(send, tail)) // EPIPE once the server gave up is fine
			_ = unix.Shutdown(s.fd, unix.SHUT_WR)
			close(wrote)
		}()
		r := rawReadAll(s.fd, 5*time.Second)
		<-wrote
		if first.Type != msgChallenge && len(r.Data) > 0 {
			t.Fatalf("the server said %d more bytes after refusing the hello with %s", len(r.Data), describeMsg(first))
		}
		checkRawReply(t, r, authed, flags&helloConfirm != 0)
		if authed {
			msgs, _ := splitMessages(r.Data)
			// Asked for its table, the server waits for the client's
			// answer to it (a spend-log) before the welcome: fuzzed bytes
			// that are none get a refusal.
			if len(msgs) > 0 && msgs[0].Type == msgTable && flags&helloTable != 0 {
				tm, _ := parseTable(msgs[0].Body)
				msgs = msgs[1:]
				if tm.Slots != 0 {
					// The client can send no descriptor: only "no log"
					// (0 records) is an answer; anything else is refused.
					if !noSpendLog(tail) {
						if len(msgs) > 1 || (len(msgs) == 1 && msgs[0].Type != msgError) {
							t.Fatalf("a table answered with %q got %s, want a refusal or nothing", tail, describeAll(msgs))
						}
						msgs = []rawMsg{{Type: msgWelcome}} // refused for the answer, not the proof
					} else if len(msgs) == 0 || msgs[0].Type != msgLogAck {
						t.Fatalf("no log-ack after the client's answer to the table: %s", describeAll(msgs))
					} else {
						msgs = msgs[1:]
					}
				}
			}
			if len(msgs) == 0 || msgs[0].Type != msgWelcome {
				t.Fatalf("the right proof was not welcomed (%d messages)", len(msgs))
			}
		}
		unix.Close(s.fd)
		ourFDs().waitFor(t, fdsBefore, "after a fuzzed handshake")
		waitGoroutines(t, gBefore)
	})
}

// fuzzOneRoundHandshake is FuzzServerHandshake's client in the one-round
// form (handshake.go): hello, the proof made as mode says, and the fuzzed
// tail, in one write. The server must prove itself (a challenge) only to a
// client whose proof checked out, before anything else, and answer an
// unauthenticated one with at most one error.
func fuzzOneRoundHandshake(t *testing.T, tk, target *Ticket, mode uint8, flags uint64, proof, tail []byte) {
	fd, err := rawDial(target.Address)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	tr := transcript{RegID: target.RegID, Flags: flags, Socket: uint64(os.Getpid()), StartTime: ourStartTime()}
	if tr.ReceiverNonce, err = newNonce(); err != nil {
		t.Fatal(err)
	}
	if tr.TicketDigest, err = target.Digest(); err != nil {
		t.Fatal(err)
	}
	send := helloMsg{RegID: target.RegID, Flags: flags, Nonce: tr.ReceiverNonce}.encode()
	switch mode & 3 {
	case proofFuzzed:
		var m proofMsg
		copy(m.Proof[:], proof)
		send = cat(send, m.encode())
	case proofRaw:
		send = cat(send, proof)
	case proofNearlyGood:
		send = cat(send, proofMsg{Proof: nearMissProof(tr, tk.Secret, roleReceiver, proof)}.encode())
	case proofGood:
		send = cat(send, proofMsg{Proof: tr.proof(tk.Secret, roleReceiver)}.encode())
	}
	wrote := make(chan struct{})
	go func() {
		_ = rawWrite(fd, cat(send, tail)) // EPIPE once the server gave up is fine
		_ = unix.Shutdown(fd, unix.SHUT_WR)
		close(wrote)
	}()
	r := rawReadAll(fd, 5*time.Second)
	<-wrote
	if r.Err != nil {
		t.Fatalf("reading the server's answer: %v (did the server hang?)", r.Err)
	}
	msgs, err := splitMessages(r.Data)
	if err != nil {
		t.Fatalf("the server sent a malformed byte stream: %v", err)
	}
	if len(msgs) == 0 || msgs[0].Type != msgChallenge {
		checkRawReply(t, r, false, false)
		for _, m := range msgs {
			if m.Type == msgChallenge {
				t.Fatal("a one-round server sent its proof after something else")
			}
		}
		return
	}
	ch, err := parseChallenge(msgs[0].Body)
	if err != nil {
		t.Fatal(err)
	}
	if mode&3 != proofGood || target != tk {
		t.Fatalf("a one-round server proved itself to a client that did not prove it knows the secret (mode %d)", mode)
	}
	if ch.Nonce != (nonce{}) || !tr.verify(tk.Secret, roleServer, ch.Proof) {
		t.Fatal("a one-round server's proof does not check out")
	}
	r.Data = r.Data[headerSize+challengeSize:]
	for i := range r.FDAt {
		r.FDAt[i] -= headerSize + challengeSize
	}
	checkRawReply(t, r, true, flags&helloConfirm != 0)
}

// nearMisses is how many ways nearMissProof knows to get a proof almost
// right.
const nearMisses = 11

// nearMissProof is a real HMAC that is not the proof for role in tr, as
// how[0] picks: of the other role (a reflected proof), under another
// secret, with another exporter socket or none, the flags, the registration, the ticket digest
// or the server's nonce changed, the right proof with one bit flipped
// (how[1] picks the bit), the other form's (one round or two) or a stale
// start time.
func nearMissProof(tr transcript, secret Secret, role byte, how []byte) [proofSize]byte {
	pick, bit := byte(0), byte(0)
	if len(how) > 0 {
		pick = how[0] % nearMisses
	}
	if len(how) > 1 {
		bit = how[1]
	}
	switch pick {
	case 0:
		role = roleServer + roleReceiver - role
	case 1:
		secret[bit%32] ^= 1 << (bit % 8)
	case 2:
		tr.Socket++
	case 3:
		tr.Socket = 0
	case 4:
		tr.Flags ^= helloConfirm
	case 5:
		tr.RegID++
	case 6:
		tr.TicketDigest[bit%32] ^= 1
	case 7:
		tr.ServerNonce[bit%nonceSize] ^= 1
	case 8:
		p := tr.proof(secret, role)
		p[bit%proofSize] ^= 1 << (bit % 8)
		return p
	case 9:
		tr.Flags ^= helloOneRound // the other form's proof
	case 10:
		tr.Flags |= helloOneRound
		tr.StartTime++ // a stale start time (or, in two rounds, the other form)
	}
	return tr.proof(secret, role)
}

// noSpendLog reports whether b begins with a whole spend-log message
// saying "no log" (a client's answer to the grant table without a
// descriptor).
func noSpendLog(b []byte) bool {
	if len(b) < headerSize {
		return false
	}
	h, err := parseHeader(b[:headerSize])
	if err != nil || h.Type != msgSpendLog || len(b) < headerSize+int(h.Len) {
		return false
	}
	m, err := parseSpendLog(b[headerSize : headerSize+int(h.Len)])
	return err == nil && m.Records == 0
}
