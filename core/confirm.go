package core

import (
	"sync"
	"time"
)

// Spending a use without receiving anything, for a receiver that has the
// memory mapped already (a cache hit, Confirm): confirm is the whole
// session, and confirmer runs such sessions later, in order, off the
// caller's path.

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

// Confirmations that cache hits leave for later (ImportConfirmLater).
//
// A hit must still spend a use of its ticket: that is what tells the
// exporter this receiver has the memory, so the exporter may end the
// registration and drop whatever it kept alive for it. But the caller
// already holds the mapping, so the authenticated session that spends the
// use (confirm, above) need not sit on its path. Each exporter gets one
// goroutine that works through its queue in order while the queue has
// work, one session per ticket, each proved with that ticket's own secret
// (a ticket can never spend another's use). A failure is counted
// (CacheInfo.ConfirmsFailed); the mapping stays valid whatever the answer,
// since it holds its own references to the memory the ticket names.
type confirmer struct {
	mu      sync.Mutex
	queues  map[string][]pendingConfirm // by exporter
	pending uint64                      // queued or in flight
	failed  uint64
}

type pendingConfirm struct {
	t       *Ticket
	timeout time.Duration
	then    func(lives bool, err error) // with the answer, if not nil
}

var confirms = &confirmer{queues: map[string][]pendingConfirm{}}

// add queues a confirmation of t and starts the exporter's worker if it
// has none; then (if not nil) gets the answer: whether the buffer lives on,
// or the error.
func (c *confirmer) add(t *Ticket, timeout time.Duration, then func(lives bool, err error)) {
	key := t.exporterKey()
	c.mu.Lock()
	defer c.mu.Unlock()
	q, running := c.queues[key]
	c.queues[key] = append(q, pendingConfirm{t: t, timeout: timeout, then: then})
	c.pending++
	if !running {
		go c.work(key)
	}
}

// work confirms key's queue in order until it is empty.
func (c *confirmer) work(key string) {
	for {
		c.mu.Lock()
		q := c.queues[key]
		if len(q) == 0 {
			delete(c.queues, key)
			c.mu.Unlock()
			return
		}
		p := q[0]
		c.queues[key] = q[1:]
		c.mu.Unlock()

		lives, err := confirm(p.t, p.timeout)
		if p.then != nil {
			p.then(lives, err)
		}

		c.mu.Lock()
		c.pending--
		if err != nil {
			c.failed++
		}
		c.mu.Unlock()
	}
}

// countFailed counts a use that failed out of the caller's sight (a held
// use's answer: holder.go).
func (c *confirmer) countFailed() {
	c.mu.Lock()
	c.failed++
	c.mu.Unlock()
}

// counts reports confirmations queued or in flight, and those that failed.
func (c *confirmer) counts() (pending, failed uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pending, c.failed
}
