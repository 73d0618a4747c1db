package core

import (
	"fmt"
	"sync"
	"time"
)

// buffer is one registered piece of memory: its chunks and the Exporter
// that makes their descriptors. Registrations are grants on a buffer (uses,
// ttl, secret); those of the same memory share one buffer, whose id is what
// receivers cache by.
type buffer struct {
	id       uint64
	key      string
	kind     uint8
	uuid     [16]byte
	sizes    []uint64
	offsets  []uint64
	total    uint64
	exporter Exporter

	regs map[*registration]struct{} // live registrations; guarded by the registry's mu

	mu        sync.Mutex
	over      bool // no registration lives any more
	exporting int  // ExportChunk calls in flight
	released  bool
	lenders   []*registration // released together with the exporter
}

// export runs the exporter for chunks [first, first+max) unless the buffer
// was released: one descriptor for the first n of them, n >= 1 (n = 1
// unless the exporter is a RunExporter).
func (b *buffer) export(first, max uint64) (fd int, fileOffset, n uint64, err error) {
	b.mu.Lock()
	if b.released {
		b.mu.Unlock()
		return -1, 0, 0, Errorf(ENOENT, "buffer %d has been released", b.id)
	}
	b.exporting++
	b.mu.Unlock()
	defer b.doneExporting()
	defer func() {
		if p := recover(); p != nil {
			fd, err = -1, Errorf(EINTERNAL, "exporter panicked: %v", p)
		}
	}()
	if re, ok := b.exporter.(RunExporter); ok && max > 1 {
		fd, fileOffset, n, err = re.ExportRun(first, max)
		if err == nil && (n == 0 || n > max) {
			closeFD(&fd)
			return -1, 0, 0, Errorf(EINTERNAL, "exporter gave %d chunks for a run of at most %d", n, max)
		}
		return fd, fileOffset, n, err
	}
	fd, fileOffset, err = b.exporter.ExportChunk(first)
	return fd, fileOffset, 1, err
}

func (b *buffer) doneExporting() {
	b.mu.Lock()
	b.exporting--
	b.mu.Unlock()
	b.maybeRelease()
}

// finish marks the buffer over (its last registration ended) and releases
// it once no export is in flight.
func (b *buffer) finish() {
	b.mu.Lock()
	b.over = true
	b.mu.Unlock()
	b.maybeRelease()
}

func (b *buffer) maybeRelease() {
	b.mu.Lock()
	if !b.over || b.exporting > 0 || b.released {
		b.mu.Unlock()
		return
	}
	b.released = true
	lenders := b.lenders
	b.lenders = nil
	b.mu.Unlock()
	safely(b.exporter.Release)
	for _, g := range lenders {
		g.release()
	}
}

// safely runs a callback of the library's user; a panic in it must not
// take the server down.
func safely(fn func()) {
	if fn == nil {
		return
	}
	defer func() { _ = recover() }()
	fn()
}

// claimGrace is how long a receiver that finds every use claimed waits for a
// claim to settle. A stream that its receiver closed early (or whose
// receiver died) gives its use back as soon as the server reads the EOF,
// which can be just after the next receiver arrives.
const claimGrace = time.Second

// registration is one grant on a buffer: its secret, uses and ttl. It owns
// its use accounting: claim (a receiver starts), spend (every chunk was
// sent, or a cached mapping confirmed), drop (the session is over; an
// unspent claim gives its use back) and end.
type registration struct {
	id            uint64
	secret        Secret
	ticket        *Ticket
	digest        [32]byte
	buf           *buffer
	reg           *Registry
	onRelease     func()
	lendsExporter bool
	holdable      bool // RegisterOptions.Hold: a holder's use is a hold (holds.go)
	published     bool // in the registry's grant table (granttable.go)

	mu       sync.Mutex
	uses     uint32 // 0 = unlimited
	consumed uint32 // uses spent
	claimed  uint32 // claims neither spent nor dropped
	claims   map[*claim]struct{}
	settled  chan struct{} // closed and replaced whenever a claim settles
	ended    string        // why it ended; "" while live
	timer    *time.Timer
	holds    int  // receivers' holds on spent uses (holds.go)
	due      bool // the release is due, and waits for holds == 0

	releaseOnce sync.Once
	releasedCh  chan struct{} // closed once onRelease has returned
}

// claim is one receiver's hold on a use. cancel cuts its session when the
// registration ends under it.
type claim struct {
	cancel func()
	spent  bool
}

func (g *registration) why() string { return fmt.Sprintf("registration %d %s", g.id, g.ended) }

func (g *registration) usedUpWhy() string {
	return fmt.Sprintf("was used up: all %d use(s) consumed", g.uses)
}

// endUsedUp ends a registration that spend reported used up, saying so.
func (g *registration) endUsedUp() bool { return g.end(g.usedUpWhy()) }

// claim reserves one use for a receiver that is about to be served.
func (g *registration) claim(cancel func()) (*claim, error) {
	return g.claimWithin(cancel, claimGrace)
}

// claimWithin is claim waiting at most grace for a claim to settle.
func (g *registration) claimWithin(cancel func(), grace time.Duration) (*claim, error) {
	deadline := time.Now().Add(grace)
	g.mu.Lock()
	defer g.mu.Unlock()
	for {
		if g.ended != "" {
			return nil, Errorf(ENOENT, "%s", g.why())
		}
		if g.usedUpLocked() {
			// Used up, if not yet ended (that waits for the last
			// receiver's answer): the same words either way.
			return nil, Errorf(ENOENT, "registration %d %s", g.id, g.usedUpWhy())
		}
		if g.uses == 0 || g.consumed+g.claimed < g.uses {
			c := &claim{cancel: cancel}
			g.claimed++
			g.claims[c] = struct{}{}
			return c, nil
		}
		wait := time.Until(deadline)
		if g.claimed == 0 || wait <= 0 {
			return nil, Errorf(ENOENT, "registration %d allows %d receiver(s); %d finished and %d being served now", g.id, g.uses, g.consumed, g.claimed)
		}
		settled := g.settled
		g.mu.Unlock()
		select {
		case <-settled:
		case <-time.After(wait):
		}
		g.mu.Lock()
	}
}

