package core

import (
	"sync"
	"time"
)

// Confirming many tickets at once (vmmipc_confirm_many): a receiver that
// has the memory of many tickets mapped already (a re-sent model: one
// ticket per run) spends all their uses with one connection per exporter
// and one round trip, instead of one session each. The first ticket of an
// exporter goes through the handshake (held on this process's lease with
// Hold, holder.go); the others follow its done-ack as use messages, each
// proved with its own ticket's secret bound to that handshake
// (wire_uses.go), sent together and answered together. Each ticket's
// outcome is its own: a refused one (ended, changed in a byte) takes
// nothing from the others.

// ConfirmMany spends one use of each ticket, as Confirm does, and returns
// each one's error (nil: spent, and held with opts.Hold). Exporters are
// confirmed concurrently, each within opts.Timeout.
func ConfirmMany(ts []*Ticket, opts ImportOptions) []error {
	errs := make([]error, len(ts))
	fail := func(err error) []error {
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	if err := opts.Validate(); err != nil {
		return fail(err)
	}
	if opts.ConfirmLater {
		return fail(Errorf(EINVAL, "confirm_many: VMMIPC_IMPORT_CONFIRM_LATER is for one ticket at a time (vmmipc_confirm)"))
	}
	opts.OpenOptions = opts.OpenOptions.withDefaults()
	deadline := time.Now().Add(opts.Timeout)
	for _, t := range ts { // this process's table hits of each ticket first
		waitSpent(t, time.Until(deadline))
	}
	var order []string
	byExporter := map[string][]int{}
	for i, t := range ts {
		k := t.exporterKey()
		if byExporter[k] == nil {
			order = append(order, k)
		}
		byExporter[k] = append(byExporter[k], i)
	}
	var wg sync.WaitGroup
	for _, k := range order {
		wg.Add(1)
		go func(idx []int) {
			defer wg.Done()
			for len(idx) > 0 {
				idx = idx[confirmSession(ts, idx[:min(len(idx), maxMoreUses+1)], opts, errs):]
			}
		}(byExporter[k])
	}
	wg.Wait()
	return errs
}

// confirmSession spends the uses of ts[idx...] (one exporter's) on one
// session and returns how many it settled: all, or only the first when
// the first was refused on its own account (the rest try again).
func confirmSession(ts []*Ticket, idx []int, opts ImportOptions, errs []error) int {
	first := ts[idx[0]]
	hold := false
	for _, i := range idx {
		hold = hold || (opts.Hold && ts[i].Holds)
	}
	flags := helloConfirm
	if len(idx) > 1 {
		flags |= helloMore
	}
	var c *conn
	var tr transcript
	var l *clientLease
	var err error
	if hold {
		c, tr, l, err = connectHeld(first, opts.Timeout, flags, nil)
	} else {
		c, tr, err = connect(first, opts.Timeout, flags, nil, nil)
	}
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
	c.deadline = time.Now().Add(opts.Timeout)
	// The others' uses and done go out in one write, before any answer is
	// read: one round trip for all. One write, not one per use: every
	// small message takes a buffer of a socket's, and a few hundred fill
	// it, so the exporter, answering each as it reads it, and we, still
	// sending, would both block.
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
