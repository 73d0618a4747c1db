package core

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// HostImporter maps chunks of host memory (mmap-able files such as memfds)
// into one contiguous range: a PROT_NONE reservation that each chunk
// replaces with MAP_FIXED|MAP_SHARED.
type HostImporter struct {
	base unsafe.Pointer
	size uintptr // reserved length, page aligned
}

func roundUp(n, to uint64) uint64 { return (n + to - 1) / to * to }

// Reserve reserves total bytes of address space, inaccessible until mapped.
func (h *HostImporter) Reserve(total uint64) (uint64, error) {
	n := roundUp(total, pageSize)
	if n < total || n > uint64(^uintptr(0)>>1) {
		return 0, Errorf(EINVAL, "import: %d bytes cannot be reserved", total)
	}
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return 0, Errorf(EIO, "import: mmap reserve of %d bytes: %w", n, err)
	}
	h.base, h.size = p, uintptr(n)
	return uint64(uintptr(p)), nil
}

// Map checks that the descriptor is a memfd big enough for the chunk and
// sealed against shrinking, so that no access can ever fault with SIGBUS
// (a size check alone would not do: the sender could truncate it later),
// and maps it in place.
func (h *HostImporter) Map(c Chunk) error {
	if c.Offset%pageSize != 0 || c.FileOffset%pageSize != 0 {
		return Errorf(EINVAL, "offset %d / file offset %d not page aligned (host chunks must be multiples of %d bytes)", c.Offset, c.FileOffset, pageSize)
	}
	if c.Offset+c.Size > uint64(h.size) {
		return Errorf(EINVAL, "chunk [%d, %d) outside the reserved %d bytes", c.Offset, c.Offset+c.Size, h.size)
	}
	var st unix.Stat_t
	if err := unix.Fstat(c.FD, &st); err != nil {
		return Errorf(EIO, "fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return Errorf(EINVAL, "descriptor is not a regular file or memfd (mode %#o): is this a CUDA ticket? import it onto a GPU", st.Mode)
	}
	if end := c.FileOffset + c.Size; end < c.FileOffset || uint64(st.Size) < end {
		return Errorf(EINVAL, "the file holds %d bytes but the chunk needs [%d, %d): refusing to map what would fault", st.Size, c.FileOffset, end)
	}
	if err := checkShrinkSeal(c.FD); err != nil {
		return err
	}
	at := unsafe.Add(h.base, c.Offset)
	if _, err := unix.MmapPtr(c.FD, int64(c.FileOffset), at, uintptr(c.Size),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
		return &Error{Code: ioCode(err), Msg: "mmap", Err: err}
	}
	return nil
}

// Finish has nothing to do for host memory.
func (h *HostImporter) Finish() error { return nil }

// Unmap removes the whole range, mapped chunks and reservation alike.
func (h *HostImporter) Unmap() error {
	if h.base == nil {
		return nil
	}
	err := unix.MunmapPtr(h.base, h.size)
	h.base = nil
	if err != nil {
		return Errorf(EIO, "munmap: %w", err)
	}
	return nil
}

// checkShrinkSeal insists on F_SEAL_SHRINK: without it whoever holds the file
// can truncate it under our mapping and kill this process with SIGBUS.
func checkShrinkSeal(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return Errorf(EINVAL, "the file cannot be sealed (not a memfd: %v); host chunks must be memfds sealed with F_SEAL_SHRINK so that they can never be truncated under a mapping", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return Errorf(EINVAL, "the memfd is not sealed against shrinking; the sender must seal it (memfd_create with MFD_ALLOW_SEALING, then fcntl F_ADD_SEALS F_SEAL_SHRINK) so that it can never be truncated under a mapping")
	}
	return nil
}
