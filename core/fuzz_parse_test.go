package core

import (
	"bytes"
	"encoding/binary"
	"testing"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// Fuzz targets for everything that parses bytes from someone else: here
// the decoders (tickets, sock_diag replies, headers, every wire message);
// conn.recv with descriptors attached anywhere and the receiver's stream
// against a fuzzed sender in fuzz_stream_test.go; a live server against a
// fuzzed client (its handshake and its session) in fuzz_server_test.go; a
// real receiver's handshake against a fuzzed fake exporter in
// fuzz_receiver_test.go. Their peers live in fuzzpeer_test.go. Seeds live
// in testdata/fuzz/<FuzzName>/ and run with every `go test`;
// `go test -run=^$ -fuzz=^FuzzX$ ./core` explores further.

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
		if m.Code < firstCode || m.Code > EINVAL {
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
