package core

import (
	"bytes"
	"encoding/binary"
	"net"
	"runtime"
	"testing"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// Fuzz targets for everything that parses bytes from someone else: tickets,
// every wire message, conn.recv with descriptors attached anywhere, the
// receiver's stream against a fuzzed sender, a live server against a
// fuzzed client (its handshake and its session), and a real receiver's
// handshake against a fuzzed fake exporter. Their peers live in
// fuzzpeer_test.go. Seeds live in testdata/fuzz/<FuzzName>/ and run with
// every `go test`; `go test -run=^$ -fuzz=^FuzzX$ ./core` explores further.

// refused reports whether err refused the fuzzed input, and fails the test
// unless it is EINVAL: the one status bad bytes from a peer may be refused
// with.
func refused(t *testing.T, what string, err error) bool {
	t.Helper()
	if err == nil {
		return false
	}
	if CodeOf(err) != EINVAL {
		t.Fatalf("%s failed with %v, want EINVAL: %v", what, CodeOf(err), err)
	}
	return true
}

func FuzzDecodeTicket(f *testing.F) {
	good, _ := sampleTicket().Marshal()
	f.Add(good[:])
	cuda := sampleTicket()
	cuda.Kind, cuda.Address, cuda.DeviceUUID = MemoryCUDA, "/tmp/vmmipc.sock", [16]byte{1, 2, 3}
	b, _ := cuda.Marshal()
	f.Add(b[:])
	f.Add(good[:100])
	f.Add(make([]byte, TicketSize))
	for _, pos := range []int{offNSDev, offPidNS, offReserved, offReserved2 + 7} {
		bad := good
		bad[pos] ^= 0xff // no device, another namespace, reserved bytes
		f.Add(bad[:])
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		tk, err := DecodeTicket(data)
		if refused(t, "decode", err) {
			return
		}
		again, err := tk.Marshal()
		if err != nil {
			t.Fatalf("a decoded ticket does not marshal: %v (%s)", err, tk)
		}
		if !bytes.Equal(again[:], data) {
			t.Fatalf("re-marshalled ticket differs:\n in  %x\n out %x", data, again[:])
		}
	})
}

// FuzzTicketMarshal checks the other direction: whatever Marshal accepts,
// DecodeTicket reads back as the same ticket.
func FuzzTicketMarshal(f *testing.F) {
	s := sampleTicket()
	var ns [32]byte
	binary.LittleEndian.PutUint64(ns[0:], s.NS.Dev)
	binary.LittleEndian.PutUint64(ns[8:], s.NS.PID)
	f.Add(s.Kind, s.Address, s.Pid, s.StartTime, s.RegID, s.BufferID, s.Count, s.Total, s.Secret[:], []byte{}, ns[:])
	f.Add(MemoryCUDA, "/run/x.sock", uint32(1), uint64(0), uint64(1), uint64(1), uint64(1), uint64(1), []byte{1}, []byte{9}, []byte{})
	f.Add(MemoryHost, "relative.sock", uint32(1), uint64(1), uint64(1), uint64(1), uint64(1), uint64(1), []byte{}, []byte{}, []byte{})
	f.Add(MemoryHost, "@x", uint32(1), uint64(1), uint64(1), uint64(1), uint64(1), uint64(1), []byte{}, []byte{1}, []byte{})
	f.Add(MemoryHost, "@x", uint32(1), uint64(1), uint64(1), uint64(1), uint64(1), uint64(1), []byte{}, []byte{}, ns[8:])
	f.Fuzz(func(t *testing.T, kind uint8, addr string, pid uint32, start, regID, bufID, count, total uint64, secret, uuid, nsBytes []byte) {
		in := &Ticket{Kind: kind, Address: addr, Pid: pid, StartTime: start, RegID: regID, BufferID: bufID, Count: count, Total: total}
		copy(in.Secret[:], secret)
		copy(in.DeviceUUID[:], uuid)
		var ns [32]byte
		copy(ns[:], nsBytes)
		in.NS = Namespaces{binary.LittleEndian.Uint64(ns[0:]), binary.LittleEndian.Uint64(ns[8:]), binary.LittleEndian.Uint64(ns[16:]), binary.LittleEndian.Uint64(ns[24:])}
		b, err := in.Marshal()
		if refused(t, "marshal", err) {
			return
		}
		if in.Kind == MemoryHost && in.DeviceUUID != [16]byte{} {
			t.Fatalf("Marshal accepted a host ticket with a device UUID: %s", in)
		}
		out, err := DecodeTicket(b[:])
		if err != nil {
			t.Fatalf("Marshal accepted %s but DecodeTicket refuses it: %v", in, err)
		}
		if *out != *in {
			t.Fatalf("round trip changed the ticket:\n in  %+v\n out %+v", in, out)
		}
	})
}

