package core

import (
	"sync"
	"time"
)

// Holds, the receiver's half (holds.go has the server's and the why).
//
// A receiver that imports or confirms with ImportOptions.Hold keeps one
// holder session per exporter: the connection of its first such use stays
// open after the done-ack. Later uses of that exporter are spent on it
// (a cache hit: one use message and its answer; a new mapping: its stream,
// on a connection of its own, names the session with hold-for), and every
// held use is let go with Release, which queues the registration id; a
// goroutine per session sends what is queued in batches, off the caller's
// path. The receiver's death closes the connection, which lets go of
// everything it held: nothing else is needed for that. One goroutine per
// session reads it: the answers to uses, and its end, so that a session
// whose exporter has gone is closed at once rather than kept open until
// its next use.
type holder struct {
	key   string // the exporter (Ticket.exporterKey)
	c     *conn
	tr    transcript // the session's handshake: uses are proved bound to it
	token holderToken
	acks  chan useAckMsg // from the reader: one per use sent
	done  chan struct{}  // closed by the reader when the session ends

	using    sync.Mutex // one use at a time: send, then its answer
	mu       sync.Mutex // the fields below, and every send on c
	broken   error      // sticky: the session is over
	held     map[uint64]int
	queued   []uint64 // registration ids to let go of
	flushing bool
}

// holders are this process's holder sessions, by exporter. Two threads
// opening the first one of an exporter at once may both succeed: each
// keeps what it holds.
var holders = struct {
	mu sync.Mutex
	m  map[string][]*holder
}{m: map[string][]*holder{}}

// holderFor is a live holder session to t's exporter, or nil.
func holderFor(t *Ticket) *holder {
	for _, h := range holdersOf(t.exporterKey()) {
		h.mu.Lock()
		ok := h.broken == nil
		h.mu.Unlock()
		if ok {
			return h
		}
	}
	return nil
}

// holdersOf copies the list of key's sessions (h.mu is taken after
// holders.mu is let go: fail takes them the other way round).
func holdersOf(key string) []*holder {
	holders.mu.Lock()
	defer holders.mu.Unlock()
	return append([]*holder(nil), holders.m[key]...)
}

// adoptHolder turns c, whose session's done-ack was just read, into a
// holder session: it reads the token, and records the first use if the
// done-ack said it is held.
func adoptHolder(t *Ticket, c *conn, tr transcript, held bool) (*holder, error) {
	f, err := recvControl(c, "holding")
	if err != nil {
		return nil, WrapErr(EIO, err, "waiting for the exporter's holder session")
	}
	m, err := parseToken(msgHolding, f.Body)
	if err != nil {
		return nil, err
	}
	h := &holder{key: t.exporterKey(), c: c, tr: tr, token: m.Token, held: map[uint64]int{},
		acks: make(chan useAckMsg, 1), done: make(chan struct{})}
	if held {
		h.held[t.RegID]++
	}
	holders.mu.Lock()
	holders.m[h.key] = append(holders.m[h.key], h)
	holders.mu.Unlock()
	// The reader waits as long as the session lives, and sends are not
	// bounded (the exporter's session reads all the time): only the wait
	// for a use's answer is (use). c.timeout is then never written again,
	// since the reader reads it concurrently.
	c.deadline, c.timeout = time.Time{}, 0
	go h.read()
	return h, nil
}

// read hands the answers to uses over to use, until the session ends: the
// exporter hung up (it exited: what was held here it let go of) or broke
// the protocol; then the session is closed and forgotten.
func (h *holder) read() {
	defer close(h.done)
	for {
		f, err := h.c.recv()
		if err == nil && f.FD >= 0 {
			closeFD(&f.FD)
			err = Errorf(EINVAL, "protocol: the exporter sent a descriptor on a holder session")
		}
		if err == nil && f.Type == msgError {
			err = remoteError(f.Body)
		} else if err == nil && f.Type != msgUseAck {
			err = Errorf(EINVAL, "protocol: expected use-ack on a holder session, got %s", msgName(f.Type))
		}
		var ack useAckMsg
		if err == nil {
			ack, err = parseUseAck(f.Body)
		}
		if err != nil {
			h.mu.Lock()
			h.fail(WrapErr(EIO, err, "the exporter's holder session ended"))
			h.mu.Unlock()
			return
		}
		select {
		case h.acks <- ack:
		default: // an answer nobody asked for
			h.mu.Lock()
			h.fail(Errorf(EINVAL, "protocol: a use-ack for registration %d that was not asked for", ack.RegID))
			h.mu.Unlock()
			return
		}
	}
}

// took records a use held on h by a stream that named it (hold-for).
func (h *holder) took(id uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.broken == nil {
		h.held[id]++
	}
}

