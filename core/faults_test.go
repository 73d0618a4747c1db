package core

import (
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Faults with real processes on the host backend: a sender killed at a
// random chunk, a receiver killed at a random chunk, a sender that stalls.

const (
	faultChunks    = 256
	faultChunkSize = 4096
	// faultTimeout is long on purpose: a receiver must notice a dead
	// sender by the closed socket, well before any timeout.
	faultTimeout = 10 * time.Second
	promptly     = 2 * time.Second
)

// TestSenderKilledMidStream kills the sender at a random chunk, 50 times:
// half the time while its exporter is stuck on chunk k (the kill lands
// inside an export), half the time from the receiver's side as chunk k is
// being mapped (the kill lands while chunks are in flight). The receiver
// must fail with EIO within promptly, and leave nothing behind: no
// descriptor, no live mapping, nothing left in /proc/self/maps of its
// reserved range or of the sender's memory.
func TestSenderKilledMidStream(t *testing.T) {
	n := trials(50, 10)
	var slowest time.Duration
	defer func() { t.Logf("%d kills: the slowest receiver noticed after %v", n, slowest) }()
	for trial := 0; trial < n; trial++ {
		k := randIndex(faultChunks)
		insideExport := trial%2 == 0
		fdsBefore := settledFDs(t)
		sender := startHelper(t, roleSender, nil, nil, "")
		blockAt := -1
		if insideExport {
			blockAt = k
		}
		tk := sender.register(faultChunks, faultChunkSize, 1, blockAt, byte(trial))

		var killedAt time.Time
		kill := func() {
			killedAt = time.Now()
			if err := syscall.Kill(sender.pid(), syscall.SIGKILL); err != nil {
				t.Errorf("kill: %v", err)
			}
		}
		imp := &recordingImporter{}
		if !insideExport {
			imp.onMap = func(i uint64) {
				if i == uint64(k) {
					kill()
				}
			}
		}
		type result struct {
			m   *Mapping
			err error
			at  time.Time
		}
		res := make(chan result, 1)
		go func() {
			m, err := ImportStream(tk, imp, -1, OpenOptions{Timeout: faultTimeout})
			res <- result{m, err, time.Now()}
		}()
		if insideExport {
			sender.expect("blocked ", faultTimeout)
			kill()
		}
		var r result
		select {
		case r = <-res:
		case <-time.After(2 * faultTimeout):
			t.Fatalf("trial %d: the receiver still waits %v after the sender died at chunk %d", trial, 2*faultTimeout, k)
		}
		sender.kill()
		if r.err == nil {
			_ = Unmap(r.m.ID, r.m.Base)
			t.Fatalf("trial %d: import succeeded although the sender was killed at chunk %d", trial, k)
		}
		if CodeOf(r.err) != EIO {
			t.Fatalf("trial %d (kill at chunk %d): got %v, want EIO: %v", trial, k, CodeOf(r.err), r.err)
		}
		d := r.at.Sub(killedAt)
		if d > promptly {
			t.Fatalf("trial %d: the receiver took %v to notice the dead sender (timeout %v)", trial, d, faultTimeout)
		}
		slowest = max(slowest, d)
		waitFDs(t, fdsBefore)
		if n := LiveMappings(); n != 0 {
			t.Fatalf("trial %d: %d live mappings after a failed import", trial, n)
		}
		checkRangeUnmapped(t, imp.base, imp.size)
		if trial == 0 {
			t.Logf("trial 0 (kill at chunk %d): %v", k, r.err)
		}
	}
}

// TestReceiverKilledMidStream kills the receiver at a random chunk, 50
// times, against one long-lived sender. Each registration allows one use:
// after the kill the sender's descriptor and goroutine counts must come
// back to where they were, and a retry must get the whole buffer, because a stream that did not
// finish gives its use back.
func TestReceiverKilledMidStream(t *testing.T) {
	n := trials(50, 10)
	sender := startHelper(t, roleSender, nil, nil, "")
	for trial := 0; trial < n; trial++ {
		// Chunks pulled before the kill: the exporter runs up to a window
		// ahead, and once it has sent every chunk the use is spent, so
		// "mid-stream" means before the last window.
		k := randIndex(faultChunks - DefaultWindow)
		seed := byte(trial + 1)
		tk := sender.register(faultChunks, faultChunkSize, 1, -1, seed)
		base := procFDs(t, sender.pid()) // after register: its memfd is open
		baseG := sender.goroutines(1 << 30)

		recv := startHelper(t, roleReceiver, []string{"VMMIPC_TEST_TICKET=" + ticketHex(t, tk), "VMMIPC_TEST_STOP_AT=" + itoa(k)}, nil, "")
		recv.expect("at ", faultTimeout)
		recv.kill()
		if got := waitProcFDs(t, sender.pid(), base); got > base {
			t.Fatalf("trial %d (receiver killed after %d chunks): the sender holds %d descriptors, %d before", trial, k, got, base)
		}

		if g := sender.goroutines(baseG); g > baseG {
			t.Fatalf("trial %d: the sender runs %d goroutines, %d before the receiver came", trial, g, baseG)
		}
		m, err := importRetry(tk)
		if err != nil {
			t.Fatalf("trial %d: retry after the receiver was killed at chunk %d: %v", trial, k, err)
		}
		verr := verifyMapping(m, seed)
		if err := Unmap(m.ID, m.Base); err != nil {
			t.Fatal(err)
		}
		if verr != nil {
			t.Fatalf("trial %d: retry: %v", trial, verr)
		}
		// The retry used the only use: the registration is gone and its
		// memfd closed.
		if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT {
			t.Fatalf("trial %d: a third receiver got %v, want ENOENT", trial, err)
		}
		if got := waitProcFDs(t, sender.pid(), base-1); got > base-1 {
			t.Fatalf("trial %d: after the retry the sender holds %d descriptors, want %d", trial, got, base-1)
		}
	}
	if live := sender.live(); live != 0 {
		t.Fatalf("the sender still holds %d registrations", live)
	}
}

// importRetry imports a ticket, retrying briefly while the sender has not
// yet seen the killed receiver's connection close (its use is still
// claimed: ENOENT "streaming now").
func importRetry(tk *Ticket) (*Mapping, error) {
	deadline := time.Now().Add(promptly)
	for {
		m, err := ImportStream(tk, &HostImporter{}, -1, OpenOptions{Timeout: faultTimeout})
		if err == nil || CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "streaming now") || time.Now().After(deadline) {
			return m, err
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSenderStalls: the sender's exporter blocks forever at a random chunk.
// The receiver must give up after its timeout with EIO saying "timed out",
// not hang, and leave nothing behind.
func TestSenderStalls(t *testing.T) {
	const timeout = 300 * time.Millisecond
	sender := startHelper(t, roleSender, nil, nil, "")
	for trial := 0; trial < 3; trial++ {
		k := randIndex(faultChunks)
		tk := sender.register(faultChunks, faultChunkSize, 1, k, 9)
		fdsBefore := settledFDs(t)
		imp := &recordingImporter{}
		start := time.Now()
		_, err := ImportStream(tk, imp, -1, OpenOptions{Timeout: timeout})
		took := time.Since(start)
		if CodeOf(err) != EIO || !strings.Contains(err.Error(), "timed out") {
			t.Fatalf("stall at chunk %d: got %v, want EIO timed out", k, err)
		}
		if took < timeout || took > timeout+promptly {
			t.Fatalf("stall at chunk %d: gave up after %v with a timeout of %v", k, took, timeout)
		}
		waitFDs(t, fdsBefore)
		if n := LiveMappings(); n != 0 {
			t.Fatalf("%d live mappings after a failed import", n)
		}
		checkRangeUnmapped(t, imp.base, imp.size)
		if trial == 0 {
			t.Logf("stall at chunk %d: %v after %v", k, err, took)
		}
	}
}

// TestSenderSilentInHandshake: the ticket's socket belongs to the ticket's
// pid but the process there never answers the hello. Open must time out.
func TestSenderSilentInHandshake(t *testing.T) {
	const timeout = 300 * time.Millisecond
	addr := "@vmmipc-test-silent-" + itoa(randIndex(1<<30))
	l := startHelper(t, roleListener, []string{"VMMIPC_TEST_ADDR=" + addr, "VMMIPC_TEST_LISTEN_MODE=silent"}, nil, "")
	l.expect("listening", faultTimeout)
	tk := sampleTicket()
	tk.Address, tk.Pid = addr, uint32(l.pid())
	fdsBefore := settledFDs(t)
	start := time.Now()
	_, err := ImportStream(tk, &HostImporter{}, -1, OpenOptions{Timeout: timeout})
	if CodeOf(err) != EIO || !strings.Contains(err.Error(), "timed out") {
		t.Fatalf("got %v, want EIO timed out", err)
	}
	if took := time.Since(start); took > timeout+promptly {
		t.Fatalf("gave up after %v with a timeout of %v", took, timeout)
	}
	waitFDs(t, fdsBefore)
}

func itoa(i int) string { return strconv.Itoa(i) }
