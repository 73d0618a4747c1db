package core

import (
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

	took, most := receiversAtOnce(t, senderFDs, tk, receivers, ImportOptions{OpenOptions: OpenOptions{Window: window, Timeout: time.Minute}, NoCache: true}, 11)
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

// receiversAtOnce imports tk in n goroutines released together, each its
// own receiver (importVerified), while sampling the sender's descriptors.
// It fails the test if any receiver failed, and returns how long they took
// and the most descriptors the sender held meanwhile.
func receiversAtOnce(t *testing.T, sender fds, tk *Ticket, n int, opts ImportOptions, seed byte) (took time.Duration, peak int) {
	t.Helper()
	stopSampling := sender.samplePeak()
	start := time.Now()
	failed, first := runAtOnce(n, func(int) error { return importVerified(tk, opts, seed) })
	took = time.Since(start)
	peak = stopSampling()
	if failed > 0 {
		t.Fatalf("%d of %d receivers failed; the first: %v", failed, n, first)
	}
	return took, peak
}
