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

// Reserve reserves total bytes of address space, inaccessible until mapped.
func (h *HostImporter) Reserve(total uint64) (uint64, error) {
	n, ok := RoundUp(total, pageSize)
	if !ok || n > uint64(^uintptr(0)>>1) {
		return 0, Errorf(EINVAL, "import: %d bytes cannot be reserved", total)
	}
	p, err := unix.MmapPtr(-1, 0, nil, uintptr(n), unix.PROT_NONE,
		unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		code := EIO
		if err == unix.ENOMEM {
			code = ENOMEM
		}
		return 0, Errorf(code, "import: mmap reserve of %d bytes: %w", n, err)
	}
	h.base, h.size = p, uintptr(n)
	return uint64(uintptr(p)), nil
}

// Map checks the chunk's descriptor (a memfd of tmpfs, sealed against
// shrinking, open and unsealed for writing, big enough for the chunk:
// memfd.go) and maps it in place. Only the offsets must be page aligned:
// the kernel rounds the length up to a whole page, which stays inside the
// page-aligned reservation, and the file's pages up to that rounded end
// start below its (unshrinkable) end, so touching them never faults. That
// holds for tmpfs pages only: a hugetlbfs file would round up to a huge
// page, past the reservation, and is refused.
func (h *HostImporter) Map(c Chunk) error {
	if c.Offset%pageSize != 0 || c.FileOffset%pageSize != 0 {
		return Errorf(EINVAL, "offset %d / file offset %d not page aligned (host chunks must be multiples of %d bytes)", c.Offset, c.FileOffset, pageSize)
	}
	if c.Size == 0 {
		return Errorf(EINVAL, "chunk at offset %d has no bytes", c.Offset)
	}
	if c.Offset+c.Size < c.Offset || c.Offset+c.Size > uint64(h.size) {
		return Errorf(EINVAL, "chunk [%d, %d) outside the reserved %d bytes", c.Offset, c.Offset+c.Size, h.size)
	}
	end := c.FileOffset + c.Size
	if end < c.FileOffset {
		return Errorf(EINVAL, "chunk at file offset %d of %d bytes overflows", c.FileOffset, c.Size)
	}
	if _, err := checkHostFile(c.FD, end); err != nil {
		var st unix.Stat_t
		if unix.Fstat(c.FD, &st) == nil && st.Mode&unix.S_IFMT != unix.S_IFREG {
			return WrapErr(EINVAL, err, "refusing to map the sender's descriptor (is this a CUDA ticket? import it onto a GPU)")
		}
		return WrapErr(EINVAL, err, "refusing to map the sender's descriptor")
	}
	at := unsafe.Add(h.base, c.Offset)
	if _, err := unix.MmapPtr(c.FD, int64(c.FileOffset), at, uintptr(c.Size),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_FIXED); err != nil {
		if err == unix.EPERM || err == unix.EACCES {
			// Checked a moment ago: someone holding the file (that did
			// not seal it with F_SEAL_SEAL) sealed it against writing since.
			return &Error{Code: EINVAL, Msg: "mmap: the sender's memfd refuses a read-write mapping (sealed against writing after it was checked; its sender must add F_SEAL_SEAL before sharing it)", Err: err}
		}
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

// Device is DeviceHost.
func (h *HostImporter) Device() int32 { return DeviceHost }
