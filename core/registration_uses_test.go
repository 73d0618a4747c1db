package core

import (
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// How a registration's uses are spent: a receiver that was sent everything
// finishes after another spent the last use, its done-ack says whether the
// buffer lives on, and a use given back goes to a waiting receiver.

// sentEverythingThenUsedUp registers a buffer of 4 chunks for 2 uses and
// makes it used up behind receiver A's back: A is sent every chunk (which
// spends its use) and has not said done yet when receiver B spends the
// last use. It returns the server and A, whose done comes next.
func sentEverythingThenUsedUp(t *testing.T) (*Server, *Stream) {
	t.Helper()
	s := newTestServer(t)
	const chunks = 4
	fd := newMemfd(t, chunks*4096, pattern(chunks*4096, 7))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, chunks*4096, 4096, RegisterOptions{Uses: 2})
	a, err := Open(tk, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { a.Close() })
	for range chunks {
		ch, err := a.Next()
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ch.FD)
	}
	s.reg.mu.Lock()
	g := s.reg.live[tk.RegID]
	s.reg.mu.Unlock()
	if !waitUntil(2*time.Second, func() bool { g.mu.Lock(); defer g.mu.Unlock(); return g.consumed == 1 }) {
		t.Fatal("A's use was not spent once every chunk was sent to it")
	}
	b := importHost(t, tk, ImportOptions{NoCache: true}) // the last use
	Unmap(b.ID, b.Base)
	return s, a
}

// TestUsedUpLetsFinishedReceiversFinish: receiver A has been sent every
// chunk (its use is spent) and has not said done yet when receiver B spends
// the registration's last use. A must still get its done-ack: it has
// everything, and its use counted. (Cutting it makes an import that
// received every chunk fail and undo itself at the last step.)
func TestUsedUpLetsFinishedReceiversFinish(t *testing.T) {
	_, a := sentEverythingThenUsedUp(t)
	if _, err := a.Next(); !IsEnd(err) {
		t.Fatalf("A, sent every chunk before the registration was used up, then says done: %v, want the end of its stream", err)
	}
}

// TestDoneAckSaysWhetherTheBufferLives: the done-ack tells a receiver
// whether the buffer outlives its use, which decides whether it may keep
// the mapping cached. Receiver A was sent every chunk, then receiver B spent
// the last use: when A says done, no registration of the buffer lives, and
// its done-ack must say so.
func TestDoneAckSaysWhetherTheBufferLives(t *testing.T) {
	s, a := sentEverythingThenUsedUp(t)
	if !waitUntil(2*time.Second, func() bool { return s.Live() == 0 }) {
		t.Fatal("the registration did not end when its last use was spent")
	}
	if _, err := a.Next(); !IsEnd(err) {
		t.Fatalf("A says done: %v", err)
	}
	if a.bufferLives {
		t.Fatal("A's done-ack says the buffer lives on, but its only registration has ended")
	}
}

// TestWaiterOutlivesAGivenBackUse: uses = 1, one receiver is being served
// and another waits for the use. The first spends it for its last chunk,
// then that send fails and the use is given back: the waiter gets it,
// rather than being told at the spend that the registration was used up.
func TestWaiterOutlivesAGivenBackUse(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4096, nil)
	defer unix.Close(fd)
	tk, err := s.Register(hookedFile(t, fd, 4096, 4096, func(uint64) error { return nil }), RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	g, err := s.reg.lookup(tk.RegID)
	if err != nil {
		t.Fatal(err)
	}
	first, err := g.claim(func() {})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		c   *claim
		err error
	}
	waiter := make(chan result, 1)
	go func() { c, err := g.claim(func() {}); waiter <- result{c, err} }()
	if !waitUntil(5*time.Second, func() bool { return blockedIn("(*registration).claim") }) {
		t.Fatal("the second receiver never waited for the use")
	}
	g.spend(first)
	select {
	case r := <-waiter:
		t.Fatalf("the waiter returned at the spend (%v, %v): the use may still come back", r.c, r.err)
	case <-time.After(100 * time.Millisecond):
	}
	g.unspend(first) // the last send failed
	g.drop(first)
	select {
	case r := <-waiter:
		if r.err != nil {
			t.Fatalf("the waiter was refused a use that was given back: %v", r.err)
		}
		g.drop(r.c)
	case <-time.After(5 * time.Second):
		t.Fatal("the waiter never got the use given back")
	}
	if err := s.Unregister(tk); err != nil {
		t.Fatal(err)
	}
}

// blockedIn reports whether some goroutine is parked in a select inside fn
// (a waiter in claim).
func blockedIn(fn string) bool {
	buf := make([]byte, 1<<20)
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "[select") && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}

// TestAUsedUpSiblingDoesNotKeepTheBufferAlive: two registrations of one
// buffer, one use each. Once the first's use is spent it can serve no other
// receiver, although it ends only after its receiver's answer: a done-ack
// for the second must then say that the buffer does not live on (it said
// it does while the first's end had not run yet, so that the receiver kept
// a mapping no ticket could hit again).
func TestAUsedUpSiblingDoesNotKeepTheBufferAlive(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 3))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, 4096, 4096, RegisterOptions{Uses: 1})
	again, err := s.RegisterAgain(tk, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	s.reg.mu.Lock()
	first, second := s.reg.live[tk.RegID], s.reg.live[again.RegID]
	s.reg.mu.Unlock()
	if !s.reg.bufferHasOthers(second) {
		t.Fatal("with the first registration unspent, the buffer has no other registration")
	}
	c, err := first.claim(func() {})
	if err != nil {
		t.Fatal(err)
	}
	if !first.spend(c) {
		t.Fatal("the first registration's only use did not use it up")
	}
	if s.reg.bufferHasOthers(second) {
		t.Fatal("a used-up registration that has not ended yet counts as one that can serve")
	}
	first.endUsedUp()
}
