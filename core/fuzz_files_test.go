package core

import (
	"errors"
	"os"
	"strconv"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// FuzzHostFileChecks: the checks of a host-memory descriptor (memfd.go)
// against a model built from how the file was made. The fuzzer picks a
// kind of file, its size, seals (added in two steps, as far as the kernel
// lets them), how it is opened, the chunk's file offset and size, and
// whether a hole is punched in it. Then, for every input:
//   - checkHostFile, HostFile and HostImporter.Map accept it exactly when
//     the model does (a memfd of tmpfs, open O_RDWR, holding the chunk,
//     sealed against shrinking and not against writing), and refuse it
//     with EINVAL otherwise;
//   - a refused registration leaves the seals as they were, an accepted one
//     ends with F_SEAL_SEAL, after which no seal can be added;
//   - an accepted mapping is read and written on every page, before and
//     after the hole punch, without a fault (a SIGBUS ends the fuzzer),
//     and reads zeros where the hole is;
//   - nothing is left: no descriptor, no mapping of the file.

// Kinds of file the fuzzer makes.
const (
	fileMemfd       = iota // memfd_create(MFD_ALLOW_SEALING)
	fileMemfdNoSeal        // memfd_create without MFD_ALLOW_SEALING (F_SEAL_SEAL set)
	fileMemfdNoExec        // memfd_create(MFD_NOEXEC_SEAL): sealable, F_SEAL_EXEC set
	fileMemfdHuge          // memfd_create(MFD_HUGETLB|MFD_ALLOW_SEALING)
	fileShm                // a file in /dev/shm (tmpfs, not a memfd)
	fileTemp               // a file in os.TempDir()
	filePipe               // a pipe
	fileDevNull            // /dev/null (a character device)
	fileDir                // a directory
	fileSocket             // a unix socket
	fileKinds
)

// Ways of opening the descriptor that is checked.
const (
	openAsMade = iota // the descriptor the file was made with
	openRDWR          // reopened through /proc: O_RDWR
	openRDONLY
	openWRONLY
	openPath
	openModes
)

func FuzzHostFileChecks(f *testing.F) {
	quietFDs(f)
	const all = unix.F_SEAL_SEAL | unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_WRITE | unix.F_SEAL_FUTURE_WRITE
	for kind := range uint8(fileKinds) {
		f.Add(kind, uint8(unix.F_SEAL_SHRINK), uint8(0), uint8(openAsMade), uint32(4*4096), uint32(4*4096), uint8(0), uint8(0))
	}
	f.Add(uint8(fileMemfd), uint8(unix.F_SEAL_SHRINK), uint8(unix.F_SEAL_SEAL), uint8(openRDWR), uint32(3*4096+100), uint32(2*4096+100), uint8(1), uint8(2))
	f.Add(uint8(fileMemfd), uint8(unix.F_SEAL_SHRINK), uint8(unix.F_SEAL_WRITE), uint8(openAsMade), uint32(4096), uint32(4096), uint8(0), uint8(0))
	f.Add(uint8(fileMemfd), uint8(unix.F_SEAL_SHRINK|unix.F_SEAL_FUTURE_WRITE), uint8(0), uint8(openAsMade), uint32(4096), uint32(4096), uint8(0), uint8(0))
	f.Add(uint8(fileMemfd), uint8(unix.F_SEAL_SHRINK), uint8(0), uint8(openRDONLY), uint32(4096), uint32(4096), uint8(0), uint8(0))
	f.Add(uint8(fileMemfd), uint8(unix.F_SEAL_SHRINK), uint8(0), uint8(openWRONLY), uint32(4096), uint32(4096), uint8(0), uint8(0))
	f.Add(uint8(fileMemfd), uint8(unix.F_SEAL_SHRINK), uint8(0), uint8(openPath), uint32(4096), uint32(4096), uint8(0), uint8(0))
	f.Add(uint8(fileMemfd), uint8(unix.F_SEAL_SHRINK), uint8(0), uint8(openAsMade), uint32(4096), uint32(8192), uint8(0), uint8(0))
	f.Add(uint8(fileMemfd), uint8(0), uint8(0), uint8(openAsMade), uint32(4096), uint32(4096), uint8(0), uint8(0))
	f.Add(uint8(fileMemfdHuge), uint8(unix.F_SEAL_SHRINK), uint8(0), uint8(openAsMade), uint32(2<<20), uint32(4096), uint8(0), uint8(0))
	f.Add(uint8(fileMemfdNoExec), uint8(unix.F_SEAL_SHRINK|unix.F_SEAL_GROW), uint8(0), uint8(openRDWR), uint32(8*4096), uint32(8*4096), uint8(2), uint8(5))

	srv := newTestServer(f)
	f.Fuzz(func(t *testing.T, kind, seals1, seals2, open uint8, fileSize, chunkSize uint32, fileOffPages, punch uint8) {
		kind, open = kind%fileKinds, open%openModes
		fileSize %= 4 << 20 // sparse: only the pages touched take memory
		chunkSize %= 1 << 20
		fileOff := uint64(fileOffPages%4) * pageSize
		fdsBefore := ourFDs().now(t)

		made, err := makeFuzzFile(kind, int64(fileSize))
		if err != nil {
			t.Skipf("kind %d cannot be made here: %v", kind, err)
		}
		opened := []int{made} // closed at the end, counted before that
		defer func() {
			for _, fd := range opened {
				unix.Close(fd)
			}
		}()
		// As far as the kernel lets them; the model reads what stuck.
		_, _ = unix.FcntlInt(uintptr(made), unix.F_ADD_SEALS, int(seals1)&all)
		_, _ = unix.FcntlInt(uintptr(made), unix.F_ADD_SEALS, int(seals2)&all)
		fd := made
		if open != openAsMade {
			flags := map[uint8]int{openRDWR: unix.O_RDWR, openRDONLY: unix.O_RDONLY, openWRONLY: unix.O_WRONLY, openPath: unix.O_PATH}[open]
			if fd, err = unix.Open("/proc/self/fd/"+strconv.Itoa(made), flags|unix.O_CLOEXEC, 0); err != nil {
				fd = made // a socket cannot be reopened: check the original
				open = openAsMade
			} else {
				opened = append(opened, fd)
			}
		}
		sealsNow, sealsErr := unix.FcntlInt(uintptr(made), unix.F_GET_SEALS, 0)
		var st unix.Stat_t
		if err := unix.Fstat(made, &st); err != nil {
			t.Fatal(err)
		}

		// The model: from how the file was made, and the kernel's word on
		// its seals and size.
		memfd := kind == fileMemfd || kind == fileMemfdNoSeal || kind == fileMemfdNoExec
		rdwr := open == openAsMade || open == openRDWR
		sealsOK := sealsErr == nil && sealsNow&unix.F_SEAL_SHRINK != 0 && sealsNow&(unix.F_SEAL_WRITE|unix.F_SEAL_FUTURE_WRITE) == 0
		fileOK := memfd && rdwr && sealsOK
		need := fileOff + uint64(chunkSize)
		holds := uint64(st.Size) >= need

		_, err = checkHostFile(fd, need)
		expectVerdict(t, "checkHostFile", err, fileOK && holds)

		before := getSealsOrZero(made)
		tk, err := srv.RegisterHostFile(fd, uint64(chunkSize), pageSize, RegisterOptions{})
		expectVerdict(t, "RegisterHostFile", err, fileOK && chunkSize > 0 && uint64(st.Size) >= uint64(chunkSize))
		if err == nil {
			if err := srv.Unregister(tk); err != nil {
				t.Fatal(err)
			}
			if s := getSealsOrZero(made); s&unix.F_SEAL_SEAL == 0 {
				t.Fatalf("after an accepted registration the seals are %#x, without F_SEAL_SEAL", s)
			}
			if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_FUTURE_WRITE); !errors.Is(err, unix.EPERM) {
				t.Fatalf("after an accepted registration a holder adding F_SEAL_FUTURE_WRITE got %v, want EPERM", err)
			}
		} else if after := getSealsOrZero(made); after != before {
			t.Fatalf("a refused registration changed the seals from %#x to %#x", before, after)
		}

		var h HostImporter
		if _, err := h.Reserve(uint64(chunkSize) + 1); err != nil {
			t.Fatal(err)
		}
		defer h.Unmap()
		err = h.Map(Chunk{Size: uint64(chunkSize), FileOffset: fileOff, FD: fd})
		expectVerdict(t, "Map", err, fileOK && holds && chunkSize > 0)
		if err == nil {
			touchEveryPage(h.base, uint64(chunkSize))
			if punch%4 == 1 && chunkSize > 0 {
				// F_SEAL_SHRINK allows it; on tmpfs it reads back as zeros.
				// [rel, rel+n) of the chunk, inside it.
				rel := int64(punch) * 64 % int64(chunkSize)
				n := max(1, min(int64(chunkSize)/2, int64(chunkSize)-rel))
				if err := unix.Fallocate(made, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, int64(fileOff)+rel, n); err != nil {
					t.Fatalf("punching a hole: %v", err)
				}
				m := bytesAt(uint64(uintptr(h.base)), uint64(chunkSize))
				for i := rel; i < rel+n; i++ {
					if m[i] != 0 {
						t.Fatalf("byte %d of the hole reads %#x, want 0", i, m[i])
					}
				}
				touchEveryPage(h.base, uint64(chunkSize))
			}
		}
		if err := h.Unmap(); err != nil {
			t.Fatal(err)
		}
		if n, b := memfdMappings(t); n != 0 {
			t.Fatalf("%d mappings (%d bytes) of the file are left", n, b)
		}
		for _, fd := range opened {
			unix.Close(fd)
		}
		opened = nil
		// Not more: an earlier test's server may close one meanwhile.
		if got := ourFDs().now(t); got > fdsBefore {
			t.Fatalf("%d descriptors open, %d before the input", got, fdsBefore)
		}
	})
}

