package core

import (
	"container/list"
	"errors"
	"os"
	"sync"
	"syscall"
	"time"
)

// The import cache. A process keeps the mappings it imported, keyed by the
// exporter (address, pid, start time), the buffer id and the placement
// (device, access devices). Every Import returns a reference (a Ref); a hit
// hands out another reference to the same mapping, but only after an
// authenticated session with the exporter for the very ticket being
// imported spent a use and confirmed the buffer (confirm.go). So a
// hit can never be stale: a buffer id names memory the exporter holds
// references to for as long as any registration of it lives, ids are never
// reused in an exporter's life, and the exporter's start time tells a
// restarted exporter with the same pid apart.
//
// Mappings with no reference stay mapped in an LRU bounded in bytes
// (DefaultCacheBytes, VMMIPC_CACHE_BYTES, SetCacheLimit; 0 = off), and are
// undone when the exporter says their buffer ended or the exporter exits:
// a poller asks the exporters of unreferenced mappings every pollInterval
// while there are any.

// CacheBytesEnv overrides DefaultCacheBytes.
const CacheBytesEnv = "VMMIPC_CACHE_BYTES"

// DefaultCacheBytes is the default bound on unreferenced cached bytes.
const DefaultCacheBytes = 32 << 30

var (
	pollInterval = 250 * time.Millisecond
	pollTimeout  = time.Second
)

type cacheKey struct {
	exporter  string
	buffer    uint64
	placement string
}

// Ref is one reference to an imported mapping, as handed to the caller.
type Ref struct {
	ID     uint64 // what Unmap takes
	Base   uint64
	Size   uint64
	Kind   uint8
	Device int32
}

// entry is one mapping in this process.
type entry struct {
	key       cacheKey
	exporter  *Ticket // the ticket it was imported with: names the exporter
	base      uint64
	size      uint64
	kind      uint8
	device    int32
	imp       Importer
	lives     bool          // the exporter said the buffer lives on
	fromTable bool          // mapped from the file the grant table names (tablemiss.go)
	refs      int           // references handed out, and hits in progress
	indexed   bool          // in byKey: may be hit
	elem      *list.Element // in the LRU while unreferenced
}

// CacheInfo is vmmipc_cache_info.
type CacheInfo struct {
	LimitBytes, Entries, ReferencedBytes, UnreferencedBytes uint64
	Hits, Misses, Evictions, Invalidations                  uint64
	ConfirmsPending, ConfirmsFailed                         uint64 // confirmer.go
	TableHits                                               uint64 // hits the grant table vouched for (granttable.go)
	TableImports                                            uint64 // misses mapped from the file the table names (tablemiss.go)
	Holds, HolderSessions                                   uint64 // holder.go: uses held, live leases
}

type importCache struct {
	mu         sync.Mutex
	limit      uint64
	limitErr   error
	configured bool
	byKey      map[cacheKey]*entry
	all        map[*entry]struct{}
	refs       map[uint64]*entry
	nextRef    uint64
	lru        *list.List // unreferenced entries, most recently used first
	unrefBytes uint64
	stats      CacheInfo
	polling    bool
}

var imports = importCache{
	byKey: map[cacheKey]*entry{}, all: map[*entry]struct{}{}, refs: map[uint64]*entry{},
	nextRef: 1, lru: list.New(),
}

// configure reads VMMIPC_CACHE_BYTES once. Called with c.mu held.
func (c *importCache) configure() {
	if c.configured {
		return
	}
	c.configured = true
	c.limit = DefaultCacheBytes
	if v, ok := os.LookupEnv(CacheBytesEnv); ok {
		n, err := ParseBytes(v)
		if err != nil {
			c.limitErr = Errorf(ECONFIG, "%s=%q: %v (e.g. 8G, 1073741824, or 0 to turn the import cache off)", CacheBytesEnv, v, err)
			return
		}
		c.limit = n
	}
}

// enabled reports whether imports use the cache.
func (c *importCache) enabled() (bool, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.configure()
	if c.limitErr != nil {
		return false, c.limitErr
	}
	return c.limit > 0, nil
}