// FuzzParseSockDiag: whatever sock_diag answers, parsing it neither
// panics nor reads past it, and a socket is named only by an answer about
// the socket asked for.
func FuzzParseSockDiag(f *testing.F) {
	reply := binary.LittleEndian.AppendUint32(nil, 48)
	reply = binary.LittleEndian.AppendUint16(reply, unix.SOCK_DIAG_BY_FAMILY)
	reply = append(reply, make([]byte, 10)...)
	reply = append(reply, unix.AF_UNIX, unix.SOCK_STREAM, 1, 0)
	reply = binary.LittleEndian.AppendUint32(reply, 13850)                 // inode
	reply = binary.LittleEndian.AppendUint64(reply, 0x0000_0001_0000_2f52) // cookie
	reply = append(reply, 8, 0, unixDiagPeerAtt, 0)
	reply = binary.LittleEndian.AppendUint32(reply, 13851)
	reply = append(reply, 5, 0, 6, 0, 0, 0, 0, 0) // another attribute, padded
	f.Add(reply, uint32(13850))
	f.Add(reply, uint32(13851))
	f.Add(reply[:30], uint32(13850))
	f.Fuzz(func(t *testing.T, b []byte, ino uint32) {
		d, err := parseSockDiag(b, uint64(ino))
		if err == nil && (len(b) < unix.SizeofNlMsghdr+unixDiagMsgSize || uint64(binary.LittleEndian.Uint32(b[unix.SizeofNlMsghdr+4:])) != uint64(ino)) {
			t.Fatalf("parsed %+v from an answer about another socket or too short", d)
		}
	})
}

func FuzzParseHeader(f *testing.F) {
	for _, m := range [][]byte{
		helloMsg{RegID: 1}.encode(), challengeMsg{}.encode(), proofMsg{}.encode(),
		welcomeMsg{Count: 1, Total: 1, Kind: 1, BufferID: 1}.encode(),
		pullMsg{Count: 1}.encode(), chunkMsg{}.encode(), encodeMsg(msgDone, nil),
		errorMsg{Code: EIO, Text: "x"}.encode(), doneAckMsg{}.encode(), encodeMsg(msgBusy, nil),
		statusMsg{BufferID: 1}.encode(), statusAckMsg{BufferID: 1, Alive: true}.encode(),
		pullMsg{Count: 1}.encodeRun(), runMsg{Count: 1}.encode(),
	} {
		f.Add(m[:headerSize])
	}
	f.Add([]byte("VMIP\x02\x06\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00"))
	f.Add([]byte("VMIP\x01\x01\x00\x00\x30\x00\x00\x00\x00\x00\x00\x00")) // protocol 1's hello
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseHeader(b)
		if refused(t, "parseHeader", err) {
			return
		}
		if h.Len > errorHead+maxErrorText {
			t.Fatalf("accepted a body of %d bytes", h.Len)
		}
		var again [headerSize]byte
		putHeader(again[:], h.Type, int(h.Len))
		if !bytes.Equal(again[:], b) {
			t.Fatalf("re-encoded header differs: %x vs %x", again, b)
		}
	})
}

