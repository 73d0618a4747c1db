package core

import (
	"sync"
	"sync/atomic"
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
// the exporter), and a batch takes only the hits that have waited so long.
// A lone hit is sent at once. 10 ms: a buffer re-sent every few
// milliseconds (a sender doing other work between sends) would otherwise
// take a session per hit, each one a few hundred microseconds of both
// processes' CPU; on a 2-vCPU machine hostrows' re-send went from a median
// of 1.42x SharedMemory's to 1.19x with this alone
// (bench/results/2026-12-06-grants-ahead-cpu.md). The cost: the exporter
// sees a streamed hit's use spent up to 10 ms later.
//
// A table hit's use has a record in this process's spend log, which the
// hit opens to the exporter (openSpend): an exporter that grants again
// meanwhile, as one re-sending a buffer in a loop does, spends it from
// the log itself (spendlogs.go harvest). So the worker first takes each
// record back (takeSpend): those the exporter spent are answered from the
// record, without a session, and only the rest go on one.
type confirmer struct {
	mu       sync.Mutex
	queues   map[string]*confirmQueue // by exporter, while it has a worker
	pending  uint64                   // queued or in flight
	failed   uint64
	sessions uint64 // sessions made, for tests: hits per session
}

type confirmQueue struct {
	items []pendingConfirm
	kick  chan struct{} // a first item came, or half a log's (buffered: the worker may be busy)
}

type pendingConfirm struct {
	t       *Ticket
	record  int // its spend log record (a table hit's), or 0
	timeout time.Duration
	at      time.Time                   // when queued
	then    func(lives bool, err error) // with the answer, if not nil
}

const (
	confirmGatherDefault = 10 * time.Millisecond // how long a streamed hit waits for others (below)
	confirmLinger        = 20 * time.Millisecond // how long a worker waits for the next hit
)

// gatherNs is confirmGather's value where a test changed it (0: the
// default), read atomically by workers that may be running.
var gatherNs atomic.Int64

// confirmGather is how long a streamed hit waits for others.
func confirmGather() time.Duration {
	if ns := gatherNs.Load(); ns > 0 {
		return time.Duration(ns)
	}
	return confirmGatherDefault
}

var confirms = &confirmer{queues: map[string]*confirmQueue{}}

// add queues a confirmation of t and starts the exporter's worker if it
// has none; then (if not nil) gets the answer: whether the buffer lives on,
// or the error.
func (c *confirmer) add(t *Ticket, timeout time.Duration, then func(lives bool, err error)) {
	c.addRecorded(t, 0, timeout, then)
}

// addRecorded is add for a table hit's use, whose spend log record
// (vouch's) it opens to the exporter first.
func (c *confirmer) addRecorded(t *Ticket, record int, timeout time.Duration, then func(lives bool, err error)) {
	if record > 0 {
		openSpend(t, record)
	}
	key := t.exporterKey()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pending++
	p := pendingConfirm{t: t, record: record, timeout: timeout, at: time.Now(), then: then}
	if q := c.queues[key]; q != nil {
		q.items = append(q.items, p)
		// The worker waits for a first item, or for half a log's records
		// while it gathers a stream: a kick per hit would only wake it for
		// nothing.
		if n := len(q.items); n == 1 || n == spendRecords/2 {
			select {
			case q.kick <- struct{}{}:
			default:
			}
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
	var last time.Time // when the last batch went
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
		// Streaming, a batch waits until its first hit has waited
		// confirmGather, and comes at most every confirmGather.
		gather := confirmGather()
		wait := gather - min(time.Since(q.items[0].at), time.Since(last))
		if streaming && wait > 0 && len(q.items) < spendRecords/2 {
			c.mu.Unlock()
			// Woken early when half a log's records wait: hits that come
			// faster than one every gather/spendRecords (a backlog of
			// pickles unpickled at once) would otherwise fill the log, and
			// each hit after that asks the exporter on a session of its own.
			timer := time.NewTimer(wait)
			select {
			case <-q.kick:
			case <-timer.C:
			}
			timer.Stop()
			continue
		}
		n := min(len(q.items), maxMoreUses+1)
		if streaming && len(q.items) < spendRecords/2 {
			// Only those that have waited their while: a younger hit may
			// still be spent by the exporter at its next grant.
			n = 1
			for n < len(q.items) && n <= maxMoreUses && time.Since(q.items[n].at) >= gather {
				n++
			}
		}
		batch := append([]pendingConfirm(nil), q.items[:n]...)
		q.items = q.items[n:]
		c.mu.Unlock()

		failed := c.confirmBatch(batch)
		streaming, last = true, time.Now()

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
	errs := make([]error, len(batch))
	acks := make([]uint64, len(batch))
	timeout := batch[0].timeout
	for i, p := range batch {
		ts[i] = p.t
		timeout = min(timeout, p.timeout)
	}
	idx := c.harvested(batch, timeout, acks, errs)
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

// harvestWait is how often the worker looks again at a record that the
// exporter is spending (it takes microseconds).
const harvestWait = 50 * time.Microsecond

// harvested takes back the batch's spend log records (takeSpend): the uses
// the exporter spent are answered from their records (acks); one it is
// still spending is waited for, within timeout (the batch's shortest) and
// while the exporter's image lives (after that, unanswered: EIO, the
// record kept); and the indices of the rest, to spend on a session, are
// returned in order.
func (c *confirmer) harvested(batch []pendingConfirm, timeout time.Duration, acks []uint64, errs []error) (send []int) {
	deadline := time.Now().Add(timeout)
	for i, p := range batch {
		if p.record == 0 {
			send = append(send, i)
			continue
		}
		for {
			take, spent, lives, busy := takeSpend(p.t, p.record)
			switch {
			case take:
				send = append(send, i)
			case spent && lives:
				acks[i] = ackBufferLives
			case busy && time.Now().Before(deadline) && tableAlive(p.t):
				time.Sleep(harvestWait)
				continue
			case busy:
				errs[i] = Errorf(EIO, "confirm: the exporter (pid %d) took registration %d's use from this process's spend log and did not say within %v whether it spent it (it may have ended)", p.t.Pid, p.t.RegID, timeout)
			}
			break
		}
	}
	return send
}

// counts reports confirmations queued or in flight, and those that failed.
func (c *confirmer) counts() (pending, failed uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.pending, c.failed
}
