package core

import (
	"encoding/binary"
	"unicode/utf8"
)

// The bodies of a session's messages (wire.go draws the session and frames
// its messages; wire_holds.go has the hold messages): each one's decoded
// form, its encode and its parse, the layout one line each way (fields,
// reader).

// Decoded message bodies.
type (
	helloMsg struct {
		RegID uint64
		Flags uint64
		Nonce [nonceSize]byte
	}
	challengeMsg struct {
		Nonce [nonceSize]byte
		Proof [proofSize]byte
	}
	proofMsg struct {
		Proof [proofSize]byte
	}
	welcomeMsg struct {
		Count, Total uint64
		Kind         uint8
		BufferID     uint64
	}
	pullMsg struct {
		First, Count uint64
	}
	chunkMsg struct {
		Index, Offset, Size, FileOffset uint64
	}
	runMsg struct {
		Index, Count, Offset, Size, FileOffset uint64
	}
	doneAckMsg struct {
		Flags uint64
	}
	statusMsg struct {
		BufferID uint64
	}
	statusAckMsg struct {
		BufferID uint64
		Alive    bool
	}
	errorMsg struct {
		Code Code
		Text string
	}
)

func (m helloMsg) encode() []byte {
	return fields{}.u64(m.RegID).u64(m.Flags).raw(m.Nonce[:]).msg(msgHello)
}

func parseHello(body []byte) (m helloMsg, err error) {
	r, err := readBody(msgHello, body)
	if err != nil {
		return m, err
	}
	m.RegID, m.Flags = r.u64(), r.u64()
	r.raw(m.Nonce[:])
	if m.Flags&^helloKnown != 0 {
		return m, Errorf(EINVAL, "protocol: hello flags %#x not understood", m.Flags)
	}
	return m, nil
}

func (m challengeMsg) encode() []byte {
	return fields{}.raw(m.Nonce[:]).raw(m.Proof[:]).msg(msgChallenge)
}

func parseChallenge(body []byte) (m challengeMsg, err error) {
	r, err := readBody(msgChallenge, body)
	if err == nil {
		r.raw(m.Nonce[:])
		r.raw(m.Proof[:])
	}
	return m, err
}

func (m proofMsg) encode() []byte { return fields{}.raw(m.Proof[:]).msg(msgProof) }

func parseProof(body []byte) (m proofMsg, err error) {
	r, err := readBody(msgProof, body)
	if err == nil {
		r.raw(m.Proof[:])
	}
	return m, err
}

// The welcome's kind is a byte followed by 7 reserved zero bytes: one
// little-endian u64 whose upper bytes must be zero.
func (m welcomeMsg) encode() []byte {
	return fields{}.u64(m.Count).u64(m.Total).u64(uint64(m.Kind)).u64(m.BufferID).msg(msgWelcome)
}

func parseWelcome(body []byte) (m welcomeMsg, err error) {
	r, err := readBody(msgWelcome, body)
	if err != nil {
		return m, err
	}
	var kind uint64
	m.Count, m.Total, kind, m.BufferID = r.u64(), r.u64(), r.u64(), r.u64()
	if kind > 0xff {
		return m, Errorf(EINVAL, "protocol: welcome reserved bytes are not zero")
	}
	m.Kind = uint8(kind)
	return m, nil
}

func (m pullMsg) encode() []byte { return fields{}.u64(m.First).u64(m.Count).msg(msgPull) }

// encodeRun is the same body as a pull-run.
func (m pullMsg) encodeRun() []byte { return fields{}.u64(m.First).u64(m.Count).msg(msgPullRun) }

func parsePull(body []byte) (m pullMsg, err error) {
	r, err := readBody(msgPull, body)
	if err == nil {
		m.First, m.Count = r.u64(), r.u64()
	}
	return m, err
}

func (m chunkMsg) encode() []byte {
	return fields{}.u64(m.Index).u64(m.Offset).u64(m.Size).u64(m.FileOffset).msg(msgChunk)
}

func parseChunk(body []byte) (m chunkMsg, err error) {
	r, err := readBody(msgChunk, body)
	if err == nil {
		m.Index, m.Offset, m.Size, m.FileOffset = r.u64(), r.u64(), r.u64(), r.u64()
	}
	return m, err
}

func (m runMsg) encode() []byte {
	return fields{}.u64(m.Index).u64(m.Count).u64(m.Offset).u64(m.Size).u64(m.FileOffset).msg(msgRun)
}

func parseRun(body []byte) (m runMsg, err error) {
	r, err := readBody(msgRun, body)
	if err == nil {
		m.Index, m.Count, m.Offset, m.Size, m.FileOffset = r.u64(), r.u64(), r.u64(), r.u64(), r.u64()
	}
	return m, err
}

