package core

import "fmt"

// Pulling a stream's chunks (stream.go opens the stream and finishes it):
// Next keeps up to Window chunks asked for ahead, NextRun asks for every chunk
// left with one pull-run; each answer is checked against the ticket before
// its descriptor is handed out, so that a confused or hostile exporter
// cannot make us map outside the range we reserved. The server's side is
// session_chunks.go.

// Next returns the next chunk, or End (as an *Error with Code End) once every
// chunk has arrived, at which point the use is consumed. After any other
// error the stream is broken and Next keeps returning that error.
func (s *Stream) Next() (Chunk, error) {
	r, err := s.advance(false)
	return r.Chunk, err
}

// Run is what one descriptor brings a receiver: Count consecutive chunks
// from chunk Index, Size bytes in all at Offset of the buffer, laid out back
// to back in FD from FileOffset. A chunk is a run of one.
type Run struct {
	Chunk
	Count uint64
}

// chunks names the run's chunks in messages: "chunk 5", "chunks 0-511".
func (r Run) chunks() string {
	if r.Count <= 1 {
		return fmt.Sprintf("chunk %d", r.Index)
	}
	return fmt.Sprintf("chunks %d-%d", r.Index, r.Index+r.Count-1)
}

// NextRun returns the next run of chunks, or End once every chunk has
// arrived (the use is then consumed), as Next does for chunks. It asks for
// every chunk left in one message (a pull-run, wire.go): a host-file
// registration answers with one descriptor for all of them. An exporter
// that puts one chunk in a descriptor answers with a run of one; the stream
// then pulls the rest chunk by chunk, Window requests ahead, as Next does.
func (s *Stream) NextRun() (Run, error) { return s.advance(true) }

// advance is Next (runs false) or NextRun: the stream's state checks and
// its sticky error around one step.
func (s *Stream) advance(runs bool) (Run, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	none := Run{Chunk: Chunk{FD: -1}}
	switch {
	case s.closed:
		return none, Errorf(EBADF, "stream is closed")
	case s.err != nil:
		return none, s.err
	case s.done:
		return none, errEnd
	}
	var r Run
	var err error
	if runs && !s.perChunk {
		r, err = s.nextRun()
	} else {
		r.Count = 1
		r.Chunk, err = s.next()
	}
	if err != nil && err != errEnd {
		s.err = err
	}
	return r, err
}

func (s *Stream) next() (Chunk, error) {
	count := s.t.Count
	if s.received == count {
		return Chunk{FD: -1}, s.finish()
	}
	// Top up the requests in flight once half the window has drained, so
	// the exporter never waits on us and requests go out in batches.
	if inFlight := s.requested - s.received; inFlight <= s.window/2 && s.requested < count {
		n := min(s.window-inFlight, count-s.requested)
		if sendErr := s.c.send(pullMsg{First: s.requested, Count: n}.encode(), -1); sendErr != nil {
			// The exporter may have hung up after telling us why: what it
			// sent before closing is still queued for us to read.
			if inFlight == 0 {
				return Chunk{FD: -1}, s.chunkErr(pendingError(s.c, sendErr, whileChunks))
			}
		} else {
			s.requested += n
		}
	}
	f, err := s.c.recv()
	if err != nil {
		return Chunk{FD: -1}, s.chunkErr(err)
	}
	switch f.Type {
	case msgChunk:
	case msgError:
		closeFD(&f.FD)
		return Chunk{FD: -1}, remoteError(f.Body, whileChunks)
	default:
		closeFD(&f.FD)
		return Chunk{FD: -1}, Errorf(EINVAL, "protocol: expected chunk %d, got %s", s.received, msgName(f.Type))
	}
	m, err := parseChunk(f.Body)
	if err == nil {
		err = s.checkChunk(m, f.FD)
	}
	if err != nil {
		closeFD(&f.FD)
		return Chunk{FD: -1}, err
	}
	s.received++
	s.offset += m.Size
	return Chunk{Index: m.Index, Offset: m.Offset, Size: m.Size, FileOffset: m.FileOffset, FD: f.FD}, nil
}

