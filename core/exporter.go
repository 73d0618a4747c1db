package core

// What a registration is made of: the memory to register (BufferSpec) and
// the Exporter that makes its chunks' descriptors when receivers ask
// (package cuda's, FileExporter, a C export_fn). importer.go is the
// receiver's counterpart.

// Exporter produces chunk descriptors on demand for one buffer.
type Exporter interface {
	// ExportChunk returns a new descriptor for chunk index, and the offset
	// inside it where the chunk's bytes start. The caller sends and closes fd.
	ExportChunk(index uint64) (fd int, fileOffset uint64, err error)
	// Release runs exactly once when the buffer ends (no registration of it
	// lives), after the last ExportChunk call has returned.
	Release()
}

// RunExporter is an Exporter whose consecutive chunks can travel as one
// descriptor: chunk first+k starts right after chunk first+k-1 inside it.
// A host-file registration is one: its chunks are ranges of one memfd.
type RunExporter interface {
	Exporter
	// ExportRun returns a new descriptor holding chunks [first, first+n)
	// back to back from fileOffset, for some 1 <= n <= max. The caller
	// sends and closes fd.
	ExportRun(first, max uint64) (fd int, fileOffset, n uint64, err error)
}

// fileBacked is an Exporter whose whole buffer is bytes [0, total) of one
// file it holds open for the buffer's life: the number of its descriptor
// in this process and the file's identity. The grant table publishes them
// with each grant that holds nothing, so that a receiver that has the
// table may open the file itself, through /proc, instead of asking for it
// (granttable.go; a FileExporter is one).
type fileBacked interface {
	heldFile() (fd int, dev, ino uint64)
}

// BufferSpec describes memory to register.
type BufferSpec struct {
	Sizes      []uint64
	Kind       uint8    // MemoryHost or MemoryCUDA
	DeviceUUID [16]byte // CUDA: the GPU holding the memory; host: zeros
	Exporter   Exporter
	// Key names the memory where the library holds its own references to it
	// (a CUDA range's retained allocations, a memfd's duplicate). A live
	// buffer with the same key is the same memory: the registration joins
	// it, and Exporter is released at once, unused. "" never matches.
	Key string
}

// validate checks the spec and returns the chunks' offsets and total size.
func (s *BufferSpec) validate() (offsets []uint64, total uint64, err error) {
	if err := CheckCount(uint64(len(s.Sizes)), "register"); err != nil {
		return nil, 0, err
	}
	switch {
	case s.Exporter == nil:
		return nil, 0, Errorf(EINVAL, "register: no exporter")
	case s.Kind != MemoryHost && s.Kind != MemoryCUDA:
		return nil, 0, Errorf(EINVAL, "register: unknown memory kind %d (want 1 = host or 2 = cuda)", s.Kind)
	case s.Kind == MemoryHost && s.DeviceUUID != [16]byte{}:
		return nil, 0, Errorf(EINVAL, "register: host memory has no device UUID")
	}
	offsets = make([]uint64, len(s.Sizes))
	for i, n := range s.Sizes {
		if n == 0 {
			return nil, 0, Errorf(EINVAL, "register: chunk %d has size 0", i)
		}
		if s.Kind == MemoryHost && i < len(s.Sizes)-1 && n%pageSize != 0 {
			return nil, 0, Errorf(EINVAL, "register: host chunk %d has size %d, not a multiple of the page size %d", i, n, pageSize)
		}
		if total+n < total {
			return nil, 0, Errorf(EINVAL, "register: sizes overflow 64 bits at chunk %d", i)
		}
		offsets[i] = total
		total += n
	}
	return offsets, total, nil
}
