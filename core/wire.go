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
// Receiver → server: hello, then pull requests (in index order, any number
// in flight), then done. Server → receiver: welcome, one chunk message per
// chunk with exactly one descriptor attached to its first byte, or an error
// message, after which the server closes the connection; after done, a
// done-ack once the use is consumed.
const (
	wireMagic       uint32 = 0x50494d56 // "VMIP"
	ProtocolVersion uint8  = 1
	headerSize             = 16
	maxBody                = 4096
	maxErrorText           = 1024
)

// Message types.
const (
	msgHello   uint8 = 1 // receiver: registration id, secret
	msgWelcome uint8 = 2 // server: count, total, kind
	msgPull    uint8 = 3 // receiver: first index, count
	msgChunk   uint8 = 4 // server: index, offset, size, file offset (+ 1 fd)
	msgDone    uint8 = 5 // receiver: every chunk arrived; consume the use
	msgError   uint8 = 6 // server: status, chunk index, text
	msgDoneAck uint8 = 7 // server: the use is consumed
)

// Body sizes of the fixed-size messages.
const (
	helloSize   = 8 + 32 + 8
	welcomeSize = 8 + 8 + 8
	pullSize    = 16
	chunkSize   = 32
	errorHead   = 16
)

// noIndex marks an error that concerns no particular chunk.
const noIndex = ^uint64(0)

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
		return header{}, Errorf(EINVAL, "protocol: peer speaks version %d, this libvmmipc speaks %d", b[4], ProtocolVersion)
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

var bodySizes = map[uint8]int{
	msgHello: helloSize, msgWelcome: welcomeSize, msgPull: pullSize,
	msgChunk: chunkSize, msgDone: 0, msgError: -1, msgDoneAck: 0,
}

func msgName(t uint8) string {
	switch t {
	case msgHello:
		return "hello"
	case msgWelcome:
		return "welcome"
	case msgPull:
		return "pull"
	case msgChunk:
		return "chunk"
	case msgDone:
		return "done"
	case msgError:
		return "error"
	case msgDoneAck:
		return "done-ack"
	}
	return "unknown"
}

// Decoded message bodies.
type (
	helloMsg struct {
		RegID  uint64
		Secret Secret
		Flags  uint64 // reserved, zero
	}
	welcomeMsg struct {
		Count, Total uint64
		Kind         uint8
	}
	pullMsg struct {
		First, Count uint64
	}
	chunkMsg struct {
		Index, Offset, Size, FileOffset uint64
	}
	errorMsg struct {
		Code  Code
		Index uint64
		Text  string
	}
)

func encodeMsg(typ uint8, body []byte) []byte {
	b := make([]byte, headerSize+len(body))
	putHeader(b, typ, len(body))
	copy(b[headerSize:], body)
	return b
}

func (m helloMsg) encode() []byte {
	body := make([]byte, helloSize)
	binary.LittleEndian.PutUint64(body[0:], m.RegID)
	copy(body[8:40], m.Secret[:])
	binary.LittleEndian.PutUint64(body[40:], m.Flags)
	return encodeMsg(msgHello, body)
}

func parseHello(body []byte) (helloMsg, error) {
	var m helloMsg
	if len(body) != helloSize {
		return m, Errorf(EINVAL, "protocol: hello of %d bytes", len(body))
	}
	m.RegID = binary.LittleEndian.Uint64(body[0:])
	copy(m.Secret[:], body[8:40])
	m.Flags = binary.LittleEndian.Uint64(body[40:])
	if m.Flags != 0 {
		return m, Errorf(EINVAL, "protocol: hello flags %#x not understood", m.Flags)
	}
	return m, nil
}

func (m welcomeMsg) encode() []byte {
	body := make([]byte, welcomeSize)
	binary.LittleEndian.PutUint64(body[0:], m.Count)
	binary.LittleEndian.PutUint64(body[8:], m.Total)
	body[16] = m.Kind
	return encodeMsg(msgWelcome, body)
}

func parseWelcome(body []byte) (welcomeMsg, error) {
	var m welcomeMsg
	if len(body) != welcomeSize {
		return m, Errorf(EINVAL, "protocol: welcome of %d bytes", len(body))
	}
	m.Count = binary.LittleEndian.Uint64(body[0:])
	m.Total = binary.LittleEndian.Uint64(body[8:])
	m.Kind = body[16]
	for _, c := range body[17:] {
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
	if len(body) != pullSize {
		return pullMsg{}, Errorf(EINVAL, "protocol: pull of %d bytes", len(body))
	}
	return pullMsg{First: binary.LittleEndian.Uint64(body[0:]), Count: binary.LittleEndian.Uint64(body[8:])}, nil
}

func (m chunkMsg) encode() []byte {
	body := make([]byte, chunkSize)
	binary.LittleEndian.PutUint64(body[0:], m.Index)
	binary.LittleEndian.PutUint64(body[8:], m.Offset)
	binary.LittleEndian.PutUint64(body[16:], m.Size)
	binary.LittleEndian.PutUint64(body[24:], m.FileOffset)
	return encodeMsg(msgChunk, body)
}

func parseChunk(body []byte) (chunkMsg, error) {
	if len(body) != chunkSize {
		return chunkMsg{}, Errorf(EINVAL, "protocol: chunk of %d bytes", len(body))
	}
	return chunkMsg{
		Index:      binary.LittleEndian.Uint64(body[0:]),
		Offset:     binary.LittleEndian.Uint64(body[8:]),
		Size:       binary.LittleEndian.Uint64(body[16:]),
		FileOffset: binary.LittleEndian.Uint64(body[24:]),
	}, nil
}

func (m errorMsg) encode() []byte {
	text := m.Text
	if len(text) > maxErrorText {
		text = text[:maxErrorText]
	}
	body := make([]byte, errorHead+len(text))
	binary.LittleEndian.PutUint32(body[0:], uint32(m.Code))
	binary.LittleEndian.PutUint64(body[8:], m.Index)
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
		Code:  Code(int32(binary.LittleEndian.Uint32(body[0:]))),
		Index: binary.LittleEndian.Uint64(body[8:]),
		Text:  string(body[errorHead:]),
	}
	if m.Code >= 0 || m.Code < EINTERNAL {
		return m, Errorf(EINVAL, "protocol: error message with status %d, not an error status", int32(m.Code))
	}
	if !utf8.ValidString(m.Text) {
		m.Text = "(peer sent a message that is not UTF-8)"
	}
	return m, nil
}