// checkChunk verifies that a chunk message is the one we expect and that
// it fits the ticket, so a confused or hostile exporter cannot make us map
// outside the range we reserved.
func (s *Stream) checkChunk(m chunkMsg, fd int) error {
	switch {
	case fd < 0:
		return Errorf(EINVAL, "protocol: chunk %d arrived without a descriptor", m.Index)
	case m.Index != s.received:
		return Errorf(EINVAL, "protocol: got chunk %d, expected %d", m.Index, s.received)
	case m.Offset != s.offset:
		return Errorf(EINVAL, "protocol: chunk %d at offset %d, expected %d", m.Index, m.Offset, s.offset)
	case m.Size == 0 || m.Size > s.t.Total-s.offset || s.t.Total-s.offset-m.Size < s.t.Count-1-m.Index:
		// Every chunk holds at least one byte, those after this one too.
		return Errorf(EINVAL, "protocol: chunk %d of size %d does not fit the %d bytes left for %d chunks", m.Index, m.Size, s.t.Total-s.offset, s.t.Count-m.Index)
	case m.Index == s.t.Count-1 && m.Offset+m.Size != s.t.Total:
		return Errorf(EINVAL, "protocol: chunks end at %d, the ticket says %d", m.Offset+m.Size, s.t.Total)
	case m.FileOffset+m.Size < m.FileOffset:
		return Errorf(EINVAL, "protocol: chunk %d at file offset %d of %d bytes overflows", m.Index, m.FileOffset, m.Size)
	}
	return nil
}

// nextRun sends one pull-run for every chunk left and receives its answer.
// Pull-runs go one at a time, so nothing else is in flight.
func (s *Stream) nextRun() (Run, error) {
	none := Run{Chunk: Chunk{FD: -1}}
	if s.received == s.t.Count {
		return none, s.finish()
	}
	want := s.t.Count - s.received
	if s.runAsked { // with the handshake (open)
		s.runAsked = false
	} else if err := s.c.send(pullMsg{First: s.received, Count: want}.encodeRun(), -1); err != nil {
		return none, s.chunkErr(pendingError(s.c, err, whileChunks))
	}
	f, err := s.c.recv()
	if err != nil {
		return none, s.chunkErr(err)
	}
	switch f.Type {
	case msgRun:
	case msgError:
		closeFD(&f.FD)
		return none, remoteError(f.Body, whileChunks)
	default:
		closeFD(&f.FD)
		return none, Errorf(EINVAL, "protocol: expected a run from chunk %d, got %s", s.received, msgName(f.Type))
	}
	m, err := parseRun(f.Body)
	if err == nil {
		err = s.checkRun(m, want, f.FD)
	}
	if err != nil {
		closeFD(&f.FD)
		return none, err
	}
	s.received += m.Count
	s.requested = s.received
	s.offset += m.Size
	s.ackFollows = s.received == s.t.Count // the exporter sends the done-ack unasked
	if m.Count == 1 && want > 1 {
		s.perChunk = true // one chunk per descriptor: pull the rest a window ahead
	}
	return Run{Chunk: Chunk{Index: m.Index, Offset: m.Offset, Size: m.Size, FileOffset: m.FileOffset, FD: f.FD}, Count: m.Count}, nil
}

// checkRun verifies that a run answers our pull-run for want chunks and
// fits the ticket, as checkChunk does for a chunk: a confused or hostile
// exporter cannot make us map outside the range we reserved.
func (s *Stream) checkRun(m runMsg, want uint64, fd int) error {
	left := s.t.Total - s.offset // bytes the ticket leaves for the chunks not yet received
	switch {
	case fd < 0:
		return Errorf(EINVAL, "protocol: the run from chunk %d arrived without a descriptor", m.Index)
	case m.Index != s.received:
		return Errorf(EINVAL, "protocol: got a run from chunk %d, expected chunk %d", m.Index, s.received)
	case m.Count == 0 || m.Count > want:
		return Errorf(EINVAL, "protocol: a run of %d chunks from chunk %d; asked for 1 to %d", m.Count, m.Index, want)
	case m.Offset != s.offset:
		return Errorf(EINVAL, "protocol: the run from chunk %d at offset %d, expected %d", m.Index, m.Offset, s.offset)
	case m.Size < m.Count || m.Size > left || left-m.Size < want-m.Count:
		// Every chunk holds at least one byte, those after the run too.
		return Errorf(EINVAL, "protocol: a run of %d chunks and %d bytes from chunk %d does not fit the %d bytes left for %d chunks", m.Count, m.Size, m.Index, left, want)
	case m.Count == want && m.Size != left:
		return Errorf(EINVAL, "protocol: chunks end at %d, the ticket says %d", m.Offset+m.Size, s.t.Total)
	case m.FileOffset+m.Size < m.FileOffset:
		return Errorf(EINVAL, "protocol: the run from chunk %d at file offset %d of %d bytes overflows", m.Index, m.FileOffset, m.Size)
	}
	return nil
}

// chunkErr prefixes an error with the chunk we were waiting for.
func (s *Stream) chunkErr(err error) error {
	return WrapErr(EIO, err, "chunk %d of %d", s.received, s.t.Count)
}