// hit returns another reference to the cached mapping for key, after the
// exporter confirmed t (with opts.Hold: held on a lease, holder.go), or
// at once with the confirmation queued (opts.ConfirmLater: confirmer.go);
// hit is false when there is none (then import anew).
func (c *importCache) hit(key cacheKey, t *Ticket, opts ImportOptions) (Ref, bool, error) {
	timeout := opts.Timeout
	c.mu.Lock()
	e := c.byKey[key]
	if e == nil || !sameGrant(e.exporter, t) {
		// A ticket that differs from the mapping's in what names its
		// memory (a changed byte, say) is no hit: the miss's handshake
		// then has the exporter judge it.
		c.mu.Unlock()
		return Ref{}, false, nil
	}
	c.pin(e) // no eviction while we confirm
	if opts.ConfirmLater {
		c.stats.Hits++
		ref := c.newRef(e) // the pin becomes the caller's reference
		c.mu.Unlock()
		confirms.add(t, timeout, nil)
		return ref, true, nil
	}
	c.mu.Unlock()

	if !opts.Hold {
		if ref, done, err := c.hitOnTable(e, t, timeout); done {
			return ref, true, err
		}
	}
	spendUse := confirm
	if opts.Hold {
		spendUse = useHeld
	}
	// This process's table uses of t first, within the one timeout.
	lives, err := spendUse(t, waitSpent(t, timeout))
	gone := err != nil && CodeOf(err) == EIO && checkExporterAlive(t) != nil // read /proc unlocked

	c.mu.Lock()
	if err != nil {
		var victims []*entry
		if gone {
			victims = c.invalidateExporter(t.exporterKey())
		}
		victims = append(victims, c.unref(e)...)
		c.mu.Unlock()
		undoAll(victims)
		return Ref{}, true, WrapErr(CodeOf(err), err, "import (cached mapping at %#x)", e.base)
	}
	e.lives = lives
	c.stats.Hits++
	ref := c.newRef(e) // the pin becomes the caller's reference
	c.mu.Unlock()
	return ref, true, nil
}

// hitOnTable answers a hit (e pinned) from the exporter's grant table
// (granttable.go) where the table vouches for t: the reference at once,
// the use spent by the confirmer, which settles it; or, where this process
// has taken t's last use already, the exporter's own refusal of a used-up
// grant. done is false where the table cannot tell: ask the exporter.
func (c *importCache) hitOnTable(e *entry, t *Ticket, timeout time.Duration) (ref Ref, done bool, err error) {
	switch answer, u := vouch(t, false); answer {
	case tableVouched:
		if u.exporterAlive(t) != nil { // unlocked: without a lifeline it reads /proc
			settle(t, u.record, false)
			return Ref{}, false, nil // the exporter's answer (none) says so
		}
		c.mu.Lock()
		c.stats.Hits++
		c.stats.TableHits++
		ref = c.newRef(e) // the pin becomes the caller's reference
		c.mu.Unlock()
		c.spendTaken(e, t, u.record, timeout)
		return ref, true, nil
	case tableSpentHere:
		c.mu.Lock()
		victims := c.unref(e)
		c.mu.Unlock()
		undoAll(victims)
		return Ref{}, true, Errorf(ENOENT, "import (cached mapping at %#x): registration %d was used up: this process has spent its last use already", e.base, t.RegID)
	}
	return Ref{}, false, nil
}

// spendTaken has the confirmer spend the use of t that vouch took on the
// table (record `record`) for mapping e: a table hit's, or a table
// import's (tablemiss.go); or the exporter, from the record, if it grants
// again first (confirmer.go). The answer settles it; asked and not
// answered (EIO), the record stays, for the exporter to spend should this
// process exit first.
func (c *importCache) spendTaken(e *entry, t *Ticket, record int, timeout time.Duration) {
	confirms.addRecorded(t, record, timeout, func(lives bool, err error) {
		settle(t, record, err != nil && CodeOf(err) == EIO)
		if err == nil && !lives {
			c.bufferEnded(e)
		}
	})
}

// bufferEnded is a table hit's (or table import's) late answer that the
// buffer ended with its use: e is not kept once unreferenced, as after a
// confirmation that said so on the caller's path (no invalidation: the
// use itself ended it).
func (c *importCache) bufferEnded(e *entry) {
	c.mu.Lock()
	e.lives = false
	var victims []*entry
	if e.refs == 0 && e.elem != nil { // kept unreferenced meanwhile
		c.forget(e)
		victims = []*entry{e}
	}
	c.mu.Unlock()
	undoAll(victims)
}

// sameGrant reports whether ticket t names the memory a mapping was
// imported with (ticket a): the same exporter, buffer, kind, chunk count,
// size and device. The registration's own fields (id, secret) may
// differ: the exporter proves them on every hit but a queued one.
func sameGrant(a, t *Ticket) bool {
	return a.Kind == t.Kind && a.Address == t.Address && a.Pid == t.Pid &&
		a.StartTime == t.StartTime && a.NS == t.NS && a.BufferID == t.BufferID &&
		a.Count == t.Count && a.Total == t.Total && a.DeviceUUID == t.DeviceUUID
}

// add records a new mapping with one reference; cacheable mappings are
// indexed for hits (unless a concurrent import indexed the same key first).
func (c *importCache) add(e *entry, cacheable bool) Ref {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.stats.Misses++
	if e.fromTable {
		c.stats.TableImports++
	}
	c.all[e] = struct{}{}
	if cacheable && e.lives && c.byKey[e.key] == nil {
		c.byKey[e.key] = e
		e.indexed = true
	}
	e.refs = 1
	return c.newRef(e)
}