// roundTrip is the property shared by the fixed-size body parsers: a body
// that parses re-encodes to the same bytes, and a failure is EINVAL.
func roundTrip[M any](t *testing.T, body []byte, parse func([]byte) (M, error), encode func(M) []byte) {
	m, err := parse(body)
	if refused(t, "parse", err) {
		return
	}
	if again := encode(m)[headerSize:]; !bytes.Equal(again, body) {
		t.Fatalf("re-encoded body differs:\n in  %x\n out %x", body, again)
	}
}

func FuzzParseHello(f *testing.F) {
	f.Add(helloMsg{RegID: 3, Nonce: nonce{1, 2}}.encode()[headerSize:])
	f.Add(helloMsg{Flags: helloConfirm}.encode()[headerSize:])
	f.Add(helloMsg{Flags: 2}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseHello, helloMsg.encode)
	})
}

func FuzzParseChallenge(f *testing.F) {
	f.Add(challengeMsg{Nonce: nonce{1}, Proof: [proofSize]byte{2}}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseChallenge, challengeMsg.encode)
	})
}

func FuzzParseProof(f *testing.F) {
	f.Add(proofMsg{Proof: [proofSize]byte{9}}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseProof, proofMsg.encode)
	})
}

// FuzzParsePull covers pull and pull-run, which share a body.
func FuzzParsePull(f *testing.F) {
	f.Add(pullMsg{First: 5, Count: 16}.encode()[headerSize:])
	f.Add(pullMsg{First: 0, Count: 1 << 26}.encodeRun()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parsePull, pullMsg.encode)
		roundTrip(t, body, parsePull, pullMsg.encodeRun)
	})
}

func FuzzParseWelcome(f *testing.F) {
	f.Add(welcomeMsg{Count: 4, Total: 4096 * 4, Kind: MemoryHost, BufferID: 9}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseWelcome, welcomeMsg.encode)
	})
}

func FuzzParseChunk(f *testing.F) {
	f.Add(chunkMsg{Index: 2, Offset: 8192, Size: 4096, FileOffset: 8192}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseChunk, chunkMsg.encode)
	})
}

func FuzzParseRun(f *testing.F) {
	f.Add(runMsg{Index: 0, Count: 512, Offset: 0, Size: 1 << 30, FileOffset: 0}.encode()[headerSize:])
	f.Add(runMsg{Index: 3, Count: 1, Offset: 3 << 21, Size: 1 << 21, FileOffset: 3 << 21}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseRun, runMsg.encode)
	})
}

func FuzzParseDoneAck(f *testing.F) {
	f.Add(doneAckMsg{Flags: ackBufferLives}.encode()[headerSize:])
	f.Add(doneAckMsg{Flags: 2}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseDoneAck, doneAckMsg.encode)
	})
}

func FuzzParseStatus(f *testing.F) {
	f.Add(statusMsg{BufferID: 5}.encode()[headerSize:])
	f.Add(statusAckMsg{BufferID: 5, Alive: true}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseStatus, statusMsg.encode)
		roundTrip(t, body, parseStatusAck, statusAckMsg.encode)
	})
}

func FuzzParseError(f *testing.F) {
	f.Add(errorMsg{Code: EEXPORT, Text: "chunk 17 of 64: export failed"}.encode()[headerSize:])
	f.Add(errorMsg{Code: EAUTH, Text: ""}.encode()[headerSize:])
	f.Add(errorMsg{Code: ETIMEDOUT, Text: "x"}.encode()[headerSize:])
	f.Add(append(errorMsg{Code: EIO}.encode()[headerSize:], 0xff, 0xfe))
	f.Fuzz(func(t *testing.T, body []byte) {
		m, err := parseError(body)
		if refused(t, "parseError", err) {
			return
		}
		if m.Code < ETIMEDOUT || m.Code > EINVAL {
			t.Fatalf("accepted status %d", m.Code)
		}
		if !utf8.ValidString(m.Text) || len(m.Text) > maxErrorText {
			t.Fatalf("accepted text %q", m.Text)
		}
		if utf8.Valid(body[errorHead:]) {
			if again := m.encode()[headerSize:]; !bytes.Equal(again, body) {
				t.Fatalf("re-encoded body differs:\n in  %x\n out %x", body, again)
			}
		}
	})
}

