// Package cuda is the only package that knows the CUDA driver. It opens
// libcuda.so.1 at run time (VMMIPC_LIBCUDA overrides the path), so building
// and unit testing need neither the CUDA toolkit nor a GPU; without a driver
// every function returns a core.ECUDA error that names the library.
//
// Driver calls run with the device's primary context pushed on the calling
// OS thread and popped afterwards, so callers may hold any context, or none.
//
// Files: driver.go loads the driver and turns CUresults into errors;
// context.go holds primary contexts; register.go prepares registrations
// (core.BufferSpec) and exports chunks; importer.go maps imported chunks;
// pool.go is core.Pool's backend (the allocator made for sharing);
// walk.go, handletypes.go and devices.go hold the logic that needs no
// driver, unit tested without a GPU.
package cuda
