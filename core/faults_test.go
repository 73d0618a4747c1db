package core

import (
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

// recordingImporter is a HostImporter that can act when a chunk arrives (to
// kill a peer at a chosen chunk) and records what became of its
// reservation. After a failed import that record, and /proc/self/maps for
// the senders' memfds, tell whether the library undid everything; looking
// at the released address range instead would race with every later
// allocation of the process, which the kernel may place there.
type recordingImporter struct {
	HostImporter
	onMap    func(index uint64)
	reserved bool
	unmaps   int // Unmap calls
	unmapErr error
}

func (r *recordingImporter) Reserve(total uint64) (uint64, error) {
	base, err := r.HostImporter.Reserve(total)
	r.reserved = err == nil
	return base, err
}

func (r *recordingImporter) Map(c Chunk) error {
	if r.onMap != nil {
		r.onMap(c.Index)
	}
	return r.HostImporter.Map(c)
}

func (r *recordingImporter) Unmap() error {
	r.unmaps++
	r.unmapErr = r.HostImporter.Unmap()
	return r.unmapErr
}

// checkUndone fails unless the import reserved its range and then undid
// all of it, once, and no sender memfd is mapped any more.
func (r *recordingImporter) checkUndone(t testing.TB, what string) {
	t.Helper()
	switch {
	case !r.reserved:
		t.Fatalf("%s: the import never reserved its range", what)
	case r.unmaps != 1 || r.unmapErr != nil:
		t.Fatalf("%s: the reservation was undone %d times (error %v), want once", what, r.unmaps, r.unmapErr)
	case r.HostImporter.base != nil:
		t.Fatalf("%s: the importer still holds its reservation at %p", what, r.HostImporter.base)
	}
	expectNoMemfdMappings(t, what)
}

// TestSenderKilledMidStream kills the sender at a random chunk, 50 times:
// half the time while its exporter is stuck on chunk k (the kill lands
// inside an export), half the time from the receiver's side as chunk k is
// being mapped (the kill lands while chunks are in flight). The receiver
// must fail with EIO within promptly, and leave nothing behind: no
// descriptor, no reservation, no mapping of the sender's memory.
func TestSenderKilledMidStream(t *testing.T) {
	n := trials(50, 10)
	var slowest time.Duration
	defer func() { t.Logf("%d kills: the slowest receiver noticed after %v", n, slowest) }()
	flushCache(t)
	for trial := 0; trial < n; trial++ {
		k := randIndex(faultChunks)
		insideExport := trial%2 == 0
		fdsBefore := ourFDs().settled(t)
		sender := startHelper(t, partSender, helperOpts{})
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
			err error
			at  time.Time
		}
		res := make(chan result, 1)
		go func() {
			_, _, err := importNew(tk, imp, OpenOptions{Timeout: faultTimeout, Window: DefaultWindow}, false)
			res <- result{err, time.Now()}
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
			_ = imp.Unmap()
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
		ourFDs().waitFor(t, fdsBefore, "after the failed import")
		imp.checkUndone(t, "after the failed import")
		if trial == 0 {
			t.Logf("trial 0 (kill at chunk %d): %v", k, r.err)
		}
	}
}

// TestReceiverKilledMidStream kills the receiver at a random chunk, 50
// times, against one long-lived sender. Each registration allows one use:
// after the kill the sender's descriptor and goroutine counts must come
// back to where they were, and a retry must get the whole buffer, because a
// stream that did not finish gives its use back.
func TestReceiverKilledMidStream(t *testing.T) {
	n := trials(50, 10)
	sender := startHelper(t, partSender, helperOpts{})
	senderFDs := fdsOf(sender.pid())
	for trial := 0; trial < n; trial++ {
		// Chunks pulled before the kill: the exporter runs up to a window
		// ahead, and once it has sent every chunk the use is spent, so
		// "mid-stream" means before the last window.
		k := randIndex(faultChunks - DefaultWindow)
		seed := byte(trial + 1)
		tk := sender.register(faultChunks, faultChunkSize, 1, -1, seed)
		base := senderFDs.settled(t) // after register: its memfd duplicate is open
		baseG := sender.goroutines(1 << 30)

		recv := startHelper(t, partReceiver, helperOpts{env: []string{envTicket + "=" + ticketHex(t, tk), envStopAt + "=" + itoa(k)}})
		recv.expect("at ", faultTimeout)
		recv.kill()
		senderFDs.waitFor(t, base, "the sender, after its receiver was killed after "+itoa(k)+" chunks")
		if g := sender.goroutines(baseG); g > baseG {
			t.Fatalf("trial %d: the sender runs %d goroutines, %d before the receiver came", trial, g, baseG)
		}
		m, err := importRetry(tk)
		if err != nil {
			t.Fatalf("trial %d: retry after the receiver was killed at chunk %d: %v", trial, k, err)
		}
		if err := verifyAndUnmap(m, seed); err != nil {
			t.Fatalf("trial %d: retry: %v", trial, err)
		}
		// The retry used the only use: the registration is gone and its
		// memfd duplicate closed.
		if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT {
			t.Fatalf("trial %d: a third receiver got %v, want ENOENT", trial, err)
		}
		senderFDs.waitFor(t, base-1, "the sender, after the only use was spent")
	}
	if live := sender.live(); live != 0 {
		t.Fatalf("the sender still holds %d registrations", live)
	}
}

// importRetry imports a ticket, retrying briefly while the sender has not
// yet seen the killed receiver's connection close (its use is still
// claimed: ENOENT "being served now").
func importRetry(tk *Ticket) (Ref, error) {
	deadline := time.Now().Add(promptly)
	for {
		m, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: faultTimeout}}, nil)
		if err == nil || CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "being served now") || time.Now().After(deadline) {
			return m, err
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSenderStalls: the sender's exporter blocks forever at a random chunk.
// The receiver must give up after its timeout with EIO saying "timed out",
// not hang, and leave nothing behind: no descriptor, no reservation (odd
// trials import through a recordingImporter to see it), no entry in the
// library's table of mappings (even trials, through Import), no mapping of
// the sender's memory.
func TestSenderStalls(t *testing.T) {
	const timeout = 300 * time.Millisecond
	flushCache(t)
	sender := startHelper(t, partSender, helperOpts{})
	for trial := 0; trial < 4; trial++ {
		k := randIndex(faultChunks)
		tk := sender.register(faultChunks, faultChunkSize, 1, k, 9)
		fdsBefore := ourFDs().settled(t)
		entries := GetCacheInfo().Entries
		imp := &recordingImporter{}
		opts := OpenOptions{Timeout: timeout, Window: DefaultWindow}
		start := time.Now()
		var err error
		if trial%2 == 0 {
			_, err = Import(tk, DeviceHost, ImportOptions{OpenOptions: opts}, nil)
		} else {
			_, _, err = importNew(tk, imp, opts, false)
		}
		took := time.Since(start)
		if CodeOf(err) != EIO || !strings.Contains(err.Error(), "timed out") {
			t.Fatalf("stall at chunk %d: got %v, want EIO timed out", k, err)
		}
		if took < timeout || took > timeout+promptly {
			t.Fatalf("stall at chunk %d: gave up after %v with a timeout of %v", k, took, timeout)
		}
		ourFDs().waitFor(t, fdsBefore, "after the stalled import")
		if n := GetCacheInfo().Entries; n != entries {
			t.Fatalf("%d mappings in the library's table after a failed import, %d before", n, entries)
		}
		if trial%2 == 1 {
			imp.checkUndone(t, "after the stalled import")
		}
		expectNoMemfdMappings(t, "after the stalled import")
		if trial == 0 {
			t.Logf("stall at chunk %d: %v after %v", k, err, took)
		}
	}
}

// TestSenderSilentInHandshake: the ticket's socket belongs to the ticket's
// pid but the process there never answers the hello. Open must time out,
// saying that the exporter did not answer.
func TestSenderSilentInHandshake(t *testing.T) {
	const timeout = 300 * time.Millisecond
	addr := "@vmmipc-test-silent-" + itoa(randIndex(1<<30))
	l := startHelper(t, partImpostor, helperOpts{env: []string{envAddr + "=" + addr, envListenMode + "=silent"}})
	l.expect("listening", faultTimeout)
	tk := ticketOf(t, l.pid(), addr)
	fdsBefore := ourFDs().settled(t)
	start := time.Now()
	_, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: timeout}}, nil)
	if CodeOf(err) != EIO || !strings.Contains(err.Error(), "did not answer within "+timeout.String()) {
		t.Fatalf("got %v, want EIO: did not answer within %v", err, timeout)
	}
	if took := time.Since(start); took < timeout || took > timeout+promptly {
		t.Fatalf("gave up after %v with a timeout of %v", took, timeout)
	}
	ourFDs().waitFor(t, fdsBefore, "after the silent exporter")
	if conns, got := l.report(); conns != 1 || len(got) != headerSize+helloSize {
		t.Fatalf("the silent exporter saw %d connections and %d bytes, want 1 and a hello", conns, len(got))
	}
}

// ticketOf is sampleTicket naming the process pid at addr, with that
// process's real start time, so that only the checks after the liveness
// check decide.
func ticketOf(t testing.TB, pid int, addr string) *Ticket {
	t.Helper()
	tk := sampleTicket()
	st, err := processStartTime(pid)
	if err != nil {
		t.Fatal(err)
	}
	tk.Address, tk.Pid, tk.StartTime, tk.NS = addr, uint32(pid), st, selfNamespaces()
	return tk
}