// FuzzConnRecv feeds a socket fuzzed bytes with descriptors attached at
// fuzzed places. mode bit 0 picks the reader: conn.recv in a loop, or a
// receiver Stream past its handshake (pulls, chunks, done) as Open leaves
// it; bit 1 has that Stream ask for runs (NextRun, as an import of host
// memory does) rather than chunks. Every descriptor that arrives must be
// handed out or closed: the descriptor count comes back to where it was.
func FuzzConnRecv(f *testing.F) {
	good, goodPlan := streamTranscript(4*4096, 4)
	f.Add(uint8(1), good, goodPlan)
	run, runPlan := runTranscript(4*4096, 4, 4)
	f.Add(uint8(3), run, runPlan)
	split, splitPlan := runTranscript(4*4096, 4, 1)
	f.Add(uint8(3), split, splitPlan)
	f.Add(uint8(3), good, goodPlan)
	f.Add(uint8(1), run, runPlan)
	f.Add(uint8(0), good, goodPlan)
	f.Add(uint8(3), good, append(goodPlan, 0, 0, 2))
	f.Add(uint8(1), errorMsg{Code: ENOENT, Text: "used up"}.encode(), []byte{})
	f.Add(uint8(0), errorMsg{Code: EEXPORT, Text: "x"}.encode(), []byte{3, 0, 1})
	f.Add(uint8(0), []byte("garbage that is not a header at all"), []byte{0, 0, 1})
	f.Fuzz(func(t *testing.T, mode uint8, data, rawPlan []byte) {
		if len(data) > 64<<10 {
			return
		}
		before := ourFDs().now(t)
		sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		file := newMemfd(t, 4*4096, pattern(4*4096, 3))
		plan := parseFDPlan(rawPlan, len(data))
		sent := make(chan error, 1)
		go func() {
			err := sendWithFDs(sp[1], data, plan, file)
			_ = unix.Shutdown(sp[1], unix.SHUT_WR)
			sent <- err
		}()
		c := socketConn(t, sp[0], "receiver")
		start := time.Now()
		if mode&1 == 0 {
			fuzzRecvLoop(t, c, len(data))
		} else {
			fuzzStream(t, c, mode)
		}
		if d := time.Since(start); d > 4*time.Second {
			t.Fatalf("reading %d bytes that were all sent took %v", len(data), d)
		}
		c.Close()
		if err := <-sent; err != nil && err != unix.EPIPE && err != unix.ECONNRESET {
			t.Fatalf("sending: %v", err)
		}
		unix.Close(sp[1])
		unix.Close(file)
		ourFDs().waitFor(t, before, "after a fuzzed stream")
	})
}

func fuzzRecvLoop(t *testing.T, c *conn, n int) {
	for i := 0; i <= n/headerSize; i++ {
		fr, err := c.recv()
		if err != nil {
			if fr.FD >= 0 {
				t.Fatalf("recv failed (%v) but handed out descriptor %d", err, fr.FD)
			}
			// Never ENFILE: there are descriptors to spare, so a
			// truncated control message means the peer sent too many.
			if code := CodeOf(err); code != EINVAL && code != EIO {
				t.Fatalf("recv: unexpected status %v: %v", code, err)
			}
			return
		}
		want := bodySizes[fr.Type]
		if fr.Type == msgError {
			if len(fr.Body) < errorHead || len(fr.Body) > errorHead+maxErrorText {
				t.Fatalf("error body of %d bytes", len(fr.Body))
			}
		} else if len(fr.Body) != want {
			t.Fatalf("%s body of %d bytes, want %d", msgName(fr.Type), len(fr.Body), want)
		}
		closeFD(&fr.FD)
	}
}

// fuzzStream reads chunks (or runs, mode bit 1) as a Stream that has just
// been welcomed.
func fuzzStream(t *testing.T, c *conn, mode uint8) {
	tk := sampleTicket()
	s := &Stream{c: c, t: tk, window: uint64(mode>>2)%8 + 1}
	checkStreamChunks(t, s, tk, mode&2 != 0)
}

