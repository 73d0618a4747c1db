package core

import (
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Host memory travels as memfds. Both sides insist on the same things (the
// sender when it registers a file, the receiver for every chunk it maps), so
// the rules live here, once: a regular file, large enough, and sealed
// against shrinking, because whoever holds a file that can shrink can
// truncate it under a mapping and kill the mapping process with SIGBUS.

// pageSize is the host page size: host chunks (all but the last), their
// offsets and their file offsets are multiples of it, as mmap demands.
var pageSize = uint64(unix.Getpagesize())

// checkHostFile checks that fd is a sealed memfd holding at least end bytes
// and returns its stat. Its messages say what to change.
func checkHostFile(fd int, end uint64) (unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return st, Errorf(EINVAL, "fd %d: %w", fd, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return st, Errorf(EINVAL, "fd %d is not a regular file or memfd (mode %#o)", fd, st.Mode)
	}
	if uint64(st.Size) < end {
		return st, Errorf(EINVAL, "fd %d holds %d bytes, fewer than the %d needed", fd, st.Size, end)
	}
	return st, checkShrinkSeal(fd)
}

func checkShrinkSeal(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return Errorf(EINVAL, "fd %d is a file that cannot be sealed (not a memfd: a /dev/shm or disk file?); host memory must be a memfd sealed against shrinking: create it with memfd_create(name, MFD_ALLOW_SEALING) and seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)", fd)
	}
	if seals&unix.F_SEAL_SHRINK != 0 {
		return nil
	}
	if seals&unix.F_SEAL_SEAL != 0 && !isMemfd(fd) {
		// Other tmpfs files (/dev/shm) answer F_GET_SEALS with F_SEAL_SEAL.
		return Errorf(EINVAL, "fd %d is a file that cannot be sealed (a tmpfs file such as one in /dev/shm, not a memfd); host memory must be a memfd sealed against shrinking: create it with memfd_create(name, MFD_ALLOW_SEALING) and seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)", fd)
	}
	if seals&unix.F_SEAL_SEAL != 0 {
		return Errorf(EINVAL, "fd %d is a memfd that is not sealed against shrinking and can no longer be (created without MFD_ALLOW_SEALING, or F_SEAL_SEAL is set): create it with MFD_ALLOW_SEALING and add F_SEAL_SHRINK", fd)
	}
	return Errorf(EINVAL, "fd %d is a memfd that is not sealed against shrinking: seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) so that it can never be truncated under a mapping", fd)
}

// isMemfd tells a memfd from other tmpfs files: its /proc link reads
// "/memfd:NAME".
func isMemfd(fd int) bool {
	target, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	return err == nil && strings.HasPrefix(target, "/memfd:")
}
