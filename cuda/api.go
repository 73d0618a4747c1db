// Package cuda is the only package that knows the CUDA driver.
package cuda

import "github.com/libvmmipc/libvmmipc/core"

// Registered is what a CUDA registration hands to the core.
type Registered struct {
	Sizes      []uint64
	Exporter   core.Exporter
	DeviceUUID [16]byte
}

// Importer is a core.Importer onto one GPU.
type Importer interface {
	core.Importer
	Device() int32 // the ordinal actually used
}

func RegisterRange(dptr, size uint64) (*Registered, error) {
	return nil, core.Errorf(core.ECUDA, "cuda: not built yet")
}

func RegisterHandles(handles, sizes []uint64, release func()) (*Registered, error) {
	return nil, core.Errorf(core.ECUDA, "cuda: not built yet")
}

func NewImporter(device int32, uuid [16]byte, access []int32) (Importer, error) {
	return nil, core.Errorf(core.ECUDA, "cuda: not built yet")
}
