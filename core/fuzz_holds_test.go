package core

import (
	"bytes"
	"testing"
)

// FuzzHoldMessages: the hold messages a peer can send (hold-on, lease,
// release, release-ack) never crash their parsers, and whatever parses
// encodes back to the same bytes (no two encodings of one message).
func FuzzHoldMessages(f *testing.F) {
	var tok leaseToken
	tok[3] = 7
	f.Add(msgRelease, releaseMsg{Slot: 3, Token: tok, Flags: releaseEnd, RegIDs: []uint64{1, 2}}.encode()[headerSize:])
	f.Add(msgRelease, releaseMsg{Slot: 0, Token: tok, Flags: releaseEnd}.encode()[headerSize:])
	f.Add(msgHoldOn, leaseRefMsg{Slot: 9, Token: tok}.encode(msgHoldOn)[headerSize:])
	f.Add(msgLease, leaseRefMsg{Slot: maxLeaseSlot + 1, Token: tok}.encode(msgLease)[headerSize:])
	f.Add(msgReleaseAck, releaseAckMsg{LetGo: 5}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, typ uint8, body []byte) {
		var again []byte
		switch typ % 4 {
		case 0:
			m, err := parseRelease(body)
			if err != nil {
				return
			}
			if len(m.RegIDs) > maxReleaseBatch || (len(m.RegIDs) == 0 && m.Flags&releaseEnd == 0) {
				t.Fatalf("accepted %+v", m)
			}
			again = m.encode()
		case 1:
			m, err := parseLeaseRef(msgHoldOn, body)
			if err != nil {
				return
			}
			if m.Slot > maxLeaseSlot {
				t.Fatalf("accepted slot %d", m.Slot)
			}
			again = m.encode(msgHoldOn)
		case 2:
			m, err := parseLeaseRef(msgLease, body)
			if err != nil {
				return
			}
			again = m.encode(msgLease)
		case 3:
			m, err := parseReleaseAck(body)
			if err != nil {
				return
			}
			again = m.encode()
		}
		if !bytes.Equal(again[headerSize:], body) {
			t.Fatalf("%x parsed and encoded back as %x", body, again[headerSize:])
		}
	})
}
