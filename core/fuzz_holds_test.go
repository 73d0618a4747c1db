package core

import (
	"bytes"
	"runtime"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// FuzzHoldMessages: the hold messages a peer can send (hold-on, lease,
// release, release-ack, use, use-ack) never crash their parsers, and whatever parses
// encodes back to the same bytes (no two encodings of one message).
func FuzzHoldMessages(f *testing.F) {
	var tok leaseToken
	tok[3] = 7
	f.Add(msgRelease, releaseMsg{Slot: 3, Token: tok, Flags: releaseEnd, RegIDs: []uint64{1, 2}}.encode()[headerSize:])
	f.Add(msgRelease, releaseMsg{Slot: 0, Token: tok, Flags: releaseEnd}.encode()[headerSize:])
	f.Add(msgRelease, releaseMsg{Slot: 2, Token: tok, Flags: releaseHoldOn, RegIDs: []uint64{4}}.encode()[headerSize:])
	f.Add(msgHoldOn, leaseRefMsg{Slot: 9, Token: tok}.encode(msgHoldOn)[headerSize:])
	f.Add(msgLease, leaseRefMsg{Slot: maxLeaseSlot + 1, Token: tok}.encode(msgLease)[headerSize:])
	f.Add(msgReleaseAck, releaseAckMsg{LetGo: 5}.encode()[headerSize:])
	f.Add(uint8(4), useMsg{RegID: 3}.encode()[headerSize:])
	f.Add(uint8(5), useAckMsg{RegID: 3, Code: ENOENT, Flags: ackHeld, Text: "gone"}.encode()[headerSize:])
	f.Fuzz(func(t *testing.T, typ uint8, body []byte) {
		var again []byte
		switch typ % 6 {
		case 0:
			m, err := parseRelease(body)
			if err != nil {
				return
			}
			if len(m.RegIDs) > maxReleaseBatch || (len(m.RegIDs) == 0 && m.Flags&releaseEnd == 0) ||
				m.Flags&(releaseEnd|releaseHoldOn) == releaseEnd|releaseHoldOn {
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
		case 4:
			m, err := parseUse(body)
			if err != nil {
				return
			}
			again = m.encode()
		case 5:
			m, err := parseUseAck(body)
			if err != nil || m.Text != string(body[useAckHead:]) {
				return // text that is not UTF-8 is replaced
			}
			if m.Code != OK && !m.Code.IsError() || m.Flags&^ackKnown != 0 {
				t.Fatalf("accepted %+v", m)
			}
			again = m.encode()
		}
		if !bytes.Equal(again[headerSize:], body) {
			t.Fatalf("%x parsed and encoded back as %x", body, again[headerSize:])
		}
	})
}

// FuzzLeaseSession: whatever a peer that does not know a lease's token
// sends as a connection's first messages (a release or hold-on naming a
// real lease's slot with a wrong token, or any bytes at all), the server
// never crashes, sends no descriptor, never acknowledges a release,
// never lets go of the real lease's hold, and once the connection ends no
// descriptor and no goroutine is left.
func FuzzLeaseSession(f *testing.F) {
	quietFDs(f)
	// Each input ends with the victim's lease: at once, not after the
	// linger a lease has between uses (which would make each 0.25 s).
	old := leaseLinger
	leaseLinger = time.Millisecond
	f.Cleanup(func() { leaseLinger = old })
	var tok leaseToken
	f.Add([]byte{}, uint8(1))
	f.Add(releaseMsg{Token: tok, Flags: releaseEnd, RegIDs: []uint64{1, 2}}.encode(), uint8(0))
	f.Add(leaseRefMsg{Token: tok}.encode(msgHoldOn), uint8(2))
	f.Add(cat(leaseRefMsg{}.encode(msgHoldOn), helloMsg{RegID: 1, Flags: helloLease}.encode()), uint8(0))
	f.Add(encodeMsg(msgLeased, nil), uint8(3))
	f.Add(helloMsg{RegID: 1}.encode(), uint8(3))
	f.Fuzz(func(t *testing.T, data []byte, mode uint8) {
		if len(data) > 64<<10 {
			return
		}
		s, anchor := fuzzServer(t)
		victim, err := s.RegisterAgain(anchor, RegisterOptions{Uses: 1, Hold: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := Confirm(victim, ImportOptions{Hold: true}); err != nil {
			t.Fatal(err)
		}
		l := leaseOf(victim)
		if l == nil {
			t.Fatal("no lease after a held use")
		}
		fdsBefore, gBefore := ourFDs().now(t), runtime.NumGoroutine()
		wrong := l.token
		wrong[int(mode)%tokenSize] ^= 1 | mode
		send := data
		switch mode % 4 {
		case 1: // a release of the victim's lease, with a wrong token
			send = cat(releaseMsg{Slot: l.slot, Token: wrong, Flags: releaseEnd, RegIDs: []uint64{victim.RegID}}.encode(), data)
		case 2: // a hold-on of it
			send = cat(leaseRefMsg{Slot: l.slot, Token: wrong}.encode(msgHoldOn), data)
		case 3: // a release carried by a held use, on it
			send = cat(releaseMsg{Slot: l.slot, Token: wrong, Flags: releaseHoldOn, RegIDs: []uint64{victim.RegID}}.encode(), data)
		}
		fd, err := rawDial(victim.Address)
		if err != nil {
			t.Fatal(err)
		}
		replies := make(chan rawReply, 1)
		go func() { replies <- rawReadAll(fd, 2*time.Second) }()
		_ = rawWrite(fd, send)
		_ = unix.Shutdown(fd, unix.SHUT_WR)
		reply := <-replies
		unix.Close(fd)
		if reply.Err != nil {
			t.Fatalf("the server neither answered nor hung up: %v", reply.Err)
		}
		if len(reply.FDAt) != 0 {
			t.Fatalf("the server sent %d descriptor(s) to a peer that never proved a secret", len(reply.FDAt))
		}
		msgs, err := splitMessages(reply.Data)
		if err != nil {
			t.Fatalf("the server sent a malformed stream: %v", err)
		}
		for i, m := range msgs {
			switch m.Type {
			case msgLeaseGone, msgError, msgBusy, msgChallenge, msgStatusAck:
			default:
				t.Fatalf("message %d to a peer without the token: %s", i, describeMsg(m))
			}
		}
		if err := s.Wait(victim, time.Millisecond); CodeOf(err) != ETIMEDOUT {
			t.Fatalf("the victim's hold was let go of: %v", err)
		}
		if err := Release(victim); err != nil {
			t.Fatal(err)
		}
		if err := s.Wait(victim, 5*time.Second); err != nil {
			t.Fatalf("the victim's own release: %v", err)
		}
		// Its lease ends with its last release: the receiver unmaps it.
		if !waitUntil(5*time.Second, func() bool { return leaseOf(victim) == nil }) {
			t.Fatal("the victim's lease outlived its last hold")
		}
		// At most as many as before: one counted then may have been a
		// session's, closing (the victim's use, an earlier release).
		if !waitUntil(3*time.Second, func() bool { return ourFDs().now(t) <= fdsBefore }) {
			t.Fatalf("%d descriptors after the fuzzed connection, %d before", ourFDs().now(t), fdsBefore)
		}
		if !waitUntil(2*time.Second, func() bool { return runtime.NumGoroutine() <= gBefore }) {
			t.Fatalf("goroutines: %d, were %d", runtime.NumGoroutine(), gBefore)
		}
	})
}

// FuzzLeaseFile: a receiver takes whatever descriptor and slot an exporter
// sends as its lease (a file of any size, sealed or not, a pipe) without
// crashing or leaking: it closes the descriptor on every path, maps only
// a file of one page, and its lock is on the slot named.
func FuzzLeaseFile(f *testing.F) {
	quietFDs(f)
	f.Add(uint64(0), uint32(4096), uint8(0))
	f.Add(uint64(maxLeaseSlot), uint32(4096), uint8(1))
	f.Add(uint64(maxLeaseSlot+1), uint32(4096), uint8(0))
	f.Add(uint64(7), uint32(0), uint8(2))
	f.Add(uint64(7), uint32(8192), uint8(3))
	f.Fuzz(func(t *testing.T, slot uint64, size uint32, kind uint8) {
		fdsBefore := ourFDs().now(t)
		var fd, keep int = -1, -1
		switch kind % 3 {
		case 0, 1:
			mfd, err := unix.MemfdCreate("fuzz-lease", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
			if err != nil {
				t.Fatal(err)
			}
			_ = unix.Ftruncate(mfd, int64(size%(3*uint32(pageSize))))
			if kind%3 == 1 {
				_, _ = unix.FcntlInt(uintptr(mfd), unix.F_ADD_SEALS, unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL)
			}
			keep = mfd
			if fd, err = reopenLeaseFile(mfd); err != nil {
				t.Fatal(err)
			}
		case 2:
			var p [2]int
			if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
				t.Fatal(err)
			}
			fd, keep = p[0], p[1]
		}
		m, err := takeLease(fd, slot)
		if err == nil {
			if len(m) != int(pageSize) {
				t.Fatalf("a lease of %d bytes", len(m))
			}
			if locked, err := slotLocked(keep, slot); err != nil || !locked {
				t.Fatalf("slot %d not locked after takeLease: %v %v", slot, locked, err)
			}
			m.end()
			if locked, _ := slotLocked(keep, slot); locked {
				t.Fatalf("slot %d still locked after the lease's end", slot)
			}
		}
		unix.Close(keep)
		if now := ourFDs().now(t); now != fdsBefore {
			t.Fatalf("descriptors: %d, were %d (takeLease: %v)", now, fdsBefore, err)
		}
	})
}
