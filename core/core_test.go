package core

import (
	"bytes"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// newMemfd makes a memfd of n bytes where byte i is pattern(i).
func newMemfd(t testing.TB, n int, seed byte) int {
	t.Helper()
	fd, err := unix.MemfdCreate("vmmipc-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, n)
	for i := range buf {
		buf[i] = byte(i/4096) ^ byte(i) ^ seed
	}
	if _, err := unix.Pwrite(fd, buf, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK); err != nil {
		t.Fatal(err)
	}
	return fd
}

// bytesAt views mapped memory at a raw address (test-only; the mapping is
// not Go memory, so the GC does not care).
func bytesAt(addr, n uint64) []byte {
	return unsafe.Slice((*byte)(*(*unsafe.Pointer)(unsafe.Pointer(&addr))), n)
}

func countFDs(t testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// waitFDs waits up to 2 s for the descriptor count to come back to want.
func waitFDs(t testing.TB, want int) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for countFDs(t) != want && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if got := countFDs(t); got != want {
		t.Fatalf("descriptors: %d open, want %d", got, want)
	}
}

func newTestServer(t testing.TB) *Server {
	s, err := NewServer("")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return s
}

func TestHostFileRoundTrip(t *testing.T) {
	s := newTestServer(t)
	const chunks = 4096
	size := chunks * int(pageSize)
	fd := newMemfd(t, size, 7)
	defer unix.Close(fd)
	var released atomic.Int32
	sizes, err := FileChunks(fd, uint64(size), pageSize)
	if err != nil {
		t.Fatal(err)
	}
	before := countFDs(t)
	tk, err := s.Register(sizes, &FileExporter{FD: fd, ChunkSize: pageSize, OnRelease: func() { released.Add(1) }}, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	if got := countFDs(t); got != before {
		t.Fatalf("register opened %d descriptors", got-before)
	}
	raw, _ := tk.Marshal()
	tk2, err := DecodeTicket(raw[:])
	if err != nil {
		t.Fatal(err)
	}
	m, err := ImportStream(tk2, &HostImporter{}, -1, OpenOptions{Window: 8})
	if err != nil {
		t.Fatal(err)
	}
	got := bytesAt(m.Base, m.Size)
	want := make([]byte, size)
	if _, err := unix.Pread(fd, want, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("imported bytes differ")
	}
	got[12345] ^= 0xff // shared: the sender's file sees the write
	var b [1]byte
	unix.Pread(fd, b[:], 12345)
	if b[0] != got[12345] {
		t.Fatal("write through the mapping not visible in the file")
	}
	if err := Unmap(m.ID, m.Base); err != nil {
		t.Fatal(err)
	}
	if err := Unmap(m.ID, m.Base); CodeOf(err) != EINVAL {
		t.Fatalf("second unmap: %v", err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for released.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if released.Load() != 1 {
		t.Fatalf("release ran %d times", released.Load())
	}
	// Used up: a second receiver is refused.
	if _, err := Open(tk2, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "used up") {
		t.Fatalf("second use: %v", err)
	}
}

func TestExportFailureNamesChunk(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 64*int(pageSize), 1)
	defer unix.Close(fd)
	sizes, _ := FileChunks(fd, 64*pageSize, pageSize)
	fe := &FileExporter{FD: fd, ChunkSize: pageSize}
	exp := &FuncExporter{Export: func(i uint64) (int, uint64, error) {
		if i == 17 {
			return -1, 0, Errorf(EEXPORT, "injected failure")
		}
		return fe.ExportChunk(i)
	}}
	tk, err := s.Register(sizes, exp, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	before := countFDs(t)
	_, err = ImportStream(tk, &HostImporter{}, -1, OpenOptions{})
	if CodeOf(err) != EEXPORT || !strings.Contains(err.Error(), "chunk 17 of 64") {
		t.Fatalf("got %v", err)
	}
	waitFDs(t, before) // the in-process server closes its end asynchronously
	// The failed stream gave its use back.
	time.Sleep(50 * time.Millisecond)
	st, err := Open(tk, OpenOptions{})
	if err != nil {
		t.Fatalf("use not given back: %v", err)
	}
	st.Close()
}

func TestWrongSecretAndUnregister(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), 1)
	defer unix.Close(fd)
	sizes, _ := FileChunks(fd, pageSize, pageSize)
	var released atomic.Int32
	tk, _ := s.Register(sizes, &FileExporter{FD: fd, ChunkSize: pageSize, OnRelease: func() { released.Add(1) }}, RegisterOptions{})
	bad := *tk
	bad.Secret[3] ^= 1
	if _, err := Open(&bad, OpenOptions{}); CodeOf(err) != EAUTH {
		t.Fatalf("wrong secret: %v", err)
	}
	if err := s.Unregister(tk); err != nil {
		t.Fatal(err)
	}
	if released.Load() != 1 {
		t.Fatal("release did not run on unregister")
	}
	if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "unregistered") {
		t.Fatalf("after unregister: %v", err)
	}
}

func TestTTLExpires(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, int(pageSize), 1)
	defer unix.Close(fd)
	sizes, _ := FileChunks(fd, pageSize, pageSize)
	released := make(chan struct{})
	tk, _ := s.Register(sizes, &FileExporter{FD: fd, ChunkSize: pageSize, OnRelease: func() { close(released) }}, RegisterOptions{TTL: 20 * time.Millisecond})
	select {
	case <-released:
	case <-time.After(5 * time.Second):
		t.Fatal("ttl did not release")
	}
	if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT || !strings.Contains(err.Error(), "expired") {
		t.Fatalf("after ttl: %v", err)
	}
}

// TestUseSpentWhenAllSent: a receiver that pulls every chunk and hangs up
// without saying done has still used the registration up; one that hangs up
// earlier gives its use back.
func TestUseSpentWhenAllSent(t *testing.T) {
	s := newTestServer(t)
	fd := newMemfd(t, 8*int(pageSize), 3)
	defer unix.Close(fd)
	sizes, _ := FileChunks(fd, 8*pageSize, pageSize)
	released := make(chan struct{})
	tk, err := s.Register(sizes, &FileExporter{FD: fd, ChunkSize: pageSize, OnRelease: func() { close(released) }}, RegisterOptions{Uses: 1})
	if err != nil {
		t.Fatal(err)
	}
	// Early hang-up, window 1: only the first chunk was sent. Use given back.
	st, err := Open(tk, OpenOptions{Window: 1})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := st.Next()
	if err != nil {
		t.Fatal(err)
	}
	unix.Close(ch.FD)
	st.Close()
	// Every chunk pulled, then a hang-up without done: the use is spent.
	st, err = Open(tk, OpenOptions{Window: 1})
	if err != nil {
		t.Fatalf("early hang-up did not give the use back: %v", err)
	}
	for range sizes {
		ch, err := st.Next()
		if err != nil {
			t.Fatal(err)
		}
		unix.Close(ch.FD)
	}
	st.Close()
	select {
	case <-released:
	case <-time.After(5 * time.Second):
		t.Fatal("registration not released after every chunk was sent")
	}
	if _, err := Open(tk, OpenOptions{}); CodeOf(err) != ENOENT {
		t.Fatalf("third receiver: %v, want ENOENT", err)
	}
}
