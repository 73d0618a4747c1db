package core

import (
	"crypto/rand"
	"sync"
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
//
// This file has a holder session's holds (take, letGo, close); the
// registry keeps the sessions by token (registry.go), and
// session_holds.go serves a session's messages.
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

// newHolderSession makes a holder session with a fresh token (the
// registry publishes it: Registry.newHolder); hangUp closes its connection.
func newHolderSession(hangUp func()) (*holderSession, error) {
	h := &holderSession{held: map[uint64]*heldUse{}, hangUp: hangUp}
	if _, err := rand.Read(h.token[:]); err != nil {
		return nil, WrapErr(EINTERNAL, err, "holder session token")
	}
	return h, nil
}

// take holds one use of g on h, unless g does not hold
// (RegisterOptions.Hold unset), h has closed (its receiver is gone: nothing
// to hold for) or g has ended (registration.go hold).
func (h *holderSession) take(g *registration) bool {
	if !g.holdable {
		return false
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed || !g.hold() {
		return false
	}
	u := h.held[g.id]
	if u == nil {
		u = &heldUse{g: g}
		h.held[g.id] = u
	}
	u.n++
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

// close lets go of every hold on h; it takes none after (its session has
// ended).
func (h *holderSession) close() {
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
