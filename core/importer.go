package core

// What an import drives: an Importer maps the chunks (Chunk) a stream
// brings into one reserved range; a GPU makes CUDA Importers.

// Chunk is one received chunk (Stream.Next gives it, Importer.Map maps
// it). The receiver of a Chunk owns FD.
type Chunk struct {
	Index, Offset, Size, FileOffset uint64
	FD                              int
}

// Importer maps the chunks of one import into a single reserved range. The
// CUDA backend (package cuda) and the host backend (HostImporter) implement
// it; Import drives it.
type Importer interface {
	// Reserve reserves total bytes of address space and returns its start.
	Reserve(total uint64) (base uint64, err error)
	// Map imports the chunk's descriptor and maps it at base+c.Offset. The
	// descriptor stays the caller's, who closes it right after. For host
	// memory c may be a run of chunks (its Offset, Size and FileOffset
	// cover them all): one mapping.
	Map(c Chunk) error
	// Finish runs once after every chunk is mapped (CUDA: set access).
	Finish() error
	// Unmap undoes everything done so far, whatever state the import is in:
	// mapped chunks are unmapped and the reservation is freed.
	Unmap() error
	// Device is DeviceHost or the CUDA ordinal the mapping lives on.
	Device() int32
}

// GPU is the CUDA backend Import uses (package cuda provides it).
type GPU interface {
	// Placement resolves device (an ordinal, or DeviceSame for the GPU whose
	// UUID is uuid) and the access devices into the import cache's placement
	// key. After the first call in a process it makes no driver call, so a
	// cache hit makes none.
	Placement(device int32, uuid [16]byte, access []int32) (string, error)
	// NewImporter prepares an import onto that placement (driver calls:
	// peer checks, granularity, primary context); it reserves nothing yet.
	NewImporter(device int32, uuid [16]byte, access []int32) (Importer, error)
}
