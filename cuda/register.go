package cuda

/*
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/libvmmipc/libvmmipc/core"
)

// allocation is what the driver says about one allocation handle.
type allocation struct {
	requested uint32 // requestedHandleTypes
	onDevice  bool
	ordinal   int32
}

func properties(h C.CUmemGenericAllocationHandle) (allocation, error) {
	var p C.CUmemAllocationProp
	if err := check("cuMemGetAllocationPropertiesFromHandle", C.vcu_mem_get_allocation_properties(&p, h)); err != nil {
		return allocation{}, err
	}
	return allocation{
		requested: uint32(p.requestedHandleTypes),
		onDevice:  p.location._type == C.VCU_LOCATION_TYPE_DEVICE,
		ordinal:   int32(p.location.id),
	}, nil
}

func (a allocation) check(what string) error {
	if !a.onDevice {
		return core.Errorf(core.EINVAL, "register: %s is not GPU memory (its location is not a device)", what)
	}
	return checkExportable(what, a.requested)
}

// RegisterRange prepares vmmipc_register_cuda: it splits [dptr, dptr+size)
// into the allocations mapped there (cuMemGetAddressRange gives the bounds
// of the allocation mapped at an address) and takes its own reference to
// each (cuMemRetainAllocationHandle), so the owner may free its buffer right
// away. The references are dropped by the exporter's Release, which the
// caller runs if it does not register the spec. The spec's Key names the
// allocations: while our references keep them alive, no other allocation
// can have their handles. Opens no descriptor. Needs no current context and
// leaves the caller's as it was.
func RegisterRange(dptr, size uint64) (core.BufferSpec, error) {
	// Arguments before the environment: a caller's mistake is EINVAL with or
	// without a driver.
	if err := checkRange("register", dptr, size); err != nil {
		return core.BufferSpec{}, err
	}
	if dptr == 0 {
		return core.BufferSpec{}, core.Errorf(core.EINVAL, "register: dptr is 0 (NULL)")
	}
	if err := load(); err != nil {
		return core.BufferSpec{}, err
	}
	// Find the GPU from the first allocation: these two calls need no context.
	var first C.CUmemGenericAllocationHandle
	if err := check("cuMemRetainAllocationHandle", C.vcu_mem_retain_allocation_handle(&first, C.CUdeviceptr(dptr))); err != nil {
		return core.BufferSpec{}, core.WrapErr(core.ECUDA, err, "register: %#x is not mapped CUDA VMM memory (cuMemCreate + cuMemMap; cudaMalloc memory cannot be registered)", dptr)
	}
	a, err := properties(first)
	if err != nil {
		err = core.WrapErr(core.ECUDA, err, "register: allocation at %#x", dptr)
	} else {
		err = a.check(fmt.Sprintf("the allocation at %#x", dptr))
	}
	var g *gpu
	if err == nil {
		g, err = gpuOf(a.ordinal)
	}
	if err != nil {
		_ = C.vcu_mem_release(first) // best effort without a context
		return core.BufferSpec{}, err
	}
	e := &exporter{gpu: g, owned: true}
	err = g.run(func() error {
		if err := check("cuMemRelease", C.vcu_mem_release(first)); err != nil {
			return err
		}
		spans, err := walkRange(dptr, size, addressRange)
		if err != nil {
			return err
		}
		e.handles = make([]C.CUmemGenericAllocationHandle, 0, len(spans))
		e.sizes = make([]uint64, 0, len(spans))
		for i, s := range spans {
			what := fmt.Sprintf("allocation %d at %#x", i, s.addr)
			var h C.CUmemGenericAllocationHandle
			if err := check("cuMemRetainAllocationHandle", C.vcu_mem_retain_allocation_handle(&h, C.CUdeviceptr(s.addr))); err != nil {
				return core.WrapErr(core.ECUDA, err, "register: %s", what)
			}
			e.handles = append(e.handles, h)
			e.sizes = append(e.sizes, s.size)
			a, err := properties(h)
			if err != nil {
				return core.WrapErr(core.ECUDA, err, "register: %s", what)
			}
			if err := a.check(what); err != nil {
				return err
			}
			if a.ordinal != g.ordinal {
				return core.Errorf(core.EINVAL, "register: %s lives on device %d, the first on device %d: a range must lie on one GPU", what, a.ordinal, g.ordinal)
			}
		}
		return nil
	})
	if err == nil {
		var uuid [16]byte
		if uuid, err = g.uuid(); err == nil {
			return core.BufferSpec{Sizes: e.sizes, Kind: core.MemoryCUDA, DeviceUUID: uuid, Exporter: e, Key: e.key()}, nil
		}
	}
	e.Release() // drop the references taken so far
	return core.BufferSpec{}, err
}

// RegisterHandles prepares vmmipc_register_cuda_handles. The handles are
// borrowed (the owner's release runs through core.RegisterOptions with
// LendsExporter). Each handle must allow POSIX-fd export and all must live
// on one GPU. The driver has no call that returns a handle's size, so each
// size is checked by mapping the handle on a scratch reservation: size bytes
// must map and size + one granule must not. The spec has no Key: without
// references of our own, equal handle values need not be the same memory
// for as long as a registration lives.
func RegisterHandles(handles, sizes []uint64) (core.BufferSpec, error) {
	if len(handles) == 0 || len(handles) != len(sizes) {
		return core.BufferSpec{}, core.Errorf(core.EINVAL, "register: %d handles and %d sizes: need as many of each, at least one", len(handles), len(sizes))
	}
	if err := load(); err != nil {
		return core.BufferSpec{}, err
	}
	e := &exporter{sizes: append([]uint64(nil), sizes...)}
	for i, h := range handles {
		what := fmt.Sprintf("handle %d (%#x)", i, h)
		e.handles = append(e.handles, C.CUmemGenericAllocationHandle(h))
		a, err := properties(C.CUmemGenericAllocationHandle(h))
		if err != nil {
			return core.BufferSpec{}, core.WrapErr(core.ECUDA, &core.Error{Code: core.EINVAL, Msg: "not a live allocation handle", Err: err}, "register: %s", what)
		}
		if err := a.check(what); err != nil {
			return core.BufferSpec{}, err
		}
		if e.gpu == nil {
			if e.gpu, err = gpuOf(a.ordinal); err != nil {
				return core.BufferSpec{}, err
			}
		} else if a.ordinal != e.gpu.ordinal {
			return core.BufferSpec{}, core.Errorf(core.EINVAL, "register: %s lives on device %d, handle 0 on device %d: all must live on one GPU", what, a.ordinal, e.gpu.ordinal)
		}
	}
	g := e.gpu
	err := g.run(func() error {
		gran, err := granularity(g)
		if err != nil {
			return err
		}
		for i := range e.handles {
			if err := checkHandleSize(e.handles[i], e.sizes[i], gran); err != nil {
				return core.WrapErr(core.ECUDA, err, "register: handle %d (%#x)", i, handles[i])
			}
		}
		return nil
	})
	if err != nil {
		return core.BufferSpec{}, err
	}
	uuid, err := g.uuid()
	if err != nil {
		return core.BufferSpec{}, err
	}
	return core.BufferSpec{Sizes: e.sizes, Kind: core.MemoryCUDA, DeviceUUID: uuid, Exporter: e}, nil
}

// QueryRange tells whether dptr lies in VMM memory and which range on
// allocation boundaries covers [dptr, dptr+size): base, its size, the
// handle types the allocation at dptr allows and its device. It keeps no
// reference. ENOENT: not VMM memory.
func QueryRange(dptr, size uint64) (base, n uint64, handleTypes uint32, device int32, err error) {
	if err := checkRange("query", dptr, size); err != nil {
		return 0, 0, 0, 0, err
	}
	last := dptr + size - 1
	if err := load(); err != nil {
		return 0, 0, 0, 0, err
	}
	// Retaining a handle is the driver's way to say "VMM memory": it fails
	// for cudaMalloc, host and unmapped memory. These calls need no
	// context. Both ends are asked, so a range running past the mapping is
	// ENOENT too.
	var h, hEnd C.CUmemGenericAllocationHandle
	if r := C.vcu_mem_retain_allocation_handle(&h, C.CUdeviceptr(dptr)); r != 0 {
		return 0, 0, 0, 0, checkAs(core.ENOENT, fmt.Sprintf("%#x is not mapped CUDA VMM memory (cudaMalloc, host or unmapped memory): cuMemRetainAllocationHandle", dptr), r)
	}
	if r := C.vcu_mem_retain_allocation_handle(&hEnd, C.CUdeviceptr(last)); r != 0 {
		_ = C.vcu_mem_release(h) // best effort without a context
		return 0, 0, 0, 0, checkAs(core.ENOENT, fmt.Sprintf("the range's end %#x is not mapped CUDA VMM memory: cuMemRetainAllocationHandle", last), r)
	}
	_ = C.vcu_mem_release(hEnd) // only needed the answer
	a, err := properties(h)
	var g *gpu
	if err == nil && !a.onDevice {
		err = core.Errorf(core.ENOENT, "%#x is VMM memory but not on a GPU (its location is not a device)", dptr)
	}
	if err == nil {
		g, err = gpuOf(a.ordinal)
	}
	if err != nil {
		_ = C.vcu_mem_release(h) // best effort without a context
		return 0, 0, 0, 0, err
	}
	err = g.run(func() error {
		if err := check("cuMemRelease", C.vcu_mem_release(h)); err != nil {
			return err
		}
		lo, _, err := addressRange(dptr)
		if err != nil {
			return err
		}
		hiBase, hiSize, err := addressRange(last)
		if err != nil {
			return core.WrapErr(core.ECUDA, err, "query: the range's end %#x", last)
		}
		base, n = lo, hiBase+hiSize-lo
		return nil
	})
	if err != nil {
		return 0, 0, 0, 0, err
	}
	return base, n, a.requested, a.ordinal, nil
}

// addressRange is cuMemGetAddressRange: the allocation mapped around p.
// Runs with a context current.
func addressRange(p uint64) (uint64, uint64, error) {
	var base C.CUdeviceptr
	var n C.size_t
	err := check("cuMemGetAddressRange", C.vcu_mem_get_address_range(&base, &n, C.CUdeviceptr(p)))
	return uint64(base), uint64(n), err
}

// checkHandleSize checks that h's allocation is exactly size bytes by
// mapping it on a scratch reservation. Runs with a context current.
func checkHandleSize(h C.CUmemGenericAllocationHandle, size, gran uint64) error {
	if size%gran != 0 {
		return core.Errorf(core.EINVAL, "size %d is not a multiple of the allocation granularity %d", size, gran)
	}
	larger := size + gran
	if larger < size {
		return core.Errorf(core.EINVAL, "size %d is too large: adding the allocation granularity %d to it overflows 64 bits", size, gran)
	}
	var va C.CUdeviceptr
	if err := check("cuMemAddressReserve", C.vcu_mem_address_reserve(&va, C.size_t(larger), C.size_t(gran), 0)); err != nil {
		return err
	}
	defer C.vcu_mem_address_free(va, C.size_t(larger))
	if r := C.vcu_mem_map(va, C.size_t(size), h); r != 0 {
		return checkAs(core.EINVAL, fmt.Sprintf("size %d does not match the allocation (cuMemMap of that many bytes failed)", size), r)
	}
	if err := check("cuMemUnmap", C.vcu_mem_unmap(va, C.size_t(size))); err != nil {
		return err
	}
	if C.vcu_mem_map(va, C.size_t(larger), h) == 0 {
		_ = C.vcu_mem_unmap(va, C.size_t(larger))
		return core.Errorf(core.EINVAL, "size %d does not match the allocation: it is larger", size)
	}
	return nil
}

// exporter exports the chunks of one CUDA buffer on request.
type exporter struct {
	gpu     *gpu
	handles []C.CUmemGenericAllocationHandle
	sizes   []uint64
	owned   bool // the handles are our references: cuMemRelease them

	releaseOnce sync.Once
}

// key names the allocations of an owned range for core's buffer sharing.
func (e *exporter) key() string {
	var b strings.Builder
	fmt.Fprintf(&b, "cuda:%d", e.gpu.ordinal)
	for i, h := range e.handles {
		fmt.Fprintf(&b, ":%x/%d", uint64(h), e.sizes[i])
	}
	return b.String()
}

// ExportChunk exports exactly chunk index as a new POSIX file descriptor.
// A failure is VMMIPC_EEXPORT for the receiver, naming the driver call.
func (e *exporter) ExportChunk(index uint64) (int, uint64, error) {
	if index >= uint64(len(e.handles)) {
		return -1, 0, core.Errorf(core.EINVAL, "chunk %d does not exist (%d chunks)", index, len(e.handles))
	}
	fd := C.int(-1)
	err := e.gpu.run(func() error {
		return checkAs(core.EEXPORT, "cuMemExportToShareableHandle", C.vcu_mem_export_fd(&fd, e.handles[index]))
	})
	if err != nil {
		if fd >= 0 {
			_ = unix.Close(int(fd))
		}
		return -1, 0, err
	}
	// The driver's descriptor may lack close-on-exec, and the driver has no
	// flag to ask for it: setting it at once narrows, but cannot close, the
	// window in which a concurrent exec in the host could inherit it.
	unix.CloseOnExec(int(fd))
	return int(fd), 0, nil
}

// Release drops our references (RegisterRange); borrowed handles
// (RegisterHandles) are left alone. Runs once.
func (e *exporter) Release() {
	e.releaseOnce.Do(func() {
		if e.owned && e.gpu != nil && len(e.handles) > 0 {
			_ = e.gpu.run(func() error {
				for _, h := range e.handles {
					_ = C.vcu_mem_release(h) // nothing useful to do with a failure here
				}
				return nil
			})
		}
		e.handles = nil
	})
}
