package cuda

/*
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"sync"

	"github.com/libvmmipc/libvmmipc/core"
)

// The allocator made for sharing: core.Pool does the bookkeeping, this file
// the driver calls under it, one GPU per pool. Each chunk is a cuMemCreate
// allocation that allows POSIX-fd export (what vmmipc shares), mapped with
// its own cuMemMap into the pool's reservation, so cuMemGetAddressRange, and
// thus vmmipc_register_cuda and vmmipc_cuda_query_range, see one allocation
// per chunk: a sub-range registers as the chunk(s) under it.

// poolRangeFactor sizes a pool's reservation: this many times the device's
// memory, rounded up to whole chunks. Mapped chunks can never exceed the
// device's memory; the rest is room for holes that giving chunks back
// leaves, so that growth still finds a contiguous run. Reservations are
// address space only, but count against RLIMIT_AS (core checks).
const poolRangeFactor = 2

// poolBackend is core.PoolBackend on one GPU. Every call runs with the
// GPU's primary context current and leaves the caller's as it was.
type poolBackend struct {
	g    *gpu
	gran uint64
}

// Reserve is cuMemAddressReserve(size, alignment = the granularity, no
// fixed address, flags 0).
func (b poolBackend) Reserve(size uint64) (uint64, error) {
	return b.g.reserve(size, b.gran)
}

// Map is cuMemCreate (exportable, on this GPU), cuMemMap at addr (offset 0,
// flags 0: the whole allocation) and cuMemSetAccess of exactly that mapped
// range for this GPU, read-write. A failure undoes the steps before it.
func (b poolBackend) Map(addr, size uint64) (uint64, error) {
	var h C.CUmemGenericAllocationHandle
	err := b.g.run(func() error {
		r := C.vcu_mem_create_exportable(&h, C.size_t(size), C.int(b.g.ordinal))
		if r == C.VCU_ERROR_OUT_OF_MEMORY {
			return checkAs(core.ENOMEM, fmt.Sprintf("GPU %d has no %d bytes free for a new chunk: cuMemCreate", b.g.ordinal, size), r)
		}
		if err := check("cuMemCreate", r); err != nil {
			return err
		}
		if err := check("cuMemMap", C.vcu_mem_map(C.CUdeviceptr(addr), C.size_t(size), h)); err != nil {
			_ = C.vcu_mem_release(h)
			return err
		}
		ord := C.int(b.g.ordinal)
		if err := check("cuMemSetAccess", C.vcu_mem_set_access_rw(C.CUdeviceptr(addr), C.size_t(size), &ord, 1)); err != nil {
			_ = C.vcu_mem_unmap(C.CUdeviceptr(addr), C.size_t(size))
			_ = C.vcu_mem_release(h)
			return err
		}
		return nil
	})
	return uint64(h), err
}

// Sync is cuCtxSynchronize on the primary context: cuMemUnmap does not wait
// for work that still uses the memory in every case (torch waits too,
// before unmapping expandable segments), and cudaFree, which callers know,
// does wait.
func (b poolBackend) Sync() error {
	return b.g.run(func() error { return check("cuCtxSynchronize", C.vcu_ctx_synchronize()) })
}

// Unmap is cuMemUnmap of the whole chunk, then cuMemRelease of our handle;
// the memory lives on while others hold it (a registration's retained
// reference, a receiver's mapping).
func (b poolBackend) Unmap(addr, size, handle uint64) error {
	return b.g.run(func() error {
		if err := check("cuMemUnmap", C.vcu_mem_unmap(C.CUdeviceptr(addr), C.size_t(size))); err != nil {
			return err
		}
		return check("cuMemRelease", C.vcu_mem_release(C.CUmemGenericAllocationHandle(handle)))
	})
}

// Free is cuMemAddressFree of the whole reservation.
func (b poolBackend) Free(base, size uint64) error {
	return b.g.run(func() error {
		return check("cuMemAddressFree", C.vcu_mem_address_free(C.CUdeviceptr(base), C.size_t(size)))
	})
}

// NewPool makes a pool on GPU device with chunks of chunk bytes (0: 1 GiB),
// keeping up to keep bytes of wholly free chunks mapped after a free. It
// reserves poolRangeFactor times the device's memory of address space and
// maps nothing yet.
func NewPool(device int32, chunk, keep uint64) (*core.Pool, error) {
	if device < 0 {
		return nil, core.Errorf(core.EINVAL, "pool: device %d is not a CUDA device ordinal", device)
	}
	if err := load(); err != nil {
		return nil, err
	}
	g, err := gpuOf(device)
	if err != nil {
		return nil, err
	}
	var gran uint64
	var total C.size_t
	err = g.run(func() error {
		var gerr error
		if gran, gerr = granularity(g); gerr != nil {
			return gerr
		}
		return check("cuDeviceTotalMem", C.vcu_device_total_mem(&total, g.dev))
	})
	if err != nil {
		return nil, err
	}
	return core.NewPool(poolBackend{g: g, gran: gran}, core.PoolConfig{
		Chunk: chunk, Granularity: gran, Reserve: poolRangeFactor * uint64(total), Keep: keep})
}

// The torch pools: one per device for the process, behind torch's
// pluggable-allocator hooks (vmmipc_torch_alloc/free), which get only a
// size and a device. Never destroyed: torch may call its free hook on such
// memory until the process ends.
var torchPools struct {
	mu    sync.Mutex
	pools map[int32]*core.Pool
}

// TorchPool returns device's torch pool, made on first use with chunk
// bytes (0: 1 GiB) and keep bound 0 (torch caches segments itself and frees
// one only to give it back). chunk 0 takes the pool as it is; another chunk
// size than the existing pool's is EINVAL.
func TorchPool(device int32, chunk uint64) (*core.Pool, error) {
	torchPools.mu.Lock()
	defer torchPools.mu.Unlock()
	if p := torchPools.pools[device]; p != nil {
		if have := p.Info().ChunkSize; chunk != 0 && chunk != have {
			return nil, core.Errorf(core.EINVAL, "torch pool: device %d's pool already uses %d-byte chunks, not %d: one chunk size per device and process (pass 0 to take it as it is)", device, have, chunk)
		}
		return p, nil
	}
	p, err := NewPool(device, chunk, 0)
	if err != nil {
		return nil, err
	}
	if torchPools.pools == nil {
		torchPools.pools = map[int32]*core.Pool{}
	}
	torchPools.pools[device] = p
	return p, nil
}

// LookupTorchPool returns device's torch pool, or nil if none was made.
func LookupTorchPool(device int32) *core.Pool {
	torchPools.mu.Lock()
	defer torchPools.mu.Unlock()
	return torchPools.pools[device]
}
