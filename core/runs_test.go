package core

import (
	"bytes"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// countingImporter is a HostImporter that records every Map call: what an
// import received, one call per descriptor.
type countingImporter struct {
	HostImporter
	maps []Chunk
}

func (c *countingImporter) Map(ch Chunk) error {
	c.maps = append(c.maps, ch)
	return c.HostImporter.Map(ch)
}

// importCounting runs importNew with a countingImporter and checks the
// bytes against the file.
func importCounting(t *testing.T, tk *Ticket, fd, size int) *countingImporter {
	t.Helper()
	imp := &countingImporter{}
	base, _, err := importNew(tk, imp, OpenOptions{}.withDefaults(), false)
	if err != nil {
		t.Fatal(err)
	}
	defer imp.Unmap()
	want := make([]byte, size)
	if _, err := unix.Pread(fd, want, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(bytesAt(base, uint64(size)), want) {
		t.Fatal("imported bytes differ from the file")
	}
	return imp
}

// runsFile is a memfd of chunks pages holding pattern(seed), closed when
// the test ends.
func runsFile(t *testing.T, chunks int, seed byte) (fd, size int) {
	size = chunks * int(pageSize)
	fd = newMemfd(t, size, pattern(size, seed))
	t.Cleanup(func() { unix.Close(fd) })
	return fd, size
}

// TestHostFileImportIsOneRun: a host-file registration of 512 chunks
// reaches an import as one descriptor, mapped with one mmap, while the
// low-level stream still hands out 512 chunks of one descriptor each.
func TestHostFileImportIsOneRun(t *testing.T) {
	s := newTestServer(t)
	const chunks = 512
	fd, size := runsFile(t, chunks, 4)
	tk := registerFile(t, s, fd, uint64(size), pageSize, RegisterOptions{Uses: 0})
	defer s.Unregister(tk)

	imp := importCounting(t, tk, fd, size)
	if len(imp.maps) != 1 {
		t.Fatalf("the import received %d descriptors (mmap calls), want 1 for the whole file", len(imp.maps))
	}
	if m := imp.maps[0]; m.Index != 0 || m.Offset != 0 || m.Size != uint64(size) || m.FileOffset != 0 {
		t.Fatalf("the run is %+v, want all %d bytes from offset 0", m, size)
	}

	st, err := Open(tk, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for i := uint64(0); i < chunks; i++ {
		ch, err := st.Next()
		if err != nil {
			t.Fatalf("chunk %d: %v", i, err)
		}
		unix.Close(ch.FD)
		if ch.Index != i || ch.Offset != i*pageSize || ch.Size != pageSize || ch.FileOffset != i*pageSize {
			t.Fatalf("low-level chunk %d is %+v", i, ch)
		}
	}
	if _, err := st.Next(); !IsEnd(err) {
		t.Fatalf("after %d chunks: %v, want End", chunks, err)
	}
}

// TestRunsFallBackToChunks: an exporter that gives one chunk per
// descriptor (a callback) answers the pull-run with a run of one; the
// import then pulls the rest chunk by chunk, and gets every byte.
func TestRunsFallBackToChunks(t *testing.T) {
	s := newTestServer(t)
	const chunks = 64
	fd, size := runsFile(t, chunks, 6)
	tk, err := s.Register(hookedFile(t, fd, uint64(size), pageSize, func(uint64) error { return nil }), RegisterOptions{Uses: 0})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Unregister(tk)
	imp := importCounting(t, tk, fd, size)
	if len(imp.maps) != chunks {
		t.Fatalf("%d mmap calls, want one per chunk (%d)", len(imp.maps), chunks)
	}
	for i, m := range imp.maps {
		if m.Index != uint64(i) || m.Size != pageSize {
			t.Fatalf("map %d is %+v", i, m)
		}
	}
}

// TestHostileRuns: runs that do not answer the pull-run or do not fit the
// ticket are refused (EINVAL, sticky), and their descriptor is closed.
func TestHostileRuns(t *testing.T) {
	const count, size = 4, 4096
	total := uint64(count * size)
	before := ourFDs().settled(t) // each case gives back what it opened
	for _, tc := range []struct {
		name string
		msg  []byte
		fd   bool
		want string
	}{
		{"no descriptor", runMsg{Count: 4, Size: total}.encode(), false, "without a descriptor"},
		{"wrong index", runMsg{Index: 1, Count: 3, Offset: size, Size: 3 * size}.encode(), true, "from chunk 1, expected chunk 0"},
		{"zero chunks", runMsg{Count: 0, Size: total}.encode(), true, "a run of 0 chunks"},
		{"more chunks than asked", runMsg{Count: 5, Size: total}.encode(), true, "asked for 1 to 4"},
		{"wrong offset", runMsg{Count: 4, Offset: 4096, Size: total}.encode(), true, "at offset 4096, expected 0"},
		{"fewer bytes than chunks", runMsg{Count: 4, Size: 3}.encode(), true, "does not fit"},
		{"past the end", runMsg{Count: 4, Size: total + 4096}.encode(), true, "does not fit"},
		{"no room for the chunks after it", runMsg{Count: 2, Size: total - 1}.encode(), true, "does not fit"},
		{"ends short of the ticket", runMsg{Count: 4, Size: total - 4096}.encode(), true, "chunks end at 12288, the ticket says 16384"},
		{"file offset overflows", runMsg{Count: 4, Size: total, FileOffset: ^uint64(0) - 10}.encode(), true, "overflows"},
		{"a chunk for a pull-run", chunkMsg{Size: size}.encode(), true, "expected a run from chunk 0, got chunk"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sp, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer closeFD(&sp[1])
			file := -1
			if tc.fd {
				file = newMemfd(t, int(total), nil)
				defer closeFD(&file)
			}
			var oob []byte
			if file >= 0 {
				oob = unix.UnixRights(file)
			}
			if err := unix.Sendmsg(sp[1], tc.msg, oob, nil, 0); err != nil {
				t.Fatal(err)
			}
			tk := sampleTicket()
			tk.Count, tk.Total = count, total
			st := &Stream{c: socketConn(t, sp[0], "receiver"), t: tk, window: 4}
			r, err := st.NextRun()
			if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.want) || r.FD >= 0 {
				t.Fatalf("got %+v, %v; want EINVAL containing %q and no descriptor", r, err, tc.want)
			}
			if _, again := st.NextRun(); again != err {
				t.Fatalf("the error is not sticky: %v then %v", err, again)
			}
			st.Close()
			closeFD(&file)
			closeFD(&sp[1])
			ourFDs().waitFor(t, before, "after a refused run: the received descriptor is closed")
		})
	}
}

// TestServerAnswersPullRun: a pull-run of a host file is answered with one
// run message and one descriptor, covering every chunk asked for.
func TestServerAnswersPullRun(t *testing.T) {
	h := newHostileSetup(t)
	msgs, r := h.exchange(t, true, cat(pullMsg{0, 3}.encode(), pullMsg{3, hostileChunks - 3}.encodeRun(), encodeMsg(msgDone, nil)))
	var types []string
	for _, m := range msgs {
		types = append(types, msgName(m.Type))
	}
	if got := strings.Join(types, " "); got != "welcome chunk chunk chunk run done-ack" {
		t.Fatalf("the server answered %s", got)
	}
	if len(r.FDAt) != 4 {
		t.Fatalf("%d descriptors for 3 chunks and a run, want 4", len(r.FDAt))
	}
	run, err := parseRun(msgs[4].Body)
	want := runMsg{Index: 3, Count: hostileChunks - 3, Offset: 3 * 4096, Size: (hostileChunks - 3) * 4096, FileOffset: 3 * 4096}
	if err != nil || run != want {
		t.Fatalf("run %+v (%v), want %+v", run, err, want)
	}
	ourFDs().waitFor(t, h.fdsBefore-1, "after the use was spent")
}