func (m doneAckMsg) encode() []byte { return fields{}.u64(m.Flags).msg(msgDoneAck) }

func parseDoneAck(body []byte) (m doneAckMsg, err error) {
	r, err := readBody(msgDoneAck, body)
	if err != nil {
		return m, err
	}
	if m.Flags = r.u64(); m.Flags&^ackKnown != 0 {
		return m, Errorf(EINVAL, "protocol: done-ack flags %#x not understood", m.Flags)
	}
	return m, nil
}

func (m statusMsg) encode() []byte { return fields{}.u64(m.BufferID).msg(msgStatus) }

func parseStatus(body []byte) (m statusMsg, err error) {
	r, err := readBody(msgStatus, body)
	if err == nil {
		m.BufferID = r.u64()
	}
	return m, err
}

func (m statusAckMsg) encode() []byte {
	alive := uint64(0)
	if m.Alive {
		alive = 1
	}
	return fields{}.u64(m.BufferID).u64(alive).msg(msgStatusAck)
}

func parseStatusAck(body []byte) (m statusAckMsg, err error) {
	r, err := readBody(msgStatusAck, body)
	if err != nil {
		return m, err
	}
	var alive uint64
	m.BufferID, alive = r.u64(), r.u64()
	if alive > 1 {
		return m, Errorf(EINVAL, "protocol: status-ack alive flag %d is not 0 or 1", alive)
	}
	m.Alive = alive == 1
	return m, nil
}

func (m errorMsg) encode() []byte {
	text := m.Text
	if len(text) > maxErrorText {
		text = text[:maxErrorText]
	}
	body := make([]byte, errorHead+len(text))
	binary.LittleEndian.PutUint32(body[0:], uint32(m.Code))
	copy(body[errorHead:], text)
	return encodeMsg(msgError, body)
}

func parseError(body []byte) (errorMsg, error) {
	if len(body) < errorHead || len(body) > errorHead+maxErrorText {
		return errorMsg{}, Errorf(EINVAL, "protocol: error message of %d bytes", len(body))
	}
	if binary.LittleEndian.Uint32(body[4:]) != 0 {
		return errorMsg{}, Errorf(EINVAL, "protocol: error message reserved bytes are not zero")
	}
	m := errorMsg{
		Code: Code(int32(binary.LittleEndian.Uint32(body[0:]))),
		Text: string(body[errorHead:]),
	}
	if !m.Code.IsError() {
		return m, Errorf(EINVAL, "protocol: error message with status %d, not an error status", int32(m.Code))
	}
	if !utf8.ValidString(m.Text) {
		m.Text = "(peer sent a message that is not UTF-8)"
	}
	return m, nil
}

// tableMsg answers helloTable: the slots of the grant table whose read-only
// descriptor comes with it, or 0 (no descriptor) when the exporter has none,
// and the number of the exporter's own descriptor of it, which receivers
// look for in /proc to tell that this process image still has it.
type tableMsg struct{ Slots, FD uint64 }

func (m tableMsg) encode() []byte { return fields{}.u64(m.Slots).u64(m.FD).msg(msgTable) }

func parseTable(body []byte) (m tableMsg, err error) {
	r, err := readBody(msgTable, body)
	if err != nil {
		return m, err
	}
	m.Slots, m.FD = r.u64(), r.u64()
	return m, nil
}

// spendLogMsg follows a table the receiver took: the records of the spend
// log whose descriptor comes with it, or 0 (no descriptor) for none.
type spendLogMsg struct{ Records uint64 }

func (m spendLogMsg) encode() []byte { return fields{}.u64(m.Records).msg(msgSpendLog) }

func parseSpendLog(body []byte) (m spendLogMsg, err error) {
	r, err := readBody(msgSpendLog, body)
	if err != nil {
		return m, err
	}
	m.Records = r.u64()
	return m, nil
}

// logAckMsg says whether the exporter took the receiver's spend log.
type logAckMsg struct{ Taken bool }

func (m logAckMsg) encode() []byte {
	v := uint64(0)
	if m.Taken {
		v = 1
	}
	return fields{}.u64(v).msg(msgLogAck)
}

func parseLogAck(body []byte) (m logAckMsg, err error) {
	r, err := readBody(msgLogAck, body)
	if err != nil {
		return m, err
	}
	switch r.u64() {
	case 0:
	case 1:
		m.Taken = true
	default:
		return m, Errorf(EINVAL, "protocol: a log-ack that is neither 0 nor 1")
	}
	return m, nil
}
