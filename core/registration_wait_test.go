package core

import (
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Server.Wait: until a registration ended and its OnRelease returned, after
// the lenders of its buffer; refused for tickets that are not this
// server's.

// TestWaitUntilReleased: Wait times out on a live registration (0 = just
// check), returns once it ended and its OnRelease returned, and returns at
// once for one that ended long ago.
func TestWaitUntilReleased(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, 1))
	defer unix.Close(fd)
	var released atomic.Bool
	tk := registerFile(t, s, fd, 4*4096, 4096, RegisterOptions{Uses: 1, OnRelease: func() { released.Store(true) }})
	if err := s.Wait(tk, 0); CodeOf(err) != ETIMEDOUT || !strings.Contains(err.Error(), "is still live") {
		t.Fatalf("wait(0) on a live registration: %v, want ETIMEDOUT", err)
	}
	start := time.Now()
	if err := s.Wait(tk, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT {
		t.Fatalf("wait(50 ms) on a live registration: %v, want ETIMEDOUT", err)
	}
	if d := time.Since(start); d < 50*time.Millisecond || d > promptly {
		t.Fatalf("wait(50 ms) returned after %v", d)
	}
	waited := make(chan error, 1)
	go func() { waited <- s.Wait(tk, 10*time.Second) }()
	r := importHost(t, tk, ImportOptions{}) // the only use
	Unmap(r.ID, r.Base)
	select {
	case err := <-waited:
		if err != nil {
			t.Fatalf("wait across the last use: %v", err)
		}
		if !released.Load() {
			t.Fatal("wait returned before OnRelease ran")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("wait did not return after the last use")
	}
	if err := s.Wait(tk, 0); err != nil {
		t.Fatalf("wait(0) on a registration released earlier: %v", err)
	}
}

// TestWaitForASlowRelease: while OnRelease runs, the registration has ended
// but Wait still times out, saying so.
func TestWaitForASlowRelease(t *testing.T) {
	unblock := make(chan struct{})
	s, tk := registerPage(t, RegisterOptions{OnRelease: func() { <-unblock }})
	unregistered := make(chan error, 1)
	go func() { unregistered <- s.Unregister(tk) }() // runs OnRelease, which blocks
	if !waitUntil(2*time.Second, func() bool { return s.Live() == 0 }) {
		t.Fatal("unregister did not end the registration")
	}
	if err := s.Wait(tk, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT || !strings.Contains(err.Error(), "has ended, but what it lent is still in use") {
		t.Fatalf("wait while OnRelease runs: %v, want ETIMEDOUT saying it has ended", err)
	}
	close(unblock)
	if err := <-unregistered; err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(tk, 2*time.Second); err != nil {
		t.Fatalf("wait after OnRelease returned: %v", err)
	}
}

// TestWaitForLenders: a registration that lends the exporter (a C
// export_fn, borrowed CUDA handles) is released only once no registration
// of its buffer lives, after the exporter; Wait says so until then.
func TestWaitForLenders(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, 2))
	defer unix.Close(fd)
	var mu sync.Mutex
	var order []string
	note := func(what string) func() {
		return func() { mu.Lock(); order = append(order, what); mu.Unlock() }
	}
	spec := hookedFile(t, fd, 4*4096, 4096, func(uint64) error { return nil })
	file := spec.Exporter
	spec.Exporter = &testExporter{export: file.ExportChunk, release: func() { note("exporter")(); file.Release() }}
	lender, err := s.Register(spec, RegisterOptions{Uses: 1, LendsExporter: true, OnRelease: note("lender")})
	if err != nil {
		t.Fatal(err)
	}
	again, err := s.RegisterAgain(lender, RegisterOptions{OnRelease: note("again")})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(lender); err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(lender, 50*time.Millisecond); CodeOf(err) != ETIMEDOUT || !strings.Contains(err.Error(), "registrations made from it still live") {
		t.Fatalf("wait on a lender whose buffer lives on: %v, want ETIMEDOUT", err)
	}
	r := importHost(t, again, ImportOptions{NoCache: true}) // the buffer still serves
	if err := verifyAndUnmap(r, 2); err != nil {
		t.Fatal(err)
	}
	if err := s.Unregister(again); err != nil {
		t.Fatal(err)
	}
	for _, tk := range []*Ticket{lender, again} {
		if err := s.Wait(tk, 2*time.Second); err != nil {
			t.Fatalf("wait on registration %d once the buffer ended: %v", tk.RegID, err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	count := map[string]int{}
	at := map[string]int{}
	for i, what := range order {
		count[what]++
		at[what] = i
	}
	if len(order) != 3 || count["again"] != 1 || count["exporter"] != 1 || count["lender"] != 1 || at["lender"] < at["exporter"] {
		t.Fatalf("releases %v: want each once, the lender after the exporter it lent", order)
	}
}

// TestWaitRefusals: Wait on tickets that are not this server's, or with a
// wrong secret.
func TestWaitRefusals(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{})
	bad := *tk
	bad.Secret[0] ^= 1
	if err := s.Wait(&bad, 0); CodeOf(err) != EAUTH {
		t.Fatalf("wait with a wrong secret: %v, want EAUTH", err)
	}
	unknown := *tk
	unknown.RegID += 100
	if err := s.Wait(&unknown, 0); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "never registered") {
		t.Fatalf("wait on a registration never issued: %v, want ENOENT", err)
	}
}

// TestWaitOnAnotherExportersTicket: a ticket of another exporter is
// refused (ENOENT), even when its registration id is one this server
// issued too (ids are small numbers, counted from 1 by every exporter).
func TestWaitOnAnotherExportersTicket(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{})
	for _, other := range []func(*Ticket){
		func(o *Ticket) { o.Pid++ },
		func(o *Ticket) { o.Address += "x" },
	} {
		o := *tk
		other(&o)
		if err := s.Wait(&o, 0); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "another exporter") {
			t.Fatalf("wait on another exporter's ticket (%s, pid %d) with a registration id this server issued: %v, want ENOENT", o.Address, o.Pid, err)
		}
	}
}
