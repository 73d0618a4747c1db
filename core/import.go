package core

// The receiver's two calls that spend a use of a ticket: Import maps the
// buffer (a cached mapping, or a new one streamed here chunk by chunk),
// Confirm spends the use without receiving anything.

// Import maps the buffer named by t into this process and returns one
// reference to the mapping: a cached one after an authenticated
// confirmation (cache.go; with opts.ConfirmLater the confirmation is queued
// instead, confirmer.go), or a new one, reserved whole and then received,
// mapped and closed one chunk at a time. On any failure everything is undone
// and the error names the chunk. A hit makes no driver call: the backend is
// built only on a miss. gpu may be nil where CUDA is not built in.
func Import(t *Ticket, device int32, opts ImportOptions, gpu GPU) (Ref, error) {
	if err := opts.Validate(); err != nil {
		return Ref{}, err
	}
	opts.OpenOptions = opts.OpenOptions.withDefaults()
	placement, err := placementOf(t, device, opts.Access, gpu)
	if err != nil {
		return Ref{}, err
	}
	useCache := !opts.NoCache
	if useCache {
		on, err := imports.enabled()
		if err != nil {
			return Ref{}, err
		}
		useCache = on
	}
	key := cacheKey{exporter: t.exporterKey(), buffer: t.BufferID, placement: placement}
	if useCache {
		if ref, hit, err := imports.hit(key, t, opts); hit || err != nil {
			return ref, err
		}
	}
	if ref, ok, err := importFromTable(t, key, opts, useCache); ok || err != nil {
		return ref, err
	}
	imp, err := newImporter(t, device, opts.Access, gpu)
	if err != nil {
		return Ref{}, err
	}
	base, lives, err := importNew(t, imp, opts.OpenOptions, opts.Hold)
	if err != nil {
		return Ref{}, err
	}
	return imports.add(newEntry(key, t, base, imp, lives), useCache), nil
}

// Confirm spends one use of t without receiving anything, for a receiver
// that has the memory mapped already (through another ticket of the same
// buffer): at once (with opts.Hold, held on this process's lease: holder.go),
// or queued with opts.ConfirmLater. It reports what the exporter said
// (queued: nil).
func Confirm(t *Ticket, opts ImportOptions) error {
	if err := opts.Validate(); err != nil {
		return err
	}
	opts.OpenOptions = opts.OpenOptions.withDefaults()
	timeout := waitSpent(t, opts.Timeout) // this process's table hits of t first
	switch {
	case opts.ConfirmLater:
		confirms.add(t, opts.Timeout, nil)
		return nil
	case opts.Hold:
		_, err := useHeld(t, timeout)
		return err
	}
	_, err := confirm(t, timeout)
	return err
}

// hostPlacement is the placement key of host mappings.
const hostPlacement = "host"

// placementOf checks that the ticket's memory and the device fit together
// and names the placement, for the cache key.
func placementOf(t *Ticket, device int32, access []int32, gpu GPU) (string, error) {
	switch {
	case t.Kind == MemoryHost && device == DeviceHost:
		if len(access) > 0 {
			return "", Errorf(EINVAL, "import: access devices apply to CUDA memory only; this ticket holds host memory")
		}
		return hostPlacement, nil
	case t.Kind == MemoryHost:
		return "", Errorf(EINVAL, "import: the ticket holds host memory; pass VMMIPC_DEVICE_HOST, not device %d", device)
	case device == DeviceHost:
		return "", Errorf(EINVAL, "import: the ticket holds CUDA memory; pass a device ordinal or VMMIPC_DEVICE_SAME, not VMMIPC_DEVICE_HOST")
	case device < DeviceSame:
		return "", Errorf(EINVAL, "import: device %d is neither an ordinal nor VMMIPC_DEVICE_SAME", device)
	case gpu == nil:
		return "", Errorf(ECUDA, "import: this build of libvmmipc has no CUDA support")
	}
	return gpu.Placement(device, t.DeviceUUID, access)
}

// newImporter builds the backend for a placement placementOf accepted.
func newImporter(t *Ticket, device int32, access []int32, gpu GPU) (Importer, error) {
	if t.Kind == MemoryHost {
		return &HostImporter{}, nil
	}
	return gpu.NewImporter(device, t.DeviceUUID, access)
}

