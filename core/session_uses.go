package core

// A session's further uses (wire_uses.go; confirm_many.go has the
// receiver's side): after its first use's done-ack, a session whose hello
// said helloMore spends up to maxMoreUses uses of other registrations of
// this exporter, each proved with its own registration's secret bound to
// this session's handshake, each held on the session's lease if any, and
// answered with a use-ack, until the receiver says done.
//
// Without a lease the acks of the uses read so far go out together, once
// nothing more is there to read (or before a refusal, which sends them
// first): a receiver that sent its uses in one write, as ours do, gets
// their answers in one write and wakes once, not once per use. With a
// lease each ack goes out as its use is read: a held use the receiver
// never learns of is let go at once, which needs each send's outcome.

// serveMoreUses serves the further uses of a session.
func (ss *session) serveMoreUses(l *lease) {
	var usedUp []*registration // used up by the uses of the acks queued
	// A used-up registration ends only once its answer is out (or could
	// not go): its release (the owner's release_fn, which in Python waits
	// for the GIL) may take a while, and the receiver need not wait for it.
	endAnswered := func() {
		for _, g := range usedUp {
			g.endUsedUp()
		}
		usedUp = usedUp[:0]
	}
	defer endAnswered()
	flush := func() bool {
		err := ss.c.send(nil, -1) // what is queued
		endAnswered()
		return err == nil
	}
	for n := 0; ; n++ {
		if len(ss.c.queued) > 0 && !ss.c.readable() && !flush() {
			return
		}
		f, ok := ss.recv()
		if !ok {
			return
		}
		switch {
		case f.Type == msgDone:
			flush()
			return
		case f.Type != msgUse:
			ss.refuse(Errorf(EINVAL, "protocol: expected use or done, got %s", msgName(f.Type)))
			return
		case n == maxMoreUses:
			ss.refuse(Errorf(EINVAL, "protocol: more than %d uses after a session's first", maxMoreUses))
			return
		}
		m, err := parseUse(f.Body)
		if err != nil {
			ss.refuse(err)
			return
		}
		ack, g, held, spentLast := ss.useMore(m, l)
		if spentLast {
			usedUp = append(usedUp, g)
		}
		if l == nil {
			ss.c.queue(ack.encode())
			continue
		}
		sent := ss.c.send(ack.encode(), -1) == nil
		if !sent && held { // the receiver never learns of it: nor may the lease keep it
			ss.reg.leases.letGo(l, []uint64{g.id}, false)
		}
		endAnswered()
		if !sent {
			return
		}
	}
}

// useMore spends one use of m's registration, held on l (if any) if the
// registration holds. It reports whether that used the registration up:
// the caller ends it after sending the ack.
func (ss *session) useMore(m useMsg, l *lease) (ack useAckMsg, g *registration, held, usedUp bool) {
	ack.RegID = m.RegID
	refuse := func(err error) (useAckMsg, *registration, bool, bool) {
		ack.Code, ack.Text = refusalCode(err), err.Error()
		return ack, nil, false, false
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
	held = l != nil && ss.reg.leases.take(l, g)
	usedUp = g.spend(cl)
	g.drop(cl)
	ack.Flags = ss.ackFlags(g, usedUp, held)
	return ack, g, held, usedUp
}
