package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "driver.h"
*/
import "C"

import (
	"fmt"
	"os"
	"runtime"
	"sync"
	"unsafe"

	"github.com/libvmmipc/libvmmipc/core"
)

// DefaultLibrary is the CUDA driver library opened unless VMMIPC_LIBCUDA
// names another path.
const DefaultLibrary = "libcuda.so.1"

// LibraryEnv overrides the path of the CUDA driver library.
const LibraryEnv = "VMMIPC_LIBCUDA"

// DriverError is a CUDA driver call that returned something other than
// CUDA_SUCCESS. It is the cause (errors.As) of the *core.Error this package
// returns, whose message is "<call>: <CUresult name>".
type DriverError struct {
	Call   string // the entry point, e.g. "cuMemMap"
	Result int    // the CUresult
	Name   string // e.g. "CUDA_ERROR_OUT_OF_MEMORY"
}

func (e *DriverError) Error() string { return e.Name }

// resultName names a CUresult with the driver's own cuGetErrorName.
func resultName(r C.CUresult) string {
	if s := C.vcu_error_name(r); s != nil {
		return C.GoString(s)
	}
	return fmt.Sprintf("CUresult(%d)", int(r))
}

// check turns a CUresult into nil or a core.ECUDA error naming the call.
func check(call string, r C.CUresult) error {
	return checkAs(core.ECUDA, call, r)
}

// checkAs is check with another status code (EINVAL when the caller's input
// was at fault, EEXPORT for the sender's export).
func checkAs(code core.Code, call string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	return &core.Error{Code: code, Msg: call, Err: &DriverError{Call: call, Result: int(r), Name: resultName(r)}}
}

// The driver is loaded at most once per process; a failed load is retried
// on the next call (the library may have been installed, or the override
// fixed, in between), which sync.Once cannot do.
var loader struct {
	mu     sync.Mutex
	loaded bool
}

// load opens the driver if it is not open yet.
func load() error {
	loader.mu.Lock()
	defer loader.mu.Unlock()
	if loader.loaded {
		return nil
	}
	path := DefaultLibrary
	if p := os.Getenv(LibraryEnv); p != "" {
		path = p
	}
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var buf [512]C.char
	var initResult C.CUresult
	// dlerror is per thread: the whole dlopen/dlsym/dlerror sequence runs in
	// this one C call, on this locked thread.
	runtime.LockOSThread()
	rc := C.vcu_load(cpath, &buf[0], C.size_t(len(buf)), &initResult)
	runtime.UnlockOSThread()
	how := "install the NVIDIA driver, or set " + LibraryEnv + " to the path of libcuda.so.1"
	switch rc {
	case C.VCU_LOAD_OK:
		loader.loaded = true
		return nil
	case C.VCU_LOAD_DLOPEN:
		return &core.Error{Code: core.ECUDA,
			Msg: fmt.Sprintf("cannot load the CUDA driver %s (%s): %s", path, C.GoString(&buf[0]), how)}
	case C.VCU_LOAD_DLSYM:
		return &core.Error{Code: core.ECUDA,
			Msg: fmt.Sprintf("%s is not a usable CUDA driver: %s: %s", path, C.GoString(&buf[0]), how)}
	default:
		return &core.Error{Code: core.ECUDA, Msg: "cuInit (CUDA driver " + path + ")",
			Err: &DriverError{Call: "cuInit", Result: int(initResult), Name: resultName(initResult)}}
	}
}
