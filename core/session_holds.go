package core

import "time"

// A holder session on the server (holds.go has the why, and the holds):
// after its first use's done-ack the connection stays open, and serves the
// receiver's uses (each proved, answered with a use-ack) and releases until
// it ends. The receiver's side is holder.go.

// holdLoop serves a holder session until its receiver hangs up (or breaks
// the protocol), then lets go of everything held on it.
func (ss *session) holdLoop(h *holderSession) {
	defer ss.reg.closeHolder(h)
	ss.c.deadline, ss.c.timeout = time.Time{}, 0 // a holder may be quiet for hours
	for {
		f, ok := ss.recv()
		if !ok {
			return
		}
		switch f.Type {
		case msgUse:
			m, err := parseUse(f.Body)
			if err != nil {
				ss.refuse(err)
				return
			}
			if !ss.sendUseAck(ss.useOnHolder(h, m)) {
				return
			}
		case msgRelease:
			m, err := parseRelease(f.Body)
			if err != nil {
				ss.refuse(err)
				return
			}
			for _, id := range m.RegIDs {
				h.letGo(id) // ids this session does not hold are ignored
			}
		default:
			ss.refuse(Errorf(EINVAL, "protocol: unexpected %s message on a holder session", msgName(f.Type)))
			return
		}
	}
}

func (ss *session) sendUseAck(m useAckMsg) bool {
	ss.c.timeout = idleTimeout // never block for ever on a receiver that does not read
	defer func() { ss.c.timeout = 0 }()
	return ss.c.send(m.encode(), -1) == nil
}

// useOnHolder spends one use of m's registration for h's receiver, holding
// it on h if the registration holds.
func (ss *session) useOnHolder(h *holderSession, m useMsg) useAckMsg {
	ack := useAckMsg{RegID: m.RegID}
	refuse := func(err error) useAckMsg {
		ack.Code, ack.Text = refusalCode(err), err.Error()
		return ack
	}
	g, err := ss.reg.lookup(m.RegID)
	if err != nil {
		return refuse(err)
	}
	if tr := ss.tr.forUse(g.id, g.digest); !tr.verify(g.secret, roleReceiver, m.Proof) {
		return refuse(Errorf(EAUTH, "use of registration %d: the proof does not check out: the ticket is corrupted or forged", g.id))
	}
	cl, err := g.claim(func() {})
	if err != nil {
		return refuse(err)
	}
	held := h.take(g)
	usedUp := g.spend(cl)
	g.drop(cl)
	if usedUp {
		defer g.end(usedUpWhy(g)) // after the ack is built; its release may take a while
	}
	ack.Flags = ss.ackFlags(g, usedUp, held)
	return ack
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
