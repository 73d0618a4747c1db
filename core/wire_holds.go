package core

import (
	"encoding/binary"
	"unicode/utf8"
)

// The messages of holds (holds.go has the rules, wire.go the framing):
//
//	receiver                               server
//	hold-for(token)                  →     (before hello, instead of helloHolder:
//	                                       hold this stream's use on that session)
//	...a stream or confirmation with helloHolder, then:
//	                                 ←     done-ack(flags, held)
//	                                 ←     holding(token)
//	use(reg id, flags, proof)        →
//	                                 ←     use-ack(reg id, status, flags, text)
//	release(n, reg ids...)           →     (no answer)
//
// A use's proof is a transcript proof (handshake.go) of the used
// registration's secret, bound to this session's handshake: its nonces and
// socket, and the used registration's id and ticket digest.

// useProofFlag is the flags of a use's transcript: it sets a use's proof
// apart from every handshake's (whose hello flags never have this bit).
const useProofFlag = 1 << 63

type holderToken [tokenSize]byte

type (
	tokenMsg struct {
		Token holderToken
	}
	useMsg struct {
		RegID uint64
		Flags uint64 // zero: none defined yet
		Proof [proofSize]byte
	}
	useAckMsg struct {
		RegID uint64
		Code  Code   // OK, or why the use was refused
		Flags uint64 // done-ack flags
		Text  string // why, when refused
	}
	releaseMsg struct {
		RegIDs []uint64
	}
)

func (m tokenMsg) encode(typ uint8) []byte { return fields{}.raw(m.Token[:]).msg(typ) }

func parseToken(typ uint8, body []byte) (m tokenMsg, err error) {
	r, err := readBody(typ, body)
	if err == nil {
		r.raw(m.Token[:])
	}
	return m, err
}

func (m useMsg) encode() []byte {
	return fields{}.u64(m.RegID).u64(m.Flags).raw(m.Proof[:]).msg(msgUse)
}

func parseUse(body []byte) (m useMsg, err error) {
	r, err := readBody(msgUse, body)
	if err != nil {
		return m, err
	}
	m.RegID, m.Flags = r.u64(), r.u64()
	r.raw(m.Proof[:])
	if m.Flags != 0 {
		return m, Errorf(EINVAL, "protocol: use flags %#x not understood", m.Flags)
	}
	return m, nil
}

func (m useAckMsg) encode() []byte {
	text := m.Text
	if len(text) > maxErrorText {
		text = text[:maxErrorText]
	}
	return fields{}.u64(m.RegID).u64(uint64(uint32(m.Code))).u64(m.Flags).raw([]byte(text)).msg(msgUseAck)
}

func parseUseAck(body []byte) (m useAckMsg, err error) {
	if len(body) < useAckHead || len(body) > useAckHead+maxErrorText {
		return m, Errorf(EINVAL, "protocol: use-ack of %d bytes", len(body))
	}
	r := &reader{body}
	var code uint64
	m.RegID, code, m.Flags = r.u64(), r.u64(), r.u64()
	if code > 0xffffffff {
		return m, Errorf(EINVAL, "protocol: use-ack status %#x out of range", code)
	}
	m.Code = Code(int32(uint32(code)))
	if m.Code != OK && !m.Code.IsError() {
		return m, Errorf(EINVAL, "protocol: use-ack status %d is neither OK nor an error", int32(m.Code))
	}
	if m.Flags&^ackKnown != 0 {
		return m, Errorf(EINVAL, "protocol: use-ack flags %#x not understood", m.Flags)
	}
	if m.Text = string(r.b); !utf8.ValidString(m.Text) {
		m.Text = "(peer sent a message that is not UTF-8)"
	}
	return m, nil
}

func (m releaseMsg) encode() []byte {
	f := fields{}.u64(uint64(len(m.RegIDs)))
	for _, id := range m.RegIDs {
		f = f.u64(id)
	}
	return f.msg(msgRelease)
}

func parseRelease(body []byte) (m releaseMsg, err error) {
	if len(body) < releaseHead+8 || (len(body)-releaseHead)%8 != 0 {
		return m, Errorf(EINVAL, "protocol: release of %d bytes", len(body))
	}
	n := binary.LittleEndian.Uint64(body)
	if n == 0 || n > maxReleaseBatch || n != uint64(len(body)-releaseHead)/8 {
		return m, Errorf(EINVAL, "protocol: release counts %d registrations in %d bytes (1 to %d)", n, len(body), maxReleaseBatch)
	}
	r := &reader{body[releaseHead:]}
	m.RegIDs = make([]uint64, n)
	for i := range m.RegIDs {
		m.RegIDs[i] = r.u64()
	}
	return m, nil
}
