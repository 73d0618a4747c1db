package core

import (
	"bufio"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

// The two ways these tests see what the library holds: descriptors in
// /proc/<pid>/fd, and its mappings of the tests' memfds in /proc/self/maps
// (from nothing kept by the import cache).

// fds counts the descriptors of one process, the entries of /proc/<pid>/fd:
// the one descriptor counter of these tests.
type fds struct{ pid int }

func ourFDs() fds       { return fds{os.Getpid()} }
func fdsOf(pid int) fds { return fds{pid} }

func (p fds) read() (int, error) {
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.pid))
	return len(ents), err
}

// numberedFrom counts the descriptors numbered n or more. RLIMIT_NOFILE
// bounds descriptor numbers, not how many are open: one inherited above
// the limit (a CI runner's pipe at 251, say) is open besides the limit's.
func (p fds) numberedFrom(t testing.TB, n int) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", p.pid))
	if err != nil {
		t.Fatal(err)
	}
	k := 0
	for _, e := range ents {
		if fd, err := strconv.Atoi(e.Name()); err == nil && fd >= n {
			k++
		}
	}
	return k
}

// now is the current count.
func (p fds) now(t testing.TB) int {
	t.Helper()
	n, err := p.read()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// settled is the count once it has not changed for 50 ms, so that a
// baseline does not include a descriptor that an earlier test's server
// goroutine is about to close. For this process it collects garbage first:
// a connection an earlier test dropped without closing is closed by its
// finalizer, and a server then closes its end.
func (p fds) settled(t testing.TB) int {
	t.Helper()
	if p.pid == os.Getpid() {
		runtime.GC()
	}
	n, since := p.now(t), time.Now()
	for deadline := since.Add(2 * time.Second); time.Since(since) < 50*time.Millisecond && time.Now().Before(deadline); {
		time.Sleep(2 * time.Millisecond)
		if m := p.now(t); m != n {
			n, since = m, time.Now()
		}
	}
	return n
}

// waitFor waits up to 3 s for the count to be exactly want (descriptors
// closed asynchronously, by a server goroutine or a peer, need a moment)
// and fails the test, saying what, if it is not.
func (p fds) waitFor(t testing.TB, want int, what string) {
	t.Helper()
	deadline := time.Now().Add(3 * time.Second)
	n := p.now(t)
	for pause := 100 * time.Microsecond; n != want && time.Now().Before(deadline); pause = min(2*pause, 5*time.Millisecond) {
		time.Sleep(pause)
		n = p.now(t)
	}
	if n != want {
		t.Fatalf("%s: process %d holds %d descriptors, want %d", what, p.pid, n, want)
	}
}

// samplePeak samples the count every 200 µs until the returned function
// is called, which returns the highest count seen. (It never calls t.Fatal:
// it runs off the test goroutine.)
func (p fds) samplePeak() (stop func() int) {
	done := make(chan struct{})
	peak := make(chan int)
	go func() {
		most := 0
		for {
			if n, err := p.read(); err == nil {
				most = max(most, n)
			}
			select {
			case <-done:
				peak <- most
				return
			case <-time.After(200 * time.Microsecond):
			}
		}
	}()
	return func() int {
		close(done)
		return <-peak
	}
}

// memfdMappings sums this process's mappings of test memfds in
// /proc/self/maps: the mappings the library imported (see testMemfdName).
// Adjacent chunks of one file merge into one line, so it reports bytes.
func memfdMappings(t testing.TB) (lines int, bytes uint64) {
	t.Helper()
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		if !strings.Contains(line, "/memfd:"+testMemfdName+" ") {
			continue
		}
		var lo, hi uint64
		if _, err := fmt.Sscanf(line, "%x-%x", &lo, &hi); err != nil {
			t.Fatalf("/proc/self/maps: %q: %v", line, err)
		}
		lines++
		bytes += hi - lo
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return lines, bytes
}

// expectNoMemfdMappings fails if any test memfd is still mapped here.
func expectNoMemfdMappings(t testing.TB, what string) {
	t.Helper()
	if n, b := memfdMappings(t); n != 0 {
		t.Fatalf("%s: %d mapping(s) of %d bytes of the senders' memfds are left in /proc/self/maps", what, n, b)
	}
}

// quietFDs readies a fuzz target that counts this process's descriptors
// around each input: nothing cached (the import cache's poller would dial
// its exporters), no use of an earlier test's table hit still being spent,
// and what earlier tests and targets left closing (a lease's connection
// whose server closed, say) closed: seen once, in CI, as one descriptor
// fewer after FuzzLeaseFile's first seed than before it.
func quietFDs(f *testing.F) {
	f.Helper()
	flushCache(f)
	confirmsAnswered(5 * time.Second)
	ourFDs().settled(f)
}

// flushCache undoes every unreferenced mapping of the import cache (which
// is per process, shared by all tests) and keeps its limit, so that a test
// that counts mappings starts from nothing kept by earlier tests.
func flushCache(t testing.TB) {
	t.Helper()
	limit := GetCacheInfo().LimitBytes
	if err := SetCacheLimit(0); err != nil {
		t.Fatal(err)
	}
	if err := SetCacheLimit(limit); err != nil {
		t.Fatal(err)
	}
}
