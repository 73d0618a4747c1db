package core

import (
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Status queries: what a peer that has not said hello may ask, and what it
// can never get from it.

// TestStatusQueries: before any hello, a peer may ask whether buffer ids
// are live. The answers follow the buffers (live, unregistered, used up,
// kept alive by another registration), a query stream cannot turn into a
// session (no hello, no pull), it is bounded, and it never carries a
// descriptor.
func TestStatusQueries(t *testing.T) {
	s := newTestServer(t)
	const size = 4 * 4096
	fd := newMemfd(t, size, pattern(size, 23))
	defer unix.Close(fd)
	unlimited := registerFile(t, s, fd, size, 4096, RegisterOptions{})
	fd2 := newMemfd(t, size, pattern(size, 24))
	defer unix.Close(fd2)
	once := registerFile(t, s, fd2, size, 4096, RegisterOptions{Uses: 1})
	again, err := s.RegisterAgain(once, RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	const unknown = 999

	conn, err := rawDial(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(conn)
	ask := func(id uint64) bool {
		t.Helper()
		if err := rawWrite(conn, statusMsg{BufferID: id}.encode()); err != nil {
			t.Fatal(err)
		}
		m, n, err := rawRecv(conn, 5*time.Second)
		if err != nil || n != 0 || m.Type != msgStatusAck {
			t.Fatalf("status of buffer %d: %s, %d descriptors, %v", id, describeMsg(m), n, err)
		}
		ack, err := parseStatusAck(m.Body)
		if err != nil || ack.BufferID != id {
			t.Fatalf("status of buffer %d answered for %d (%v)", id, ack.BufferID, err)
		}
		return ack.Alive
	}
	if !ask(unlimited.BufferID) || !ask(once.BufferID) || ask(unknown) {
		t.Fatal("status of live buffers / an unknown buffer is wrong")
	}
	r := importHost(t, once, ImportOptions{NoCache: true}) // uses `once` up
	Unmap(r.ID, r.Base)
	if !ask(once.BufferID) {
		t.Fatal("a buffer is reported ended while a registration made from it with RegisterAgain lives")
	}
	if err := s.Unregister(again); err != nil {
		t.Fatal(err)
	}
	if ask(once.BufferID) {
		t.Fatal("a buffer is reported live after its last registration ended")
	}
	if err := s.Unregister(unlimited); err != nil {
		t.Fatal(err)
	}
	if ask(unlimited.BufferID) {
		t.Fatal("an unregistered buffer is reported live")
	}
	// The receiver's own poller asks the same way.
	got, err := bufferStatus(once, []uint64{once.BufferID, unknown}, time.Second)
	if err != nil || len(got) != 2 || got[once.BufferID] || got[unknown] {
		t.Fatalf("bufferStatus: %v, %v", got, err)
	}

	// A status connection cannot be turned into a session.
	live := registerFile(t, s, fd, size, 4096, RegisterOptions{})
	for _, tc := range []struct {
		name string
		msg  []byte
	}{
		{"hello", helloMsg{RegID: live.RegID}.encode()},
		{"pull", pullMsg{0, 4}.encode()},
		{"proof", proofMsg{}.encode()},
	} {
		c, err := rawDial(s.Addr())
		if err != nil {
			t.Fatal(err)
		}
		_ = rawWrite(c, cat(statusMsg{BufferID: live.BufferID}.encode(), tc.msg))
		_ = unix.Shutdown(c, unix.SHUT_WR)
		msgs, rep := readReply(t, c)
		unix.Close(c)
		if len(msgs) != 2 || msgs[0].Type != msgStatusAck {
			t.Fatalf("status then %s: got %d messages", tc.name, len(msgs))
		}
		expectRefused(t, msgs, rep, EINVAL, "only status queries may follow a status query, got "+tc.name, 0)
	}
	// Bounded: a connection answers maxStatusQueries queries, then closes.
	c, err := rawDial(s.Addr())
	if err != nil {
		t.Fatal(err)
	}
	var many []byte
	for i := 0; i < maxStatusQueries+4; i++ {
		many = append(many, statusMsg{BufferID: uint64(i)}.encode()...)
	}
	go func() { _ = rawWrite(c, many); _ = unix.Shutdown(c, unix.SHUT_WR) }()
	msgs, rep := readReply(t, c)
	unix.Close(c)
	if len(msgs) != maxStatusQueries || len(rep.FDAt) != 0 {
		t.Fatalf("%d queries on one connection: %d answers and %d descriptors, want %d and none", maxStatusQueries+4, len(msgs), len(rep.FDAt), maxStatusQueries)
	}
}
