package core

import (
	"encoding/binary"
	"unicode/utf8"
)

// The wire protocol between a receiver and a server, over a Unix stream
// socket. Every message is a 16-byte header followed by a body:
//
//	0  u32 magic "VMIP"
//	4  u8  protocol version
//	5  u8  message type
//	6  u16 reserved, zero
//	8  u32 body length
//	12 u32 reserved, zero
//
// A session (handshake.go has the proofs):
//
//	receiver                               server
//	hello(reg id, flags, nonce Nr)   →
//	                                 ←     challenge(nonce Ns, server proof)
//	                                       (or error, or busy: retry later)
//	proof(receiver proof)            →
//	                                 ←     welcome(count, total, kind, buffer id)
//	pull(first, n) ...               →
//	                                 ←     chunk(index, offset, size, file offset)
//	                                       + exactly one descriptor, per chunk
//	done                             →
//	                                 ←     done-ack(buffer lives on?)
//
// With the confirm flag (a receiver that has the buffer cached) the server
// sends done-ack right after welcome and no chunk is pulled. An error
// message ends the session; the server closes the connection after it.
// Before any hello, a peer may send status queries (buffer id → alive?);
// they reveal nothing but whether a buffer id is live.
const (
	wireMagic       uint32 = 0x50494d56 // "VMIP"
	ProtocolVersion uint8  = 2
	headerSize             = 16
	maxErrorText           = 1024
)

// Message types.
const (
	msgHello     uint8 = 1  // receiver: registration id, flags, nonce
	msgWelcome   uint8 = 2  // server: count, total, kind, buffer id
	msgPull      uint8 = 3  // receiver: first index, count
	msgChunk     uint8 = 4  // server: index, offset, size, file offset (+ 1 fd)
	msgDone      uint8 = 5  // receiver: every chunk arrived
	msgError     uint8 = 6  // server: status, text
	msgDoneAck   uint8 = 7  // server: the use is spent; flags
	msgChallenge uint8 = 8  // server: nonce, proof
	msgProof     uint8 = 9  // receiver: proof
	msgBusy      uint8 = 10 // server: too many unauthenticated peers; retry
	msgStatus    uint8 = 11 // receiver, before hello: buffer id
	msgStatusAck uint8 = 12 // server: buffer id, alive
)

// Hello flags.
const (
	helloConfirm uint64 = 1 << 0 // the receiver has the buffer; spend a use, send nothing
	helloKnown          = helloConfirm
)

// Done-ack flags.
const (
	ackBufferLives uint64 = 1 << 0 // the buffer outlives this use: a receiver may cache it
	ackKnown              = ackBufferLives
)

// Body sizes of the fixed-size messages; an error message has errorHead
// bytes then up to maxErrorText bytes of UTF-8 text.
const (
	helloSize     = 8 + 8 + nonceSize
	challengeSize = nonceSize + proofSize
	proofMsgSize  = proofSize
	welcomeSize   = 8 + 8 + 8 + 8
	pullSize      = 16
	chunkMsgSize  = 32
	doneAckSize   = 8
	statusSize    = 8
	statusAckSize = 16
	errorHead     = 8
)

var bodySizes = map[uint8]int{
	msgHello: helloSize, msgWelcome: welcomeSize, msgPull: pullSize,
	msgChunk: chunkMsgSize, msgDone: 0, msgError: -1, msgDoneAck: doneAckSize,
	msgChallenge: challengeSize, msgProof: proofMsgSize, msgBusy: 0,
	msgStatus: statusSize, msgStatusAck: statusAckSize,
}

var msgNames = map[uint8]string{
	msgHello: "hello", msgWelcome: "welcome", msgPull: "pull", msgChunk: "chunk",
	msgDone: "done", msgError: "error", msgDoneAck: "done-ack", msgChallenge: "challenge",
	msgProof: "proof", msgBusy: "busy", msgStatus: "status", msgStatusAck: "status-ack",
}

func msgName(t uint8) string {
	if n, ok := msgNames[t]; ok {
		return n
	}
	return "unknown"
}

type header struct {
	Type uint8
	Len  uint32
}

