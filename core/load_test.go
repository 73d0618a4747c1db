package core

import (
	"sync"
	"testing"
	"time"
)

// TestLoad64Receivers: one sender process, one registration of 1024 chunks
// with 64 uses, 64 receivers at once (goroutines here, each with its own
// connection and importer, bypassing the import cache so that each one
// streams). Every receiver gets every byte right, and the sender's
// descriptor count, sampled from /proc while they run, never exceeds
// 64 × (window + 1) + 16.
func TestLoad64Receivers(t *testing.T) {
	const (
		receivers = 64
		chunks    = 1024
		window    = DefaultWindow
	)
	sender := startHelper(t, partSender, helperOpts{})
	senderFDs := fdsOf(sender.pid())
	tk := sender.register(chunks, 4096, receivers, -1, 11)
	base := senderFDs.settled(t)
	bound := receivers*(window+1) + 16
	fdsBefore := ourFDs().settled(t)
	entries := GetCacheInfo().Entries

	stopSampling := senderFDs.samplePeak()
	start := time.Now()
	errs := make(chan error, receivers)
	var wg sync.WaitGroup
	for r := 0; r < receivers; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m, err := Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Window: window, Timeout: time.Minute}, NoCache: true}, nil)
			if err != nil {
				errs <- err
				return
			}
			verr := verifyRef(m, 11)
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
	if n := GetCacheInfo().Entries; n != entries {
		t.Fatalf("%d mappings in the library's table after every receiver unmapped, %d before", n, entries)
	}
	// All 64 uses consumed: the registration ended and closed its memfd.
	if live := sender.live(); live != 0 {
		t.Fatalf("the sender still holds %d registrations", live)
	}
	senderFDs.waitFor(t, base-1, "the sender, after the load")
	ourFDs().waitFor(t, fdsBefore, "after the load")
	t.Logf("%d receivers × %d chunks in %v; the sender peaked at %d descriptors (%d idle, bound %d)", receivers, chunks, took, most, base, bound)
}
