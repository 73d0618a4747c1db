package core

import (
	"testing"
	"time"
)

// Held cache hits (issue 31 items 5 and 6): a hit is believed only once the
// exporter granted it, for this very ticket.

// TestHeldHitOnAnEndedGrant: a held hit on a grant that was unregistered,
// or whose ttl passed, gives ENOENT, as a miss would (at 860d711: OK, and
// the refusal arrived later, counted in confirms_failed), and holds
// nothing.
func TestHeldHitOnAnEndedGrant(t *testing.T) {
	f := newHoldFixture(t)
	r := importHost(t, f.anchor, ImportOptions{}) // the mapping hits find
	defer Unmap(r.ID, r.Base)
	g0 := holdOne(t, f) // this process holds from the exporter already
	held := f.s.Holds()
	for _, how := range []string{"unregistered", "ttl"} {
		for i := range 10 {
			opts := RegisterOptions{Uses: 1, Hold: true}
			if how == "ttl" {
				opts.TTL = time.Millisecond
			}
			g, err := f.s.RegisterAgain(f.anchor, opts)
			if err != nil {
				t.Fatal(err)
			}
			if how == "unregistered" {
				if err := f.s.Unregister(g); err != nil {
					t.Fatal(err)
				}
			} else {
				time.Sleep(5 * time.Millisecond)
			}
			if _, err := Import(g, DeviceHost, holdImport, nil); CodeOf(err) != ENOENT {
				t.Fatalf("%s grant %d: a held hit gave %v, want ENOENT", how, i, err)
			}
		}
	}
	if n := f.s.Holds(); n != held {
		t.Fatalf("the exporter counts %d holds, had %d", n, held)
	}
	letGo(t, f, g0, "the first hold")
}

// TestHeldHitRefusesAChangedTicket: a ticket changed in any one byte (each
// of 256 positions, two ways) is refused on a held import whose buffer is
// mapped here already, as in a fresh process (at 860d711: 148 of 512
// accepted, secret bytes included, handing back the live memory).
func TestHeldHitRefusesAChangedTicket(t *testing.T) {
	f := newHoldFixture(t)
	r := importHost(t, f.anchor, ImportOptions{}) // the mapping hits find
	defer Unmap(r.ID, r.Base)
	g0 := holdOne(t, f) // this process holds from the exporter already
	g, err := f.s.RegisterAgain(f.anchor, RegisterOptions{Uses: 0, Hold: true})
	if err != nil {
		t.Fatal(err)
	}
	good, err := g.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	opts := ImportOptions{Hold: true, OpenOptions: OpenOptions{Timeout: 2 * time.Second}}
	accepted := 0
	for pos := range TicketSize {
		for _, flip := range []byte{0x01, 0x80} {
			b := good
			b[pos] ^= flip
			tk, err := DecodeTicket(b[:])
			if err != nil {
				continue // refused before any use
			}
			ref, err := Import(tk, DeviceHost, opts, nil)
			if err == nil {
				accepted++
				t.Errorf("byte %d ^ %#x: accepted (mapping at %#x)", pos, flip, ref.Base)
				Unmap(ref.ID, ref.Base)
			}
		}
	}
	if accepted > 0 {
		t.Fatalf("%d of 512 changed tickets accepted", accepted)
	}
	if n := f.s.Holds(); n != 1 {
		t.Fatalf("the exporter counts %d holds after only refusals, want the first one", n)
	}
	if held := GetCacheInfo().Holds; held != 1 {
		t.Fatalf("the receiver counts %d holds after only refusals, want the first one", held)
	}
	letGo(t, f, g0, "the first hold")
}

// holdOne holds one use of a grant of f's exporter, so that later held
// uses find this process holding from it already (at 860d711: its holder
// session, on which a hit did not wait for its answer).
func holdOne(t *testing.T, f holdFixture) *Ticket {
	t.Helper()
	g, _ := f.grant(t, true)
	if err := Confirm(g, holdImport); err != nil {
		t.Fatal(err)
	}
	stillHeld(t, f, g, "the first hold")
	return g
}
