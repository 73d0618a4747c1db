package core

import (
	"golang.org/x/sys/unix"
)

// FileExporter exports ranges of one mmap-able file (a memfd) as chunks: each
// export is a fresh close-on-exec duplicate of the borrowed descriptor plus
// the chunk's file offset. The owner keeps FD open until OnRelease runs.
type FileExporter struct {
	FD        int
	ChunkSize uint64
	OnRelease func() // may be nil
}

// FileChunks validates a file registration and returns its chunk sizes.
func FileChunks(fd int, size, chunkSize uint64) ([]uint64, error) {
	if chunkSize == 0 || chunkSize%pageSize != 0 {
		return nil, Errorf(EINVAL, "register: chunk size %d is not a positive multiple of the page size %d", chunkSize, pageSize)
	}
	if size == 0 {
		return nil, Errorf(EINVAL, "register: size is 0")
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, Errorf(EINVAL, "register: fd %d: %w", fd, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, Errorf(EINVAL, "register: fd %d is not a regular file or memfd", fd)
	}
	if uint64(st.Size) < size {
		return nil, Errorf(EINVAL, "register: fd %d holds %d bytes, fewer than the %d to share", fd, st.Size, size)
	}
	if err := checkShrinkSeal(fd); err != nil {
		return nil, wrapErr(EINVAL, err, "register: fd %d", fd)
	}
	n := (size + chunkSize - 1) / chunkSize
	if n > MaxChunks {
		return nil, Errorf(EINVAL, "register: %d chunks exceed the limit of %d; use larger chunks", n, MaxChunks)
	}
	sizes := make([]uint64, n)
	for i := range sizes {
		sizes[i] = min(chunkSize, size-uint64(i)*chunkSize)
	}
	return sizes, nil
}

// ExportChunk duplicates the file descriptor for chunk index.
func (e *FileExporter) ExportChunk(index uint64) (int, uint64, error) {
	fd, err := unix.FcntlInt(uintptr(e.FD), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, 0, &Error{Code: ioCode(err), Msg: "duplicating the registered file descriptor (closed before the registration ended?)", Err: err}
	}
	return fd, index * e.ChunkSize, nil
}

// Release tells the owner it may close the file.
func (e *FileExporter) Release() {
	if e.OnRelease != nil {
		e.OnRelease()
	}
}

// FuncExporter adapts plain functions to Exporter.
type FuncExporter struct {
	Export    func(index uint64) (fd int, fileOffset uint64, err error)
	OnRelease func()
}

// ExportChunk calls Export.
func (f *FuncExporter) ExportChunk(index uint64) (int, uint64, error) { return f.Export(index) }

// Release calls OnRelease if set.
func (f *FuncExporter) Release() {
	if f.OnRelease != nil {
		f.OnRelease()
	}
}
