package core

import (
	"crypto/subtle"
	"fmt"
	"sync"
	"time"
)

// Exporter produces chunk descriptors on demand for one registration.
type Exporter interface {
	// ExportChunk returns a new descriptor for chunk index, and the offset
	// inside it where the chunk's bytes start. The caller sends and closes fd.
	ExportChunk(index uint64) (fd int, fileOffset uint64, err error)
	// Release runs exactly once when the registration ends, after the last
	// ExportChunk call has returned.
	Release()
}

// RegisterOptions are the sender-side options of a registration.
type RegisterOptions struct {
	Uses       uint32        // receivers allowed to finish; 0 = unlimited
	TTL        time.Duration // 0 = never expires
	Kind       uint8         // MemoryHost or MemoryCUDA
	DeviceUUID [16]byte      // CUDA: the GPU holding the memory
}

// registration is one registered buffer. Its mutex guards the use counts and
// the lifecycle; sizes and offsets never change after creation.
type registration struct {
	id       uint64
	secret   Secret
	sizes    []uint64
	offsets  []uint64 // prefix sums of sizes
	total    uint64
	kind     uint8
	exporter Exporter
	owner    *Registry

	mu        sync.Mutex
	uses      uint32 // 0 = unlimited
	consumed  uint32 // receivers that finished
	claimed   uint32 // receivers streaming now
	ended     string // why it ended; "" while live
	exporting int    // ExportChunk calls in flight
	released  bool
	streams   map[*conn]struct{} // live connections, cut on end
	settled   chan struct{}      // closed and replaced whenever a claim ends
	timer     *time.Timer
}

// Registry holds the registrations of one server.
type Registry struct {
	mu     sync.Mutex
	nextID uint64
	live   map[uint64]*registration
	ended  map[uint64]string // why recent registrations ended, for messages
	order  []uint64          // ended ids, oldest first, to bound the map
}

const rememberEnded = 4096

func newRegistry() *Registry {
	return &Registry{nextID: 1, live: map[uint64]*registration{}, ended: map[uint64]string{}}
}

// add records a new registration. It opens no descriptor.
func (r *Registry) add(sizes []uint64, exp Exporter, opts RegisterOptions) (*registration, error) {
	if len(sizes) == 0 {
		return nil, Errorf(EINVAL, "register: chunk count is 0")
	}
	if uint64(len(sizes)) > MaxChunks {
		return nil, Errorf(EINVAL, "register: %d chunks exceed the limit of %d", len(sizes), MaxChunks)
	}
	if exp == nil {
		return nil, Errorf(EINVAL, "register: no exporter")
	}
	offsets := make([]uint64, len(sizes))
	var total uint64
	for i, s := range sizes {
		if s == 0 {
			return nil, Errorf(EINVAL, "register: chunk %d has size 0", i)
		}
		if total+s < total {
			return nil, Errorf(EINVAL, "register: sizes overflow 64 bits at chunk %d", i)
		}
		offsets[i] = total
		total += s
	}
	secret, err := NewSecret()
	if err != nil {
		return nil, err
	}
	reg := &registration{
		secret: secret, sizes: append([]uint64(nil), sizes...), offsets: offsets,
		total: total, kind: opts.Kind, exporter: exp, owner: r,
		uses: opts.Uses, streams: map[*conn]struct{}{}, settled: make(chan struct{}),
	}
	r.mu.Lock()
	reg.id = r.nextID
	r.nextID++
	r.live[reg.id] = reg
	r.mu.Unlock()
	if opts.TTL > 0 {
		reg.mu.Lock()
		reg.timer = time.AfterFunc(opts.TTL, func() {
			reg.end(fmt.Sprintf("expired after its ttl of %v", opts.TTL))
		})
		reg.mu.Unlock()
	}
	return reg, nil
}

// lookup finds a live registration and checks the secret in constant time.
func (r *Registry) lookup(id uint64, secret Secret) (*registration, error) {
	r.mu.Lock()
	reg := r.live[id]
	why := r.ended[id]
	r.mu.Unlock()
	if reg == nil {
		if why != "" {
			return nil, Errorf(ENOENT, "registration %d %s", id, why)
		}
		return nil, Errorf(ENOENT, "registration %d is unknown to this exporter (never registered, or ended long ago)", id)
	}
	if subtle.ConstantTimeCompare(reg.secret[:], secret[:]) != 1 {
		return nil, Errorf(EAUTH, "wrong secret for registration %d (ticket corrupted or forged)", id)
	}
	return reg, nil
}

