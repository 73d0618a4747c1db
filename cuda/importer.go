package cuda

/*
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"

	"github.com/libvmmipc/libvmmipc/core"
)

// gpuImporter reserves one range on a GPU and maps imported chunks into it.
// All methods hold mu, so Unmap may come from any thread, at any time.
type gpuImporter struct {
	mu       sync.Mutex
	gpu      *gpu
	access   []int32 // devices given read-write access, gpu first
	gran     uint64
	base     uint64
	reserved uint64 // bytes reserved at base; 0 = nothing reserved
	total    uint64 // bytes the ticket holds
	mapped   []span // offsets and sizes mapped so far, in order
}

// GPU is the core.GPU this package provides.
type GPU struct{}

// Placement is core.GPU's: the access list of the resolved placement.
func (GPU) Placement(device int32, uuid [16]byte, access []int32) (string, error) {
	p, err := resolve(device, uuid, access)
	if err != nil {
		return "", err
	}
	return placementKey(p.devices), nil
}

// NewImporter prepares an import onto device (an ordinal, or DeviceSame for
// the GPU whose UUID is uuid), granting read-write access to it and to the
// access devices. Checks peer access up front so nothing is reserved for an
// import that cannot finish.
func (GPU) NewImporter(device int32, uuid [16]byte, access []int32) (core.Importer, error) {
	p, err := resolve(device, uuid, access)
	if err != nil {
		return nil, err
	}
	if p.owner >= 0 {
		if err := checkPeers(p.devices, p.owner, uuid); err != nil {
			return nil, err
		}
	}
	g, err := gpuOf(p.devices[0])
	if err != nil {
		return nil, err
	}
	gran, err := granularity(g)
	if err != nil {
		return nil, err
	}
	return &gpuImporter{gpu: g, access: p.devices, gran: gran}, nil
}

// placement is where an import maps: the devices given access (the
// importing device first) and the exporter's GPU here (-1: not seen).
type placement struct {
	devices []int32
	owner   int32
}

// placementKey names a placement in the import cache's key: the same buffer
// mapped with other access is another mapping.
func placementKey(devices []int32) string { return fmt.Sprintf("cuda:%v", devices) }

// resolve finds the importing device (DeviceSame: the GPU whose UUID is
// uuid) and the access list, from the device table alone.
func resolve(device int32, uuid [16]byte, access []int32) (placement, error) {
	if err := load(); err != nil {
		return placement{}, err
	}
	uuids, err := visibleDevices()
	if err != nil {
		return placement{}, err
	}
	count := int32(len(uuids))
	owner := int32(-1) // ordinal of the exporter's GPU here, if this process sees it
	if uuid != ([16]byte{}) {
		owner = int32(findUUID(uuids, uuid))
	}
	if device == core.DeviceSame {
		if uuid == ([16]byte{}) {
			return placement{}, core.Errorf(core.EINVAL, "import: this ticket names no GPU (it was made with vmmipc_register, not vmmipc_register_cuda*): pass a device ordinal instead of VMMIPC_DEVICE_SAME")
		}
		if owner < 0 {
			return placement{}, core.Errorf(core.ECUDA, "import: the exporter's GPU %s is not among the %d CUDA device(s) this process sees (check CUDA_VISIBLE_DEVICES), or pass a device ordinal instead of VMMIPC_DEVICE_SAME", formatUUID(uuid), count)
		}
		device = owner
	}
	if device < 0 || device >= count {
		return placement{}, core.Errorf(core.EINVAL, "import: CUDA device %d does not exist: this process sees %d device(s)", device, count)
	}
	devices, err := accessList(device, access, count)
	if err != nil {
		return placement{}, core.WrapErr(core.ECUDA, err, "import")
	}
	return placement{devices: devices, owner: owner}, nil
}

// checkPeers makes sure every device can reach memory on owner.
func checkPeers(devices []int32, owner int32, uuid [16]byte) error {
	var ownerDev C.CUdevice
	if err := check("cuDeviceGet", C.vcu_device_get(&ownerDev, C.int(owner))); err != nil {
		return err
	}
	for _, d := range devices {
		if d == owner {
			continue
		}
		var dev C.CUdevice
		if err := check("cuDeviceGet", C.vcu_device_get(&dev, C.int(d))); err != nil {
			return err
		}
		var can C.int
		if err := check("cuDeviceCanAccessPeer", C.vcu_device_can_access_peer(&can, dev, ownerDev)); err != nil {
			return err
		}
		if can == 0 {
			return core.Errorf(core.EINVAL, "import: device %d cannot access memory on device %d (%s), where the exporter's memory lives: cuDeviceCanAccessPeer says no peer access; import onto device %d or drop device %d from the access devices", d, owner, formatUUID(uuid), owner, d)
		}
	}
	return nil
}

// Device is the ordinal the mapping lives on.
func (m *gpuImporter) Device() int32 { return m.gpu.ordinal }

// Reserve reserves total bytes (rounded up to the allocation granularity),
// aligned to the granularity.
func (m *gpuImporter) Reserve(total uint64) (uint64, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.reserved != 0 {
		return 0, core.Errorf(core.EINTERNAL, "import: Reserve called twice")
	}
	n, ok := core.RoundUp(total, m.gran)
	if !ok || total == 0 {
		return 0, core.Errorf(core.EINVAL, "import: %d bytes cannot be reserved", total)
	}
	base, err := m.gpu.reserve(n, m.gran)
	if err != nil {
		return 0, err
	}
	m.base, m.reserved, m.total = base, n, total
	return m.base, nil
}

// Map imports the chunk's descriptor, maps it at base+offset and drops the
// import handle at once: the mapping keeps the memory alive. The descriptor
// stays the caller's.
func (m *gpuImporter) Map(c core.Chunk) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.reserved == 0 {
		return core.Errorf(core.EINTERNAL, "import: Map before Reserve")
	}
	if c.FileOffset != 0 {
		return core.Errorf(core.EINVAL, "file offset %d: CUDA chunks start at offset 0 of their descriptor", c.FileOffset)
	}
	if c.Size == 0 || c.Offset%m.gran != 0 || c.Size%m.gran != 0 {
		return core.Errorf(core.EINVAL, "chunk [%d, +%d) is not aligned to the allocation granularity %d", c.Offset, c.Size, m.gran)
	}
	if c.Offset > m.reserved || c.Size > m.reserved-c.Offset {
		return core.Errorf(core.EINVAL, "chunk [%d, +%d) lies outside the %d reserved bytes", c.Offset, c.Size, m.reserved)
	}
	if c.FD < 0 {
		return core.Errorf(core.EINVAL, "no descriptor (fd %d)", c.FD)
	}
	return m.gpu.run(func() error {
		var h C.CUmemGenericAllocationHandle
		if err := check("cuMemImportFromShareableHandle", C.vcu_mem_import_fd(&h, C.int(c.FD))); err != nil {
			return err
		}
		mapErr := check("cuMemMap", C.vcu_mem_map(C.CUdeviceptr(m.base+c.Offset), C.size_t(c.Size), h))
		if mapErr == nil {
			m.mapped = append(m.mapped, span{addr: c.Offset, size: c.Size})
		}
		relErr := check("cuMemRelease", C.vcu_mem_release(h))
		if mapErr != nil {
			return mapErr
		}
		return relErr
	})
}

// Finish grants read-write access over the whole mapped range to the
// importing device and the access devices.
func (m *gpuImporter) Finish() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.reserved == 0 {
		return core.Errorf(core.EINTERNAL, "import: Finish before Reserve")
	}
	var mappedBytes uint64
	for _, s := range m.mapped {
		mappedBytes += s.size
	}
	if mappedBytes != m.total {
		return core.Errorf(core.EINTERNAL, "import: %d of %d bytes mapped at Finish", mappedBytes, m.total)
	}
	return m.gpu.run(func() error {
		ords := make([]C.int, len(m.access))
		for i, d := range m.access {
			ords[i] = C.int(d)
		}
		return check("cuMemSetAccess", C.vcu_mem_set_access_rw(C.CUdeviceptr(m.base), C.size_t(m.total),
			(*C.int)(unsafe.Pointer(&ords[0])), C.size_t(len(ords))))
	})
}

// Unmap unmaps every chunk mapped so far (newest first) and frees the
// reservation. It tries everything even when a step fails, reports the first
// failure, and never touches the range again afterwards.
func (m *gpuImporter) Unmap() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.reserved == 0 {
		return nil
	}
	base, reserved, mapped := m.base, m.reserved, m.mapped
	m.base, m.reserved, m.mapped = 0, 0, nil
	return m.gpu.run(func() error {
		var first error
		for i := len(mapped) - 1; i >= 0; i-- {
			s := mapped[i]
			if err := check("cuMemUnmap", C.vcu_mem_unmap(C.CUdeviceptr(base+s.addr), C.size_t(s.size))); err != nil && first == nil {
				first = core.WrapErr(core.ECUDA, err, "unmap [%#x, +%d)", base+s.addr, s.size)
			}
		}
		if err := check("cuMemAddressFree", C.vcu_mem_address_free(C.CUdeviceptr(base), C.size_t(reserved))); err != nil && first == nil {
			first = err
		}
		return first
	})
}
