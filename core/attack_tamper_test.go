package core

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Tampering with what a ticket names: a ticket with any one byte changed,
// and another file put at the number of the registered descriptor.
// Receivers get the registered bytes or a refusal, never anything else.

// TestEverySingleByteCorruption changes each of the 256 bytes of a ticket
// to several other values. Every variant is refused (EINVAL when decoding,
// or EINVAL, EAUTH, ENOENT or EIO when importing), none is imported, none
// spends the registration's only use, and nothing leaks. Bytes of the
// device-UUID field of a host ticket are refused by the decoder itself.
func TestEverySingleByteCorruption(t *testing.T) {
	s, tk := oneUseTicket(t, 6)
	good, err := tk.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	fdsBefore := ourFDs().settled(t)
	entries := GetCacheInfo().Entries
	outcomes := map[string]int{}
	var slowest time.Duration
	for pos := 0; pos < TicketSize; pos++ {
		for _, v := range corruptions(good[pos]) {
			b := good
			b[pos] = v
			bad, err := DecodeTicket(b[:])
			if err != nil {
				if CodeOf(err) != EINVAL {
					t.Fatalf("byte %d = %#x: decode failed with %v, want EINVAL: %v", pos, v, CodeOf(err), err)
				}
				outcomes["decode EINVAL"]++
				continue
			}
			if pos >= offUUID && pos < offUUID+16 {
				t.Fatalf("byte %d (device UUID) = %#x: a host ticket with a device UUID decoded", pos, v)
			}
			start := time.Now()
			r, err := Import(bad, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: 2 * time.Second}}, nil)
			took := time.Since(start)
			slowest = max(slowest, took)
			switch CodeOf(err) {
			case EINVAL, EAUTH, ENOENT, EIO:
				outcomes["import "+CodeOf(err).String()[:strings.IndexByte(CodeOf(err).String(), ':')]]++
			case OK:
				Unmap(r.ID, r.Base)
				t.Fatalf("byte %d = %#x: the corrupted ticket imported", pos, v)
			default:
				t.Fatalf("byte %d = %#x: import failed with %v, want EINVAL, EAUTH, ENOENT or EIO: %v", pos, v, CodeOf(err), err)
			}
			if took > promptly {
				t.Fatalf("byte %d = %#x: refused only after %v: %v", pos, v, took, err)
			}
		}
	}
	ourFDs().waitFor(t, fdsBefore, "after every corrupted ticket")
	if n := GetCacheInfo().Entries; n != entries {
		t.Fatalf("%d mappings in the library's table, %d before", n, entries)
	}
	expectNoMemfdMappings(t, "after every corrupted ticket")
	if s.Live() != 1 {
		t.Fatalf("%d live registrations, want the 1", s.Live())
	}
	r := importHost(t, tk, ImportOptions{}) // the only use is still there
	if err := verifyAndUnmap(r, 6); err != nil {
		t.Fatal(err)
	}
	t.Logf("outcomes %v; slowest refusal after an import attempt %v", outcomes, slowest)
}

// corruptions are the values a ticket byte b is changed to: one low and one
// high bit flipped, every bit flipped, and zero or 0xff.
func corruptions(b byte) []byte {
	out := []byte{b ^ 0x01, b ^ 0x80, b ^ 0xff}
	if b != 0 && b != 0xff {
		out = append(out, 0)
	}
	return out
}

// TestRegisteredFileNotItsNumber: the owner's descriptor of the registered
// file is closed and its number taken by another memfd with other bytes.
// Receivers get the registered file's bytes: the library holds a duplicate
// of its own, not a number.
func TestRegisteredFileNotItsNumber(t *testing.T) {
	s := newTestServer(t)
	const size = 8 * 4096
	fd := newMemfd(t, size, pattern(size, 21))
	before := ourFDs().settled(t)
	tk := registerFile(t, s, fd, size, 4096, RegisterOptions{Uses: 2})
	// Close the registered descriptor and put another file at its number,
	// in one step: close-then-open would race with the library's own
	// goroutines for the freed number.
	other := newMemfd(t, size, pattern(size, 22))
	if err := unix.Dup3(other, fd, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(other)
	for i := 0; i < 2; i++ {
		r := importHost(t, tk, ImportOptions{NoCache: true})
		if err := verifyAndUnmap(r, 21); err != nil {
			t.Fatalf("import %d after the descriptor number was reused: %v", i, err)
		}
	}
	// Registering the new file at the same number is another buffer.
	tk2 := registerFile(t, s, fd, size, 4096, RegisterOptions{Uses: 1})
	if tk2.BufferID == tk.BufferID {
		t.Fatalf("another file at the same descriptor number joined buffer %d", tk.BufferID)
	}
	r := importHost(t, tk2, ImportOptions{})
	if err := verifyAndUnmap(r, 22); err != nil {
		t.Fatal(err)
	}
	unix.Close(fd)
	ourFDs().waitFor(t, before-1, "after both registrations were used up (the library's duplicates closed)")
}

// TestDamagedTicketIsSuspected: where a ticket's own fields lead nowhere
// (a pid no process has, a pid of another process, nobody listening at
// its address, a network namespace not ours) while the exporter lives, the
// receiver is refused at once (EIO) with a message that says the ticket may
// be damaged or come from another host or container, not only that the
// exporter exited; the registration's use is not spent.
func TestDamagedTicketIsSuspected(t *testing.T) {
	_, tk := oneUseTicket(t, 7)
	unused := uint32(0)
	for pid := uint32(4194303); pid > 1000; pid-- {
		if _, err := os.Stat(fmt.Sprintf("/proc/%d", pid)); os.IsNotExist(err) {
			unused = pid
			break
		}
	}
	damage := map[string]func(*Ticket){
		"a pid no process has":       func(b *Ticket) { b.Pid = unused },
		"the pid of another process": func(b *Ticket) { b.Pid = uint32(os.Getppid()) },
		"an address nobody listens at": func(b *Ticket) {
			b.Address = b.Address[:len(b.Address)-1] + string(b.Address[len(b.Address)-1]^1)
		},
		"another network namespace": func(b *Ticket) { b.NS.Net++ },
	}
	for what, change := range damage {
		bad := *tk
		change(&bad)
		_, err := Import(&bad, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: 2 * time.Second}}, nil)
		if CodeOf(err) != EIO || !strings.Contains(err.Error(), "the ticket is damaged, or comes from another host or container") {
			t.Errorf("%s: got %v (%v), want EIO saying the ticket may be damaged", what, CodeOf(err), err)
		}
		t.Logf("%s: %v", what, err)
	}
	r := importHost(t, tk, ImportOptions{}) // the only use is still there
	if err := verifyAndUnmap(r, 7); err != nil {
		t.Fatal(err)
	}
}

// oneUseTicket registers a fresh 4-page memfd of pattern(seed) with one use
// on a new server, the cache flushed first.
func oneUseTicket(t *testing.T, seed byte) (*Server, *Ticket) {
	t.Helper()
	flushCache(t)
	s := newTestServer(t)
	fd := newMemfd(t, 4*4096, pattern(4*4096, seed))
	defer unix.Close(fd)
	return s, registerFile(t, s, fd, 4*4096, 4096, RegisterOptions{Uses: 1})
}
