package core

import (
	"sync"
	"time"
)

// Confirmations that cache hits leave for later (ImportConfirmLater).
//
// A hit must still spend a use of its ticket: that is what tells the
// exporter this receiver has the memory, so the exporter may end the
// registration and drop whatever it kept alive for it. But the caller
// already holds the mapping, so the authenticated session that spends the
// use (stream.go confirm) need not sit on its path. Each exporter gets one
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
}

var confirms = &confirmer{queues: map[string][]pendingConfirm{}}

// add queues a confirmation of t and starts the exporter's worker if it
// has none.
func (c *confirmer) add(t *Ticket, timeout time.Duration) {
	key := t.exporterKey()
	c.mu.Lock()
	defer c.mu.Unlock()
	q, running := c.queues[key]
	c.queues[key] = append(q, pendingConfirm{t: t, timeout: timeout})
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

		_, err := confirm(p.t, p.timeout)

		c.mu.Lock()
		c.pending--
		if err != nil {
			c.failed++
		}
		c.mu.Unlock()
	}
}

// Confirm spends one use of t without receiving anything, for a receiver
// that has the memory mapped already (through another ticket of the same
// buffer): at once (with opts.Hold, held on a holder session: holder.go),
// or queued with opts.ConfirmLater. It reports what the exporter said
// (queued: nil).
func Confirm(t *Ticket, opts ImportOptions) error {
	if err := opts.Validate(); err != nil {
		return err
	}
	opts.OpenOptions = opts.OpenOptions.withDefaults()
	switch {
	case opts.ConfirmLater:
		confirms.add(t, opts.Timeout)
		return nil
	case opts.Hold:
		_, err := useHeld(t, opts.Timeout)
		return err
	}
	_, err := confirm(t, opts.Timeout)
	return err
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
