package core

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// FileExporter exports ranges of one memfd as chunks. It holds its own
// duplicate of the file, taken at registration: so it can never send
// another file that was given the registered descriptor's number after its
// owner closed it, and the owner may close its descriptor at once. Each
// export is a fresh close-on-exec duplicate plus the chunk's file offset;
// the chunks lie back to back in the file, so one duplicate serves any run
// of them (a RunExporter).
type FileExporter struct {
	fd        int // ours; closed by Release
	chunkSize uint64
}

// HostFile validates a memfd registration of bytes [0, size) in chunks of
// chunkSize and returns what to register. The spec's Key names the file (its
// inode) and the chunking, so registering the same memfd again while a
// registration of it lives shares the buffer. On success the file carries
// F_SEAL_SEAL (added here if it did not: no receiver of it can add a seal
// that would refuse later receivers; memfd.go) and the spec's exporter
// holds one duplicate of fd until the buffer ends. A file the checks refuse
// is left as it was.
func HostFile(fd int, size, chunkSize uint64) (BufferSpec, error) {
	if chunkSize == 0 || chunkSize%pageSize != 0 {
		return BufferSpec{}, Errorf(EINVAL, "register: chunk size %d is not a positive multiple of the page size %d", chunkSize, pageSize)
	}
	if size == 0 {
		return BufferSpec{}, Errorf(EINVAL, "register: size is 0")
	}
	n := (size + chunkSize - 1) / chunkSize
	if n > MaxChunks {
		return BufferSpec{}, Errorf(EINVAL, "register: %d chunks exceed the limit of %d; use larger chunks", n, MaxChunks)
	}
	if fd < 0 {
		return BufferSpec{}, Errorf(EINVAL, "register: fd %d is not a descriptor", fd)
	}
	st, err := checkHostFile(fd, size)
	if err != nil {
		return BufferSpec{}, WrapErr(EINVAL, err, "register")
	}
	if err := sealForSharing(fd); err != nil {
		return BufferSpec{}, WrapErr(EINVAL, err, "register")
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return BufferSpec{}, &Error{Code: ioCode(err), Msg: fmt.Sprintf("register: duplicating fd %d", fd), Err: err}
	}
	sizes := make([]uint64, n)
	for i := range sizes {
		sizes[i] = min(chunkSize, size-uint64(i)*chunkSize)
	}
	return BufferSpec{
		Sizes: sizes, Kind: MemoryHost,
		Exporter: &FileExporter{fd: dup, chunkSize: chunkSize},
		// While our duplicate keeps the inode alive, no other file can
		// have its number on that device: equal keys are the same file.
		Key: fmt.Sprintf("memfd:%d:%d:%d:%d", st.Dev, st.Ino, size, chunkSize),
	}, nil
}

// ExportChunk duplicates our descriptor of the file for chunk index.
func (e *FileExporter) ExportChunk(index uint64) (int, uint64, error) {
	fd, err := unix.FcntlInt(uintptr(e.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, 0, &Error{Code: ioCode(err), Msg: "duplicating the registered file", Err: err}
	}
	return fd, index * e.chunkSize, nil
}

// ExportRun duplicates our descriptor once for chunks [first, first+max):
// they lie back to back in the file.
func (e *FileExporter) ExportRun(first, max uint64) (int, uint64, uint64, error) {
	fd, off, err := e.ExportChunk(first)
	return fd, off, max, err
}

// Release closes our duplicate.
func (e *FileExporter) Release() {
	if e.fd >= 0 {
		_ = unix.Close(e.fd)
		e.fd = -1
	}
}
