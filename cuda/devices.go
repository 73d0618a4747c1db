package cuda

import (
	"fmt"

	"github.com/libvmmipc/libvmmipc/core"
)

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
// number of devices this process sees. (core.ImportOptions bounds how many
// extra devices there may be.)
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
	return out, nil
}
