package core

import "golang.org/x/sys/unix"

// Serving a use's chunks (session.go runs the session): pulls answered one
// chunk a descriptor, pull-runs as many chunks a descriptor as the exporter
// can put in one; the use is spent right before the last chunk goes out. A
// receiver's side of this is pull.go.

// serveChunks answers pulls and pull-runs until done (true) or failure
// (false); sendChunks calls spend(true) right before the last chunk is
// sent, spend(false) if that send fails. The run that completes the buffer
// ends the stream at once: its done-ack follows unasked (wire.go).
func (ss *session) serveChunks(g *registration, spend func(bool)) bool {
	b := g.buf
	count := uint64(len(b.sizes))
	next := uint64(0) // the next index we expect to be asked for
	for {
		f, ok := ss.recv()
		if !ok {
			return false
		}
		switch f.Type {
		case msgPull, msgPullRun:
			p, err := parsePull(f.Body)
			if err == nil && (p.First != next || p.Count == 0 || p.Count > count-next) {
				err = Errorf(EINVAL, "protocol: %s of chunks [%d, %d+%d) out of order or out of range (next is %d of %d)", msgName(f.Type), p.First, p.First, p.Count, next, count)
			}
			if err != nil {
				ss.refuse(err)
				return false
			}
			if f.Type == msgPullRun {
				// One message answers it, however many chunks it covers.
				n, err := ss.sendChunks(g, p.First, p.Count, true, spend)
				if err != nil {
					ss.refuse(err)
					return false
				}
				if next += n; next == count {
					return true
				}
			} else {
				for i := p.First; i < p.First+p.Count; i++ {
					if _, err := ss.sendChunks(g, i, 1, false, spend); err != nil {
						ss.refuse(err)
						return false
					}
				}
				next += p.Count
			}
		case msgDone:
			if next != count {
				ss.refuse(Errorf(EINVAL, "protocol: done after %d of %d chunks", next, count))
				return false
			}
			return true
		default:
			ss.refuse(Errorf(EINVAL, "protocol: unexpected %s message while streaming", msgName(f.Type)))
			return false
		}
	}
}

// sendChunks exports chunks [first, first+max), as many of them as the
// exporter puts in one descriptor, sends that descriptor with the header in
// one message (a run message when run, else a chunk message: max is then 1),
// and closes it whatever happens. It returns how many chunks it sent. When
// they include the last chunk, the use is spent right before the send and
// given back if the send fails, so that a receiver never holds every chunk
// of a use the exporter has not counted.
func (ss *session) sendChunks(g *registration, first, max uint64, run bool, spend func(bool)) (uint64, error) {
	b := g.buf
	if !g.live() {
		return 0, Errorf(ENOENT, "%s while streaming", g.why())
	}
	fd, fileOff, n, err := b.export(first, max)
	if err != nil {
		if CodeOf(err) == ENOENT {
			return 0, err
		}
		// EEXPORT whatever the cause's own status: the receiver would read
		// ENFILE as its own shortage, and ECUDA is no status of its calls.
		return 0, Errorf(EEXPORT, "chunk %d of %d: export failed: %w", first, len(b.sizes), err)
	}
	if fd < 0 {
		return 0, Errorf(EEXPORT, "chunk %d of %d: exporter returned no descriptor", first, len(b.sizes))
	}
	defer unix.Close(fd)
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0); err != nil {
		return 0, Errorf(EEXPORT, "chunk %d of %d: exporter returned %d, which is not an open descriptor", first, len(b.sizes), fd)
	}
	last := first + n - 1
	size := b.offsets[last] + b.sizes[last] - b.offsets[first]
	var msg []byte
	if !run {
		msg = chunkMsg{Index: first, Offset: b.offsets[first], Size: size, FileOffset: fileOff}.encode()
	} else {
		msg = runMsg{Index: first, Count: n, Offset: b.offsets[first], Size: size, FileOffset: fileOff}.encode()
	}
	final := last == uint64(len(b.sizes))-1
	if final {
		spend(true)
	}
	if err := ss.c.send(msg, fd); err != nil {
		if final {
			spend(false)
		}
		return 0, err
	}
	return n, nil
}
