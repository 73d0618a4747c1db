package core

import "time"

// session is one receiver's connection, from its hello (or release) to its
// answer.
//
// This file has what every part of a session uses: reading the receiver's
// messages (recv) and refusing it (refuse). session.go runs a session,
// session_chunks.go serves its chunks, session_holds.go its lease and
// releases.
type session struct {
	reg     *Registry
	adm     *admission
	c       *conn
	p       *pendingConn
	tr      transcript // the handshake's, which further uses are proved against
	authed  bool       // the peer proved the secret
	refused bool       // the peer was told why it gets nothing
}

// recv reads one message from the receiver; on failure it says why when
// the receiver broke the protocol.
func (ss *session) recv() (frame, bool) {
	f, err := ss.c.recv()
	if err != nil {
		closeFD(&f.FD)
		if CodeOf(err) == EINVAL { // a malformed message: say why we hang up
			ss.refuse(err)
		}
		return f, false
	}
	if f.FD >= 0 { // receivers never send descriptors
		closeFD(&f.FD)
		ss.refuse(Errorf(EINVAL, "protocol: receivers must not send descriptors"))
		return f, false
	}
	return f, true
}

// refuse tells the receiver why it gets nothing (best effort) and lets the
// caller close the connection. No descriptor is ever sent with it.
func (ss *session) refuse(err error) {
	ss.refused = true
	ss.c.deadline = time.Time{}
	ss.c.timeout = time.Second // never block long on a receiver that does not read
	_ = ss.c.send(errorMsg{Code: refusalCode(err), Text: err.Error()}.encode(), -1)
}

// refusalCode is the status a refusal sends for err: its own, or EINTERNAL
// where that is no error status (the receiver takes only those as a
// refusal: parseError, parseUseAck).
func refusalCode(err error) Code {
	if code := CodeOf(err); code.IsError() {
		return code
	}
	return EINTERNAL
}

// ackFlags are the done-ack flags of a use of g.
func (ss *session) ackFlags(g *registration, usedUp, held bool) uint64 {
	var flags uint64
	// Another receiver may have spent the last use meanwhile: ask whether
	// the registration still lives, not only whether we used it up.
	if (!usedUp && g.live()) || ss.reg.bufferHasOthers(g) {
		flags |= ackBufferLives
	}
	if held {
		flags |= ackHeld
	}
	return flags
}
