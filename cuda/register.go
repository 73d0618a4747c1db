package cuda

/*
#include "driver.h"
*/
import "C"

import (
	"fmt"
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
// away. The references are dropped by the exporter's Release. Opens no
// descriptor. Needs no current context and leaves the caller's as it was.
func RegisterRange(dptr, size uint64) (*Registered, error) {
	if err := load(); err != nil {
		return nil, err
	}
	if size == 0 {
		return nil, core.Errorf(core.EINVAL, "register: size is 0")
	}
	// Find the GPU from the first allocation: these two calls need no context.
	var first C.CUmemGenericAllocationHandle
	if err := check("cuMemRetainAllocationHandle", C.vcu_mem_retain_allocation_handle(&first, C.CUdeviceptr(dptr))); err != nil {
		return nil, prefix(err, "register: %#x is not mapped CUDA VMM memory (cuMemCreate + cuMemMap; cudaMalloc memory cannot be registered)", dptr)
	}
	a, err := properties(first)
	if err != nil {
		err = prefix(err, "register: allocation at %#x", dptr)
	} else {
		err = a.check(fmt.Sprintf("the allocation at %#x", dptr))
	}
	var g *gpu
	if err == nil {
		g, err = gpuOf(a.ordinal)
	}
	if err != nil {
		_ = C.vcu_mem_release(first) // best effort without a context
		return nil, err
	}
	e := &exporter{gpu: g, owned: true}
	err = g.run(func() error {
		if err := check("cuMemRelease", C.vcu_mem_release(first)); err != nil {
			return err
		}
		spans, err := walkRange(dptr, size, func(p uint64) (uint64, uint64, error) {
			var base C.CUdeviceptr
			var n C.size_t
			err := check("cuMemGetAddressRange", C.vcu_mem_get_address_range(&base, &n, C.CUdeviceptr(p)))
			return uint64(base), uint64(n), err
		})
		if err != nil {
			return err
		}
		e.handles = make([]C.CUmemGenericAllocationHandle, 0, len(spans))
		e.sizes = make([]uint64, 0, len(spans))
		for i, s := range spans {
			what := fmt.Sprintf("allocation %d at %#x", i, s.addr)
			var h C.CUmemGenericAllocationHandle
			if err := check("cuMemRetainAllocationHandle", C.vcu_mem_retain_allocation_handle(&h, C.CUdeviceptr(s.addr))); err != nil {
				return prefix(err, "register: %s", what)
			}
			e.handles = append(e.handles, h)
			e.sizes = append(e.sizes, s.size)
			a, err := properties(h)
			if err != nil {
				return prefix(err, "register: %s", what)
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
			return &Registered{Sizes: e.sizes, Exporter: e, DeviceUUID: uuid}, nil
		}
	}
	e.Release() // drop the references taken so far
	return nil, err
}

// RegisterHandles prepares vmmipc_register_cuda_handles. The handles are
// borrowed: release runs from the exporter's Release. Each handle must allow
// POSIX-fd export and all must live on one GPU. The driver has no call that
// returns a handle's size, so each size is checked by mapping the handle on
// a scratch reservation: size bytes must map and size + one granule must
// not.
func RegisterHandles(handles, sizes []uint64, release func()) (*Registered, error) {
	if len(handles) == 0 || len(handles) != len(sizes) {
		return nil, core.Errorf(core.EINVAL, "register: %d handles and %d sizes: need as many of each, at least one", len(handles), len(sizes))
	}
	if err := load(); err != nil {
		return nil, err
	}
	e := &exporter{sizes: append([]uint64(nil), sizes...), onRelease: release}
	for i, h := range handles {
		what := fmt.Sprintf("handle %d (%#x)", i, h)
		e.handles = append(e.handles, C.CUmemGenericAllocationHandle(h))
		a, err := properties(C.CUmemGenericAllocationHandle(h))
		if err != nil {
			return nil, prefix(&core.Error{Code: core.EINVAL, Msg: "not a live allocation handle", Err: err}, "register: %s", what)
		}
		if err := a.check(what); err != nil {
			return nil, err
		}
		if e.gpu == nil {
			if e.gpu, err = gpuOf(a.ordinal); err != nil {
				return nil, err
			}
		} else if a.ordinal != e.gpu.ordinal {
			return nil, core.Errorf(core.EINVAL, "register: %s lives on device %d, handle 0 on device %d: all must live on one GPU", what, a.ordinal, e.gpu.ordinal)
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
				return prefix(err, "register: handle %d (%#x)", i, handles[i])
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	uuid, err := g.uuid()
	if err != nil {
		return nil, err
	}
	return &Registered{Sizes: e.sizes, Exporter: e, DeviceUUID: uuid}, nil
}

// granularity is the minimum allocation granularity of device memory on g.
func granularity(g *gpu) (uint64, error) {
	var n C.size_t
	if err := check("cuMemGetAllocationGranularity", C.vcu_mem_get_granularity(&n, C.int(g.ordinal))); err != nil {
		return 0, err
	}
	if n == 0 {
		return 0, core.Errorf(core.ECUDA, "cuMemGetAllocationGranularity: returned 0 for device %d", g.ordinal)
	}
	return uint64(n), nil
}

// checkHandleSize checks that h's allocation is exactly size bytes by
// mapping it on a scratch reservation. Runs with a context current.
func checkHandleSize(h C.CUmemGenericAllocationHandle, size, gran uint64) error {
	if size%gran != 0 {
		return core.Errorf(core.EINVAL, "size %d is not a multiple of the allocation granularity %d", size, gran)
	}
	larger := size + gran
	if larger < size {
		return core.Errorf(core.EINVAL, "size %d is too large", size)
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

// exporter exports the chunks of one CUDA registration on request.
type exporter struct {
	gpu       *gpu
	handles   []C.CUmemGenericAllocationHandle
	sizes     []uint64
	owned     bool   // the handles are our references: cuMemRelease them
	onRelease func() // the owner's release_fn for borrowed handles

	releaseOnce sync.Once
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

// Release drops the registration's references (RegisterRange) or calls the
// owner's release_fn (RegisterHandles). Runs once.
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
		if e.onRelease != nil {
			e.onRelease()
		}
	})
}
