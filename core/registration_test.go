package core

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Registrations from the sender's side: here RegisterAgain and the local
// calls that take only the very ticket issued; Wait in
// registration_wait_test.go, what Register and HostFile accept in
// registration_spec_test.go, the option bounds and the address-space check
// in registration_bounds_test.go, how uses are spent in
// registration_uses_test.go.

// registerPage registers one page of pattern(1) with opts on a server of
// the test's own. The memfd is closed at once: the registration holds a
// duplicate of its own.
func registerPage(t *testing.T, opts RegisterOptions) (*Server, *Ticket) {
	t.Helper()
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	return s, registerFile(t, s, fd, 4096, 4096, opts)
}

// TestRegisterAgain: a new registration of the same buffer with its own
// uses and secret; the memory stays exported (the memfd duplicate open)
// until the last registration of it ends.
func TestRegisterAgain(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, 3))
	defer unix.Close(fd)
	before := ourFDs().settled(t)
	var released atomic.Int32
	orig := registerFile(t, s, fd, 4*4096, 4096, RegisterOptions{Uses: 1, OnRelease: func() { released.Add(1) }})
	again, err := s.RegisterAgain(orig, RegisterOptions{Uses: 2, OnRelease: func() { released.Add(10) }})
	if err != nil {
		t.Fatal(err)
	}
	if again.BufferID != orig.BufferID || again.RegID == orig.RegID || again.Secret == orig.Secret || again.Count != orig.Count || again.Total != orig.Total {
		t.Fatalf("register again gave %s, the original %s", again, orig)
	}
	ourFDs().waitFor(t, before+1, "two registrations of one memfd (one duplicate)")
	r := importHost(t, orig, ImportOptions{NoCache: true})
	Unmap(r.ID, r.Base)
	if _, err := Open(orig, OpenOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("the original's second use: %v, want ENOENT (its one use is spent)", err)
	}
	if !waitUntil(2*time.Second, func() bool { return released.Load() == 1 }) {
		t.Fatalf("release count %d after the original ended, want its own 1", released.Load())
	}
	ourFDs().waitFor(t, before+1, "the original ended, a registration of its memory lives (the duplicate stays)")
	for i := 0; i < 2; i++ { // its own two uses
		r := importHost(t, again, ImportOptions{NoCache: true})
		if err := verifyAndUnmap(r, 3); err != nil {
			t.Fatal(err)
		}
	}
	if !waitUntil(2*time.Second, func() bool { return released.Load() == 11 }) {
		t.Fatalf("release count %d after both ended, want 11", released.Load())
	}
	ourFDs().waitFor(t, before, "once no registration of the memfd lives")
	if _, err := s.RegisterAgain(orig, RegisterOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("register again from an ended registration: %v, want ENOENT", err)
	}
}

func TestRegisterAgainRefusals(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{})
	bad := *tk
	bad.Secret[5] ^= 1
	if _, err := s.RegisterAgain(&bad, RegisterOptions{}); CodeOf(err) != EAUTH {
		t.Fatalf("wrong secret: %v, want EAUTH", err)
	}
	other := *tk
	other.Address += "x"
	if _, err := s.RegisterAgain(&other, RegisterOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("another exporter's ticket: %v, want ENOENT", err)
	}
	if _, err := s.RegisterAgain(tk, RegisterOptions{TTL: MaxTTL + time.Millisecond}); CodeOf(err) != EINVAL {
		t.Fatalf("ttl above the bound: %v, want EINVAL", err)
	}
	if s.Live() != 1 {
		t.Fatalf("%d live registrations after refused calls, want 1", s.Live())
	}
}

// TestRegisterAgainOwnTTL: the new registration expires on its own ttl;
// the original is untouched.
func TestRegisterAgainOwnTTL(t *testing.T) {
	s, orig := registerPage(t, RegisterOptions{})
	again, err := s.RegisterAgain(orig, RegisterOptions{TTL: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Wait(again, 5*time.Second); err != nil {
		t.Fatalf("the new registration did not expire: %v", err)
	}
	if _, err := Open(again, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("after its ttl: %v", err)
	}
	st, err := Open(orig, OpenOptions{})
	if err != nil {
		t.Fatalf("the original after the new one expired: %v", err)
	}
	st.Close()
}

// TestLocalCallsRefuseAlteredTickets: unregister, wait and register_again
// take only the very ticket issued: a copy with any single byte changed is
// refused (or does not parse), and the registration is untouched.
func TestLocalCallsRefuseAlteredTickets(t *testing.T) {
	s, tk := registerPage(t, RegisterOptions{Uses: 0})
	raw, err := tk.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	for i := range raw {
		b := raw
		b[i] ^= 0x01
		bad, err := DecodeTicket(b[:])
		if err != nil {
			continue // refused already by parsing
		}
		if err := s.Unregister(bad); err == nil {
			t.Fatalf("byte %d changed: unregister succeeded", i)
		}
		if err := s.Wait(bad, 0); err == nil || CodeOf(err) == ETIMEDOUT {
			t.Fatalf("byte %d changed: wait answered %v", i, err)
		}
		if _, err := s.RegisterAgain(bad, RegisterOptions{}); err == nil {
			t.Fatalf("byte %d changed: register_again succeeded", i)
		}
	}
	if s.Live() != 1 {
		t.Fatalf("%d registrations live after the refusals, want 1", s.Live())
	}
	if err := s.Unregister(tk); err != nil {
		t.Fatalf("the real ticket: %v", err)
	}
}
