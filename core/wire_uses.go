package core

import "unicode/utf8"

// The messages of a session's further uses (confirm_many.go has the why,
// wire.go the framing): after the done-ack of its first use, a session
// whose hello said helloMore carries up to maxMoreUses uses of other
// registrations of the same exporter, answered in order, then done:
//
//	receiver                               server
//	use(reg id, flags, proof) ...    →
//	done                             →
//	                                 ←     use-ack(reg id, status, flags, text) ...
//
// (the server answers the uses it has read once nothing more waits to be
// read, or each as it reads it on a session with a lease:
// session_uses.go). A use's proof is a
// transcript proof (handshake.go) of the used registration's secret, bound
// to this session's handshake: its nonces and socket, and the used
// registration's id and ticket digest.

// useProofFlag is the flags of a use's transcript: it sets a use's proof
// apart from every handshake's (whose hello flags never have this bit).
const useProofFlag = 1 << 63

type (
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
)

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
