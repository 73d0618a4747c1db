package core

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
)

// The handshake proves, in both directions, knowledge of the ticket's secret
// without sending it (in the spirit of CPython's multiprocessing.connection
// challenge and of TLS with a pre-shared key):
//
//	receiver → server: hello(reg id, flags, Nr)
//	server → receiver: challenge(Ns, HMAC(secret, "S" || T))
//	receiver → server: proof(HMAC(secret, "R" || T))
//
// T binds everything either side could be fooled about: the protocol
// version, the registration id, the hello flags, this very connection (the
// kernel's cookie of the exporter's socket of it, sockends.go: a process
// that relays the session between the two, in any namespace, holds two
// connections and gets proofs bound to neither; a receiver without
// sock_diag binds its pid instead), the SHA-256 of the whole
// ticket (so a ticket changed in any byte fails), and both fresh nonces (so
// no proof can be replayed). The receiver accepts
// no descriptor before the server's proof checks out; the server answers
// nothing but the challenge before the receiver's does. The role byte keeps a
// server's proof from ever passing for a receiver's.
//
// A receiver in the exporter's PID namespace (and time namespace) may
// instead authenticate in one round trip (hello flag helloOneRound): a
// confirmation, and a stream whose ticket says that its exporter takes one
// (Ticket.OneRound; an exporter that does not refuses the hello, and the
// receiver asks again in two rounds):
//
//	receiver → server: hello(reg id, flags, Nr), proof(HMAC(secret, "R" || T1))
//	server → receiver: challenge(0, HMAC(secret, "S" || T1)), welcome, ...
//
// T1 has no server nonce: it binds the receiver's own identity instead,
// its pid and its start time (field 22 of /proc/<pid>/stat), which the
// exporter takes from the kernel (SO_PEERCRED, SO_PEERPIDFD and /proc,
// sockends.go), never from the receiver. A relay or impostor that
// forwards the receiver's first message has a pid of its own, so the
// exporter's T1 differs and the proof fails; a replay checks out only
// from the same pid with the same start time, that is from the receiver
// itself (which knows the secret anyway), and only while it lives (the
// exporter checks the peer's pidfd after reading its start time, so a
// pid handed out again cannot pass either). The server still proves
// itself before the receiver believes anything: its proof covers Nr, so
// it cannot be replayed to the receiver, and the receiver checks it
// before the welcome (a stream's descriptors, sent after it, stay unread
// in the socket until then). The server's proof is sent only after the
// receiver's has checked out, so a peer without the secret learns
// nothing but a refusal, as in the two-round form. The flag is in T1,
// and the start time enters the HMAC only with it: no proof of one form
// passes for the other.

type nonce [nonceSize]byte

func newNonce() (nonce, error) { return random32("nonce") }

// transcript is what both proofs of one session cover.
type transcript struct {
	RegID         uint64
	Flags         uint64
	Socket        uint64 // the cookie of the exporter's socket of the connection
	TicketDigest  [32]byte
	ReceiverNonce nonce
	ServerNonce   nonce  // zero in the one-round form
	StartTime     uint64 // the receiver's, in the one-round form only
}

const (
	roleServer   byte = 'S'
	roleReceiver byte = 'R'
)

// proof is HMAC-SHA256 under the secret of the role byte and the transcript.
func (t *transcript) proof(secret Secret, role byte) [proofSize]byte {
	mac := hmac.New(sha256.New, secret[:])
	var b [1 + 1 + 8 + 8 + 8 + 32 + 2*nonceSize]byte
	b[0] = role
	b[1] = ProtocolVersion
	binary.LittleEndian.PutUint64(b[2:], t.RegID)
	binary.LittleEndian.PutUint64(b[10:], t.Flags)
	binary.LittleEndian.PutUint64(b[18:], t.Socket)
	copy(b[26:], t.TicketDigest[:])
	copy(b[58:], t.ReceiverNonce[:])
	copy(b[58+nonceSize:], t.ServerNonce[:])
	mac.Write(b[:])
	if t.Flags&helloOneRound != 0 {
		var st [8]byte
		binary.LittleEndian.PutUint64(st[:], t.StartTime)
		mac.Write(st[:])
	}
	var out [proofSize]byte
	copy(out[:], mac.Sum(nil))
	return out
}

// forUse is the transcript a further use of registration id (whose ticket
// digest is digest) is proved with on a session whose handshake was t
// (wire_uses.go): receiver and server both build it here, so that they
// cannot drift apart. A one-round session's uses keep its flag, and so
// its start time: without a server nonce, the pid and start time are what
// keeps a use's proof from passing on another process's session.
func (t transcript) forUse(id uint64, digest [32]byte) transcript {
	t.RegID, t.Flags, t.TicketDigest = id, useProofFlag|t.Flags&helloOneRound, digest
	return t
}

// verify checks a proof in constant time.
func (t *transcript) verify(secret Secret, role byte, got [proofSize]byte) bool {
	want := t.proof(secret, role)
	return hmac.Equal(want[:], got[:])
}
