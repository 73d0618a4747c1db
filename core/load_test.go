package core

import (
	"fmt"
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
	// All 64 uses consumed: the registration ends (right after the last
	// receiver has its answer) and closes its memfd.
	waitUntil(5*time.Second, func() bool { return sender.live() == 0 })
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
	if peak == 0 { // samplePeak skips counts it cannot read: a bound of nothing checks nothing
		t.Fatalf("the sender's descriptors (process %d) were never counted while the receivers ran", sender.pid)
	}
	return took, peak
}

// receiversAtALimit: n receivers import at once (receiversAtOnce) an
// unlimited registration of chunks from a sender process whose
// RLIMIT_NOFILE is nofile. The sender's descriptors stay within bound(base,
// inherited) at their peak (base: what it holds idle; inherited: those
// numbered nofile or more, open since before its limit was set, which the
// limit does not count), and afterwards both sides hold what they held
// before, the sender its one registration, and nothing stays mapped.
func receiversAtALimit(t *testing.T, nofile, n, chunks int, seed byte, bound func(base, inherited int) int) {
	t.Helper()
	sender := startHelper(t, partSender, helperOpts{env: []string{fmt.Sprintf("%s=%d", envNoFile, nofile)}})
	senderFDs := fdsOf(sender.pid())
	tk := sender.register(chunks, 4096, 0, -1, seed)
	base := senderFDs.settled(t)
	inherited := senderFDs.numberedFrom(t, nofile)
	most := bound(base, inherited)
	fdsBefore := ourFDs().settled(t)

	took, peak := receiversAtOnce(t, senderFDs, tk, n, ImportOptions{OpenOptions: OpenOptions{Timeout: time.Minute}, NoCache: true}, seed)
	if peak > most {
		t.Fatalf("the sender held %d descriptors at its peak, bound %d (its limit is %d; %d idle, %d inherited numbered above it)", peak, most, nofile, base, inherited)
	}
	what := fmt.Sprintf("after %d receivers", n)
	senderFDs.waitFor(t, base, "the sender, "+what)
	if live := sender.live(); live != 1 {
		t.Fatalf("the sender holds %d registrations, want its 1", live)
	}
	ourFDs().waitFor(t, fdsBefore, what)
	expectNoMemfdMappings(t, what)
	t.Logf("%d receivers in %v; the sender peaked at %d descriptors (%d idle, %d inherited above its limit %d, bound %d)", n, took, peak, base, inherited, nofile, most)
}
