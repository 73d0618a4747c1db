// Package cuda is the only package that knows the CUDA driver. It opens
// libcuda.so.1 at run time (VMMIPC_LIBCUDA overrides the path), so building
// and unit testing need neither the CUDA toolkit nor a GPU; without a driver
// every function returns a core.ECUDA error that names the library.
//
// Driver calls run with the device's primary context pushed on the calling
// OS thread and popped afterwards, so callers may hold any context, or none.
package cuda

import "github.com/libvmmipc/libvmmipc/core"

// Registered is what a CUDA registration hands to the core.
type Registered struct {
	Sizes      []uint64
	Exporter   core.Exporter
	DeviceUUID [16]byte
}
