package core

import "time"

// One session that spends the uses of many tickets of one exporter (the
// receiver's side of wire_uses.go; session_uses.go has the exporter's):
// the first through the handshake, the others as use messages after its
// done-ack, each proved with its own ticket's secret bound to that
// handshake, sent together and answered together. ConfirmMany and the
// confirmer's batches (confirmer.go) both spend this way.

// sessionDial starts a confirming session for the first of ts[idx...]
// with the hello flags given: held on a lease (returned) or not (nil).
type sessionDial func(idx []int, flags uint64) (*conn, transcript, *clientLease, error)

// confirmSession spends the uses of ts[idx...] (one exporter's) on one
// session that dial starts, within timeout, and returns how many it
// settled: all, or only the first when the first was refused on its own
// account (the rest try again). Each settled ticket's error goes to errs
// and, if acks is not nil, the flags of its answer to acks (the same
// indexes).
func confirmSession(ts []*Ticket, idx []int, timeout time.Duration, dial sessionDial, errs []error, acks []uint64) int {
	flags := helloConfirm
	if len(idx) > 1 {
		flags |= helloMore
	}
	c, tr, l, err := dial(idx, flags)
	if err != nil {
		errs[idx[0]] = err
		if code := CodeOf(err); code == ENOENT || code == EAUTH {
			return 1 // this ticket's own trouble: the others go on
		}
		for _, i := range idx[1:] {
			errs[i] = err
		}
		return len(idx)
	}
	defer c.Close()
	c.deadline = time.Now().Add(timeout)
	// The others' uses and done go out in one write, before any answer is
	// read: one round trip for all, answered in one write where the
	// exporter reads them all at once (session_uses.go). One write, not one
	// per use: every small message takes a buffer of a socket's, and a few
	// hundred fill it, so the exporter, answering what it has read (each
	// use on a lease), and we, still sending, would both block.
	var batch []byte
	sent := make([]int, 0, len(idx)-1)
	for _, i := range idx[1:] {
		t := ts[i]
		digest, err := t.Digest()
		if err != nil {
			errs[i] = err
			continue
		}
		ut := tr.forUse(t.RegID, digest)
		batch = append(batch, useMsg{RegID: t.RegID, Proof: ut.proof(t.Secret, roleReceiver)}.encode()...)
		sent = append(sent, i)
	}
	if l != nil {
		l.moreInFlight(len(sent))
	}
	if len(idx) > 1 {
		batch = append(batch, encodeMsg(msgDone, nil)...)
		_ = c.send(batch, -1) // the answers tell what arrived
	}
	settle := func(i int, ackFlags uint64, err error) {
		errs[i] = err
		if acks != nil {
			acks[i] = ackFlags
		}
		switch {
		case l == nil:
		case err == nil:
			l.useDone(ts[i].RegID, ackFlags&ackHeld != 0)
		case CodeOf(err) == EIO: // no answer: it may have been held
			l.useLost()
		default:
			l.useDone(0, false)
		}
	}
	ackFlags, err := readDoneAckFlags(c)
	settle(idx[0], ackFlags, err)
	for _, i := range sent {
		if err != nil && CodeOf(err) == EIO { // the session broke: no more answers
			settle(i, 0, err)
			continue
		}
		var f frame
		var ack useAckMsg
		f, err = recvControl(c, "use-ack")
		if err == nil {
			ack, err = parseUseAck(f.Body)
		}
		switch {
		case err != nil:
			err = WrapErr(EIO, err, "confirm_many: waiting for the exporter's answer")
		case ack.RegID != ts[i].RegID:
			err = Errorf(EIO, "protocol: a use-ack for registration %d, the use sent was %d", ack.RegID, ts[i].RegID)
		case ack.Code != OK:
			settle(i, 0, &Error{Code: remoteCode(ack.Code), Msg: "exporter: " + ack.Text})
			continue
		}
		settle(i, ack.Flags, err)
	}
	return len(idx)
}

// remoteCode is the status a receiver's call returns for an exporter's
// refusal of a use: its own where the call lists it, else EIO (as
// remoteError).
func remoteCode(c Code) Code {
	switch c {
	case EINVAL, EAUTH, ENOENT, EIO:
		return c
	}
	return EIO
}
