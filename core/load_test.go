package core

import (
	"sync"
	"testing"
	"time"
)

// TestLoad64Receivers: one sender process, one registration of 1024 chunks
// with 64 uses, 64 receivers at once (goroutines here, each with its own
// connection and importer). Every receiver gets every byte right, and the
// sender's descriptor count, sampled from /proc while they run, never
// exceeds 64 × (window + 1) + 16.
func TestLoad64Receivers(t *testing.T) {
	const (
		receivers = 64
		chunks    = 1024
		window    = DefaultWindow
	)
	sender := startHelper(t, roleSender, nil, nil, "")
	tk := sender.register(chunks, 4096, receivers, -1, 11)
	base := procFDs(t, sender.pid())
	bound := receivers*(window+1) + 16
	fdsBefore := settledFDs(t)

	stopSampling := samplePeakFDs(sender.pid())
	start := time.Now()
	errs := make(chan error, receivers)
	var wg sync.WaitGroup
	for r := 0; r < receivers; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m, err := ImportStream(tk, &HostImporter{}, -1, OpenOptions{Window: window, Timeout: time.Minute})
			if err != nil {
				errs <- err
				return
			}
			verr := verifyMapping(m, 11)
			if err := Unmap(m.ID, m.Base); err != nil && verr == nil {
				verr = err
			}
			errs <- verr
		}()
	}
	wg.Wait()
	took := time.Since(start)
	most := stopSampling()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if most > bound {
		t.Fatalf("the sender held %d descriptors at its peak, bound %d", most, bound)
	}
	if n := LiveMappings(); n != 0 {
		t.Fatalf("%d live mappings after every receiver unmapped", n)
	}
	// All 64 uses consumed: the registration ended and closed its memfd.
	if live := sender.live(); live != 0 {
		t.Fatalf("the sender still holds %d registrations", live)
	}
	if got := waitProcFDs(t, sender.pid(), base-1); got > base-1 {
		t.Fatalf("the sender holds %d descriptors after the load, want %d", got, base-1)
	}
	waitFDs(t, fdsBefore)
	t.Logf("%d receivers × %d chunks in %v; the sender peaked at %d descriptors (%d idle, bound %d)", receivers, chunks, took, most, base, bound)
}
