package core

import (
	"bytes"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Host files a peer can use against us (issue 27): huge pages, seals a
// receiver adds, descriptors that refuse a read-write mapping. Each is
// refused where it is registered and again where a receiver maps it, since
// a sender with its own export_fn never passes the registration's checks.
// The attacks that kill a receiver run in a receiver process of their own
// (hugepages_test.go).

// sendAnyway registers fd's bytes [0, size) as one host chunk whose
// exporter sends a duplicate of fd unchecked, as a hostile or careless
// sender's export_fn does (vmmipc_register): the receiver alone must refuse
// what it cannot map safely.
func sendAnyway(t testing.TB, s *Server, fd int, size uint64) *Ticket {
	t.Helper()
	spec := BufferSpec{Sizes: []uint64{size}, Kind: MemoryHost, Exporter: &testExporter{
		export: func(uint64) (int, uint64, error) {
			d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
			return d, 0, err
		},
	}}
	tk, err := s.Register(spec, RegisterOptions{Uses: 0})
	if err != nil {
		t.Fatal(err)
	}
	return tk
}

// memfdSealed is a memfd of size bytes holding pattern(seed), with seals
// (at least F_SEAL_SHRINK) added; the test closes it.
func memfdSealed(t testing.TB, size int, seed byte, seals int) int {
	t.Helper()
	fd := newMemfd(t, size, pattern(size, seed))
	t.Cleanup(func() { unix.Close(fd) })
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		t.Fatalf("adding seals %#x: %v", seals, err)
	}
	return fd
}

// reopened opens the file of fd anew with flags (through /proc, as anyone
// holding fd can); the test closes it.
func reopened(t testing.TB, fd, flags int) int {
	t.Helper()
	r, err := unix.Open("/proc/self/fd/"+strconv.Itoa(fd), flags|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(r) })
	return r
}

// hugeMemfd is a memfd of huge pages (MFD_HUGETLB) of size bytes sealed
// against shrinking, as receivers once accepted; the test closes it. It
// skips the test where the kernel has no hugetlbfs.
func hugeMemfd(t testing.TB, size int64) int {
	t.Helper()
	fd, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_HUGETLB)
	if err != nil {
		t.Skipf("memfd_create(MFD_HUGETLB): %v (no hugetlbfs in this kernel)", err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		t.Fatal(err)
	}
	return fd
}

func getSeals(t testing.TB, fd int) int {
	t.Helper()
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		t.Fatal(err)
	}
	return seals
}

// TestHostFilesRefusedBothWays: files that a receiver cannot map safely, or
// at all, are refused with EINVAL saying why, by the registration (which
// leaves the file as it was and keeps no descriptor) and by a receiver that
// gets one anyway (which maps nothing and keeps no descriptor). Before,
// huge pages were accepted by both, and the others were accepted by the
// registration and failed the receiver's mmap as VMMIPC_EIO "mmap:
// permission denied" / "operation not permitted".
func TestHostFilesRefusedBothWays(t *testing.T) {
	const size = 4 * 4096
	good := memfdSealed(t, size, 31, unix.F_SEAL_SHRINK)
	s := newTestServer(t)
	for _, tc := range []struct {
		name string
		fd   func() int
		says string
	}{
		{"a memfd of huge pages", func() int { return hugeMemfd(t, 2<<20) }, "hugetlbfs"},
		{"a read-only descriptor", func() int { return reopened(t, good, unix.O_RDONLY) }, "open read-only (O_RDONLY)"},
		{"a write-only descriptor", func() int { return reopened(t, good, unix.O_WRONLY) }, "open write-only (O_WRONLY)"},
		{"an O_PATH descriptor", func() int { return reopened(t, good, unix.O_PATH) }, "opened with O_PATH"},
		{"a memfd sealed with F_SEAL_WRITE", func() int {
			return memfdSealed(t, size, 32, unix.F_SEAL_SHRINK|unix.F_SEAL_WRITE)
		}, "sealed against writing"},
		{"a memfd sealed with F_SEAL_FUTURE_WRITE", func() int {
			return memfdSealed(t, size, 33, unix.F_SEAL_SHRINK|unix.F_SEAL_FUTURE_WRITE)
		}, "sealed against writing"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fd := tc.fd()
			fdsBefore := ourFDs().settled(t)
			var sealsBefore int
			if tc.name != "an O_PATH descriptor" { // fcntl F_GET_SEALS refuses O_PATH
				sealsBefore = getSeals(t, fd)
			}
			if _, err := HostFile(fd, size, 4096); CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) {
				t.Errorf("registering it: %v, want EINVAL saying %q", err, tc.says)
			}
			if tc.name != "an O_PATH descriptor" && getSeals(t, fd) != sealsBefore {
				t.Errorf("a refused registration changed the seals from %#x to %#x", sealsBefore, getSeals(t, fd))
			}
			ourFDs().waitFor(t, fdsBefore, "after the refused registration")

			tk := sendAnyway(t, s, fd, size)
			_, err := Import(tk, DeviceHost, ImportOptions{NoCache: true}, nil)
			if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) ||
				!strings.Contains(err.Error(), "refusing to map the sender's descriptor") {
				t.Errorf("importing it: %v, want EINVAL refusing to map it, saying %q", err, tc.says)
			}
			expectNoMemfdMappings(t, "after the refused import")
			ourFDs().waitFor(t, fdsBefore, "after the refused import (the registration's exporter holds none)")
		})
	}
}

