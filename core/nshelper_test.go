package core

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"testing"
)

// Helpers for the tests across namespaces (namespace_test.go): an importer
// that reports what it got and what it kept, and what an impostor does at a
// socket path in a shared directory.

// helperImporter imports VMMIPC_TEST_TICKET VMMIPC_TEST_IMPORTS times (default
// once; the second one on is an import-cache hit while the buffer lives),
// checks the bytes against pattern(VMMIPC_TEST_SEED) and unmaps each, empties
// the import cache, and reports "import code=<status> took=<ms of the
// first> fds=<before>/<after> maps=<n> hits=<n> <message>": its descriptors
// before and after (settled), the test memfd's mappings left, cache hits.
func helperImporter(t *testing.T, out *lineWriter) error {
	tk, err := ticketFromEnv()
	if err != nil {
		return err
	}
	seed, err := strconv.Atoi(os.Getenv(envSeed))
	if err != nil {
		return err
	}
	times, _ := strconv.Atoi(os.Getenv(envImports))
	before := ourFDs().settled(t)
	var took time.Duration
	for i := range max(times, 1) {
		start := time.Now()
		var r Ref
		r, err = Import(tk, DeviceHost, ImportOptions{OpenOptions: OpenOptions{Timeout: faultTimeout}}, nil)
		if i == 0 {
			took = time.Since(start)
		}
		if err == nil {
			err = verifyAndUnmap(r, byte(seed))
		}
		if err != nil {
			break
		}
	}
	hits := GetCacheInfo().Hits
	flushCache(t)
	after := ourFDs().settled(t)
	maps, _ := memfdMappings(t)
	out.printf("import code=%d took=%d fds=%d/%d maps=%d hits=%d %v", CodeOf(err), took.Milliseconds(), before, after, maps, hits, err)
	return nil
}

// impostorListen listens at addr the way an impostor takes an address:
// an abstract name as it is; at a socket path (in a directory it may
// write, like a same-uid process in a shared socket directory), per
// VMMIPC_TEST_TAKE:
//
//	swap  renames the socket there (the exporter's, still listening) to
//	      <addr>.orig and listens in its place
//	lock  also takes the exporter's lock, free after it died
//	(else) removes whatever file is there (one left by a dead exporter)
func impostorListen(addr string) (net.Listener, error) {
	if strings.HasPrefix(addr, "@") {
		return net.Listen("unix", addr)
	}
	take := os.Getenv(envTake)
	if strings.Contains(take, "swap") {
		if err := os.Rename(addr, addr+".orig"); err != nil {
			return nil, err
		}
	} else if err := os.Remove(addr); err != nil && !os.IsNotExist(err) {
		return nil, err
	}
	if strings.Contains(take, "lock") {
		lock, _ := lockPathFor(addr)
		fd, err := unix.Open(lock, unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, err
		}
		lk := unix.Flock_t{Type: unix.F_WRLCK}
		if err := unix.FcntlFlock(uintptr(fd), unix.F_SETLK, &lk); err != nil {
			return nil, fmt.Errorf("taking %s: %w", lock, err)
		}
		// fd stays open: the lock lives as long as this process.
	}
	return net.Listen("unix", addr)
}

// restoreSwapped puts the swapped exporter socket back at addr.
func restoreSwapped(addr string) error {
	_ = os.Remove(addr)
	return os.Rename(addr+".orig", addr)
}

// relaySwapped relays uc to the exporter's swapped socket, bytes and
// descriptors both ways, until both directions end. It returns what the
// receiver sent and how many descriptors crossed.
func relaySwapped(uc *net.UnixConn, addr string) ([]byte, int) {
	sc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: addr + ".orig", Net: "unix"})
	if err != nil {
		return nil, 0
	}
	defer sc.Close()
	p := &recordingProxy{}
	var both sync.WaitGroup
	both.Add(2)
	go func() { defer both.Done(); p.relay(uc, sc, &p.toServer) }()
	go func() { defer both.Done(); p.relay(sc, uc, &p.toReceiver) }()
	both.Wait()
	return p.toServer, p.descriptors()
}
