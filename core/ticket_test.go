package core

import (
	"strings"
	"testing"
)

// TestTicketMessagesSayWhich: a malformed ticket is refused with a message
// that names the one thing wrong with it, never a list of what might be
// ("registration id 5 or buffer id 0 is 0", "truncated or oversized").
func TestTicketMessagesSayWhich(t *testing.T) {
	good := func() *Ticket {
		return &Ticket{Kind: MemoryHost, Pid: 1, RegID: 2, BufferID: 3, Count: 1, Total: 4096, Address: "@vmmipc-test"}
	}
	if _, err := good().Marshal(); err != nil {
		t.Fatalf("the good ticket: %v", err)
	}
	for _, tc := range []struct {
		name   string
		change func(*Ticket)
		says   string
		not    string
	}{
		{"registration id 0", func(k *Ticket) { k.RegID = 0 }, "ticket: registration id is 0", "buffer id"},
		{"buffer id 0", func(k *Ticket) { k.BufferID = 0 }, "ticket: buffer id is 0", "registration id"},
		{"empty address", func(k *Ticket) { k.Address = "@" }, `socket address "@" is empty`, "NUL"},
		{"long address", func(k *Ticket) { k.Address = "/" + strings.Repeat("a", 107) }, "is 108 bytes, longer than the 107 a ticket holds", "NUL"},
		{"NUL in the address", func(k *Ticket) { k.Address = "@a\x00b" }, "contains a NUL byte", "longer"},
	} {
		k := good()
		tc.change(k)
		_, err := k.Marshal()
		if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) || strings.Contains(err.Error(), tc.not) {
			t.Errorf("%s: %v, want EINVAL saying %q and not %q", tc.name, err, tc.says, tc.not)
		}
	}
	b, err := good().Marshal()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		n    int
		says string
	}{
		{TicketSize - 1, "ticket: 255 bytes, fewer than the 256 of a ticket (truncated)"},
		{TicketSize + 1, "ticket: 257 bytes, more than the 256 of a ticket"},
	} {
		in := make([]byte, tc.n)
		copy(in, b[:])
		if _, err := DecodeTicket(in); CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%d bytes: %v, want EINVAL saying %q", tc.n, err, tc.says)
		}
	}
}