// makeFuzzFile makes a file of kind with size bytes where it can have any
// (a page written at its start, so that some memory is real), closed and
// removed at the end of the input.
func makeFuzzFile(kind uint8, size int64) (int, error) {
	var fd int
	var err error
	switch kind {
	case fileMemfd:
		fd, err = unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	case fileMemfdNoSeal:
		fd, err = unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC)
	case fileMemfdNoExec:
		fd, err = unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_NOEXEC_SEAL)
	case fileMemfdHuge:
		fd, err = unix.MemfdCreate(testMemfdName, unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING|unix.MFD_HUGETLB)
	case fileShm, fileTemp:
		dir := "/dev/shm"
		if kind == fileTemp {
			dir = os.TempDir()
		}
		var f *os.File
		if f, err = os.CreateTemp(dir, "vmmipc-fuzz-"); err == nil {
			os.Remove(f.Name())
			fd, err = unix.Dup(int(f.Fd()))
			f.Close()
		}
	case filePipe, fileSocket:
		p := make([]int, 2)
		if kind == filePipe {
			err = unix.Pipe2(p, unix.O_CLOEXEC)
		} else {
			p[0], p[1], err = socketpair()
		}
		if err == nil {
			unix.Close(p[1])
			fd = p[0]
		}
	case fileDevNull:
		fd, err = unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	case fileDir:
		fd, err = unix.Open(os.TempDir(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return -1, err
	}
	if kind <= fileTemp {
		_ = unix.Ftruncate(fd, size) // hugetlbfs takes whole huge pages only
		if kind != fileMemfdHuge && size > 0 {
			_, _ = unix.Pwrite(fd, pattern(int(min(size, 4096)), 9), 0)
		}
	}
	return fd, nil
}

