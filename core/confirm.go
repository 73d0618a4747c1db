package core

import "time"

// Spending a use without receiving anything, for a receiver that has the
// memory mapped already (a cache hit, Confirm): confirm is the whole
// session. confirmer.go runs such uses later, off the caller's path.

// confirm is a cache hit's whole session: authenticate with the confirm
// flag, which spends a use without sending anything; it reports whether the
// buffer lives on after the use.
func confirm(t *Ticket, timeout time.Duration) (bool, error) {
	c, _, err := connect(t, timeout, helloConfirm, nil, nil)
	if err != nil {
		return false, err
	}
	defer c.Close()
	return readDoneAck(c)
}
