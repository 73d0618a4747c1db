package core

import (
	"sync"
	"testing"
	"time"
)

// TestReceiversWaitAtATinyDescriptorLimit: a sender whose soft
// RLIMIT_NOFILE is 16 (its cap, at least minConns = 16 connections, is
// more than it can hold: each needs a socket and a chunk in hand) serves 40
// receivers that come at once. Every one of them gets every byte: those the
// sender cannot hold yet wait in the listen backlog, as the header
// promises, instead of being told "too many open files". Afterwards the
// sender holds the descriptors it held before.
func TestReceiversWaitAtATinyDescriptorLimit(t *testing.T) {
	flushCache(t)
	receiversAtALimit(t, 16, 40, 8, 14, func(_, inherited int) int { return 16 + inherited })
}

// TestRoomWaitsForDescriptors: while the process has fewer descriptors
// free than one more connection needs (here another thread of the host
// holds them, and no connection of ours will end to say when they come
// back), admission accepts nothing; it counts again, backing off, and
// admits as soon as two are free.
func TestRoomWaitsForDescriptors(t *testing.T) {
	a := newAdmission()
	defer a.close()
	var mu sync.Mutex
	free, counts := 1, 0
	a.free = func() (int, bool) {
		mu.Lock()
		defer mu.Unlock()
		counts++
		return free, true
	}
	got := roomWaits(t, a, 300*time.Millisecond, "a connection with one descriptor free")
	mu.Lock()
	free, n := 2, counts
	mu.Unlock()
	if n < 3 || n > 20 {
		t.Fatalf("counted the free descriptors %d times in 300 ms, want a few (backing off from %v to %v)", n, fdWaitFirst, fdWaitMost)
	}
	select {
	case ok := <-got:
		if !ok {
			t.Fatal("room() said closed")
		}
	case <-time.After(2 * fdWaitMost):
		t.Fatalf("room() did not admit within %v of two descriptors coming free", 2*fdWaitMost)
	}
	// One held connection (authenticated, so not evicted to make room)
	// needs one more for its chunk: two free are no longer enough.
	a.authenticated(a.admit(nil))
	got = roomWaits(t, a, 100*time.Millisecond, "a second connection with two descriptors free and one connection held")
	mu.Lock()
	free = 3
	mu.Unlock()
	if ok := <-got; !ok {
		t.Fatal("room() said closed")
	}
}

// roomWaits asks a.room() on a goroutine of its own and fails if it answers
// within wait (it admitted what); its answer comes on the channel returned.
func roomWaits(t *testing.T, a *admission, wait time.Duration, what string) <-chan bool {
	t.Helper()
	got := make(chan bool, 1)
	go func() { got <- a.room() }()
	select {
	case <-got:
		t.Fatalf("room() admitted %s", what)
	case <-time.After(wait):
	}
	return got
}
