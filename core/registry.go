package core

import (
	"crypto/hmac"
	"crypto/subtle"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Registry holds the registrations and buffers of one server, and issues
// their tickets. Ids are never reused within the process's life.
type Registry struct {
	addr  string // where receivers connect, for tickets
	pid   uint32
	start uint64
	ns    Namespaces

	mu        sync.Mutex
	nextReg   uint64
	nextBuf   uint64
	live      map[uint64]*registration
	releasing map[uint64]*registration // ended, their release still to come
	ended     map[uint64]string        // why recent registrations ended, for messages
	order     []uint64                 // ended ids, oldest first, to bound the map
	buffers   map[uint64]*buffer       // buffers with live registrations
	byKey     map[string]*buffer
	leases    *leaseTable // receivers' leases, on which their holds live (holds.go)
	table     grantTable  // the live grants that hold nothing, for receivers' hits (granttable.go)
	spends    spendLogs   // receivers' spend logs, drained when they exit (spendlogs.go)

	holds atomic.Int64 // receivers' holds on spent uses (holds.go): counted off mu
}

const rememberEnded = 4096

func newRegistry(addr string, pid uint32, start uint64, ns Namespaces) *Registry {
	r := &Registry{
		addr: addr, pid: pid, start: start, ns: ns, nextReg: 1, nextBuf: 1,
		live: map[uint64]*registration{}, releasing: map[uint64]*registration{},
		ended: map[uint64]string{}, buffers: map[uint64]*buffer{}, byKey: map[string]*buffer{},
		leases: newLeaseTable(),
	}
	r.spends.spend, r.spends.published = r.spendRecorded, r.table.anyPublished
	return r
}

// add records a registration of spec's memory: of a live buffer with the
// same key if there is one (joined), else of a new buffer. It opens no
// descriptor.
func (r *Registry) add(spec BufferSpec, opts RegisterOptions) (g *registration, joined bool, err error) {
	if err := opts.Validate(); err != nil {
		return nil, false, err
	}
	offsets, total, err := spec.validate()
	if err != nil {
		return nil, false, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	b := r.byKey[spec.Key]
	if spec.Key == "" || b == nil {
		b = &buffer{
			id: r.nextBuf, key: spec.Key, kind: spec.Kind, uuid: spec.DeviceUUID,
			sizes: append([]uint64(nil), spec.Sizes...), offsets: offsets, total: total,
			exporter: spec.Exporter, regs: map[*registration]struct{}{},
		}
		r.nextBuf++
	} else {
		joined = true
	}
	g, err = r.newRegistration(b, opts)
	if err != nil {
		return nil, false, err
	}
	if !joined {
		r.buffers[b.id] = b
		if b.key != "" {
			r.byKey[b.key] = b
		}
	}
	return g, joined, nil
}

// again records a new registration of the buffer of the live registration g.
func (r *Registry) again(g *registration, opts RegisterOptions) (*registration, error) {
	if err := opts.Validate(); err != nil {
		return nil, err
	}
	if opts.LendsExporter {
		return nil, Errorf(EINTERNAL, "register again: a new registration cannot lend the exporter")
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.live[g.id] != g {
		return nil, Errorf(ENOENT, "register again: %s", r.endedWhy(g.id))
	}
	return r.newRegistration(g.buf, opts)
}

// newRegistration makes a registration of b and publishes it. Called with
// r.mu held.
func (r *Registry) newRegistration(b *buffer, opts RegisterOptions) (*registration, error) {
	secret, err := NewSecret()
	if err != nil {
		return nil, err
	}
	g := &registration{
		id: r.nextReg, secret: secret, buf: b, reg: r,
		onRelease: opts.OnRelease, lendsExporter: opts.LendsExporter, holdable: opts.Hold,
		uses: opts.Uses, claims: map[*claim]struct{}{}, settled: make(chan struct{}),
		releasedCh: make(chan struct{}),
	}
	g.ticket = &Ticket{
		Kind: b.kind, Address: r.addr, Pid: r.pid, StartTime: r.start, NS: r.ns, RegID: g.id,
		BufferID: b.id, Secret: secret, Count: uint64(len(b.sizes)), Total: b.total,
		DeviceUUID: b.uuid, Holds: opts.Hold, OneRound: true,
	}
	if g.digest, err = g.ticket.Digest(); err != nil {
		return nil, err
	}
	if !opts.Hold {
		var deadline uint64
		if opts.TTL > 0 {
			deadline = monotonicNanos() + uint64(opts.TTL)
		}
		g.published = r.table.publish(g.id, opts.Uses, deadline, g.digest, fileOf(b))
	}
	r.nextReg++
	r.live[g.id] = g
	b.regs[g] = struct{}{}
	if opts.LendsExporter {
		b.mu.Lock()
		b.lenders = append(b.lenders, g)
		b.mu.Unlock()
	}
	if opts.TTL > 0 {
		ttl := opts.TTL
		g.mu.Lock() // the timer may fire before this assignment is done
		g.timer = time.AfterFunc(ttl, func() { g.end(fmt.Sprintf("expired after its ttl of %v", ttl)) })
		g.mu.Unlock()
	}
	return g, nil
}

// forget moves an ended registration out of the live set and reports
// whether it was its buffer's last, which the caller then finishes (the
// exporter's release may run the library user's code).
func (r *Registry) forget(g *registration) (last bool) {
	r.mu.Lock()
	delete(r.live, g.id)
	r.releasing[g.id] = g
	r.ended[g.id] = g.ended
	r.order = append(r.order, g.id)
	if len(r.order) > rememberEnded {
		delete(r.ended, r.order[0])
		r.order = r.order[1:]
	}
	b := g.buf
	delete(b.regs, g)
	last = len(b.regs) == 0
	if last {
		delete(r.buffers, b.id)
		if b.key != "" && r.byKey[b.key] == b {
			delete(r.byKey, b.key)
		}
	}
	r.mu.Unlock()
	return last
}

// released drops a registration whose release has run.
func (r *Registry) released(g *registration) {
	r.mu.Lock()
	delete(r.releasing, g.id)
	r.mu.Unlock()
}

// endedWhy says what became of registration id. Called with r.mu held.
func (r *Registry) endedWhy(id uint64) string {
	if why := r.ended[id]; why != "" {
		return fmt.Sprintf("registration %d %s", id, why)
	}
	if id > 0 && id < r.nextReg {
		return fmt.Sprintf("registration %d has ended (long ago)", id)
	}
	return fmt.Sprintf("registration %d is unknown to this exporter (never registered)", id)
}

// lookup finds a live registration by id alone: the handshake proves the
// secret without sending it.
func (r *Registry) lookup(id uint64) (*registration, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if g := r.live[id]; g != nil {
		return g, nil
	}
	return nil, Errorf(ENOENT, "%s", r.endedWhy(id))
}

// lookupOwn finds a live (or, with releasing, a not yet released)
// registration of this process by id and secret, checked in constant time.
func (r *Registry) lookupOwn(id uint64, secret Secret, releasing bool) (*registration, error) {
	r.mu.Lock()
	g := r.live[id]
	if g == nil && releasing {
		g = r.releasing[id]
	}
	if g == nil {
		why := r.endedWhy(id)
		r.mu.Unlock()
		return nil, Errorf(ENOENT, "%s", why)
	}
	r.mu.Unlock()
	if subtle.ConstantTimeCompare(g.secret[:], secret[:]) != 1 {
		return nil, Errorf(EAUTH, "wrong secret for registration %d (ticket corrupted or forged)", id)
	}
	return g, nil
}

// issued reports whether this registry ever issued registration id.
func (r *Registry) issued(id uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return id > 0 && id < r.nextReg
}

// bufferLives reports whether buffer id still has a live registration.
func (r *Registry) bufferLives(id uint64) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.buffers[id] != nil
}

// bufferHasOthers reports whether g's buffer has registrations besides g
// that can still serve a use. One used up by another receiver still counts
// among the buffer's registrations until its end runs, just after that
// receiver's answer: it must not make this receiver keep a mapping that no
// ticket can hit again.
func (r *Registry) bufferHasOthers(g *registration) bool {
	r.mu.Lock()
	others := make([]*registration, 0, len(g.buf.regs))
	for o := range g.buf.regs {
		if o != g {
			others = append(others, o)
		}
	}
	r.mu.Unlock()
	for _, o := range others { // each under its own lock, never under r.mu
		if o.canServe() {
			return true
		}
	}
	return false
}

// Live returns the number of registrations that have not ended.
func (r *Registry) Live() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.live)
}

