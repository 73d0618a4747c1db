package core

import (
	"crypto/sha256"
	"encoding/binary"
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
// Instead of pulls, a receiver may send pull-runs, one at a time:
//
//	pull-run(first, n)               →
//	                                 ←     run(index, count, offset, size,
//	                                       file offset) + exactly one descriptor
//
// A run answers one pull-run with chunks [first, first+count), 1 <= count <=
// n, laid out back to back in one descriptor from its file offset: as many
// as the exporter can put in one descriptor (all of a host-file
// registration, whose chunks are one memfd; one CUDA chunk). The run that
// completes the buffer is followed at once by the done-ack, and the
// receiver sends no done. The receiver maps a run with one mmap;
// vmmipc_pull_next keeps pulling chunk by chunk.
//
// With the confirm flag (a receiver that has the buffer cached) the server
// sends done-ack right after welcome and no chunk is pulled. A confirming
// receiver in the exporter's PID namespace may send its proof right after
// its hello (the one-round flag, handshake.go): the server then answers
// challenge (a zero nonce and its proof), welcome and done-ack together. An error
// message ends the session; the server closes the connection after it.
// Before any hello, a peer may send status queries (buffer id → alive?);
// they reveal nothing but whether a buffer id is live.
const (
	wireMagic       uint32 = 0x50494d56 // "VMIP"
	ProtocolVersion uint8  = 3
	headerSize             = 16
	maxErrorText           = 1024
)

// Sizes of the handshake's values on the wire (handshake.go computes them):
// each side's nonce, and a proof (HMAC-SHA256).
const (
	nonceSize = 32
	proofSize = sha256.Size
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
	msgPullRun   uint8 = 13 // receiver: first index, most chunks wanted in one run
	msgRun       uint8 = 14 // server: index, count, offset, size, file offset (+ 1 fd)
	// Holds (wire_holds.go, holds.go).
	msgHoldOn     uint8 = 15 // receiver, before hello: hold this use on the lease (slot, token)
	msgLease      uint8 = 16 // server, after the proof: a new lease (slot, token) + 1 descriptor
	msgLeased     uint8 = 17 // receiver: its slot is locked
	msgReleaseAck uint8 = 18 // server: holds let go
	msgRelease    uint8 = 19 // receiver, first on its connection: let go of holds on its lease
	msgLeaseGone  uint8 = 20 // server: the lease named is not (or no longer) one of this exporter's
	msgUse        uint8 = 21 // receiver, after a done-ack (helloMore): spend a use of another registration
	msgUseAck     uint8 = 22 // server: registration id, status, done-ack flags, text
	msgTable      uint8 = 23 // server, after the proof (and lease): its grant table's slots and descriptor number (+ 1 descriptor), or 0 (granttable.go)
	msgSpendLog   uint8 = 24 // receiver, after a table: its spend log's records (+ 1 descriptor), or 0 (spendlog.go)
	msgLogAck     uint8 = 25 // server: whether it took the spend log
)

// Hello flags.
const (
	helloConfirm  uint64 = 1 << 0 // the receiver has the buffer; spend a use, send nothing
	helloPidBound uint64 = 1 << 1 // bind the receiver's pid, not the socket (sockends.go)
	helloLease    uint64 = 1 << 2 // give me a lease and hold this use on it (holds.go)
	helloMore     uint64 = 1 << 3 // uses of other registrations follow the done-ack (confirm_many.go)
	helloOneRound uint64 = 1 << 4 // the proof follows at once, bound to the receiver's pid and start time (handshake.go)
	helloTable    uint64 = 1 << 5 // send me your grant table (granttable.go)
	helloKnown           = helloConfirm | helloPidBound | helloLease | helloMore | helloOneRound | helloTable
)

// Done-ack flags.
const (
	ackBufferLives uint64 = 1 << 0 // the buffer outlives this use: a receiver may cache it
	ackHeld        uint64 = 1 << 1 // the use is held until released (holds.go)
	ackKnown              = ackBufferLives | ackHeld
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
	runMsgSize    = 40
	doneAckSize   = 8
	statusSize    = 8
	statusAckSize = 16
	errorHead     = 8
	// The hold messages (wire_holds.go): a release has releaseHead bytes
	// then 8 for each registration id.
	tokenSize       = 32
	leaseRefSize    = 8 + tokenSize
	releaseHead     = 8 + tokenSize + 8 + 8
	releaseAckSize  = 8
	maxReleaseBatch = 512 // registration ids in one release message
	useSize         = 8 + 8 + proofSize
	useAckHead      = 8 + 8 + 8
	maxMoreUses     = 512 // uses that may follow a session's first (helloMore)
	tableMsgSize    = 16
	spendLogMsgSize = 8
	logAckSize      = 8
)

var bodySizes = map[uint8]int{
	msgHello: helloSize, msgWelcome: welcomeSize, msgPull: pullSize,
	msgChunk: chunkMsgSize, msgDone: 0, msgError: -1, msgDoneAck: doneAckSize,
	msgChallenge: challengeSize, msgProof: proofMsgSize, msgBusy: 0,
	msgStatus: statusSize, msgStatusAck: statusAckSize,
	msgPullRun: pullSize, msgRun: runMsgSize,
	msgHoldOn: leaseRefSize, msgLease: leaseRefSize, msgLeased: 0, msgReleaseAck: releaseAckSize,
	msgRelease: -1, msgLeaseGone: 0, msgUse: useSize, msgUseAck: -1, msgTable: tableMsgSize,
	msgSpendLog: spendLogMsgSize, msgLogAck: logAckSize,
}

var msgNames = map[uint8]string{
	msgHello: "hello", msgWelcome: "welcome", msgPull: "pull", msgChunk: "chunk",
	msgDone: "done", msgError: "error", msgDoneAck: "done-ack", msgChallenge: "challenge",
	msgProof: "proof", msgBusy: "busy", msgStatus: "status", msgStatusAck: "status-ack",
	msgPullRun: "pull-run", msgRun: "run",
	msgHoldOn: "hold-on", msgLease: "lease", msgLeased: "leased", msgReleaseAck: "release-ack",
	msgRelease: "release", msgLeaseGone: "lease-gone", msgUse: "use", msgUseAck: "use-ack",
	msgTable: "table", msgSpendLog: "spend-log", msgLogAck: "log-ack",
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
	case want < 0:
		if lo, hi := variableBody(h.Type); h.Len < lo || h.Len > hi {
			return header{}, Errorf(EINVAL, "protocol: %s message body of %d bytes out of range", msgName(h.Type), h.Len)
		}
	case h.Len != uint32(want):
		return header{}, Errorf(EINVAL, "protocol: %s message body of %d bytes, want %d", msgName(h.Type), h.Len, want)
	}
	return h, nil
}

