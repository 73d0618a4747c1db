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
// everything it held: nothing else is needed for that.
//
// A use on the session does not wait for its answer (a cache hit adds no
// round trip): its message is in the exporter's socket before the call
// returns, so the receiver's death right after cannot lose it, and the
// exporter reads the session's messages in order, so a later release of
// the same registration comes after it. One goroutine per session reads
// the answers, in the order the uses went out: a refused use is counted
// (CacheInfo.ConfirmsFailed) and un-held here; and it sees the session's
// end, so that a session whose exporter has gone is closed at once rather
// than kept open until its next use.
type holder struct {
	key   string // the exporter (Ticket.exporterKey)
	c     *conn
	tr    transcript // the session's handshake: uses are proved bound to it
	token holderToken

	// sendMu orders every send on c (taken before mu); mu guards the
	// fields below and is never held across a send, so that the reader
	// always takes the answers: an exporter blocked sending use-acks to a
	// reader that waits for a sender blocked on the exporter would stall
	// both until the exporter gives up on the session (idleTimeout), and
	// drop every hold on it.
	sendMu   sync.Mutex
	mu       sync.Mutex
	broken   error // sticky: the session is over
	held     map[uint64]int
	sent     []uint64 // ids of uses sent and not answered yet, oldest first
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
	h := &holder{key: t.exporterKey(), c: c, tr: tr, token: m.Token, held: map[uint64]int{}}
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
	for {
		f, err := recvControl(h.c, "use-ack")
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
		h.mu.Lock()
		err = h.answered(ack)
		if err != nil {
			h.fail(err)
		}
		h.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// answered takes the answer to the oldest use sent. Called with h.mu held.
func (h *holder) answered(ack useAckMsg) error {
	if len(h.sent) == 0 || h.sent[0] != ack.RegID {
		return Errorf(EINVAL, "protocol: a use-ack for registration %d, which is not the use sent next", ack.RegID)
	}
	h.sent = h.sent[1:]
	if ack.Code == OK && ack.Flags&ackHeld != 0 {
		return nil
	}
	// Refused (the registration ended before this use, say), or not held
	// (registered without Hold): nothing is held for it here.
	h.letGoHere(ack.RegID)
	if ack.Code != OK {
		confirms.countFailed()
	}
	return nil
}

// letGoHere forgets one use of id held on h. Called with h.mu held.
func (h *holder) letGoHere(id uint64) bool {
	if h.held[id] == 0 {
		return false
	}
	if h.held[id]--; h.held[id] == 0 {
		delete(h.held, id)
	}
	return true
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

// use spends one use of t on h, held until Release: one message, whose
// answer the reader takes (no round trip). broken says that the session is
// over (then nothing was sent: try another).
func (h *holder) use(t *Ticket) (broken bool, err error) {
	digest, err := t.Digest()
	if err != nil {
		return false, err
	}
	tr := h.tr.forUse(t.RegID, digest)
	msg := useMsg{RegID: t.RegID, Proof: tr.proof(t.Secret, roleReceiver)}.encode()
	h.sendMu.Lock() // no release goes out before this use: they follow it
	defer h.sendMu.Unlock()
	h.mu.Lock()
	if h.broken != nil {
		defer h.mu.Unlock()
		return true, h.broken
	}
	// Recorded before the send: its answer may come before send returns.
	h.sent = append(h.sent, t.RegID)
	h.held[t.RegID]++ // until an answer says otherwise
	h.mu.Unlock()
	if err := h.c.send(msg, -1); err != nil {
		h.mu.Lock()
		defer h.mu.Unlock()
		h.fail(err)
		return true, h.broken
	}
	return false, nil
}

// useHeld spends one use of t, held if its registration holds: with one
// message on this process's holder session to its exporter, or, with none,
// by opening one with this use (then the answer is waited for). lives says
// whether the buffer lives on, as far as is known without waiting.
func useHeld(t *Ticket, timeout time.Duration) (lives bool, err error) {
	for h := holderFor(t); h != nil; h = holderFor(t) {
		if broken, err := h.use(t); !broken {
			return true, err
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
		ok := h.broken == nil && h.letGoHere(t.RegID)
		if ok {
			h.queueRelease(t.RegID)
		}
		h.mu.Unlock()
		if ok {
			return nil
		}
	}
	return Errorf(ENOENT, "release: this process holds no use of registration %d (never held, let go of already, or its exporter has gone, which let go of it)", t.RegID)
}

// letGo sends the exporter the release of one use of id held on h that
// this process never recorded (Stream.letGoUnread).
func (h *holder) letGo(id uint64) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.broken == nil {
		h.queueRelease(id)
	}
}

// queueRelease queues id for the session's goroutine to send. Called with
// h.mu held.
func (h *holder) queueRelease(id uint64) {
	h.queued = append(h.queued, id)
	if !h.flushing {
		h.flushing = true
		go h.flush()
	}
}

// flush sends the queued releases, up to maxReleaseBatch ids a message,
// until none is left.
func (h *holder) flush() {
	h.sendMu.Lock()
	defer h.sendMu.Unlock()
	h.mu.Lock()
	defer h.mu.Unlock()
	for len(h.queued) > 0 && h.broken == nil {
		n := min(len(h.queued), maxReleaseBatch)
		msg := releaseMsg{RegIDs: h.queued[:n]}.encode()
		h.queued = h.queued[n:]
		h.mu.Unlock()
		err := h.c.send(msg, -1)
		h.mu.Lock()
		if err != nil {
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
