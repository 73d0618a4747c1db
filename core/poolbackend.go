package core

// What a Pool (pool.go) is built on, and with: the backend that does its
// memory (cuda/pool.go: the CUDA driver; tests: a stand-in), its
// configuration and the constants include/vmmipc.h mirrors.

// PoolBackend is the memory a Pool manages. Calls come one at a time (the
// Pool holds its lock), with offsets inside the reservation and sizes that
// are multiples of the chunk size.
type PoolBackend interface {
	// Reserve reserves size bytes of address space (no memory) and returns
	// its base.
	Reserve(size uint64) (uint64, error)
	// Map creates one chunk of size bytes, maps it at addr and makes it
	// accessible, returning its handle. All or nothing: after an error
	// nothing of that chunk is left.
	Map(addr, size uint64) (handle uint64, err error)
	// Sync waits until the device has finished the work queued so far:
	// called before chunks are unmapped.
	Sync() error
	// Unmap unmaps the chunk at addr and releases its handle.
	Unmap(addr, size, handle uint64) error
	// Free gives back the reservation made by Reserve.
	Free(base, size uint64) error
}

// PoolConfig sets a Pool up.
type PoolConfig struct {
	Chunk       uint64 // bytes per physical chunk; 0 = DefaultPoolChunk
	Granularity uint64 // the backend's allocation granularity: Chunk must be a multiple of it
	Reserve     uint64 // address space to reserve, rounded up to whole chunks
	Keep        uint64 // wholly free chunk bytes a Free leaves mapped
}

// Pool constants, mirrored by include/vmmipc.h.
const (
	// DefaultPoolChunk is the chunk size of a pool made with chunk size 0.
	DefaultPoolChunk = 1 << 30
	// PoolAlignment is what every allocation's size is rounded up to and its
	// offset a multiple of: torch's own block size (kMinBlockSize), above
	// the 256 bytes cudaMalloc promises.
	PoolAlignment = 512
)