// The count of the holds on the registry's registrations (holds.go).

func (r *Registry) holdsChanged(d int64) { r.holds.Add(d) }

// Holds counts the uses receivers hold now, over every registration.
func (r *Registry) Holds() int64 { return r.holds.Load() }

// spendRecorded spends the use a receiver's record names, as its
// confirmation would have (a dead receiver's, or one harvested from a live
// receiver's log): only a live grant that holds nothing, only with the
// proof its secret makes, waiting at most grace for a use that receivers
// being served have claimed. lives: the buffer lives on after it, as a
// confirmation's answer would say (ackFlags). usedUp, if not nil, is the
// registration this use used up, for the caller to end (endQuiet on a
// granting thread: its release callback, and with the buffer's last
// registration the exporter's release, must not run there).
func (r *Registry) spendRecorded(id uint64, proof [32]byte, grace time.Duration) (spent, lives bool, usedUp *registration) {
	r.mu.Lock()
	g := r.live[id]
	r.mu.Unlock()
	if g == nil || g.holdable {
		return false, false, nil
	}
	want := spendProof(g.secret, id)
	if !hmac.Equal(want[:], proof[:]) {
		return false, false, nil
	}
	cl, err := g.claimWithin(func() {}, grace)
	if err != nil {
		return false, false, nil
	}
	used := g.spend(cl)
	g.drop(cl)
	lives = (!used && g.live()) || r.bufferHasOthers(g)
	if used {
		usedUp = g
	}
	return true, lives, usedUp
}

// fileOf is the file that holds b whole from offset 0, if its exporter has
// one (fileBacked), for the grant table.
func fileOf(b *buffer) backingFile {
	if fb, ok := b.exporter.(fileBacked); ok {
		if fd, dev, ino := fb.heldFile(); fd >= 0 {
			return backingFile{fd: fd, dev: dev, ino: ino}
		}
	}
	return noFile
}
