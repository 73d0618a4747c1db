package cuda

import (
	"fmt"
	"strings"

	"github.com/libvmmipc/libvmmipc/core"
)

// Bits of CUmemAllocationHandleType.
const (
	handlePOSIXFD  = 0x1
	handleWin32    = 0x2
	handleWin32KMT = 0x4
	handleFabric   = 0x8
)

// handleTypeNames names the handle types in a requestedHandleTypes mask.
func handleTypeNames(mask uint32) string {
	if mask == 0 {
		return "none (CU_MEM_HANDLE_TYPE_NONE)"
	}
	names := []struct {
		bit  uint32
		name string
	}{
		{handlePOSIXFD, "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"},
		{handleWin32, "CU_MEM_HANDLE_TYPE_WIN32"},
		{handleWin32KMT, "CU_MEM_HANDLE_TYPE_WIN32_KMT"},
		{handleFabric, "CU_MEM_HANDLE_TYPE_FABRIC"},
	}
	var out []string
	for _, n := range names {
		if mask&n.bit != 0 {
			out = append(out, n.name)
			mask &^= n.bit
		}
	}
	if mask != 0 {
		out = append(out, fmt.Sprintf("unknown bits %#x", mask))
	}
	return strings.Join(out, " | ")
}

// checkExportable refuses allocations that cannot be exported as a POSIX
// file descriptor; what names the allocation in the message.
func checkExportable(what string, requested uint32) error {
	if requested&handlePOSIXFD != 0 {
		return nil
	}
	return core.Errorf(core.EINVAL, "register: %s allows export only as %s, not as a POSIX file descriptor: create it with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in CUmemAllocationProp.requestedHandleTypes", what, handleTypeNames(requested))
}
