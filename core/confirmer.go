package core

import (
	"sync"
	"time"
)

// Confirmations that cache hits leave for later (ImportConfirmLater, and
// every table hit: cache.go).
//
// A hit must still spend a use of its ticket: that is what tells the
// exporter this receiver has the memory, so the exporter may end the
// registration and drop whatever it kept alive for it. But the caller
// already holds the mapping, so the authenticated session that spends the
// use need not sit on its path. Each exporter gets one goroutine that
// works through its queue in order while the queue has work. Each use is
// proved with its own ticket's secret (a ticket can never spend another's
// use), and the uses queued together go on one session (confirmSession:
// one connection, one round trip), as vmmipc_confirm_many sends a re-sent
// model's. A failure is counted (CacheInfo.ConfirmsFailed); the mapping
// stays valid whatever the answer, since it holds its own references to
// the memory the ticket names.
//
// Hits that come as a stream (a buffer re-sent in a loop) are gathered:
// a session costs both processes far more CPU than the use it carries
// (connect, credentials, /proc, the handshake's proofs), and on a busy
// machine that CPU is taken from the next hit. So once a session has gone
// out, the worker stays for confirmLinger, and a hit that comes meanwhile
// waits up to confirmGather for others to join it, or until half a spend
// log's records wait (spendlog.go: a full log would send the next hits to
// the exporter). A lone hit is sent at once.
type confirmer struct {
	mu       sync.Mutex
	queues   map[string]*confirmQueue // by exporter, while it has a worker
	pending  uint64                   // queued or in flight
	failed   uint64
	sessions uint64 // sessions made, for tests: hits per session
}

type confirmQueue struct {
	items []pendingConfirm
	kick  chan struct{} // an item came (buffered: the worker may be busy)
}

type pendingConfirm struct {
	t       *Ticket
	timeout time.Duration
	at      time.Time                   // when queued
	then    func(lives bool, err error) // with the answer, if not nil
}

const (
	confirmGather = 2 * time.Millisecond  // how long a streamed hit waits for others
	confirmLinger = 20 * time.Millisecond // how long a worker waits for the next hit
)

var confirms = &confirmer{queues: map[string]*confirmQueue{}}

// add queues a confirmation of t and starts the exporter's worker if it
// has none; then (if not nil) gets the answer: whether the buffer lives on,
// or the error.
func (c *confirmer) add(t *Ticket, timeout time.Duration, then func(lives bool, err error)) {
	key := t.exporterKey()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pending++
	p := pendingConfirm{t: t, timeout: timeout, at: time.Now(), then: then}
	if q := c.queues[key]; q != nil {
		q.items = append(q.items, p)
		select {
		case q.kick <- struct{}{}:
		default:
		}
		return
	}
	q := &confirmQueue{items: []pendingConfirm{p}, kick: make(chan struct{}, 1)}
	c.queues[key] = q
	go c.work(key, q)
}

// work confirms q (key's queue) in order, a batch per session, until it
// has stayed empty for confirmLinger.
func (c *confirmer) work(key string, q *confirmQueue) {
	streaming := false // a session went out lately: gather the next hits
	for {
		c.mu.Lock()
		if len(q.items) == 0 {
			if !streaming {
				delete(c.queues, key)
				c.mu.Unlock()
				return
			}
			c.mu.Unlock()
			select {
			case <-q.kick:
			case <-time.After(confirmLinger):
				streaming = false
			}
			continue
		}
		if wait := confirmGather - time.Since(q.items[0].at); streaming && wait > 0 && len(q.items) < spendRecords/2 {
			c.mu.Unlock()
			time.Sleep(wait)
			continue
		}
		batch := append([]pendingConfirm(nil), q.items[:min(len(q.items), maxMoreUses+1)]...)
		q.items = q.items[len(batch):]
		c.mu.Unlock()

		failed := c.confirmBatch(batch)
		streaming = true

		c.mu.Lock()
		c.pending -= uint64(len(batch))
		c.failed += uint64(failed)
		c.mu.Unlock()
	}
}

// confirmBatch spends the uses of one exporter's batch, on one session
// where they are all answered (a ticket refused on its own account first
// takes one session of its own), tells each its answer and returns how many
// failed.
func (c *confirmer) confirmBatch(batch []pendingConfirm) (failed int) {
	ts := make([]*Ticket, len(batch))
	idx := make([]int, len(batch))
	timeout := batch[0].timeout
	for i, p := range batch {
		ts[i], idx[i] = p.t, i
		timeout = min(timeout, p.timeout)
	}
	errs := make([]error, len(batch))
	acks := make([]uint64, len(batch))
	dial := func(idx []int, hello uint64) (*conn, transcript, *clientLease, error) {
		cn, tr, err := connect(ts[idx[0]], timeout, hello, nil, nil)
		return cn, tr, nil, err
	}
	for len(idx) > 0 {
		idx = idx[confirmSession(ts, idx, timeout, dial, errs, acks):]
		c.mu.Lock()
		c.sessions++
		c.mu.Unlock()
	}
	for i, p := range batch {
		if p.then != nil {
			p.then(acks[i]&ackBufferLives != 0, errs[i])
		}
		if errs[i] != nil {
			failed++
		}
	}
	return failed
}

// counts reports confirmations queued or in flight, and those that failed.
func (c *confirmer) counts() (pending, failed uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pending, c.failed
}