func putHeader(b []byte, typ uint8, bodyLen int) {
	binary.LittleEndian.PutUint32(b[0:], wireMagic)
	b[4] = ProtocolVersion
	b[5] = typ
	binary.LittleEndian.PutUint16(b[6:], 0)
	binary.LittleEndian.PutUint32(b[8:], uint32(bodyLen))
	binary.LittleEndian.PutUint32(b[12:], 0)
}

// parseHeader checks a message header and returns its type and body length.
func parseHeader(b []byte) (header, error) {
	if len(b) != headerSize {
		return header{}, Errorf(EINVAL, "protocol: header of %d bytes, want %d", len(b), headerSize)
	}
	if m := binary.LittleEndian.Uint32(b[0:]); m != wireMagic {
		return header{}, Errorf(EINVAL, "protocol: bad magic %#x (not a libvmmipc peer)", m)
	}
	if b[4] != ProtocolVersion {
		return header{}, Errorf(EINVAL, "protocol: peer speaks version %d, this libvmmipc speaks %d (use libvmmipc versions with the same protocol on both sides)", b[4], ProtocolVersion)
	}
	if binary.LittleEndian.Uint16(b[6:]) != 0 || binary.LittleEndian.Uint32(b[12:]) != 0 {
		return header{}, Errorf(EINVAL, "protocol: reserved header bytes are not zero")
	}
	h := header{Type: b[5], Len: binary.LittleEndian.Uint32(b[8:])}
	want, ok := bodySizes[h.Type]
	switch {
	case !ok:
		return header{}, Errorf(EINVAL, "protocol: unknown message type %d", h.Type)
	case h.Type == msgError:
		if h.Len < errorHead || h.Len > errorHead+maxErrorText {
			return header{}, Errorf(EINVAL, "protocol: error message body of %d bytes out of range", h.Len)
		}
	case h.Len != uint32(want):
		return header{}, Errorf(EINVAL, "protocol: %s message body of %d bytes, want %d", msgName(h.Type), h.Len, want)
	}
	return h, nil
}

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

func encodeMsg(typ uint8, body []byte) []byte {
	b := make([]byte, headerSize+len(body))
	putHeader(b, typ, len(body))
	copy(b[headerSize:], body)
	return b
}

// bodyOf checks the body length of a fixed-size message.
func bodyOf(typ uint8, body []byte) error {
	if len(body) != bodySizes[typ] {
		return Errorf(EINVAL, "protocol: %s of %d bytes, want %d", msgName(typ), len(body), bodySizes[typ])
	}
	return nil
}

func (m helloMsg) encode() []byte {
	body := make([]byte, helloSize)
	binary.LittleEndian.PutUint64(body[0:], m.RegID)
	binary.LittleEndian.PutUint64(body[8:], m.Flags)
	copy(body[16:], m.Nonce[:])
	return encodeMsg(msgHello, body)
}

func parseHello(body []byte) (helloMsg, error) {
	var m helloMsg
	if err := bodyOf(msgHello, body); err != nil {
		return m, err
	}
	m.RegID = binary.LittleEndian.Uint64(body[0:])
	m.Flags = binary.LittleEndian.Uint64(body[8:])
	copy(m.Nonce[:], body[16:])
	if m.Flags&^helloKnown != 0 {
		return m, Errorf(EINVAL, "protocol: hello flags %#x not understood", m.Flags)
	}
	return m, nil
}

func (m challengeMsg) encode() []byte {
	body := make([]byte, challengeSize)
	copy(body, m.Nonce[:])
	copy(body[nonceSize:], m.Proof[:])
	return encodeMsg(msgChallenge, body)
}

func parseChallenge(body []byte) (challengeMsg, error) {
	var m challengeMsg
	if err := bodyOf(msgChallenge, body); err != nil {
		return m, err
	}
	copy(m.Nonce[:], body)
	copy(m.Proof[:], body[nonceSize:])
	return m, nil
}

func (m proofMsg) encode() []byte { return encodeMsg(msgProof, m.Proof[:]) }

func parseProof(body []byte) (proofMsg, error) {
	var m proofMsg
	if err := bodyOf(msgProof, body); err != nil {
		return m, err
	}
	copy(m.Proof[:], body)
	return m, nil
}

