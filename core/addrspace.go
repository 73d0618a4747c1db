package core

import (
	"bytes"
	"fmt"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// RuntimeHeadroom is the address space an import leaves free under
// RLIMIT_AS for the Go runtime inside this process: the runtime reserves its
// heap in 64 MiB arenas and each new thread takes a stack, and it cannot
// survive failing to get them (it aborts the whole process). A reservation
// that would leave less is refused with ENOMEM instead; export/abi.c
// refuses such an import before entering Go (its init hands the value over).
const RuntimeHeadroom = 128 << 20

// checkAddressSpace refuses a reservation of need bytes that RLIMIT_AS
// leaves no room for (what: "import" or "pool", who reserves; instead:
// what else the caller can do). (CUDA reservations count too: the driver
// keeps the unified address space by reserving the same range in the host.)
func checkAddressSpace(need uint64, what, instead string) error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_AS, &lim); err != nil || lim.Cur == unix.RLIM_INFINITY {
		return nil
	}
	used, err := addressSpaceInUse()
	if err != nil {
		return nil // cannot tell: let the reservation itself fail cleanly
	}
	return addressSpaceFits(need, lim.Cur, used, what, instead)
}

// addressSpaceFits is checkAddressSpace's arithmetic: need bytes more, with
// RuntimeHeadroom kept, under a limit of limit bytes with used in use.
func addressSpaceFits(need, limit, used uint64, what, instead string) error {
	if need <= limit && used <= limit-need && limit-need-used >= RuntimeHeadroom {
		return nil
	}
	free := uint64(0)
	if limit > used {
		free = limit - used
	}
	// The figures are rounded down and the shortfall up (shortStr): a free
	// figure rounded up to what is needed would read as enough.
	return Errorf(ENOMEM, "%s: reserving %s needs that much address space plus %s kept for the Go runtime, but RLIMIT_AS (%s) leaves %s free (%s in use), %s short: raise RLIMIT_AS (ulimit -v)%s",
		what, sizeStr(need), sizeStr(RuntimeHeadroom), sizeStr(limit), sizeStr(free), sizeStr(used), shortStr(need+RuntimeHeadroom-free), instead)
}

// shortStr gives a shortfall rounded up (a whole KiB below 1 MiB, else a
// tenth of a MiB), so that it never reads as less than it is.
func shortStr(n uint64) string {
	if n < 1<<20 {
		return fmt.Sprintf("%d KiB", (n+1023)/1024)
	}
	mib, rest := n>>20, n&(1<<20-1)
	tenths := mib*10 + (rest*10+(1<<20-1))>>20 // the remainder's tenths, rounded up
	return fmt.Sprintf("%d.%d MiB", tenths/10, tenths%10)
}

// addressSpaceInUse is this process's virtual size, what RLIMIT_AS counts.
func addressSpaceInUse() (uint64, error) {
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		return 0, err
	}
	f := bytes.Fields(b)
	if len(f) == 0 {
		return 0, fmt.Errorf("/proc/self/statm is empty")
	}
	pages, err := strconv.ParseUint(string(f[0]), 10, 64)
	if err != nil {
		return 0, err
	}
	return pages * pageSize, nil
}

// sizeStr gives a size to a tenth of a GiB or MiB, rounded down.
func sizeStr(n uint64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%d.%d GiB", n>>30, (n%(1<<30))*10>>30)
	case n >= 1<<20:
		return fmt.Sprintf("%d.%d MiB", n>>20, (n%(1<<20))*10>>20)
	default:
		return fmt.Sprintf("%d bytes", n)
	}
}
