package core

import (
	"encoding/binary"
	"net"
	"os"
	"sort"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The peers that the fuzz targets (fuzz_*_test.go) talk to or
// impersonate: descriptor plans over fuzzed byte streams, a live server
// shared by the iterations of one fuzz process, a fake exporter that
// answers a real receiver, and the rules a server's reply must follow.

// sampleTicket is a well-formed ticket used as a seed.
func sampleTicket() *Ticket {
	t := &Ticket{Kind: MemoryHost, Address: "@vmmipc-1234-00112233", Pid: 1234, StartTime: 5678, RegID: 7, BufferID: 3, Count: 4, Total: 4 * 4096,
		NS: Namespaces{Dev: 4, PID: 4026531836, Net: 4026531840, Time: 4026531834}}
	for i := range t.Secret {
		t.Secret[i] = byte(i * 7)
	}
	return t
}

// fdAttach is a group of n descriptors riding on the byte at offset at.
type fdAttach struct{ at, n int }

// parseFDPlan reads where descriptors ride on a fuzzed byte stream: entries
// of 3 bytes, a little-endian u16 byte offset and a count (1..3).
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

// socketConn wraps one end of a socket pair as a conn, taking sp over (the
// conn holds a duplicate; sp itself is closed here).
func socketConn(t testing.TB, sp int, what string) *conn {
	t.Helper()
	osf := os.NewFile(uintptr(sp), "socketpair")
	nc, err := net.FileConn(osf) // dups sp
	osf.Close()
	if err != nil {
		t.Fatal(err)
	}
	c, err := newConn(nc.(*net.UnixConn), 5*time.Second, what)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// streamTranscript is what a well-behaved server sends after its welcome
// for count chunks of total bytes: the chunks, with the offsets where their
// descriptors go, and the done-ack.
func streamTranscript(total uint64, count int) (data, plan []byte) {
	size := total / uint64(count)
	for i := 0; i < count; i++ {
		plan = binary.LittleEndian.AppendUint16(plan, uint16(len(data)))
		plan = append(plan, 1)
		data = append(data, chunkMsg{Index: uint64(i), Offset: uint64(i) * size, Size: size, FileOffset: uint64(i) * size}.encode()...)
	}
	data = append(data, doneAckMsg{Flags: ackBufferLives}.encode()...)
	return data, plan
}

// runTranscript is what a well-behaved server sends to a receiver that
// asks for runs (NextRun): runs of up to per chunks (the first one a run of
// one when per is 1, after which the receiver pulls chunk by chunk), with
// the offsets where their descriptors go, and the done-ack.
func runTranscript(total uint64, count, per int) (data, plan []byte) {
	size := total / uint64(count)
	for i := 0; i < count; {
		n := min(per, count-i)
		plan = binary.LittleEndian.AppendUint16(plan, uint16(len(data)))
		plan = append(plan, 1)
		if per == 1 && i > 0 {
			data = append(data, chunkMsg{Index: uint64(i), Offset: uint64(i) * size, Size: size, FileOffset: uint64(i) * size}.encode()...)
		} else {
			data = append(data, runMsg{Index: uint64(i), Count: uint64(n), Offset: uint64(i) * size, Size: uint64(n) * size, FileOffset: uint64(i) * size}.encode()...)
		}
		i += n
	}
	data = append(data, doneAckMsg{Flags: ackBufferLives}.encode()...)
	return data, plan
}

// The server-side fuzz targets share one server (one per fuzz worker
// process) with an unlimited registration of fuzzChunks pages.
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
		fd := newMemfd(t, fuzzChunks*int(pageSize), pattern(fuzzChunks*int(pageSize), 3))
		defer unix.Close(fd)
		spec, err := HostFile(fd, fuzzChunks*pageSize, pageSize)
		if err != nil {
			fuzzSrv.err = err
			return
		}
		fuzzSrv.s = s
		fuzzSrv.tk, fuzzSrv.err = s.Register(spec, RegisterOptions{Uses: 0})
	})
	if fuzzSrv.err != nil {
		t.Fatal(fuzzSrv.err)
	}
	return fuzzSrv.s, fuzzSrv.tk
}

