package core

import (
	"container/list"
	"net"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Admission: how many connections the server holds, and which wait.
//
//   - At most connLimit() connections are held at once (a quarter of the
//     host's soft RLIMIT_NOFILE, between minConns and maxConns), so that a
//     flood of receivers cannot take the host's descriptors; and no more
//     than the descriptors free allow: each connection takes a socket and,
//     while a chunk is sent, the chunk's descriptor, so one more is
//     admitted only while the process has two free for it and one for each
//     held (counted at each connection where the soft limit is at most
//     maxCountedLimit: at a soft limit of 16 the cap alone is more than the
//     process can hold; above, the cap is at most half). At the limit the
//     server stops accepting: the rest wait in the listen backlog and are
//     served in turn (receivers retry a full backlog themselves). An accept
//     that fails for want of a descriptor (another thread of the host took
//     it) leaves its connection in the backlog, and is retried with back-off.
//   - Connections that have not authenticated yet are "pending": at most
//     pendingLimit() of them, each with handshakeTimeout to prove itself.
//     When that bound (or the whole limit) is full, the oldest pending one,
//     if older than evictAge, is told "busy" and dropped to make room; a
//     libvmmipc receiver told so retries. So idle peers cannot lock out
//     receivers that authenticate, and an honest handshake, which takes
//     microseconds, is almost never evicted.
//   - Peers of a foreign uid are told why and dropped at once; at most
//     maxRefusing of those are being told at a time, the rest get no word.
var (
	handshakeTimeout = 2 * time.Second
	evictAge         = 100 * time.Millisecond
	idleTimeout      = 2 * time.Minute
	minConns         = 16
	maxConns         = 1024
	maxRefusing      = 64
	// How long the accept loop waits, doubling from the first to the
	// last, for a descriptor to free: nothing tells it when one does.
	fdWaitFirst = 5 * time.Millisecond
	fdWaitMost  = 200 * time.Millisecond
)

// connLimit is how many connections the server holds at once.
func connLimit() int {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return minConns
	}
	return int(max(uint64(minConns), min(uint64(maxConns), lim.Cur/4)))
}

// pendingLimit is how many unauthenticated connections may be held.
func pendingLimit(limit int) int { return max(4, limit/4) }

// maxCountedLimit is the largest soft RLIMIT_NOFILE at which the server
// counts the descriptors open before admitting a connection. Above it the
// cap alone keeps the server's connections (at most maxConns, two
// descriptors each) to half the limit or less, and a count would cost
// more (a poll entry per descriptor number).
const maxCountedLimit = 4096