// notifySettled wakes receivers waiting in claim. Called with g.mu held.
func (g *registration) notifySettled() {
	close(g.settled)
	g.settled = make(chan struct{})
}

// spend consumes c's use and reports whether that used the registration
// up. The caller ends it then (g.end), once the receiver has its answer.
func (g *registration) spend(c *claim) (usedUp bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if c.spent {
		return false
	}
	c.spent = true
	g.claimed--
	g.consumed++
	g.tableSpent()
	// No waiter is woken: consumed+claimed is unchanged, so none could
	// claim now, and one woken would be refused as "used up" although the
	// use comes back if this last send fails (unspend). The end, or the
	// session's drop, wakes them.
	return g.usedUpLocked()
}

// tableSpent shows g's spent uses in the grant table, before the receiver
// that spent one hears so. Called with g.mu held.
func (g *registration) tableSpent() {
	if g.published {
		g.reg.table.spent(g.id, g.uses, g.consumed)
	}
}

// usedUpLocked reports whether every use of g is spent. Called with g.mu
// held.
func (g *registration) usedUpLocked() bool {
	return g.uses != 0 && g.consumed >= g.uses
}

// unspend gives back c's use, spent for a last chunk that could not be sent.
func (g *registration) unspend(c *claim) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !c.spent {
		return
	}
	c.spent = false
	g.consumed--
	g.claimed++
	g.tableSpent()
	g.notifySettled()
}

// drop ends c's session: an unspent use is given back for a retry.
func (g *registration) drop(c *claim) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.claims[c]; !ok {
		return
	}
	delete(g.claims, c)
	if !c.spent {
		g.claimed--
		g.notifySettled()
	}
}

// end ends the registration (the first caller wins and gets true): it
// refuses new receivers, cuts the sessions still being sent chunks, leaves
// its buffer and releases what it lent.
func (g *registration) end(why string) bool {
	rest, ended := g.endQuiet(why)
	if rest != nil {
		rest()
	}
	return ended
}

// endQuiet is end up to the library user's code: what would run it (g's
// release callback; the exporter's release, when g was its buffer's last
// registration) is returned for the caller to run, nil when there is
// none. A grant made again in a loop ends its predecessor on the granting
// thread with it: a goroutine per grant would wake a thread per grant.
func (g *registration) endQuiet(why string) (rest func(), ended bool) {
	g.mu.Lock()
	if g.ended != "" {
		g.mu.Unlock()
		return nil, false
	}
	g.ended = why
	if g.published {
		g.reg.table.withdraw(g.id) // before anyone can learn that it ended
	}
	g.notifySettled()
	if g.timer != nil {
		g.timer.Stop()
	}
	// A spent claim has had every chunk (or its confirmation): its session
	// only waits for done. Cutting it would fail a receiver that got
	// everything, e.g. when another receiver spends the last use.
	cancels := make([]func(), 0, len(g.claims))
	for c := range g.claims {
		if !c.spent {
			cancels = append(cancels, c.cancel)
		}
	}
	g.mu.Unlock()

	last := g.reg.forget(g)
	for _, cancel := range cancels {
		cancel() // wakes the session; it sees the end and stops
	}
	userCode := last || (!g.lendsExporter && g.onRelease != nil)
	if !userCode {
		if !g.lendsExporter {
			g.release() // no callback: it only tells waiters
		}
		return nil, true
	}
	return func() {
		if last {
			g.buf.finish()
		}
		if !g.lendsExporter {
			g.release()
		}
	}, true
}

// release runs the owner's callback once and tells waiters, as soon as no
// receiver holds a use of the registration: until then what the owner
// keeps alive for it (a sent tensor's storage) must stay where it is.
func (g *registration) release() {
	g.mu.Lock()
	g.due = true
	held := g.holds > 0
	g.mu.Unlock()
	if held {
		return // the last unhold releases
	}
	g.releaseOnce.Do(func() {
		safely(g.onRelease)
		g.reg.released(g)
		close(g.releasedCh)
	})
}

// hold records a receiver's hold on a use it spent (holds.go), unless the
// registration has ended: its release may have run already (a spent use's
// session is not cut by the end, so its hold can come after it).
func (g *registration) hold() bool {
	g.mu.Lock()
	if g.ended != "" {
		g.mu.Unlock()
		return false
	}
	g.holds++
	g.mu.Unlock()
	g.reg.holdsChanged(1)
	return true
}

// unhold lets go of one hold; the last one releases a registration whose
// release was due.
func (g *registration) unhold() {
	g.mu.Lock()
	g.holds--
	release := g.holds == 0 && g.due
	g.mu.Unlock()
	g.reg.holdsChanged(-1)
	if release {
		g.release()
	}
}

// live reports whether the registration has not ended.
func (g *registration) live() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.ended == ""
}

// canServe reports whether g could still serve a use: not ended and not
// used up (a used-up registration ends only after its last receiver's
// answer, which another receiver's ack must not wait for).
func (g *registration) canServe() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.ended == "" && !g.usedUpLocked()
}
