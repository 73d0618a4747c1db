package core

import (
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Holds at their edges: a stream closed before its done-ack, many held
// uses at once on one session, a registration ending under a use.

// TestHeldStreamClosedBeforeItsDoneAck: a receiver whose stream, held
// through hold-on, gets every chunk but is closed before it reads the
// done-ack (its mapping failed, say) never learns that its use was held.
// Chunk by chunk, the exporter holds it only once the done-ack goes out
// (asked for with done): the hold must not stay on the session. Host
// memory's last run brings the done-ack unasked, the use already held: the
// receiver must let go of it at Close. Else the grant is never released
// while the receiver lives.
func TestHeldStreamClosedBeforeItsDoneAck(t *testing.T) {
	t.Run("every chunk, no done", func(t *testing.T) {
		f := newHoldFixture(t) // its exporter sends a descriptor per chunk
		closedBeforeTheAck(t, f, func(s *Stream, g *Ticket) {
			for i := uint64(0); i < g.Count; i++ {
				c, err := s.Next()
				if err != nil {
					t.Fatalf("chunk %d: %v", i, err)
				}
				closeFD(&c.FD)
			}
		})
	})
	t.Run("one run, its done-ack unread", func(t *testing.T) {
		f := newHoldFixture(t)
		fd := newMemfd(t, cacheSize, pattern(cacheSize, 22))
		f.anchor = registerFile(t, f.s, fd, cacheSize, 4096, RegisterOptions{Uses: 0}) // a run per descriptor
		unix.Close(fd)
		closedBeforeTheAck(t, f, func(s *Stream, g *Ticket) {
			r, err := s.NextRun()
			if err != nil || r.Count != g.Count {
				t.Fatalf("one run of every chunk: %+v, %v", r, err)
			}
			closeFD(&r.FD)
		})
	})
}

// closedBeforeTheAck holds a use of one grant on the lease, pulls a
// second grant held through hold-on with pull, closes its stream (as
// mapAll does when a mapping fails), and checks that only the first use
// is still held, on both sides.
func closedBeforeTheAck(t *testing.T, f holdFixture, pull func(s *Stream, g *Ticket)) {
	g1, _ := f.grant(t, true)
	if err := Confirm(g1, holdImport); err != nil { // the lease
		t.Fatal(err)
	}
	g2, rel2 := f.grant(t, true)
	s, err := open(g2, OpenOptions{}, true, false)
	if err != nil {
		t.Fatal(err)
	}
	if s.lease == nil {
		t.Fatal("the stream holds on no lease")
	}
	pull(s, g2)
	_ = s.Close()
	releasedSoon(t, f, g2, "a held use its receiver never learned of")
	if !rel2.Load() {
		t.Fatal("OnRelease did not run")
	}
	if n := f.s.Holds(); n != 1 {
		t.Fatalf("the exporter counts %d holds, want 1 (g1's)", n)
	}
	if held := GetCacheInfo().Holds; held != 1 {
		t.Fatalf("the receiver counts %d holds, want 1 (g1's)", held)
	}
	letGo(t, f, g1, "the session's own use")
}

// TestHeldUsesInABurst: many threads spending held uses on one lease at
// once all get them held, on one lease (the threads that find none wait
// for the one getting it), and every release arrives.
func TestHeldUsesInABurst(t *testing.T) {
	f := newHoldFixture(t)
	g, err := f.s.RegisterAgain(f.anchor, RegisterOptions{Uses: 0, Hold: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := Confirm(g, holdImport); err != nil { // the lease
		t.Fatal(err)
	}
	const threads, each = 16, 100
	done := make(chan struct{})
	go func() {
		defer close(done)
		var wg sync.WaitGroup
		for range threads {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for range each {
					if err := Confirm(g, holdImport); err != nil {
						t.Error(err)
						return
					}
				}
			}()
		}
		wg.Wait()
	}()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		t.Fatalf("%d threads' held uses stalled: the exporter counts %d holds", threads, f.s.Holds())
	}
	if n := len(leasesOf(g)); n != 1 {
		t.Fatalf("%d threads' held uses took %d leases, want 1", threads, n)
	}
	const want = threads*each + 1
	if !waitUntil(10*time.Second, func() bool { return f.s.Holds() == want }) {
		t.Fatalf("the exporter counts %d holds, want %d", f.s.Holds(), want)
	}
	for range want {
		if err := Release(g); err != nil {
			t.Fatal(err)
		}
	}
	if !waitUntil(10*time.Second, func() bool { return f.s.Holds() == 0 }) {
		t.Fatalf("the exporter counts %d holds after every release, want 0", f.s.Holds())
	}
}

// TestNoHoldAfterTheRelease: a use whose registration ends between its
// claim and its hold (a ttl or Unregister, racing a use on a holder
// session, which nothing cuts) is not held: the release has run, so a
// hold would tell the receiver that memory is kept which the owner may be
// handing out again.
func TestNoHoldAfterTheRelease(t *testing.T) {
	f := newHoldFixture(t)
	tk, released := f.grant(t, true)
	g, err := f.s.reg.lookup(tk.RegID)
	if err != nil {
		t.Fatal(err)
	}
	cl, err := g.claim(func() {})
	if err != nil {
		t.Fatal(err)
	}
	defer g.drop(cl)
	g.end("was unregistered")
	releasedSoon(t, f, tk, "an ended grant no receiver held")
	l, err := newLease(0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if f.s.reg.leases.take(l, g) {
		t.Fatalf("a hold was taken on a registration released already (OnRelease ran: %v)", released.Load())
	}
	if n := f.s.Holds(); n != 0 {
		t.Fatalf("the exporter counts %d holds, want 0", n)
	}
}