// importNew authenticates with the exporter and claims a use, then
// reserves the whole range, then receives, maps and closes one chunk at a
// time; it reports whether the exporter said the buffer lives on after this
// use (then the mapping may be cached). Nothing is kept for a ticket the
// exporter does not vouch for (host memory reserves its range first, and
// gives it back).
func importNew(t *Ticket, imp Importer, opts OpenOptions, hold bool) (base uint64, lives bool, err error) {
	if t.Kind == MemoryHost {
		return importHostNew(t, imp, opts, hold)
	}
	return importInOrder(t, imp, opts, hold)
}

// importInOrder is importNew's order: authenticate, reserve, pull.
func importInOrder(t *Ticket, imp Importer, opts OpenOptions, hold bool) (base uint64, lives bool, err error) {
	s, err := open(t, opts, hold, false)
	if err != nil {
		return 0, false, err
	}
	defer s.Close() // before the last chunk is sent, this gives the use back
	if err := checkAddressSpace(t.Total, "import", " or import less at a time"); err != nil {
		return 0, false, err
	}
	base, err = imp.Reserve(t.Total)
	if err != nil {
		return 0, false, WrapErr(ENOMEM, err, "import: reserving %d bytes", t.Total)
	}
	lives, err = mapAll(s, imp)
	if err != nil {
		if uerr := imp.Unmap(); uerr != nil {
			err = WrapErr(CodeOf(err), err, "import failed (and undoing it failed too: %v)", uerr)
		}
		return 0, false, err
	}
	return base, lives, nil
}

// importHostNew is importNew for host memory, a round trip shorter: the
// range is reserved first (address space only, given back on every
// error), so that the stream asks for every chunk with its proof, and the
// exporter's run (a host file's chunks, one descriptor) follows the
// welcome at once. A range that cannot be reserved takes importNew's
// order, so that a ticket the exporter does not vouch for (a damaged size,
// say) is refused for that, as it would be there.
func importHostNew(t *Ticket, imp Importer, opts OpenOptions, hold bool) (base uint64, lives bool, err error) {
	if checkAddressSpace(t.Total, "", "") != nil {
		return importInOrder(t, imp, opts, hold)
	}
	base, err = imp.Reserve(t.Total)
	if err != nil {
		return importInOrder(t, imp, opts, hold)
	}
	s, err := open(t, opts, hold, true)
	if err == nil {
		lives, err = mapAll(s, imp)
		s.Close() // before the last chunk is sent, this gives the use back
	}
	if err != nil {
		if uerr := imp.Unmap(); uerr != nil {
			err = WrapErr(CodeOf(err), err, "import failed (and undoing it failed too: %v)", uerr)
		}
		return 0, false, err
	}
	return base, lives, nil
}

// mapAll receives, maps and closes every chunk of s, finishes the mapping
// and reads the exporter's done-ack. Host memory arrives in runs (NextRun):
// a host-file registration is one descriptor and one mmap, whatever its
// chunk count. CUDA chunks arrive one descriptor each.
func mapAll(s *Stream, imp Importer) (bool, error) {
	t := s.t
	for got := uint64(0); got < t.Count; {
		r, err := s.advance(t.Kind == MemoryHost)
		if err != nil {
			if IsEnd(err) {
				err = Errorf(EINVAL, "protocol: stream ended after %d of %d chunks", got, t.Count)
			}
			return false, err
		}
		err = imp.Map(r.Chunk) // a run maps as one chunk: its range and file offset cover it all
		closeFD(&r.FD)
		if err != nil {
			return false, WrapErr(EIO, err, "%s of %d", r.chunks(), t.Count)
		}
		got += r.Count
	}
	if err := imp.Finish(); err != nil {
		return false, err
	}
	// Says done and reads the done-ack, which tells whether the buffer
	// lives on after this use.
	if _, err := s.Next(); !IsEnd(err) {
		if err == nil {
			err = Errorf(EINVAL, "protocol: more chunks than the ticket's %d", t.Count)
		}
		return false, err
	}
	return s.bufferLives, nil
}