// checkServerReply checks a server's messages after the handshake part the
// client did by hand. Unauthenticated, a client may get status answers, one
// challenge and a final error, and nothing else: no welcome, no chunk, no
// done-ack. Authenticated, it gets its grant table if it asked, a welcome,
// chunks 0.. in order, then at
// most one done-ack (after every chunk, or at once for a confirm), then
// only use-acks (further uses, helloMore), or one error, which ends the
// reply.
func checkServerReply(t *testing.T, msgs []rawMsg, authed, confirm bool) {
	t.Helper()
	next := uint64(0)
	challenged, acked, tabled, logAcked := false, false, false, false
	for i, m := range msgs {
		last := i == len(msgs)-1
		switch {
		case m.Type == msgError:
			if !last {
				t.Fatalf("the server kept talking after an error message")
			}
			if _, err := parseError(m.Body); err != nil {
				t.Fatalf("the server's error message does not parse: %v", err)
			}
		case !authed && m.Type == msgStatusAck:
			if challenged {
				t.Fatalf("a status answer after a challenge (message %d)", i)
			}
			if _, err := parseStatusAck(m.Body); err != nil {
				t.Fatalf("status-ack: %v", err)
			}
		case !authed && m.Type == msgChallenge:
			if challenged {
				t.Fatalf("a second challenge as message %d", i)
			}
			challenged = true
		case !authed:
			t.Fatalf("the server sent %s (message %d) to a client that never proved it knows the secret", msgName(m.Type), i)
		case acked && m.Type != msgUseAck:
			t.Fatalf("the server sent %s (message %d) after the done-ack", msgName(m.Type), i)
		case m.Type == msgTable: // asked for (helloTable): before the welcome
			if tm, err := parseTable(m.Body); i != 0 || err != nil || (tm.Slots != 0 && tm.Slots != tableSlots) {
				t.Fatalf("table %+v as message %d (%v)", tm, i, err)
			}
			tabled = true
		case m.Type == msgLogAck: // after the table, once the receiver answered it with its log
			if _, err := parseLogAck(m.Body); !tabled || i != 1 || err != nil {
				t.Fatalf("log-ack as message %d (%v)", i, err)
			}
			logAcked = true
		case m.Type == msgWelcome:
			if i != 0 && !(i == 1 && tabled) && !(i == 2 && logAcked) {
				t.Fatalf("welcome as message %d", i)
			}
		case m.Type == msgChunk:
			ch, err := parseChunk(m.Body)
			if err != nil || i == 0 || confirm || ch.Index != next || ch.Index >= fuzzChunks || ch.Offset != ch.Index*pageSize || ch.Size != pageSize {
				t.Fatalf("message %d: chunk %+v, expected chunk %d (confirm %v)", i, ch, next, confirm)
			}
			next++
		case m.Type == msgRun:
			r, err := parseRun(m.Body)
			if err != nil || i == 0 || confirm || r.Index != next || r.Count == 0 || r.Count > fuzzChunks-next ||
				r.Offset != r.Index*pageSize || r.Size != r.Count*pageSize || r.FileOffset != r.Offset {
				t.Fatalf("message %d: run %+v, expected a run from chunk %d (confirm %v)", i, r, next, confirm)
			}
			next += r.Count
		case m.Type == msgDoneAck:
			if acked || (next != fuzzChunks && !(confirm && next == 0)) {
				t.Fatalf("done-ack as message %d after %d chunks (confirm %v)", i, next, confirm)
			}
			acked = true
		case m.Type == msgUseAck: // a further use (helloMore), answered after the done-ack
			if _, err := parseUseAck(m.Body); !acked || err != nil {
				t.Fatalf("use-ack as message %d, before the done-ack or malformed (%v)", i, err)
			}
		default:
			t.Fatalf("the server sent a %s message", msgName(m.Type))
		}
	}
}

// fakeExporter listens at a fresh address in this process, so that a
// ticket naming this process (pid and start time) passes the receiver's
// liveness and SO_PEERCRED checks and only the handshake decides. Its
// first connection is answered by serve (with the ticket); later ones (a receiver retrying
// after "busy") are closed at once.
type fakeExporter struct {
	ln   *net.UnixListener
	tk   *Ticket
	done chan struct{}
}

func newFakeExporter(t testing.TB, count int, total uint64, serve func(uc *net.UnixConn, tk *Ticket)) *fakeExporter {
	t.Helper()
	tk := sampleTicket()
	// A name of its own: a receiver remembers what an exporter (its address,
	// pid and start time) said, such as refusing one-round hellos, and a
	// fuzzer makes hundreds of thousands of fakes (1<<30 names repeated).
	tk.Address = "@vmmipc-fuzz-fake-" + itoa(os.Getpid()) + "-" + itoa(randIndex(1<<62))
	tk.Pid, tk.StartTime, tk.NS = uint32(os.Getpid()), selfStartTime(), selfNamespaces()
	tk.Count, tk.Total = uint64(count), total
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: tk.Address, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeExporter{ln: ln, tk: tk, done: make(chan struct{})}
	go func() {
		defer close(f.done)
		first := true
		for {
			uc, err := ln.AcceptUnix()
			if err != nil {
				return
			}
			if first {
				first = false
				serve(uc, tk)
			}
			uc.Close()
		}
	}()
	return f
}

func (f *fakeExporter) close() {
	f.ln.Close()
	<-f.done
}

// serverTranscript is what an exporter's proofs cover for a receiver's
// hello on uc (the server nonce still to be drawn).
func serverTranscript(t testing.TB, uc *net.UnixConn, tk *Ticket, hello helloMsg) transcript {
	t.Helper()
	tr := transcript{RegID: hello.RegID, Flags: hello.Flags, ReceiverNonce: hello.Nonce}
	var err error
	if tr.TicketDigest, err = tk.Digest(); err != nil {
		t.Error(err)
	}
	raw, err := uc.SyscallConn()
	if err == nil {
		tr.Socket, err = exporterSocket(raw, roleServer)
	}
	if err != nil {
		t.Error(err)
	}
	if hello.Flags&helloPidBound != 0 {
		tr.Socket = uint64(os.Getpid()) // the receiver is this process
	}
	return tr
}