// TestRegisteringSealsTheFile: a registration adds F_SEAL_SEAL to a memfd
// that lacks it, so that no receiver can seal it; a memfd sealed already
// registers as before; a refused memfd stays sealable.
func TestRegisteringSealsTheFile(t *testing.T) {
	s := newTestServer(t)
	fd := memfdSealed(t, 4096, 1, unix.F_SEAL_GROW) // with F_SEAL_SHRINK from newMemfd
	registerFile(t, s, fd, 4096, 4096, RegisterOptions{})
	if got, want := getSeals(t, fd), unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL; got != want {
		t.Errorf("after registering, seals %#x, want %#x (F_SEAL_SEAL added, nothing else)", got, want)
	}
	sealed := memfdSealed(t, 4096, 1, unix.F_SEAL_SEAL)
	registerFile(t, s, sealed, 4096, 4096, RegisterOptions{})
	registerFile(t, s, sealed, 4096, 4096, RegisterOptions{}) // again: already sealed

	unsealed, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	if err := unix.Ftruncate(unsealed, 4096); err != nil {
		t.Fatal(err)
	}
	if _, err := HostFile(unsealed, 4096, 4096); CodeOf(err) != EINVAL {
		t.Fatalf("an unsealed memfd: %v, want EINVAL", err)
	}
	if seals := getSeals(t, unsealed); seals != 0 {
		t.Fatalf("a refused memfd got seals %#x", seals)
	}
	if _, err := unix.FcntlInt(uintptr(unsealed), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		t.Fatalf("a refused memfd can no longer be sealed against shrinking: %v", err)
	}
	registerFile(t, s, unsealed, 4096, 4096, RegisterOptions{})
}

// TestReceiverCannotSealTheFile: a receiver holds a read-write descriptor
// of a registered memfd (any receiver of the low-level stream does, and
// keeps it as long as it likes). Before, it could add F_SEAL_FUTURE_WRITE
// (or, once no writable mapping was left, F_SEAL_WRITE) and F_SEAL_SEAL,
// after which every later receiver was refused ("mmap: operation not
// permitted"). Now the registration sealed the file with F_SEAL_SEAL: every
// seal is refused (EPERM), and later receivers map and read it.
func TestReceiverCannotSealTheFile(t *testing.T) {
	const size = 4 * 4096
	s := newTestServer(t)
	fd := newMemfd(t, size, pattern(size, 41))
	tk := registerFile(t, s, fd, size, 4096, RegisterOptions{Uses: 0})
	unix.Close(fd) // the owner is gone: no writable mapping is left anywhere
	st, err := Open(tk, OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c, err := st.Next()
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(c.FD)
	st.Close()
	for _, seal := range []struct {
		name string
		bits int
	}{
		{"F_SEAL_FUTURE_WRITE|F_SEAL_SEAL", unix.F_SEAL_FUTURE_WRITE | unix.F_SEAL_SEAL},
		{"F_SEAL_WRITE", unix.F_SEAL_WRITE},
		{"F_SEAL_FUTURE_WRITE", unix.F_SEAL_FUTURE_WRITE},
		{"F_SEAL_GROW", unix.F_SEAL_GROW},
		{"F_SEAL_SEAL", unix.F_SEAL_SEAL},
	} {
		if _, err := unix.FcntlInt(uintptr(c.FD), unix.F_ADD_SEALS, seal.bits); !errors.Is(err, unix.EPERM) {
			t.Errorf("a receiver adding %s to the registered memfd: %v, want EPERM", seal.name, err)
		}
	}
	for i := range 2 {
		if err := importVerified(tk, ImportOptions{NoCache: true}, 41); err != nil {
			t.Fatalf("receiver %d after the sealing attempts: %v", i+2, err)
		}
	}
}

// TestHolePunchedReadsZeros: F_SEAL_SHRINK does not stop its holder from
// punching a hole (fallocate FALLOC_FL_PUNCH_HOLE). In a memfd (tmpfs) that
// is no SIGBUS risk, unlike hugetlbfs: the hole reads back as zeros through
// a receiver's existing mapping, the rest is intact, and a write into the
// hole reaches the file (memfd.go says so).
func TestHolePunchedReadsZeros(t *testing.T) {
	const size = 8 * 4096
	s := newTestServer(t)
	fd := newMemfd(t, size, pattern(size, 42))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, size, 4096, RegisterOptions{})
	r := importHost(t, tk, ImportOptions{NoCache: true})
	defer Unmap(r.ID, r.Base)
	m := bytesAt(r.Base, r.Size)
	_ = m[3*4096] // fault the pages in before the hole is punched
	if err := unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 2*4096, 3*4096); err != nil {
		t.Fatalf("punching a hole in a memfd sealed against shrinking: %v", err)
	}
	want := pattern(size, 42)
	clear(want[2*4096 : 5*4096])
	if !bytes.Equal(m, want) {
		t.Fatal("after the hole punch the mapping is not the pattern with zeros in the hole")
	}
	copy(m[3*4096:], "written into the hole")
	got := make([]byte, 21)
	if _, err := unix.Pread(fd, got, 3*4096); err != nil || string(got) != "written into the hole" {
		t.Fatalf("the file after a write into the hole through the mapping: %q, %v", got, err)
	}
}

