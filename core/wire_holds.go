package core

import (
	"encoding/binary"
)

// The messages of holds (holds.go has the rules, wire.go the framing). A
// held use is an ordinary session whose hello asks for a lease, or which
// names one first; releases go on a short connection of their own, or
// ride on the next held use (below):
//
//	receiver                               server
//	hold-on(slot, token)             →     (before hello: hold this use on
//	                                       that lease; or lease-gone)
//	hello(flags: lease) ... proof    →     (a receiver without a lease)
//	                                 ←     lease(slot, token) + 1 descriptor
//	leased                           →     (the slot is locked: believe it)
//	                                 ←     welcome ... done-ack(flags, held)
//
//	release(slot, token, flags,      →     (the first message on its own
//	        n, reg ids...)                 connection)
//	                                 ←     release-ack(n let go), or lease-gone
//
// A held use may carry the releases queued on its lease: a release with
// flag hold-on stands for its hold-on, and the use's answers answer it (the
// challenge comes only once its ids were let go).
//
// A lease names itself by its slot and a random token that only the
// exporter and the receiver it was sent to know (on an authenticated
// session).

// maxLeaseSlot bounds a slot number on the wire (the exporter hands out far
// fewer: maxLeases).
const maxLeaseSlot = 1 << 20

type leaseToken [tokenSize]byte

// errLeaseGone is the receiver's view of lease-gone: the lease it named has
// ended (it was idle, its receiver unmapped it, or the exporter closed):
// what it held there was let go.
var errLeaseGone = Errorf(ENOENT, "the exporter no longer knows this process's lease (it ended: idle, or let go of)")

// Release flags.
const (
	releaseEnd    uint64 = 1 << 0 // the receiver holds nothing more: end the lease
	releaseHoldOn uint64 = 1 << 1 // carried by a held use: it stands for that use's hold-on
	releaseKnown         = releaseEnd | releaseHoldOn
)

type (
	// leaseRefMsg names a lease: hold-on (receiver) and lease (server).
	leaseRefMsg struct {
		Slot  uint64
		Token leaseToken
	}
	releaseMsg struct {
		Slot   uint64
		Token  leaseToken
		Flags  uint64
		RegIDs []uint64
	}
	releaseAckMsg struct {
		LetGo uint64 // holds let go (ids the lease did not hold are ignored)
	}
)

func (m leaseRefMsg) encode(typ uint8) []byte {
	return fields{}.u64(m.Slot).raw(m.Token[:]).msg(typ)
}

func parseLeaseRef(typ uint8, body []byte) (m leaseRefMsg, err error) {
	r, err := readBody(typ, body)
	if err != nil {
		return m, err
	}
	m.Slot = r.u64()
	r.raw(m.Token[:])
	if m.Slot > maxLeaseSlot {
		return m, Errorf(EINVAL, "protocol: lease slot %d out of range", m.Slot)
	}
	return m, nil
}

func (m releaseMsg) encode() []byte {
	f := fields{}.u64(m.Slot).raw(m.Token[:]).u64(m.Flags).u64(uint64(len(m.RegIDs)))
	for _, id := range m.RegIDs {
		f = f.u64(id)
	}
	return f.msg(msgRelease)
}

func parseRelease(body []byte) (m releaseMsg, err error) {
	if len(body) < releaseHead || (len(body)-releaseHead)%8 != 0 {
		return m, Errorf(EINVAL, "protocol: release of %d bytes", len(body))
	}
	r := &reader{body}
	m.Slot = r.u64()
	r.raw(m.Token[:])
	m.Flags = r.u64()
	n := r.u64()
	switch {
	case m.Slot > maxLeaseSlot:
		return m, Errorf(EINVAL, "protocol: lease slot %d out of range", m.Slot)
	case m.Flags&^releaseKnown != 0:
		return m, Errorf(EINVAL, "protocol: release flags %#x not understood", m.Flags)
	case n > maxReleaseBatch || n != uint64(len(body)-releaseHead)/8:
		return m, Errorf(EINVAL, "protocol: release counts %d registrations in %d bytes (0 to %d)", n, len(body), maxReleaseBatch)
	case m.Flags&releaseEnd != 0 && m.Flags&releaseHoldOn != 0:
		return m, Errorf(EINVAL, "protocol: a release that ends its lease cannot hold a use on it")
	case n == 0 && m.Flags&releaseEnd == 0:
		return m, Errorf(EINVAL, "protocol: a release of nothing that does not end the lease")
	}
	m.RegIDs = make([]uint64, n)
	for i := range m.RegIDs {
		m.RegIDs[i] = binary.LittleEndian.Uint64(body[releaseHead+8*i:])
	}
	return m, nil
}

func (m releaseAckMsg) encode() []byte { return fields{}.u64(m.LetGo).msg(msgReleaseAck) }

func parseReleaseAck(body []byte) (m releaseAckMsg, err error) {
	r, err := readBody(msgReleaseAck, body)
	if err == nil {
		m.LetGo = r.u64()
	}
	return m, err
}
