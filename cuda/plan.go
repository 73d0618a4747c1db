package cuda

import (
	"errors"
	"fmt"
	"math"
	"strings"

	"github.com/libvmmipc/libvmmipc/core"
)

// This file holds the logic that needs no driver, so that it is unit tested
// on machines without a GPU.

// DeviceSame is VMMIPC_DEVICE_SAME: import onto the exporter's GPU, found by
// its UUID among the devices this process sees.
const DeviceSame int32 = -2

// maxAccessDevices bounds the devices one mapping grants access to (the
// importing device plus vmmipc_options.access_devices, at most 64).
const maxAccessDevices = 65

// roundUp rounds n up to a multiple of to; ok is false on overflow.
func roundUp(n, to uint64) (r uint64, ok bool) {
	if to == 0 || n > math.MaxUint64-(to-1) {
		return 0, false
	}
	return (n + to - 1) / to * to, true
}

// span is one allocation inside a registered range.
type span struct{ addr, size uint64 }

// walkRange splits [dptr, dptr+size) into the allocations mapped there, as
// reported by rangeAt(p) = the bounds of the allocation containing p
// (cuMemGetAddressRange). The range must start and end on allocation
// boundaries.
func walkRange(dptr, size uint64, rangeAt func(p uint64) (base, n uint64, err error)) ([]span, error) {
	if size == 0 {
		return nil, core.Errorf(core.EINVAL, "register: size is 0")
	}
	end := dptr + size
	if end < dptr {
		return nil, core.Errorf(core.EINVAL, "register: range %#x + %d overflows 64 bits", dptr, size)
	}
	var spans []span
	for p := dptr; p < end; {
		base, n, err := rangeAt(p)
		if err != nil {
			return nil, prefix(err, "register: at %#x (offset %d)", p, p-dptr)
		}
		if n == 0 || base+n < base {
			return nil, core.Errorf(core.ECUDA, "register: cuMemGetAddressRange at %#x returned the bad range [%#x, +%d)", p, base, n)
		}
		if base != p {
			return nil, core.Errorf(core.EINVAL, "register: %#x is inside the allocation mapped at [%#x, %#x): the range must start on an allocation boundary", p, base, base+n)
		}
		if n > end-p {
			return nil, core.Errorf(core.EINVAL, "register: the range ends at %#x, inside the allocation mapped at [%#x, %#x): it must end on an allocation boundary", end, base, base+n)
		}
		if uint64(len(spans)) >= core.MaxChunks {
			return nil, core.Errorf(core.EINVAL, "register: the range holds more than %d allocations", core.MaxChunks)
		}
		spans = append(spans, span{addr: p, size: n})
		p += n
	}
	return spans, nil
}

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

// formatUUID writes a GPU UUID the way nvidia-smi does.
func formatUUID(u [16]byte) string {
	return fmt.Sprintf("GPU-%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// findUUID returns the index of want in uuids, or -1.
func findUUID(uuids [][16]byte, want [16]byte) int {
	for i, u := range uuids {
		if u == want {
			return i
		}
	}
	return -1
}

// accessList returns the devices a mapping grants read-write access to:
// device first, then the extra devices, without repeats. count is the
// number of devices this process sees.
func accessList(device int32, extra []int32, count int32) ([]int32, error) {
	out := []int32{device}
	for _, d := range extra {
		if d < 0 || d >= count {
			return nil, core.Errorf(core.EINVAL, "access device %d does not exist: this process sees %d CUDA device(s)", d, count)
		}
		seen := false
		for _, o := range out {
			seen = seen || o == d
		}
		if !seen {
			out = append(out, d)
		}
	}
	if len(out) > maxAccessDevices {
		return nil, core.Errorf(core.EINVAL, "%d access devices exceed the limit of %d", len(out), maxAccessDevices)
	}
	return out, nil
}

// prefix puts context in front of err's message and keeps its status code
// (ECUDA when err carries none).
func prefix(err error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	var e *core.Error
	if errors.As(err, &e) {
		return &core.Error{Code: e.Code, Msg: msg + ": " + e.Msg, Err: e.Err}
	}
	return &core.Error{Code: core.ECUDA, Msg: msg, Err: err}
}