// fdsFree is how many more descriptors the process may open now: its soft
// RLIMIT_NOFILE less those open. ok is false where it does not count (a
// soft limit above maxCountedLimit, or poll failed): then only connLimit
// bounds the server. It counts with one poll over every descriptor number
// below the limit (POLLNVAL marks those not open), so that it opens no
// descriptor itself: a host that counts its own (as tests do) never sees
// one come and go. poll is the buffer, kept between calls.
func fdsFree(poll *[]unix.PollFd) (free int, ok bool) {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil || lim.Cur > maxCountedLimit {
		return 0, false
	}
	n := int(lim.Cur)
	if cap(*poll) < n {
		*poll = make([]unix.PollFd, n)
	}
	fds := (*poll)[:n]
	for i := range fds {
		fds[i] = unix.PollFd{Fd: int32(i)}
	}
	for {
		_, err := unix.Poll(fds, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil { // EINVAL: the limit was lowered meanwhile
			return 0, false
		}
		break
	}
	open := 0
	for _, p := range fds {
		if p.Revents&unix.POLLNVAL == 0 {
			open++
		}
	}
	return n - open, true
}

// backoff is a wait that doubles from first to most, and starts over after
// reset.
type backoff struct {
	first, most, next time.Duration
}

func (b *backoff) wait() time.Duration {
	b.next = min(max(b.first, 2*b.next), b.most)
	return b.next
}

func (b *backoff) reset() { b.next = 0 }

type admission struct {
	mu       sync.Mutex
	cond     *sync.Cond
	held     int        // connections being served, pending or not
	leaving  int        // held connections evicted and closing
	pending  *list.List // of *pendingConn, oldest first
	refusing int
	closed   bool
	wake     *time.Timer // rouses room() when the oldest pending may be evicted, or to count descriptors again
	fdWait   backoff     // room()'s wait for descriptors to free
	free     func() (int, bool)
	poll     []unix.PollFd // fdsFree's buffer
}

// pendingConn is a held connection; elem is set while it is unauthenticated.
type pendingConn struct {
	uc      *net.UnixConn
	since   time.Time
	elem    *list.Element
	evicted bool
}

func newAdmission() *admission {
	a := &admission{pending: list.New(), fdWait: backoff{first: fdWaitFirst, most: fdWaitMost}}
	a.free = func() (int, bool) { return fdsFree(&a.poll) } // called with a.mu held
	a.cond = sync.NewCond(&a.mu)
	return a
}

// room blocks until another connection may be accepted, evicting the oldest
// pending connection when that makes room. It returns false once closed.
func (a *admission) room() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	for !a.closed {
		limit := connLimit()
		below := a.held-a.leaving < limit && a.pending.Len() < pendingLimit(limit)
		fds := below && a.descriptorsFree()
		if fds {
			a.fdWait.reset()
			return true
		}
		var wake time.Duration
		if below { // only descriptors are short: count again later
			wake = a.fdWait.wait()
		}
		if front := a.pending.Front(); front != nil {
			p := front.Value.(*pendingConn)
			if age := time.Since(p.since); age >= evictAge {
				a.evict(p)
				continue
			} else if wake == 0 || evictAge-age < wake {
				wake = evictAge - age
			}
		}
		if wake > 0 {
			a.wakeIn(wake)
		}
		a.cond.Wait()
	}
	return false
}

// descriptorsFree reports whether the process has descriptors free for one
// more connection (its socket and a chunk in hand) beside a chunk for each
// held one. Called with a.mu held.
func (a *admission) descriptorsFree() bool {
	free, ok := a.free()
	return !ok || free >= a.held+2
}

func (a *admission) wakeIn(d time.Duration) {
	if a.wake == nil {
		a.wake = time.AfterFunc(d, func() {
			a.mu.Lock()
			a.cond.Broadcast()
			a.mu.Unlock()
		})
		return
	}
	a.wake.Reset(d)
}

// evict drops a pending connection. Called with a.mu held. Shutting down
// its read side wakes the session serving it (wherever it waits for the
// peer), which then tells the peer "busy" and closes: the session alone
// writes to its socket, so nothing can cut that message off.
func (a *admission) evict(p *pendingConn) {
	p.evicted = true
	a.pending.Remove(p.elem)
	p.elem = nil
	a.leaving++
	_ = p.uc.CloseRead()
}

// wasEvicted reports whether p was evicted.
func (a *admission) wasEvicted(p *pendingConn) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return p.evicted
}

// admit counts a newly accepted connection as held and pending.
func (a *admission) admit(uc *net.UnixConn) *pendingConn {
	a.mu.Lock()
	defer a.mu.Unlock()
	p := &pendingConn{uc: uc, since: time.Now()}
	p.elem = a.pending.PushBack(p)
	a.held++
	return p
}

// authenticated takes p out of the pending set, unless it was evicted.
func (a *admission) authenticated(p *pendingConn) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if p.evicted {
		return false
	}
	a.pending.Remove(p.elem)
	p.elem = nil
	a.cond.Broadcast()
	return true
}

// done uncounts a connection whose session has ended.
func (a *admission) done(p *pendingConn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.held--
	if p.elem != nil {
		a.pending.Remove(p.elem)
		p.elem = nil
	}
	if p.evicted {
		a.leaving--
	}
	a.cond.Broadcast()
}

// takeRefusal counts a connection being refused, unless too many are.
func (a *admission) takeRefusal() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.refusing >= maxRefusing {
		return false
	}
	a.refusing++
	return true
}

func (a *admission) doneRefusal() {
	a.mu.Lock()
	a.refusing--
	a.mu.Unlock()
}

func (a *admission) close() {
	a.mu.Lock()
	a.closed = true
	if a.wake != nil {
		a.wake.Stop()
	}
	a.cond.Broadcast()
	a.mu.Unlock()
}