// checkStreamChunks pulls every chunk of s, one by one or in runs,
// checking each against the ticket and closing its descriptor; errors must
// be sticky.
func checkStreamChunks(t *testing.T, s *Stream, tk *Ticket, runs bool) {
	next := func() (Run, error) {
		ch, err := s.Next()
		return Run{Chunk: ch, Count: 1}, err
	}
	if runs {
		next = s.NextRun
	}
	var i, offset uint64
	for calls := uint64(0); calls <= tk.Count+1; calls++ {
		r, err := next()
		if err != nil {
			if r.FD >= 0 {
				t.Fatalf("Next failed (%v) but handed out descriptor %d", err, r.FD)
			}
			if IsEnd(err) {
				if i != tk.Count || offset != tk.Total {
					t.Fatalf("End after %d chunks / %d bytes of %d / %d", i, offset, tk.Count, tk.Total)
				}
				return
			}
			if _, again := next(); again != err {
				t.Fatalf("stream error is not sticky: %v then %v", err, again)
			}
			return
		}
		if _, ferr := unix.FcntlInt(uintptr(r.FD), unix.F_GETFD, 0); ferr != nil {
			t.Fatalf("%s: descriptor %d is not open", r.chunks(), r.FD)
		}
		unix.Close(r.FD)
		if r.Index != i || r.Offset != offset || r.Count == 0 || r.Count > tk.Count-i || r.Size < r.Count ||
			r.Offset+r.Size > tk.Total || tk.Total-(r.Offset+r.Size) < tk.Count-i-r.Count ||
			(i+r.Count == tk.Count && r.Offset+r.Size != tk.Total) || r.FileOffset+r.Size < r.FileOffset {
			t.Fatalf("stream accepted %+v as %d chunks from chunk %d at offset %d of %d", r, r.Count, i, offset, tk.Total)
		}
		i += r.Count
		offset += r.Size
	}
	t.Fatalf("stream handed out more than %d chunks", tk.Count)
}

// Session prefixes chosen by the low bits of FuzzServerSession's mode: only
// the first one authenticates, so only it may ever see a descriptor.
const (
	prefixAuthenticated = iota // the whole handshake, done right
	prefixNone                 // nothing: the fuzzed bytes are the first ones
	prefixWrongSecret          // hello, then a proof under another secret
	prefixUnknownID            // hello for a registration that does not exist
)

