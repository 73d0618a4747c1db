package core

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// setSoftNoFile sets this process's soft RLIMIT_NOFILE to n for the test's
// duration, or skips where the hard limit is lower.
func setSoftNoFile(t *testing.T, n uint64) {
	t.Helper()
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Max < n {
		t.Skipf("needs a hard RLIMIT_NOFILE of %d; it is %d", n, lim.Max)
	}
	saved := lim
	lim.Cur = n
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Setrlimit(unix.RLIMIT_NOFILE, &saved) })
}

// TestSenderLimitsAtLargeDescriptorLimits: what the header's "Limits of a
// sender" says of large soft limits. Up to 4096 the process's open
// descriptors are counted before a connection is admitted; above it they
// are not, and the cap alone, C = limit/4 clamped to 1024, keeps C
// connections (two descriptors each) to half the limit or less.
func TestSenderLimitsAtLargeDescriptorLimits(t *testing.T) {
	var poll []unix.PollFd
	for _, tc := range []struct {
		limit   uint64
		counted bool
		conns   int
	}{
		{4096, true, 1024},
		{4097, false, 1024},
		{8192, false, 1024},
	} {
		setSoftNoFile(t, tc.limit)
		if got := connLimit(); got != tc.conns {
			t.Errorf("soft limit %d: C = %d, want %d", tc.limit, got, tc.conns)
		}
		if got := connLimit(); uint64(2*got) > tc.limit/2 && !tc.counted {
			t.Errorf("soft limit %d: C = %d connections could take more than half the limit", tc.limit, got)
		}
		free, ok := fdsFree(&poll)
		if ok != tc.counted {
			t.Fatalf("soft limit %d: descriptors counted %v, want %v", tc.limit, ok, tc.counted)
		}
		if !ok {
			continue
		}
		ents, err := os.ReadDir("/proc/self/fd") // its own descriptor is gone again
		if err != nil {
			t.Fatal(err)
		}
		// Other goroutines of earlier tests may open or close one meanwhile.
		if want := int(tc.limit) - (len(ents) - 1); free < want-4 || free > want+4 {
			t.Errorf("soft limit %d: %d descriptors free, /proc/self/fd says about %d", tc.limit, free, want)
		}
	}
}
