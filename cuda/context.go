package cuda

/*
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync"

	"github.com/libvmmipc/libvmmipc/core"
)

// gpu is one CUDA device of this process with its primary context.
type gpu struct {
	ordinal int32
	dev     C.CUdevice
	ctx     C.uintptr_t // primary context, retained for the process's life
}

// Primary contexts are retained once per device and never released: the
// driver destroys a primary context when its last reference goes, and
// creating one costs far more than any call here. This matches what the
// CUDA runtime does. Mappings and handles do not depend on a context.
var primaries struct {
	mu  sync.Mutex
	gpu map[int32]*gpu
}

// deviceCount returns the number of devices this process sees.
func deviceCount() (int32, error) {
	var n C.int
	if err := check("cuDeviceGetCount", C.vcu_device_get_count(&n)); err != nil {
		return 0, err
	}
	return int32(n), nil
}

// The devices this process sees, by ordinal: their UUIDs, read once. The
// set cannot change while the process runs (CUDA_VISIBLE_DEVICES is read
// when the driver initializes), so imports resolve devices without a
// driver call after the first.
var devices struct {
	mu    sync.Mutex
	uuids [][16]byte // nil until read
}

// visibleDevices returns the UUID of every device this process sees.
func visibleDevices() ([][16]byte, error) {
	devices.mu.Lock()
	defer devices.mu.Unlock()
	if devices.uuids != nil {
		return devices.uuids, nil
	}
	n, err := deviceCount()
	if err != nil {
		return nil, err
	}
	uuids := make([][16]byte, n)
	for i := range uuids {
		var dev C.CUdevice
		if err := check("cuDeviceGet", C.vcu_device_get(&dev, C.int(i))); err != nil {
			return nil, err
		}
		if uuids[i], err = deviceUUID(dev); err != nil {
			return nil, err
		}
	}
	devices.uuids = uuids
	return uuids, nil
}

// gpuOf returns device ordinal's handle and retained primary context.
func gpuOf(ordinal int32) (*gpu, error) {
	primaries.mu.Lock()
	defer primaries.mu.Unlock()
	if g := primaries.gpu[ordinal]; g != nil {
		return g, nil
	}
	n, err := deviceCount()
	if err != nil {
		return nil, err
	}
	if ordinal < 0 || ordinal >= n {
		return nil, core.Errorf(core.EINVAL, "CUDA device %d does not exist: this process sees %d device(s) (check CUDA_VISIBLE_DEVICES)", ordinal, n)
	}
	g := &gpu{ordinal: ordinal}
	if err := check("cuDeviceGet", C.vcu_device_get(&g.dev, C.int(ordinal))); err != nil {
		return nil, err
	}
	if err := check(fmt.Sprintf("cuDevicePrimaryCtxRetain (device %d)", ordinal), C.vcu_primary_ctx_retain(&g.ctx, g.dev)); err != nil {
		return nil, err
	}
	if primaries.gpu == nil {
		primaries.gpu = map[int32]*gpu{}
	}
	primaries.gpu[ordinal] = g
	return g, nil
}

// uuid returns the device's UUID.
func (g *gpu) uuid() ([16]byte, error) { return deviceUUID(g.dev) }

// deviceUUID is cuDeviceGetUuid.
func deviceUUID(dev C.CUdevice) ([16]byte, error) {
	var u C.CUuuid
	var out [16]byte
	if err := check("cuDeviceGetUuid", C.vcu_device_get_uuid(&u, dev)); err != nil {
		return out, err
	}
	for i := range out {
		out[i] = byte(u.bytes[i])
	}
	return out, nil
}

// run calls fn with g's primary context current on this OS thread and
// leaves the thread's context stack exactly as it found it: if the primary
// context is already current nothing changes, otherwise it is pushed before
// and popped after. Works on threads with no context, or another one.
func (g *gpu) run(fn func() error) error {
	runtime.LockOSThread() // push, fn and pop must share one OS thread
	defer runtime.UnlockOSThread()
	var cur C.uintptr_t
	if err := check("cuCtxGetCurrent", C.vcu_ctx_get_current(&cur)); err != nil {
		return err
	}
	if cur == g.ctx {
		return fn()
	}
	if err := check("cuCtxPushCurrent", C.vcu_ctx_push(g.ctx)); err != nil {
		return err
	}
	err := fn()
	var popped C.uintptr_t
	if perr := check("cuCtxPopCurrent", C.vcu_ctx_pop(&popped)); perr != nil && err == nil {
		err = perr
	}
	return err
}

// reserve is cuMemAddressReserve of size bytes on g (aligned to align, no
// fixed address, flags 0); the driver's out-of-memory is ENOMEM (no virtual
// address space left), not ECUDA.
func (g *gpu) reserve(size, align uint64) (uint64, error) {
	var p C.CUdeviceptr
	err := g.run(func() error {
		r := C.vcu_mem_address_reserve(&p, C.size_t(size), C.size_t(align), 0)
		if r == C.VCU_ERROR_OUT_OF_MEMORY {
			return checkAs(core.ENOMEM, fmt.Sprintf("the driver has no %d bytes of virtual address space left: cuMemAddressReserve", size), r)
		}
		return check("cuMemAddressReserve", r)
	})
	return uint64(p), err
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