// TestAFailedRegistrationAddsNoSeal: F_SEAL_SEAL is RegisterHostFile's
// last step, so a registration the registry refuses (here an option out
// of bounds, checked after the file) leaves the file's seals as they were,
// closes its duplicate and runs no release callback. On 860d711 HostFile
// sealed the file first.
func TestAFailedRegistrationAddsNoSeal(t *testing.T) {
	s := newTestServer(t)
	fd := memfdSealed(t, 4096, 1, 0) // F_SEAL_SHRINK only
	fdsBefore := ourFDs().settled(t)
	released := 0
	_, err := s.RegisterHostFile(fd, 4096, 4096, RegisterOptions{TTL: MaxTTL + 1, OnRelease: func() { released++ }})
	if CodeOf(err) != EINVAL {
		t.Fatalf("registering with a ttl out of bounds: %v, want EINVAL", err)
	}
	if got := getSeals(t, fd); got != unix.F_SEAL_SHRINK {
		t.Errorf("after the failed registration, seals %#x, want %#x (as they were)", got, unix.F_SEAL_SHRINK)
	}
	ourFDs().waitFor(t, fdsBefore, "after the failed registration (its duplicate closed)")
	if released != 0 {
		t.Errorf("the failed registration ran its release callback %d times", released)
	}
	registerFile(t, s, fd, 4096, 4096, RegisterOptions{}) // and it still registers, sealed
	if got := getSeals(t, fd); got != unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL {
		t.Errorf("after registering, seals %#x, want F_SEAL_SHRINK|F_SEAL_SEAL", got)
	}
}

// TestReleaseGate: a registration's release callback runs once after it
// was handed out, also when it ended before (a ttl shorter than the call),
// and never after it was withdrawn.
func TestReleaseGate(t *testing.T) {
	ran := make(chan struct{}, 4)
	run := func() { ran <- struct{}{} }
	g := &releaseGate{onRelease: run}
	g.grant()
	g.released()
	g.released() // the registry calls it once; twice would run it twice, as before
	if len(ran) != 2 {
		t.Fatalf("granted: ran %d times, want 2 (once per release)", len(ran))
	}
	<-ran
	<-ran
	g = &releaseGate{onRelease: run}
	g.released() // ended before it was handed out
	if len(ran) != 0 {
		t.Fatal("ran before the registration was handed out")
	}
	g.grant()
	select {
	case <-ran:
	case <-time.After(5 * time.Second):
		t.Fatal("a registration released before grant never ran its callback")
	}
	g = &releaseGate{onRelease: run}
	g.withdraw()
	g.released()
	time.Sleep(10 * time.Millisecond)
	if len(ran) != 0 {
		t.Fatal("a withdrawn registration ran its callback")
	}
}
