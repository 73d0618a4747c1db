package core

import (
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Host memory travels as memfds. Both sides insist on the same things (the
// sender when it registers a file, the receiver for every chunk it maps), so
// the rules live here, once. A peer's file is input: whoever else holds it
// (its sender, other receivers) may act on it while we have it mapped, so we
// map only a file that none of them can turn into a crash or a refusal:
//
//   - shared memory of tmpfs (a memfd). hugetlbfs is refused (MFD_HUGETLB):
//     its mappings cover whole huge pages, so a chunk that is not a multiple
//     of one maps past its range, and whoever holds it can punch a hole
//     (F_SEAL_SHRINK allows that) and take the free huge pages, after which
//     the next touch of the hole is SIGBUS. A hole in a memfd reads back as
//     zeros: the memfds' internal tmpfs mount has no size limit, so a fault
//     in a hole gets a fresh page (or, out of memory, the OOM killer), never
//     SIGBUS.
//   - sealed against shrinking (F_SEAL_SHRINK): a file truncated under a
//     mapping kills the mapping process with SIGBUS at its next touch of the
//     lost pages. A shmem file with that seal is a memfd, on that unlimited
//     mount (other tmpfs files cannot be sealed).
//   - open for reading and writing and not sealed against writing: receivers
//     map it read-write shared, which such a file refuses (mmap says EACCES
//     or EPERM, which would read as an I/O failure, not as a bad file).
//
// A registered file also gets F_SEAL_SEAL (sealForSharing): a receiver holds
// a read-write descriptor of it, and without that seal could add
// F_SEAL_WRITE or F_SEAL_FUTURE_WRITE and so make every later receiver's
// mapping fail.

// pageSize is the host page size: host chunks (all but the last), their
// offsets and their file offsets are multiples of it, as mmap demands.
var pageSize = uint64(unix.Getpagesize())

// writeSeals are the seals under which no read-write shared mapping can be
// made.
const writeSeals = unix.F_SEAL_WRITE | unix.F_SEAL_FUTURE_WRITE

// checkHostFile checks that fd may be mapped read-write as host memory up to
// byte end (see above) and returns its stat. Its messages say what to
// change.
func checkHostFile(fd int, end uint64) (unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return st, Errorf(EINVAL, "fd %d: %w", fd, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return st, Errorf(EINVAL, "fd %d is not a regular file or memfd (mode %#o)", fd, st.Mode)
	}
	if err := checkFileSystem(fd); err != nil {
		return st, err
	}
	if err := checkAccessMode(fd); err != nil {
		return st, err
	}
	if uint64(st.Size) < end {
		return st, Errorf(EINVAL, "fd %d holds %d bytes, fewer than the %d needed", fd, st.Size, end)
	}
	_, err := checkSeals(fd)
	return st, err
}

// checkFileSystem accepts tmpfs only (see above).
func checkFileSystem(fd int) error {
	var fs unix.Statfs_t
	if err := unix.Fstatfs(fd, &fs); err != nil {
		return Errorf(EINVAL, "fd %d: fstatfs: %w", fd, err)
	}
	switch fs.Type {
	case unix.TMPFS_MAGIC:
		return nil
	case unix.HUGETLBFS_MAGIC:
		return Errorf(EINVAL, "fd %d is a file of huge pages (hugetlbfs: memfd_create with MFD_HUGETLB?), which cannot be shared safely: whoever holds it can punch a hole in it and take the free huge pages, and a mapping that then touches the hole dies of SIGBUS (and its mappings cover whole huge pages, past a chunk that is not a multiple of one); create the memfd without MFD_HUGETLB", fd)
	}
	return Errorf(EINVAL, "fd %d is a file that cannot be sealed (not a memfd: a disk file? its file system is of type %#x); host memory must be a memfd sealed against shrinking: create it with memfd_create(name, MFD_ALLOW_SEALING) and seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)", fd, fs.Type)
}

// checkAccessMode accepts a descriptor open for reading and writing: a
// shared read-write mapping needs one.
func checkAccessMode(fd int) error {
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil {
		return Errorf(EINVAL, "fd %d: fcntl F_GETFL: %w", fd, err)
	}
	var how string
	switch {
	case fl&unix.O_PATH != 0:
		how = "opened with O_PATH"
	case fl&unix.O_ACCMODE == unix.O_RDONLY:
		how = "open read-only (O_RDONLY)"
	case fl&unix.O_ACCMODE == unix.O_WRONLY:
		how = "open write-only (O_WRONLY)"
	default:
		return nil
	}
	return Errorf(EINVAL, "fd %d is %s: host memory is mapped for reading and writing, so its descriptor must be open O_RDWR (pass the memfd memfd_create returned, not a reopened copy)", fd, how)
}

// checkSeals accepts a memfd sealed against shrinking and not against
// writing, and returns its seals.
func checkSeals(fd int) (int, error) {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return 0, Errorf(EINVAL, "fd %d is a file that cannot be sealed (not a memfd); host memory must be a memfd sealed against shrinking: create it with memfd_create(name, MFD_ALLOW_SEALING) and seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)", fd)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return seals, shrinkSealMissing(fd, seals)
	}
	if seals&writeSeals != 0 {
		return seals, Errorf(EINVAL, "fd %d is a memfd sealed against writing (seals %#x: F_SEAL_WRITE or F_SEAL_FUTURE_WRITE), which refuses the read-write shared mapping every receiver makes; share a memfd without those seals (whoever added them, a receiver or its owner, they cannot be removed)", fd, seals)
	}
	return seals, nil
}

func shrinkSealMissing(fd, seals int) error {
	if seals&unix.F_SEAL_SEAL != 0 && !isMemfd(fd) {
		// Other tmpfs files (/dev/shm) answer F_GET_SEALS with F_SEAL_SEAL.
		return Errorf(EINVAL, "fd %d is a file that cannot be sealed (a tmpfs file such as one in /dev/shm, not a memfd); host memory must be a memfd sealed against shrinking: create it with memfd_create(name, MFD_ALLOW_SEALING) and seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK)", fd)
	}
	if seals&unix.F_SEAL_SEAL != 0 {
		return Errorf(EINVAL, "fd %d is a memfd that is not sealed against shrinking and can no longer be (created without MFD_ALLOW_SEALING, or F_SEAL_SEAL is set): create it with MFD_ALLOW_SEALING and add F_SEAL_SHRINK", fd)
	}
	return Errorf(EINVAL, "fd %d is a memfd that is not sealed against shrinking: seal it with fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) so that it can never be truncated under a mapping", fd)
}

// sealForSharing adds F_SEAL_SEAL to a file checkHostFile accepted, so that
// no receiver of a descriptor of it can add a seal that refuses later
// receivers (see above), and checks the seals it ends with: someone else
// may have sealed it meanwhile. It checks them first too, so that a file
// sealed against writing since its check fails without a seal of ours.
func sealForSharing(fd int) error {
	seals, err := checkSeals(fd)
	if err != nil {
		return err
	}
	if seals&unix.F_SEAL_SEAL == 0 {
		// EPERM: sealed by someone else since; the check below judges.
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SEAL); err != nil && err != unix.EPERM {
			return Errorf(EINVAL, "fd %d: adding F_SEAL_SEAL: %w", fd, err)
		}
	}
	if seals, err = checkSeals(fd); err != nil {
		return err
	}
	if seals&unix.F_SEAL_SEAL == 0 {
		return Errorf(EINVAL, "fd %d: F_SEAL_SEAL did not stay added (seals %#x)", fd, seals)
	}
	return nil
}

// isMemfd tells a memfd from other tmpfs files: its /proc link reads
// "/memfd:NAME".
func isMemfd(fd int) bool {
	target, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	return err == nil && strings.HasPrefix(target, "/memfd:")
}
