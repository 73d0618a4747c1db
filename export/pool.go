package main

/*
#include "abi.h"
*/
import "C"

import (
	"sync"
	"unsafe"

	"github.com/libvmmipc/libvmmipc/core"
	"github.com/libvmmipc/libvmmipc/cuda"
)

// The allocator made for sharing (vmmipc.h, "Pools"): vmmipc_pool_* for C
// callers, vmmipc_torch_* for torch's pluggable allocator. A vmmipc_pool *
// is a handle of handles.go holding a poolRef.

type poolRef struct {
	pool   *core.Pool
	device int32
	torch  bool // a torch pool: lives as long as the process
}

// The torch pools' handles, one per device, given out again on every call.
var torchHandles struct {
	mu sync.Mutex
	h  map[int32]unsafe.Pointer
}

func poolOf(fn string, h C.uintptr_t) (*poolRef, error) {
	r, _ := lookupHandle(uintptr(h)).(*poolRef)
	if r == nil {
		return nil, core.Errorf(core.EBADF, "%s: pool handle %#x is NULL, stale or destroyed", fn, uintptr(h))
	}
	return r, nil
}

//export vmmipcgo_pool_create
func vmmipcgo_pool_create(device C.int, chunk, keep C.uint64_t, out **C.vmmipc_pool) C.int {
	return call("vmmipc_pool_create", func() error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_pool_create: pool_out is NULL")
		}
		p, err := cuda.NewPool(int32(device), uint64(chunk), uint64(keep))
		if err != nil {
			return err
		}
		*out = (*C.vmmipc_pool)(saveHandle(&poolRef{pool: p, device: int32(device)}))
		return nil
	})
}

//export vmmipcgo_torch_pool
func vmmipcgo_torch_pool(device C.int, chunk C.uint64_t, out **C.vmmipc_pool) C.int {
	return call("vmmipc_torch_pool", func() error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_torch_pool: pool_out is NULL")
		}
		p, err := cuda.TorchPool(int32(device), uint64(chunk))
		if err != nil {
			return err
		}
		*out = (*C.vmmipc_pool)(torchHandle(int32(device), p))
		return nil
	})
}

// torchHandle is the one handle of device's torch pool p.
func torchHandle(device int32, p *core.Pool) unsafe.Pointer {
	torchHandles.mu.Lock()
	defer torchHandles.mu.Unlock()
	if h := torchHandles.h[device]; h != nil {
		return h
	}
	if torchHandles.h == nil {
		torchHandles.h = map[int32]unsafe.Pointer{}
	}
	h := saveHandle(&poolRef{pool: p, device: device, torch: true})
	torchHandles.h[device] = h
	return h
}

//export vmmipcgo_pool_alloc
func vmmipcgo_pool_alloc(h C.uintptr_t, size C.uint64_t, out *C.uint64_t) C.int {
	return callOn("vmmipc_pool_alloc", h, poolOf, func(r *poolRef) error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_pool_alloc: dptr_out is NULL")
		}
		p, err := r.pool.Alloc(uint64(size))
		if err != nil {
			return err
		}
		*out = C.uint64_t(p)
		return nil
	})
}

//export vmmipcgo_pool_free
func vmmipcgo_pool_free(h C.uintptr_t, dptr C.uint64_t) C.int {
	return callOn("vmmipc_pool_free", h, poolOf, func(r *poolRef) error {
		_, err := r.pool.Free(uint64(dptr))
		return err
	})
}

//export vmmipcgo_pool_trim
func vmmipcgo_pool_trim(h C.uintptr_t, keep C.uint64_t, released *C.uint64_t) C.int {
	return callOn("vmmipc_pool_trim", h, poolOf, func(r *poolRef) error {
		n, err := r.pool.Trim(uint64(keep))
		if released != nil {
			*released = C.uint64_t(n) // what went back, also when a later chunk failed
		}
		return err
	})
}

//export vmmipcgo_pool_get_info
func vmmipcgo_pool_get_info(h C.uintptr_t, out *C.vmmipc_pool_info, size C.size_t) C.int {
	return callOn("vmmipc_pool_get_info", h, poolOf, func(r *poolRef) error {
		if out == nil {
			return core.Errorf(core.EINVAL, "vmmipc_pool_get_info: info_out is NULL")
		}
		i := r.pool.Info()
		full := C.vmmipc_pool_info{
			base:            C.uint64_t(i.Base),
			reserved_bytes:  C.uint64_t(i.Reserved),
			chunk_size:      C.uint64_t(i.ChunkSize),
			keep_bytes:      C.uint64_t(i.KeepBytes),
			mapped_bytes:    C.uint64_t(i.MappedBytes),
			idle_bytes:      C.uint64_t(i.WhollyFreeMappedBytes),
			allocated_bytes: C.uint64_t(i.AllocatedBytes),
			allocations:     C.uint64_t(i.Allocations),
			chunks_mapped:   C.uint64_t(i.ChunksMapped),
			chunks_released: C.uint64_t(i.ChunksReleased),
			device:          C.int32_t(r.device),
		}
		if r.torch {
			full.torch = 1
		}
		copyOut(out, &full, size)
		return nil
	})
}

//export vmmipcgo_pool_destroy
func vmmipcgo_pool_destroy(h C.uintptr_t) C.int {
	return callOn("vmmipc_pool_destroy", h, poolOf, func(r *poolRef) error {
		if r.torch {
			return core.Errorf(core.EINVAL, "vmmipc_pool_destroy: this is device %d's torch pool, which lives as long as the process (torch may free into it until then): use vmmipc_pool_trim to give its free chunks back", r.device)
		}
		err := r.pool.Close()
		if core.CodeOf(err) == core.EINVAL {
			return core.WrapErr(core.EINVAL, err, "vmmipc_pool_destroy") // live allocations: nothing touched
		}
		takeHandle(uintptr(h)) // destroyed, also after a failure of the driver
		return err
	})
}

// The torch hooks: torch calls them from its caching allocator, on any
// thread, holding its own lock. They cannot return a status: a failure is
// NULL (torch then frees cached blocks, retries, and raises its
// OutOfMemoryError) with this thread's last error saying why.

//export vmmipcgo_torch_alloc
func vmmipcgo_torch_alloc(size C.size_t, device C.int, out *C.uint64_t) C.int {
	return call("vmmipc_torch_alloc", func() error {
		p, err := cuda.TorchPool(int32(device), 0)
		if err != nil {
			return err
		}
		a, err := p.Alloc(uint64(size))
		if err != nil {
			return err
		}
		*out = C.uint64_t(a)
		return nil
	})
}

//export vmmipcgo_torch_free
func vmmipcgo_torch_free(ptr C.uint64_t, device C.int) C.int {
	return call("vmmipc_torch_free", func() error {
		p := cuda.LookupTorchPool(int32(device))
		if p == nil {
			return core.Errorf(core.EINVAL, "vmmipc_torch_free: device %d has no torch pool, so %#x is not its memory", int32(device), uint64(ptr))
		}
		_, err := p.Free(uint64(ptr))
		return err
	})
}