func socketpair() (int, int, error) {
	p, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	return p[0], p[1], err
}

// expectVerdict fails the test unless err accepts exactly when the model
// does, and refuses with EINVAL.
func expectVerdict(t *testing.T, what string, err error, accept bool) {
	t.Helper()
	switch {
	case accept && err != nil:
		t.Fatalf("%s refused what the model accepts: %v", what, err)
	case !accept && err == nil:
		t.Fatalf("%s accepted what the model refuses", what)
	case err != nil && CodeOf(err) != EINVAL:
		t.Fatalf("%s refused with %v, want EINVAL: %v", what, CodeOf(err), err)
	}
}

// touchEveryPage reads and writes (then restores) one byte of every page
// of [base, base+n), and the last byte: a fault anywhere is SIGBUS or
// SIGSEGV, which ends the fuzzer.
func touchEveryPage(base unsafe.Pointer, n uint64) {
	if n == 0 {
		return
	}
	m := bytesAt(uint64(uintptr(base)), n)
	touch := func(i uint64) {
		old := m[i]
		m[i] = old + 1
		if m[i] != old+1 {
			panic("a write through the mapping did not stick")
		}
		m[i] = old
	}
	for i := uint64(0); i < n; i += pageSize {
		touch(i)
	}
	touch(n - 1)
}

func getSealsOrZero(fd int) int {
	s, _ := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	return s
}
