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
				idx = idx[confirmSession(ts, idx[:min(len(idx), maxMoreUses+1)], opts.Timeout, dialFor(ts, opts), errs, nil):]
			}
		}(byExporter[k])
	}
	wg.Wait()
	return errs
}

// dialFor is how ConfirmMany's sessions start: held on this process's
// lease (holder.go) where opts.Hold and a ticket of the session holds.
func dialFor(ts []*Ticket, opts ImportOptions) sessionDial {
	return func(idx []int, flags uint64) (*conn, transcript, *clientLease, error) {
		for _, i := range idx {
			if opts.Hold && ts[i].Holds {
				return connectHeld(ts[idx[0]], opts.Timeout, flags, nil)
			}
		}
		c, tr, err := connect(ts[idx[0]], opts.Timeout, flags, nil, nil)
		return c, tr, nil, err
	}
}