func (m welcomeMsg) encode() []byte {
	body := make([]byte, welcomeSize)
	binary.LittleEndian.PutUint64(body[0:], m.Count)
	binary.LittleEndian.PutUint64(body[8:], m.Total)
	body[16] = m.Kind
	binary.LittleEndian.PutUint64(body[24:], m.BufferID)
	return encodeMsg(msgWelcome, body)
}

func parseWelcome(body []byte) (welcomeMsg, error) {
	var m welcomeMsg
	if err := bodyOf(msgWelcome, body); err != nil {
		return m, err
	}
	m.Count = binary.LittleEndian.Uint64(body[0:])
	m.Total = binary.LittleEndian.Uint64(body[8:])
	m.Kind = body[16]
	m.BufferID = binary.LittleEndian.Uint64(body[24:])
	for _, c := range body[17:24] {
		if c != 0 {
			return m, Errorf(EINVAL, "protocol: welcome reserved bytes are not zero")
		}
	}
	return m, nil
}

func (m pullMsg) encode() []byte {
	body := make([]byte, pullSize)
	binary.LittleEndian.PutUint64(body[0:], m.First)
	binary.LittleEndian.PutUint64(body[8:], m.Count)
	return encodeMsg(msgPull, body)
}

func parsePull(body []byte) (pullMsg, error) {
	if err := bodyOf(msgPull, body); err != nil {
		return pullMsg{}, err
	}
	return pullMsg{First: binary.LittleEndian.Uint64(body[0:]), Count: binary.LittleEndian.Uint64(body[8:])}, nil
}

func (m chunkMsg) encode() []byte {
	body := make([]byte, chunkMsgSize)
	binary.LittleEndian.PutUint64(body[0:], m.Index)
	binary.LittleEndian.PutUint64(body[8:], m.Offset)
	binary.LittleEndian.PutUint64(body[16:], m.Size)
	binary.LittleEndian.PutUint64(body[24:], m.FileOffset)
	return encodeMsg(msgChunk, body)
}

func parseChunk(body []byte) (chunkMsg, error) {
	if err := bodyOf(msgChunk, body); err != nil {
		return chunkMsg{}, err
	}
	return chunkMsg{
		Index:      binary.LittleEndian.Uint64(body[0:]),
		Offset:     binary.LittleEndian.Uint64(body[8:]),
		Size:       binary.LittleEndian.Uint64(body[16:]),
		FileOffset: binary.LittleEndian.Uint64(body[24:]),
	}, nil
}

func (m doneAckMsg) encode() []byte {
	body := make([]byte, doneAckSize)
	binary.LittleEndian.PutUint64(body, m.Flags)
	return encodeMsg(msgDoneAck, body)
}

func parseDoneAck(body []byte) (doneAckMsg, error) {
	if err := bodyOf(msgDoneAck, body); err != nil {
		return doneAckMsg{}, err
	}
	m := doneAckMsg{Flags: binary.LittleEndian.Uint64(body)}
	if m.Flags&^ackKnown != 0 {
		return m, Errorf(EINVAL, "protocol: done-ack flags %#x not understood", m.Flags)
	}
	return m, nil
}

func (m statusMsg) encode() []byte {
	body := make([]byte, statusSize)
	binary.LittleEndian.PutUint64(body, m.BufferID)
	return encodeMsg(msgStatus, body)
}

func parseStatus(body []byte) (statusMsg, error) {
	if err := bodyOf(msgStatus, body); err != nil {
		return statusMsg{}, err
	}
	return statusMsg{BufferID: binary.LittleEndian.Uint64(body)}, nil
}

func (m statusAckMsg) encode() []byte {
	body := make([]byte, statusAckSize)
	binary.LittleEndian.PutUint64(body, m.BufferID)
	if m.Alive {
		body[8] = 1
	}
	return encodeMsg(msgStatusAck, body)
}

func parseStatusAck(body []byte) (statusAckMsg, error) {
	if err := bodyOf(msgStatusAck, body); err != nil {
		return statusAckMsg{}, err
	}
	v := binary.LittleEndian.Uint64(body[8:])
	if v > 1 {
		return statusAckMsg{}, Errorf(EINVAL, "protocol: status-ack alive flag %d is not 0 or 1", v)
	}
	return statusAckMsg{BufferID: binary.LittleEndian.Uint64(body), Alive: v == 1}, nil
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
