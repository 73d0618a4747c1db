package core

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// What Register refuses in a buffer spec and HostFile in a file, with
// messages that say what to change.

// TestBufferSpecChecks: what Register refuses in a spec, and what HostFile
// refuses in a file, with messages that say what to change.
func TestBufferSpecChecks(t *testing.T) {
	s := newTestServer(t)
	exp := &testExporter{export: func(uint64) (int, uint64, error) { return -1, 0, nil }}
	for _, tc := range []struct {
		name string
		spec BufferSpec
		says string
	}{
		{"no chunks", BufferSpec{Kind: MemoryHost, Exporter: exp}, "register: count is 0: register at least one chunk"},
		{"no exporter", BufferSpec{Sizes: []uint64{4096}, Kind: MemoryHost}, "no exporter"},
		{"unknown kind", BufferSpec{Sizes: []uint64{4096}, Kind: 3, Exporter: exp}, "unknown memory kind 3"},
		{"host with a UUID", BufferSpec{Sizes: []uint64{4096}, Kind: MemoryHost, DeviceUUID: [16]byte{1}, Exporter: exp}, "no device UUID"},
		{"a zero size", BufferSpec{Sizes: []uint64{4096, 0}, Kind: MemoryCUDA, Exporter: exp}, "chunk 1 has size 0"},
		{"host chunk not page aligned", BufferSpec{Sizes: []uint64{4095, 4096}, Kind: MemoryHost, Exporter: exp}, "not a multiple of the page size"},
		{"sizes overflow", BufferSpec{Sizes: []uint64{1 << 63, 1 << 63}, Kind: MemoryCUDA, Exporter: exp}, "overflow"},
	} {
		if _, err := s.Register(tc.spec, RegisterOptions{}); CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v, want EINVAL saying %q", tc.name, err, tc.says)
		}
	}
	if _, err := s.Register(BufferSpec{Sizes: []uint64{4096, 100}, Kind: MemoryHost, Exporter: exp}, RegisterOptions{}); err != nil {
		t.Errorf("a host buffer whose last chunk is short: %v", err)
	}

	before := ourFDs().settled(t)
	sealed := newMemfd(t, 8192, nil)
	defer unix.Close(sealed)
	unsealed, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealed)
	unix.Ftruncate(unsealed, 8192)
	unsealable, err := unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC) // F_SEAL_SEAL set
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(unsealable)
	unix.Ftruncate(unsealable, 8192)
	disk := tempFile(t, os.TempDir())
	shm := tempFile(t, "/dev/shm")
	pipe := make([]int, 2)
	if err := unix.Pipe2(pipe, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	before += 7 // the descriptors just opened
	for _, tc := range []struct {
		name        string
		fd          int
		size, chunk uint64
		says        string
	}{
		{"chunk size 0", sealed, 8192, 0, "chunk size 0 is not a positive multiple of the page size"},
		{"chunk not page aligned", sealed, 8192, 1000, "chunk size 1000"},
		{"size 0", sealed, 0, 4096, "size is 0"},
		{"too many chunks", sealed, (MaxChunks + 1) * 4096, 4096, "chunks exceed the limit"},
		{"no descriptor", -1, 8192, 4096, "is not a descriptor"},
		{"closed descriptor", 1 << 20, 8192, 4096, "bad file descriptor"},
		{"larger than the file", sealed, 3 * 4096, 4096, "fewer than the 12288 needed"},
		{"a pipe", pipe[0], 4096, 4096, "not a regular file or memfd"},
		{"unsealed memfd", unsealed, 8192, 4096, "seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)"},
		{"memfd that can no longer be sealed", unsealable, 8192, 4096, "can no longer be"},
		{"a file in " + os.TempDir(), int(disk.Fd()), 8192, 4096, unsealableSays(t, disk)},
		{"a file in /dev/shm", int(shm.Fd()), 8192, 4096, unsealableSays(t, shm)},
	} {
		if _, err := HostFile(tc.fd, tc.size, tc.chunk); CodeOf(err) != EINVAL || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("HostFile, %s: %v, want EINVAL saying %q", tc.name, err, tc.says)
		}
	}
	ourFDs().waitFor(t, before, "after refused host files (no duplicate may stay open)")
}

// tempFile is a file of 8192 bytes in dir, removed at the end.
func tempFile(t *testing.T, dir string) *os.File {
	t.Helper()
	f, err := os.CreateTemp(dir, "vmmipc-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close(); os.Remove(f.Name()) })
	if err := f.Truncate(8192); err != nil {
		t.Fatal(err)
	}
	return f
}

// unsealableSays is what HostFile must say of a file that is not a memfd:
// tmpfs files (/dev/shm) have a message of their own.
func unsealableSays(t *testing.T, f *os.File) string {
	t.Helper()
	var fs unix.Statfs_t
	if err := unix.Fstatfs(int(f.Fd()), &fs); err != nil {
		t.Fatal(err)
	}
	if fs.Type == unix.TMPFS_MAGIC {
		return "cannot be sealed (a tmpfs file such as one in /dev/shm, not a memfd)"
	}
	return "cannot be sealed (not a memfd: a disk file?"
}
