package core

import (
	"crypto/rand"
	"sync"
	"time"
)

// Holds: the server's half of "memory a receiver holds is never handed out
// again" (the receiver's half is holder.go).
//
// torch.multiprocessing promises that a tensor a receiver rebuilt stays
// valid while the receiver holds it, whatever the sender does with its own
// copy: the sender's allocator must not hand the memory out again until
// every receiver has let go. A registration made with RegisterOptions.Hold
// keeps that promise. Each use spent by a receiver that asked to hold
// (ImportOptions.Hold) is a *hold*, and the registration's release (its
// OnRelease, where the owner drops what it kept alive for receivers) waits
// until every hold is let go (registration.go release/unhold).
//
// Holds live on a *holder session*: one connection per receiver process and
// exporter. A receiver's first use of an exporter (a stream, or the
// confirmation of a cached mapping) sends helloHolder, and after the
// done-ack its connection stays open as that session, named by a random
// token (holding). On it the receiver spends further uses (use → use-ack:
// one round trip, no handshake) and lets go of holds in batches (release).
// A stream on a connection of its own names the session first (hold-for),
// and its use is held there. When the session's connection closes — the
// receiver hung up, or its process died, SIGKILL included, and the kernel
// closed it — every hold on it is let go. A session lets go only of its own
// holds: no receiver can release what another holds, and a use must be
// proved with the used registration's own secret, bound to the session's
// handshake (wire_holds.go).
type holderSession struct {
	token  holderToken
	hangUp func() // closes the connection (Server.Close); set before it is published

	mu     sync.Mutex
	held   map[uint64]*heldUse // by registration id
	closed bool
}

type heldUse struct {
	g *registration
	n int // uses of g held on this session
}

// newHolder makes a holder session with a fresh token and publishes it;
// hangUp closes its connection.
func (r *Registry) newHolder(hangUp func()) (*holderSession, error) {
	h := &holderSession{held: map[uint64]*heldUse{}, hangUp: hangUp}
	if _, err := rand.Read(h.token[:]); err != nil {
		return nil, WrapErr(EINTERNAL, err, "holder session token")
	}
	r.mu.Lock()
	r.holders[h.token] = h
	r.mu.Unlock()
	return h, nil
}

// holder is the live holder session named by token.
func (r *Registry) holder(token holderToken) (*holderSession, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if h := r.holders[token]; h != nil {
		return h, nil
	}
	return nil, Errorf(ENOENT, "hold-for: no holder session with that token lives here: it has closed (its connection ended); open a new one")
}

// closeHolder lets go of every hold of h and forgets it.
func (r *Registry) closeHolder(h *holderSession) {
	r.mu.Lock()
	delete(r.holders, h.token)
	r.mu.Unlock()
	h.mu.Lock()
	h.closed = true
	held := h.held
	h.held = nil
	h.mu.Unlock()
	for _, u := range held {
		for ; u.n > 0; u.n-- {
			u.g.unhold()
		}
	}
}

// hangUpHolders closes every holder session's connection, as the
// exporter's exit would: each session then lets go of what it holds, and
// its receiver closes its end.
func (r *Registry) hangUpHolders() {
	r.mu.Lock()
	hs := make([]*holderSession, 0, len(r.holders))
	for _, h := range r.holders {
		hs = append(hs, h)
	}
	r.mu.Unlock()
	for _, h := range hs {
		h.hangUp()
	}
}

func (r *Registry) holdsChanged(d int64) {
	r.mu.Lock()
	r.holds += d
	r.mu.Unlock()
}

// Holds counts the uses receivers hold now, over every registration.
func (r *Registry) Holds() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.holds
}

// take holds one use of g on h, unless h has closed (its receiver is
// gone: nothing to hold for).
func (h *holderSession) take(g *registration) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return false
	}
	u := h.held[g.id]
	if u == nil {
		u = &heldUse{g: g}
		h.held[g.id] = u
	}
	u.n++
	g.hold()
	return true
}

// letGo lets go of one use of registration id held on h; false if h holds
// none.
func (h *holderSession) letGo(id uint64) bool {
	h.mu.Lock()
	u := h.held[id]
	if u == nil {
		h.mu.Unlock()
		return false
	}
	if u.n--; u.n == 0 {
		delete(h.held, id)
	}
	h.mu.Unlock()
	u.g.unhold()
	return true
}

// holdLoop serves a holder session until its receiver hangs up (or breaks
// the protocol), then lets go of everything held on it.
func (ss *session) holdLoop(h *holderSession) {
	defer ss.srv.reg.closeHolder(h)
	ss.c.deadline, ss.c.timeout = time.Time{}, 0 // a holder may be quiet for hours
	for {
		f, ok := ss.recv()
		if !ok {
			return
		}
		switch f.Type {
		case msgUse:
			m, err := parseUse(f.Body)
			if err != nil {
				ss.refuse(err)
				return
			}
			if !ss.sendUseAck(ss.useOnHolder(h, m)) {
				return
			}
		case msgRelease:
			m, err := parseRelease(f.Body)
			if err != nil {
				ss.refuse(err)
				return
			}
			for _, id := range m.RegIDs {
				h.letGo(id) // ids this session does not hold are ignored
			}
		default:
			ss.refuse(Errorf(EINVAL, "protocol: unexpected %s message on a holder session", msgName(f.Type)))
			return
		}
	}
}

func (ss *session) sendUseAck(m useAckMsg) bool {
	ss.c.timeout = idleTimeout // never block for ever on a receiver that does not read
	defer func() { ss.c.timeout = 0 }()
	return ss.c.send(m.encode(), -1) == nil
}

// useOnHolder spends one use of m's registration for h's receiver, holding
// it on h if the registration holds.
func (ss *session) useOnHolder(h *holderSession, m useMsg) useAckMsg {
	ack := useAckMsg{RegID: m.RegID}
	refuse := func(err error) useAckMsg {
		ack.Code, ack.Text = CodeOf(err), err.Error()
		if !ack.Code.IsError() {
			ack.Code = EINTERNAL
		}
		return ack
	}
	g, err := ss.srv.reg.lookup(m.RegID)
	if err != nil {
		return refuse(err)
	}
	tr := ss.tr
	tr.RegID, tr.Flags, tr.TicketDigest = g.id, useProofFlag, g.digest
	if !tr.verify(g.secret, roleReceiver, m.Proof) {
		return refuse(Errorf(EAUTH, "use of registration %d: the proof does not check out: the ticket is corrupted or forged", g.id))
	}
	cl, err := g.claim(func() {})
	if err != nil {
		return refuse(err)
	}
	held := g.holdable && h.take(g)
	usedUp := g.spend(cl)
	g.drop(cl)
	if usedUp {
		defer g.end(usedUpWhy(g)) // after the ack is built; its release may take a while
	}
	ack.Flags = ss.ackFlags(g, usedUp, held)
	return ack
}

// ackFlags are the done-ack flags of a use of g.
func (ss *session) ackFlags(g *registration, usedUp, held bool) uint64 {
	var flags uint64
	// Another receiver may have spent the last use meanwhile: ask whether
	// the registration still lives, not only whether we used it up.
	if (!usedUp && g.live()) || ss.srv.reg.bufferHasOthers(g) {
		flags |= ackBufferLives
	}
	if held {
		flags |= ackHeld
	}
	return flags
}

// Holds counts the uses receivers hold now on s's registrations.
func (s *Server) Holds() int64 { return s.reg.Holds() }

// DefaultHolds reports the holds on the default server's registrations
// without starting it.
func DefaultHolds() int64 {
	if s := StartedServer(); s != nil {
		return s.Holds()
	}
	return 0
}