// fail marks h over and forgets it; what it held the exporter let go of
// when the connection ended. Called with h.mu held.
func (h *holder) fail(err error) {
	if h.broken != nil {
		return
	}
	h.broken = err
	h.held = nil
	h.queued = nil
	_ = h.c.Close()
	holders.mu.Lock()
	list := holders.m[h.key]
	for i, x := range list {
		if x == h {
			list = append(list[:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(holders.m, h.key)
	} else {
		holders.m[h.key] = list
	}
	holders.mu.Unlock()
}

// use spends one use of t on h: one message and its answer. broken says
// that the session is over (then nothing was spent here: try another).
func (h *holder) use(t *Ticket, timeout time.Duration) (ackFlags uint64, broken bool, err error) {
	digest, err := t.Digest()
	if err != nil {
		return 0, false, err
	}
	tr := h.tr
	tr.RegID, tr.Flags, tr.TicketDigest = t.RegID, useProofFlag, digest
	h.using.Lock()
	defer h.using.Unlock()
	h.mu.Lock()
	if h.broken != nil {
		h.mu.Unlock()
		return 0, true, h.broken
	}
	err = h.c.send(useMsg{RegID: t.RegID, Proof: tr.proof(t.Secret, roleReceiver)}.encode(), -1)
	if err != nil {
		h.fail(err)
		h.mu.Unlock()
		return 0, true, h.broken
	}
	h.mu.Unlock()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var ack useAckMsg
	select {
	case ack = <-h.acks:
	case <-h.done:
		// Sent but not answered: it may have been spent (and held: the end
		// of the connection let go of it). Do not retry.
		h.mu.Lock()
		defer h.mu.Unlock()
		return 0, false, WrapErr(EIO, h.broken, "use of registration %d", t.RegID)
	case <-timer.C:
		h.mu.Lock()
		defer h.mu.Unlock()
		h.fail(Errorf(EIO, "use of registration %d: the exporter did not answer on its holder session within %v (raise timeout_ms if it is just busy)", t.RegID, timeout))
		return 0, false, h.broken
	}
	if ack.RegID != t.RegID {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.fail(Errorf(EINVAL, "protocol: use of registration %d answered for registration %d", t.RegID, ack.RegID))
		return 0, false, h.broken
	}
	if ack.Code != OK {
		return 0, false, &Error{Code: ack.Code, Msg: ack.Text}
	}
	if ack.Flags&ackHeld != 0 {
		h.took(t.RegID)
	}
	return ack.Flags, false, nil
}

// useHeld spends one use of t, held if its registration holds: on a holder
// session to its exporter, opened by this use if there is none. It reports
// whether the buffer lives on, like confirm.
func useHeld(t *Ticket, timeout time.Duration) (bool, error) {
	for h := holderFor(t); h != nil; h = holderFor(t) {
		flags, broken, err := h.use(t, timeout)
		if !broken {
			return flags&ackBufferLives != 0, err
		}
	}
	c, tr, err := connect(t, timeout, helloConfirm|helloHolder, nil)
	if err != nil {
		return false, err
	}
	ack, err := readDoneAckFlags(c)
	if err == nil {
		_, err = adoptHolder(t, c, tr, ack&ackHeld != 0)
	}
	if err != nil {
		_ = c.Close()
		return false, err
	}
	return ack&ackBufferLives != 0, nil
}

// Release lets go of one held use of t (taken by Import or Confirm with
// Hold): its id is queued and sent, with others, by the session's
// goroutine. ENOENT if this process holds no use of it (never held, let go
// already, or its exporter ended the session: then it let go itself).
func Release(t *Ticket) error {
	for _, h := range holdersOf(t.exporterKey()) {
		h.mu.Lock()
		if h.broken == nil && h.held[t.RegID] > 0 {
			if h.held[t.RegID]--; h.held[t.RegID] == 0 {
				delete(h.held, t.RegID)
			}
			h.queued = append(h.queued, t.RegID)
			if !h.flushing {
				h.flushing = true
				go h.flush()
			}
			h.mu.Unlock()
			return nil
		}
		h.mu.Unlock()
	}
	return Errorf(ENOENT, "release: this process holds no use of registration %d (never held, let go of already, or its exporter has gone, which let go of it)", t.RegID)
}

// flush sends the queued releases, up to maxReleaseBatch ids a message,
// until none is left.
func (h *holder) flush() {
	h.mu.Lock()
	defer h.mu.Unlock()
	for len(h.queued) > 0 && h.broken == nil {
		n := min(len(h.queued), maxReleaseBatch)
		msg := releaseMsg{RegIDs: h.queued[:n]}.encode()
		h.queued = h.queued[n:]
		if err := h.c.send(msg, -1); err != nil {
			h.fail(err)
		}
	}
	h.queued = nil
	h.flushing = false
}

// holdCounts reports the uses this process holds and its holder sessions.
func holdCounts() (held, sessions uint64) {
	holders.mu.Lock()
	var all []*holder
	for _, list := range holders.m {
		all = append(all, list...)
	}
	holders.mu.Unlock()
	for _, h := range all {
		h.mu.Lock()
		for _, n := range h.held {
			held += uint64(n)
		}
		h.mu.Unlock()
	}
	return held, uint64(len(all))
}