// newEntry is the mapping of a miss: t's buffer at base, through imp;
// lives: whether the exporter said the buffer lives on after this use.
func newEntry(key cacheKey, t *Ticket, base uint64, imp Importer, lives bool) *entry {
	return &entry{key: key, exporter: t, base: base, size: t.Total, kind: t.Kind, device: imp.Device(), imp: imp, lives: lives}
}

// newRef hands out a reference to e, whose refs already counts it.
func (c *importCache) newRef(e *entry) Ref {
	id := c.nextRef
	c.nextRef++
	c.refs[id] = e
	return Ref{ID: id, Base: e.base, Size: e.size, Kind: e.kind, Device: e.device}
}

// pin takes a reference without handing it out. Called with c.mu held.
func (c *importCache) pin(e *entry) {
	if e.elem != nil {
		c.lru.Remove(e.elem)
		e.elem = nil
		c.unrefBytes -= e.size
	}
	e.refs++
}

// unref drops one reference; an unreferenced mapping is kept in the LRU or
// returned for undoing, with any mappings evicted for room. Called with
// c.mu held.
func (c *importCache) unref(e *entry) []*entry {
	e.refs--
	if e.refs > 0 {
		return nil
	}
	if !e.indexed || !e.lives || c.limit == 0 || e.size > c.limit {
		c.forget(e)
		return []*entry{e}
	}
	e.elem = c.lru.PushFront(e)
	c.unrefBytes += e.size
	var victims []*entry
	for c.unrefBytes > c.limit {
		v := c.lru.Back().Value.(*entry)
		c.forget(v)
		c.stats.Evictions++
		victims = append(victims, v)
	}
	c.startPolling()
	return victims
}

// forget removes e from every table. Called with c.mu held.
func (c *importCache) forget(e *entry) {
	if e.elem != nil {
		c.lru.Remove(e.elem)
		e.elem = nil
		c.unrefBytes -= e.size
	}
	if e.indexed {
		delete(c.byKey, e.key)
		e.indexed = false
	}
	delete(c.all, e)
}

// invalidate stops hits on e because its buffer ended or its exporter
// exited. Called with c.mu held; returns what to undo.
func (c *importCache) invalidate(e *entry) []*entry {
	if !e.indexed {
		return nil
	}
	c.stats.Invalidations++
	return c.unindex(e)
}

// unindex stops hits on e: undone now if unreferenced, else once its last
// reference goes. Called with c.mu held; returns what to undo.
func (c *importCache) unindex(e *entry) []*entry {
	delete(c.byKey, e.key)
	e.indexed = false
	if e.refs == 0 {
		c.forget(e)
		return []*entry{e}
	}
	return nil
}

// invalidateExporter invalidates every mapping of one exporter. Called with
// c.mu held.
func (c *importCache) invalidateExporter(exporter string) []*entry {
	dropTable(exporter)
	var victims []*entry
	for e := range c.all {
		if e.key.exporter == exporter {
			victims = append(victims, c.invalidate(e)...)
		}
	}
	return victims
}

func undoAll(victims []*entry) {
	for _, v := range victims {
		_ = v.imp.Unmap()
	}
}

// startPolling starts the poller unless it runs. Called with c.mu held.
func (c *importCache) startPolling() {
	if c.polling || c.lru.Len() == 0 {
		return
	}
	c.polling = true
	go c.poll()
}

// poll asks the exporters of unreferenced mappings whether their buffers
// live, and undoes those that do not, until no unreferenced mapping is left.
func (c *importCache) poll() {
	for {
		time.Sleep(pollInterval)
		c.mu.Lock()
		if c.lru.Len() == 0 {
			c.polling = false
			c.mu.Unlock()
			return
		}
		byExporter := map[string][]*entry{}
		for el := c.lru.Front(); el != nil; el = el.Next() {
			e := el.Value.(*entry)
			byExporter[e.key.exporter] = append(byExporter[e.key.exporter], e)
		}
		c.mu.Unlock()
		for _, es := range byExporter {
			c.check(es)
		}
	}
}

// check polls one exporter about its buffers.
func (c *importCache) check(es []*entry) {
	t := es[0].exporter
	ids := make([]uint64, len(es))
	for i, e := range es {
		ids[i] = e.key.buffer
	}
	alive, err := bufferStatus(t, ids, pollTimeout)
	gone := err != nil && (checkExporterAlive(t) != nil ||
		errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT))
	if err != nil && !gone {
		return // busy or slow: ask again next time
	}
	if gone {
		dropTable(t.exporterKey())
	}
	c.mu.Lock()
	var victims []*entry
	for _, e := range es {
		if gone || !alive[e.key.buffer] {
			victims = append(victims, c.invalidate(e)...)
		}
	}
	c.mu.Unlock()
	undoAll(victims)
}
