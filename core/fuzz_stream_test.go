package core

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Fuzz targets for what a receiver reads off its socket: conn.recv with
// descriptors attached anywhere, and the receiver's stream of chunks
// against a fuzzed sender.

// FuzzConnRecv feeds a socket fuzzed bytes with descriptors attached at
// fuzzed places. mode bit 0 picks the reader: conn.recv in a loop, or a
// receiver Stream past its handshake (pulls, chunks, done) as Open leaves
// it; bit 1 has that Stream ask for runs (NextRun, as an import of host
// memory does) rather than chunks. Every descriptor that arrives must be
// handed out or closed: the descriptor count comes back to where it was.
func FuzzConnRecv(f *testing.F) {
	quietFDs(f)
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