// FuzzServerSession connects to a live server, runs the start chosen by
// mode and then sends the fuzzed bytes, reading until the server closes.
// The server must answer with well-formed messages only, never give a
// descriptor, a welcome or a chunk to a client that did not prove it knows
// the secret, attach descriptors only to chunk messages, serve chunks in
// order, and leak no descriptor and no goroutine.
func FuzzServerSession(f *testing.F) {
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
	f.Fuzz(func(t *testing.T, mode uint8, data []byte) {
		if len(data) > 1<<20 {
			return
		}
		_, tk := fuzzServer(t)
		fdsBefore, gBefore := ourFDs().now(t), runtime.NumGoroutine()
		var fd int
		authed := false
		switch mode % 4 {
		case prefixAuthenticated:
			fd = rawAuthenticate(t, tk, 0)
			authed = true
		case prefixNone:
			var err error
			if fd, err = rawDial(tk.Address); err != nil {
				t.Fatal(err)
			}
		case prefixWrongSecret:
			s, m := rawHello(t, tk, 0)
			if m.Type != msgChallenge {
				t.Fatalf("hello answered with %s", describeMsg(m))
			}
			bad := tk.Secret
			bad[0] ^= 0x80
			_ = rawWrite(s.fd, s.proof(bad))
			fd = s.fd
		case prefixUnknownID:
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
		checkRawReply(t, r, authed, false)
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
	full := cat(pullMsg{0, 4}.encode(), encodeMsg(msgDone, nil))
	for _, m := range []uint8{proofFuzzed, proofRaw, proofGood, proofGood | 1<<2} {
		f.Add(m, uint64(0), make([]byte, proofSize), full)
	}
	for how := byte(0); how < nearMisses; how++ {
		f.Add(uint8(proofNearlyGood), uint64(0), []byte{how}, full)
	}
	f.Add(uint8(proofGood), helloConfirm, []byte{}, []byte{})
	f.Add(uint8(proofNearlyGood), helloConfirm, []byte{2}, []byte{})
	f.Add(uint8(proofRaw), uint64(0), statusMsg{BufferID: 1}.encode(), full)
	f.Add(uint8(proofRaw), uint64(0), pullMsg{0, 4}.encode(), full)
	f.Add(uint8(proofFuzzed|1<<3), uint64(2), []byte{}, full)
	f.Fuzz(func(t *testing.T, mode uint8, flags uint64, proof, tail []byte) {
		if len(tail) > 1<<20 || len(proof) > 1<<16 {
			return
		}
		_, tk := fuzzServer(t)
		if mode&(1<<3) == 0 {
			flags &= helloKnown // mostly known flags, else most runs stop at the hello
		}
		target := tk
		if mode&(1<<2) != 0 {
			other := *tk
			other.RegID += 1 + uint64(mode>>4)
			target = &other
		}
		fdsBefore, gBefore := ourFDs().now(t), runtime.NumGoroutine()
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
			if msgs, _ := splitMessages(r.Data); len(msgs) == 0 || msgs[0].Type != msgWelcome {
				t.Fatalf("the right proof was not welcomed (%d messages)", len(msgs))
			}
		}
		unix.Close(s.fd)
		ourFDs().waitFor(t, fdsBefore, "after a fuzzed handshake")
		waitGoroutines(t, gBefore)
	})
}

// nearMisses is how many ways nearMissProof knows to get a proof almost
// right.
const nearMisses = 9

// nearMissProof is a real HMAC that is not the proof for role in tr, as
// how[0] picks: of the other role (a reflected proof), under another
// secret, with another exporter socket or none, the flags, the registration, the ticket digest
// or the server's nonce changed, or the right proof with one bit flipped
// (how[1] picks the bit).
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
	}
	return tr.proof(secret, role)
}

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
// stands between the receiver and whatever it is sent. Without the right
// server proof, Open must fail, the receiver must not send its own proof
// (or anything else after its hello), and every descriptor it was sent must
// be closed. With it, the receiver's proof must check out, and the stream
// that follows must hand out only chunks that fit the ticket.
func FuzzReceiverHandshake(f *testing.F) {
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
	f.Fuzz(func(t *testing.T, mode uint8, challenge, data, rawPlan []byte) {
		if len(data) > 64<<10 {
			return
		}
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
			if err != nil || hello.RegID != tk.RegID || hello.Flags != 0 {
				t.Errorf("the receiver's hello %+v, %v", hello, err)
				return
			}
			tr := serverTranscript(t, uc, tk, hello)
			raw, _ := uc.SyscallConn()
			var sendErr error
			send := func(b []byte, plan []fdAttach) {
				_ = raw.Write(func(s uintptr) bool {
					sendErr = sendWithFDs(int(s), b, plan, file)
					return true
				})
			}
			plan := parseFDPlan(rawPlan, len(data))
			switch mode & 3 {
			case answerFuzzed:
				send(data, plan)
			case answerBadProof:
				var m challengeMsg
				copy(m.Nonce[:], challenge)
				copy(m.Proof[:], challenge[min(len(challenge), nonceSize):])
				send(cat(m.encode(), data), shiftPlan2(plan, headerSize+challengeSize))
			case answerNearlyGood:
				tr.ServerNonce, _ = newNonce()
				m := challengeMsg{Nonce: tr.ServerNonce, Proof: nearMissProof(tr, tk.Secret, roleServer, challenge)}
				send(cat(m.encode(), data), shiftPlan2(plan, headerSize+challengeSize))
			case answerGood:
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
		s, err := Open(fake.tk, OpenOptions{Timeout: 2 * time.Second, Window: 2})
		if err == nil {
			checkStreamChunks(t, s, fake.tk, mode&4 != 0)
			s.Close()
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