// variableBody is the least and most body length of a message whose
// length varies.
func variableBody(typ uint8) (lo, hi uint32) {
	switch typ {
	case msgError:
		return errorHead, errorHead + maxErrorText
	case msgRelease:
		return releaseHead, releaseHead + 8*maxReleaseBatch
	case msgUseAck:
		return useAckHead, useAckHead + maxErrorText
	}
	return 1, 0 // none fits
}

func encodeMsg(typ uint8, body []byte) []byte {
	b := make([]byte, headerSize+len(body))
	putHeader(b, typ, len(body))
	copy(b[headerSize:], body)
	return b
}

// fields writes a body as little-endian fields in order; reader takes them
// back in the same order. Each message's layout is then one line each way.
type fields []byte

func (f fields) u64(v uint64) fields  { return binary.LittleEndian.AppendUint64(f, v) }
func (f fields) raw(p []byte) fields  { return append(f, p...) }
func (f fields) msg(typ uint8) []byte { return encodeMsg(typ, f) }

type reader struct{ b []byte }

// readBody checks the body length of a fixed-size message.
func readBody(typ uint8, body []byte) (*reader, error) {
	if len(body) != bodySizes[typ] {
		return nil, Errorf(EINVAL, "protocol: %s of %d bytes, want %d", msgName(typ), len(body), bodySizes[typ])
	}
	return &reader{body}, nil
}

func (r *reader) u64() uint64 {
	v := binary.LittleEndian.Uint64(r.b)
	r.b = r.b[8:]
	return v
}

func (r *reader) raw(p []byte) { r.b = r.b[copy(p, r.b):] }
