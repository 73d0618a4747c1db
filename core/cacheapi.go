package core

// The import cache's calls (cache.go has the cache): Unmap drops a
// reference, SetCacheLimit bounds the unreferenced bytes, GetCacheInfo
// reports the cache's counts with those of the confirmations (confirmer.go)
// and holds (holder.go).

// Unmap drops the reference id (whose mapping starts at base).
func Unmap(id, base uint64) error {
	c := &imports
	c.mu.Lock()
	e := c.refs[id]
	if e == nil || e.base != base {
		c.mu.Unlock()
		return Errorf(EINVAL, "unmap: %#x is not a live mapping reference of this process (already unmapped, or not from vmmipc_import_stream)", base)
	}
	delete(c.refs, id)
	victims := c.unref(e)
	c.mu.Unlock()
	var first error
	for _, v := range victims {
		if err := v.imp.Unmap(); err != nil && v == e && first == nil {
			first = WrapErr(EIO, err, "unmap %#x", base)
		}
	}
	return first
}

// SetCacheLimit sets the bound on unreferenced cached bytes (0 = off) and
// undoes what no longer fits.
func SetCacheLimit(n uint64) error {
	c := &imports
	c.mu.Lock()
	c.configure()
	c.limit, c.limitErr = n, nil
	var victims []*entry
	if n == 0 { // off: no more hits; what is unreferenced goes now
		for e := range c.all {
			if e.indexed {
				if e.refs == 0 {
					c.stats.Evictions++
				}
				victims = append(victims, c.unindex(e)...)
			}
		}
	}
	for c.unrefBytes > c.limit {
		v := c.lru.Back().Value.(*entry)
		c.forget(v)
		c.stats.Evictions++
		victims = append(victims, v)
	}
	c.mu.Unlock()
	var first error
	for _, v := range victims {
		if err := v.imp.Unmap(); err != nil && first == nil {
			first = WrapErr(EIO, err, "cache: unmap %#x", v.base)
		}
	}
	return first
}

// GetCacheInfo reports the cache's state.
func GetCacheInfo() CacheInfo {
	c := &imports
	c.mu.Lock()
	defer c.mu.Unlock()
	c.configure()
	info := c.stats
	info.LimitBytes = c.limit
	info.Entries = uint64(len(c.all))
	info.UnreferencedBytes = c.unrefBytes
	info.ConfirmsPending, info.ConfirmsFailed = confirms.counts()
	info.Holds, info.HolderSessions = holdCounts()
	for e := range c.all {
		if e.refs > 0 {
			info.ReferencedBytes += e.size
		}
	}
	return info
}
