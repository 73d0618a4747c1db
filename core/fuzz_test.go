package core

import (
	"bytes"
	"encoding/binary"
	"net"
	"os"
	"runtime"
	"sort"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// Fuzz targets for everything that parses bytes from someone else: tickets,
// every wire message, conn.recv with descriptors attached anywhere, the
// receiver's stream against a fuzzed sender, and a live server against a
// fuzzed client. Seeds live in testdata/fuzz/<FuzzName>/ and run with every
// `go test`; `go test -run=^$ -fuzz=^FuzzX$ ./core` explores further.

// sampleTicket is a well-formed ticket used as a seed.
func sampleTicket() *Ticket {
	t := &Ticket{Kind: MemoryHost, Address: "@vmmipc-1234-00112233", Pid: 1234, RegID: 7, Count: 4, Total: 4 * 4096}
	for i := range t.Secret {
		t.Secret[i] = byte(i * 7)
	}
	return t
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
	f.Fuzz(func(t *testing.T, data []byte) {
		tk, err := DecodeTicket(data)
		if err != nil {
			if CodeOf(err) != EINVAL {
				t.Fatalf("decode failed with %v, want EINVAL: %v", CodeOf(err), err)
			}
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
	f.Add(s.Kind, s.Address, s.Pid, s.RegID, s.Count, s.Total, s.Secret[:])
	f.Add(MemoryCUDA, "/run/x.sock", uint32(1), uint64(1), uint64(1), uint64(1), []byte{1})
	f.Add(MemoryHost, "relative.sock", uint32(1), uint64(1), uint64(1), uint64(1), []byte{})
	f.Fuzz(func(t *testing.T, kind uint8, addr string, pid uint32, regID, count, total uint64, secret []byte) {
		in := &Ticket{Kind: kind, Address: addr, Pid: pid, RegID: regID, Count: count, Total: total}
		copy(in.Secret[:], secret)
		copy(in.DeviceUUID[:], secret)
		b, err := in.Marshal()
		if err != nil {
			if CodeOf(err) != EINVAL {
				t.Fatalf("marshal failed with %v, want EINVAL: %v", CodeOf(err), err)
			}
			return
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

func FuzzParseHeader(f *testing.F) {
	for _, m := range [][]byte{
		helloMsg{RegID: 1}.encode(), welcomeMsg{Count: 1, Total: 1, Kind: 1}.encode(),
		pullMsg{Count: 1}.encode(), chunkMsg{}.encode(), encodeMsg(msgDone, nil),
		errorMsg{Code: EIO, Text: "x"}.encode(), encodeMsg(msgDoneAck, nil),
	} {
		f.Add(m[:headerSize])
	}
	f.Add([]byte("VMIP\x01\x06\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := parseHeader(b)
		if err != nil {
			if CodeOf(err) != EINVAL {
				t.Fatalf("got %v, want EINVAL: %v", CodeOf(err), err)
			}
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
	if err != nil {
		if CodeOf(err) != EINVAL {
			t.Fatalf("got %v, want EINVAL: %v", CodeOf(err), err)
		}
		return
	}
	if again := encode(m)[headerSize:]; !bytes.Equal(again, body) {
		t.Fatalf("re-encoded body differs:\n in  %x\n out %x", body, again)
	}
}

func FuzzParseHello(f *testing.F) {
	f.Add(helloMsg{RegID: 3, Secret: Secret{1, 2}}.encode()[headerSize:])
	f.Add(helloMsg{Flags: 1}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parseHello, helloMsg.encode)
	})
}

func FuzzParsePull(f *testing.F) {
	f.Add(pullMsg{First: 5, Count: 16}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, body []byte) {
		roundTrip(t, body, parsePull, pullMsg.encode)
	})
}

func FuzzParseWelcome(f *testing.F) {
	f.Add(welcomeMsg{Count: 4, Total: 4096 * 4, Kind: MemoryHost}.encode()[headerSize:])
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

func FuzzParseError(f *testing.F) {
	f.Add(errorMsg{Code: EEXPORT, Index: 17, Text: "chunk 17 of 64: export failed"}.encode()[headerSize:])
	f.Add(errorMsg{Code: EAUTH, Index: noIndex, Text: ""}.encode()[headerSize:])
	f.Add(append(errorMsg{Code: EIO}.encode()[headerSize:], 0xff, 0xfe))
	f.Fuzz(func(t *testing.T, body []byte) {
		m, err := parseError(body)
		if err != nil {
			if CodeOf(err) != EINVAL {
				t.Fatalf("got %v, want EINVAL: %v", CodeOf(err), err)
			}
			return
		}
		if m.Code >= 0 || m.Code < EINTERNAL {
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

// fdPlan says where descriptors ride on a fuzzed byte stream: entries of 3
// bytes, a little-endian u16 byte offset and a count (1..3).
type fdAttach struct{ at, n int }

func parseFDPlan(plan []byte, dataLen int) []fdAttach {
	if dataLen == 0 {
		return nil
	}
	byAt := map[int]int{}
	for i := 0; i+3 <= len(plan) && i < 8*3; i += 3 {
		at := int(binary.LittleEndian.Uint16(plan[i:])) % dataLen
		if n := int(plan[i+2] % 4); n > 0 {
			byAt[at] = min(byAt[at]+n, 3)
		}
	}
	var out []fdAttach
	for at, n := range byAt {
		out = append(out, fdAttach{at, n})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].at < out[j].at })
	return out
}

// sendWithFDs writes data to fd in pieces so that each planned descriptor
// group rides on the first byte of the piece starting at its offset.
func sendWithFDs(fd int, data []byte, plan []fdAttach, file int) error {
	cut := 0
	for i := 0; i <= len(plan); i++ {
		end := len(data)
		if i < len(plan) {
			end = plan[i].at
		}
		var oob []byte
		if i > 0 {
			fds := make([]int, plan[i-1].n)
			for j := range fds {
				fds[j] = file
			}
			oob = unix.UnixRights(fds...)
		}
		for piece := data[cut:end]; len(piece) > 0; {
			n, err := unix.SendmsgN(fd, piece, oob, nil, unix.MSG_NOSIGNAL)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return err
			}
			piece, oob = piece[n:], nil
		}
		cut = end
	}
	return nil
}

// senderTranscript is what a well-behaved server sends for sampleTicket's
// 4 chunks, with the offsets where the chunk descriptors go.
func senderTranscript(total uint64, count int) ([]byte, []byte) {
	var out, plan []byte
	out = append(out, welcomeMsg{Count: uint64(count), Total: total, Kind: MemoryHost}.encode()...)
	size := total / uint64(count)
	for i := 0; i < count; i++ {
		plan = binary.LittleEndian.AppendUint16(plan, uint16(len(out)))
		plan = append(plan, 1)
		out = append(out, chunkMsg{Index: uint64(i), Offset: uint64(i) * size, Size: size, FileOffset: uint64(i) * size}.encode()...)
	}
	out = append(out, encodeMsg(msgDoneAck, nil)...)
	return out, plan
}

// FuzzConnRecv feeds a socket fuzzed bytes with descriptors attached at
// fuzzed places. mode bit 0 picks the reader: conn.recv in a loop, or a
// receiver Stream (hello, pulls, chunks, done) as Open would run it. Every
// descriptor that arrives must be handed out or closed: the descriptor count
// comes back to where it was.
func FuzzConnRecv(f *testing.F) {
	good, goodPlan := senderTranscript(4*4096, 4)
	f.Add(uint8(1), good, goodPlan)
	f.Add(uint8(0), good, goodPlan)
	f.Add(uint8(3), good, append(goodPlan, 0, 0, 2))
	f.Add(uint8(1), errorMsg{Code: ENOENT, Index: noIndex, Text: "used up"}.encode(), []byte{})
	f.Add(uint8(0), errorMsg{Code: EEXPORT, Index: 3, Text: "x"}.encode(), []byte{3, 0, 1})
	f.Add(uint8(0), []byte("garbage that is not a header at all"), []byte{0, 0, 1})
	f.Fuzz(func(t *testing.T, mode uint8, data, rawPlan []byte) {
		if len(data) > 64<<10 {
			return
		}
		before := countFDs(t)
		sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		file := newMemfd(t, 4*4096, 3)
		plan := parseFDPlan(rawPlan, len(data))
		sent := make(chan error, 1)
		go func() {
			err := sendWithFDs(sp[1], data, plan, file)
			_ = unix.Shutdown(sp[1], unix.SHUT_WR)
			sent <- err
		}()
		osf := os.NewFile(uintptr(sp[0]), "fuzz")
		nc, err := net.FileConn(osf) // dups sp[0]
		osf.Close()
		if err != nil {
			t.Fatal(err)
		}
		c, err := newConn(nc.(*net.UnixConn), 5*time.Second, "receiver")
		if err != nil {
			t.Fatal(err)
		}
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
		if got := countFDs(t); got != before {
			t.Fatalf("descriptors: %d open after the run, %d before: a received descriptor leaked", got, before)
		}
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

func fuzzStream(t *testing.T, c *conn, mode uint8) {
	tk := sampleTicket()
	s := &Stream{c: c, t: tk, window: uint64(mode>>1)%8 + 1}
	if err := s.handshake(); err != nil {
		return
	}
	var offset uint64
	for i := uint64(0); i <= tk.Count+1; i++ {
		ch, err := s.Next()
		if err != nil {
			if ch.FD >= 0 {
				t.Fatalf("Next failed (%v) but handed out descriptor %d", err, ch.FD)
			}
			if IsEnd(err) {
				if i != tk.Count || offset != tk.Total {
					t.Fatalf("End after %d chunks / %d bytes of %d / %d", i, offset, tk.Count, tk.Total)
				}
				return
			}
			if _, again := s.Next(); again != err {
				t.Fatalf("stream error is not sticky: %v then %v", err, again)
			}
			return
		}
		if _, ferr := unix.FcntlInt(uintptr(ch.FD), unix.F_GETFD, 0); ferr != nil {
			t.Fatalf("chunk %d: descriptor %d is not open", ch.Index, ch.FD)
		}
		unix.Close(ch.FD)
		if ch.Index != i || ch.Offset != offset || ch.Size == 0 || ch.Offset+ch.Size > tk.Total {
			t.Fatalf("stream accepted chunk %+v as chunk %d at offset %d of %d", ch, i, offset, tk.Total)
		}
		offset += ch.Size
	}
	t.Fatalf("stream handed out more than %d chunks", tk.Count)
}

// The server fuzz target shares one server (one per fuzz worker process)
// with an unlimited registration of fuzzChunks chunks.
const fuzzChunks = 4

var fuzzSrv struct {
	once sync.Once
	s    *Server
	tk   *Ticket
	err  error
}

func fuzzServer(t testing.TB) (*Server, *Ticket) {
	fuzzSrv.once.Do(func() {
		s, err := NewServer("")
		if err != nil {
			fuzzSrv.err = err
			return
		}
		fd, err := unix.MemfdCreate("vmmipc-fuzz", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		if err == nil {
			err = unix.Ftruncate(fd, fuzzChunks*int64(pageSize))
		}
		if err == nil {
			_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK)
		}
		if err != nil {
			fuzzSrv.err = err
			return
		}
		sizes, _ := FileChunks(fd, fuzzChunks*pageSize, pageSize)
		fuzzSrv.s = s
		fuzzSrv.tk, fuzzSrv.err = s.Register(sizes, &FileExporter{FD: fd, ChunkSize: pageSize}, RegisterOptions{Uses: 0})
	})
	if fuzzSrv.err != nil {
		t.Fatal(fuzzSrv.err)
	}
	return fuzzSrv.s, fuzzSrv.tk
}

// Session prefixes chosen by the low bits of mode: only the first one
// authenticates, so only it may ever see a descriptor.
const (
	prefixValidHello = iota
	prefixNone
	prefixWrongSecret
	prefixUnknownID
)

// FuzzServerSession connects to a live server, sends a prefix chosen by mode
// and then the fuzzed bytes, and reads until the server closes. The server
// must answer with well-formed messages only, never give a descriptor to an
// unauthenticated client, attach descriptors only to chunk messages, serve
// chunks in order, and leak no descriptor and no goroutine.
func FuzzServerSession(f *testing.F) {
	pulls := func(ps ...pullMsg) []byte {
		var b []byte
		for _, p := range ps {
			b = append(b, p.encode()...)
		}
		return b
	}
	full := append(pulls(pullMsg{0, 2}, pullMsg{2, 2}), encodeMsg(msgDone, nil)...)
	f.Add(uint8(prefixValidHello), full)
	f.Add(uint8(prefixValidHello), pulls(pullMsg{0, 4}))
	f.Add(uint8(prefixValidHello), pulls(pullMsg{1, 1}))
	f.Add(uint8(prefixValidHello), pulls(pullMsg{0, 5}))
	f.Add(uint8(prefixValidHello), append(pulls(pullMsg{0, 1}), encodeMsg(msgDone, nil)...))
	f.Add(uint8(prefixValidHello), append(pulls(pullMsg{0, 1}), helloMsg{}.encode()...))
	f.Add(uint8(prefixNone), full)
	f.Add(uint8(prefixNone), helloMsg{RegID: 1}.encode())
	f.Add(uint8(prefixWrongSecret), full)
	f.Add(uint8(prefixUnknownID), full)
	f.Add(uint8(prefixNone), []byte("GET / HTTP/1.0\r\n\r\n"))
	f.Add(uint8(prefixValidHello|1<<2), full)
	f.Add(uint8(prefixValidHello|2<<2), full)
	f.Add(uint8(prefixValidHello|3<<2), full)
	f.Add(uint8(prefixNone|1<<2), full)
	f.Fuzz(func(t *testing.T, mode uint8, data []byte) {
		if len(data) > 1<<20 {
			return
		}
		s, tk := fuzzServer(t)
		var msg []byte
		switch mode % 4 {
		case prefixValidHello:
			msg = helloMsg{RegID: tk.RegID, Secret: tk.Secret}.encode()
		case prefixWrongSecret:
			bad := tk.Secret
			bad[0] ^= 0x80
			msg = helloMsg{RegID: tk.RegID, Secret: bad}.encode()
		case prefixUnknownID:
			msg = helloMsg{RegID: tk.RegID + 1000, Secret: tk.Secret}.encode()
		}
		// Bits 2-3 of mode attach a descriptor from the client: to the
		// first byte it sends, to the first fuzzed byte, or to the middle
		// of the fuzzed bytes. The server must close whatever it receives.
		var plan []fdAttach
		switch at := len(msg); mode >> 2 & 3 {
		case 1:
			plan = []fdAttach{{0, 1}}
		case 2:
			plan = []fdAttach{{at, 1}}
		case 3:
			plan = []fdAttach{{at + len(data)/2, 2}}
		}
		msg = append(msg, data...)
		if len(plan) > 0 && plan[0].at >= len(msg) {
			plan = nil
		}
		authed := mode%4 == prefixValidHello

		fdsBefore, gBefore := countFDs(t), runtime.NumGoroutine()
		fd, err := rawDial(s.Addr())
		if err != nil {
			t.Fatal(err)
		}
		wrote := make(chan struct{})
		file := -1
		if len(plan) > 0 {
			if file, err = unix.MemfdCreate("vmmipc-fuzz-client", unix.MFD_CLOEXEC); err != nil {
				t.Fatal(err)
			}
		}
		go func() {
			_ = sendWithFDs(fd, msg, plan, file) // EPIPE once the server gave up is fine
			_ = unix.Shutdown(fd, unix.SHUT_WR)
			close(wrote)
		}()
		r := rawReadAll(fd, 5*time.Second)
		<-wrote
		unix.Close(fd)
		if file >= 0 {
			unix.Close(file)
		}
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
		checkServerReply(t, msgs, authed)
		waitFDsFast(t, fdsBefore)
		waitGoroutines(t, gBefore)
	})
}

// checkServerReply checks the order of a server's messages: welcome (only
// after authentication), chunks 0.. in order, then at most one done-ack or
// one error, which ends the reply.
func checkServerReply(t *testing.T, msgs []rawMsg, authed bool) {
	next := uint64(0)
	for i, m := range msgs {
		last := i == len(msgs)-1
		switch m.Type {
		case msgWelcome:
			if !authed || i != 0 {
				t.Fatalf("welcome as message %d (authenticated: %v)", i, authed)
			}
		case msgChunk:
			ch, err := parseChunk(m.Body)
			if err != nil || i == 0 || ch.Index != next || ch.Index >= fuzzChunks || ch.Offset != ch.Index*pageSize || ch.Size != pageSize {
				t.Fatalf("message %d: chunk %+v, expected chunk %d", i, ch, next)
			}
			next++
		case msgDoneAck:
			if !last || next != fuzzChunks {
				t.Fatalf("done-ack as message %d after %d chunks", i, next)
			}
		case msgError:
			if !last {
				t.Fatalf("the server kept talking after an error message")
			}
			if _, err := parseError(m.Body); err != nil {
				t.Fatalf("the server's error message does not parse: %v", err)
			}
		default:
			t.Fatalf("the server sent a %s message", msgName(m.Type))
		}
	}
}