// Live returns the number of registrations that have not ended.
func (r *Registry) Live() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.live)
}

// Unregister ends the registration named by id and secret.
func (r *Registry) Unregister(id uint64, secret Secret) error {
	reg, err := r.lookup(id, secret)
	if err != nil {
		return err
	}
	if !reg.end("was unregistered by its owner") {
		return Errorf(ENOENT, "registration %d has already ended", id)
	}
	return nil
}

// claimGrace is how long a receiver that finds every use claimed waits for a
// claim to settle. A stream that its receiver closed early (or whose
// receiver died) gives its use back as soon as the server reads the EOF,
// which can be just after the next receiver arrives.
const claimGrace = time.Second

// claim reserves one use for a receiver that is about to stream.
func (g *registration) claim(c *conn) error {
	deadline := time.Now().Add(claimGrace)
	g.mu.Lock()
	defer g.mu.Unlock()
	for {
		if g.ended != "" {
			return Errorf(ENOENT, "registration %d %s", g.id, g.ended)
		}
		if g.uses == 0 || g.consumed+g.claimed < g.uses {
			g.claimed++
			g.streams[c] = struct{}{}
			return nil
		}
		wait := time.Until(deadline)
		if g.claimed == 0 || wait <= 0 {
			return Errorf(ENOENT, "registration %d allows %d receiver(s); %d finished and %d streaming now", g.id, g.uses, g.consumed, g.claimed)
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

// finish releases a receiver's claim; completed says whether every chunk
// was sent to it (then the use is consumed, else given back for a retry).
// Only the first call for a stream counts. When that used the registration
// up, it is ended but not yet released: the caller calls maybeRelease once
// the receiver no longer needs an answer.
func (g *registration) finish(c *conn, completed bool) {
	g.mu.Lock()
	if _, ok := g.streams[c]; !ok {
		g.mu.Unlock()
		return // already finished
	}
	delete(g.streams, c)
	g.claimed--
	g.notifySettled()
	usedUp := false
	if completed {
		g.consumed++
		usedUp = g.uses != 0 && g.consumed >= g.uses
	}
	g.mu.Unlock()
	if usedUp {
		g.markEnded(fmt.Sprintf("was used up: all %d use(s) consumed", g.uses))
	}
}

// export runs the exporter for one chunk unless the registration has ended.
func (g *registration) export(index uint64) (fd int, fileOffset uint64, err error) {
	g.mu.Lock()
	if g.ended != "" {
		g.mu.Unlock()
		return -1, 0, Errorf(ENOENT, "registration %d %s", g.id, g.ended)
	}
	g.exporting++
	g.mu.Unlock()
	defer g.doneExporting()
	defer func() {
		if p := recover(); p != nil {
			fd, err = -1, Errorf(EINTERNAL, "exporter panicked: %v", p)
		}
	}()
	return g.exporter.ExportChunk(index)
}

func (g *registration) doneExporting() {
	g.mu.Lock()
	g.exporting--
	g.mu.Unlock()
	g.maybeRelease()
}

// end marks the registration ended (first caller wins, reporting true), cuts
// its live streams and releases it once no export is in flight.
func (g *registration) end(why string) bool {
	if !g.markEnded(why) {
		return false
	}
	g.maybeRelease()
	return true
}

// markEnded records why the registration ended, refuses new receivers and
// cuts the live streams; it reports false if it had already ended.
func (g *registration) markEnded(why string) bool {
	g.mu.Lock()
	if g.ended != "" {
		g.mu.Unlock()
		return false
	}
	g.ended = why
	g.notifySettled()
	if g.timer != nil {
		g.timer.Stop()
	}
	streams := make([]*conn, 0, len(g.streams))
	for c := range g.streams {
		streams = append(streams, c)
	}
	g.mu.Unlock()

	r := g.owner
	r.mu.Lock()
	delete(r.live, g.id)
	r.ended[g.id] = why
	r.order = append(r.order, g.id)
	if len(r.order) > rememberEnded {
		delete(r.ended, r.order[0])
		r.order = r.order[1:]
	}
	r.mu.Unlock()

	for _, c := range streams {
		_ = c.Close() // wakes the stream's goroutine; it sees ended and stops
	}
	return true
}

func (g *registration) maybeRelease() {
	g.mu.Lock()
	if g.ended == "" || g.exporting > 0 || g.released {
		g.mu.Unlock()
		return
	}
	g.released = true
	g.mu.Unlock()
	func() {
		defer func() { _ = recover() }() // a panicking release must not kill the server
		g.exporter.Release()
	}()
}
