package core

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Bounds: each of vmmipc.h's VMMIPC_MAX_* option bounds, refusals whose
// figures never round up, and the receiver's address-space check.

// TestOptionBounds: each bound of vmmipc.h's VMMIPC_MAX_* holds at its
// value and is refused one past it, by Validate and by the calls that take
// the options.
func TestOptionBounds(t *testing.T) {
	ok := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s: %v, want ok", what, err)
		}
	}
	refused := func(what string, err error, says string) {
		t.Helper()
		if CodeOf(err) != EINVAL || !strings.Contains(err.Error(), says) {
			t.Errorf("%s: %v, want EINVAL saying %q", what, err, says)
		}
	}
	ok("window at the bound", OpenOptions{Window: MaxWindow}.Validate())
	refused("window past the bound", OpenOptions{Window: MaxWindow + 1}.Validate(), "window 1025 is larger than 1024")
	refused("negative timeout", OpenOptions{Timeout: -time.Second}.Validate(), "negative")
	ok("64 access devices", ImportOptions{Access: make([]int32, MaxAccessDevices)}.Validate())
	refused("65 access devices", ImportOptions{Access: make([]int32, MaxAccessDevices+1)}.Validate(), "65 access devices exceed the limit of 64")
	refused("window inside import options", ImportOptions{OpenOptions: OpenOptions{Window: MaxWindow + 1}}.Validate(), "window")
	refused("a count of access devices", CheckAccessCount(1<<40), "exceed the limit")
	ok("ttl at the bound", RegisterOptions{TTL: MaxTTL}.Validate())
	refused("ttl past the bound", RegisterOptions{TTL: MaxTTL + time.Millisecond}.Validate(), "ttl")
	refused("negative ttl", RegisterOptions{TTL: -1}.Validate(), "ttl")
	if d, err := TTLFromMillis(1 << 40); err != nil || d != MaxTTL {
		t.Errorf("TTLFromMillis(2^40) = %v, %v", d, err)
	}
	_, err := TTLFromMillis(1<<40 + 1)
	refused("ttl_ms past the bound", err, "ttl_ms 1099511627777 is larger than 1099511627776")
	// Each count message says which of the two is wrong, and nothing of the
	// other (not "count 0 is 0 or above the limit").
	refused("0 chunks", CheckCount(0, "vmmipc_register"), "vmmipc_register: count is 0: register at least one chunk")
	if err := CheckCount(0, "x"); strings.Contains(err.Error(), "limit") {
		t.Errorf("0 chunks: %v, speaks of the limit", err)
	}
	ok("1 chunk", CheckCount(1, "x"))
	ok("chunks at the bound", CheckCount(MaxChunks, "x"))
	refused("chunks past the bound", CheckCount(MaxChunks+1, "x"), "x: count 67108865 is above the limit of 67108864 chunks (VMMIPC_MAX_CHUNKS)")
	if err := CheckCount(MaxChunks+1, "x"); strings.Contains(err.Error(), " 0 ") {
		t.Errorf("chunks past the bound: %v, speaks of 0", err)
	}
	for _, k := range []uint32{1, 2} {
		if got, err := KindOf(k); err != nil || got != uint8(k) {
			t.Errorf("KindOf(%d) = %d, %v", k, got, err)
		}
	}
	for _, k := range []uint32{0, 3, 257} {
		_, err := KindOf(k)
		refused(fmt.Sprintf("memory kind %d", k), err, "memory_kind")
	}

	// The calls check them too.
	s := newTestServer(t)
	fd := newMemfd(t, 4096, pattern(4096, 1))
	defer unix.Close(fd)
	tk := registerFile(t, s, fd, 4096, 4096, RegisterOptions{})
	_, err = Open(tk, OpenOptions{Window: MaxWindow + 1})
	refused("Open", err, "window")
	_, err = Import(tk, DeviceHost, ImportOptions{Access: make([]int32, MaxAccessDevices+1)}, nil)
	refused("Import", err, "access devices")
	_, err = Import(tk, DeviceHost, ImportOptions{Access: []int32{0}}, nil)
	refused("Import of host memory with access devices", err, "CUDA memory only")
	spec, err := HostFile(fd, 4096, 4096)
	if err != nil {
		t.Fatal(err)
	}
	var releasedSpec atomic.Bool
	file := spec.Exporter
	spec.Exporter = &testExporter{export: file.ExportChunk, release: func() { releasedSpec.Store(true); file.Release() }}
	_, err = s.Register(spec, RegisterOptions{TTL: MaxTTL + time.Millisecond})
	refused("Register", err, "ttl")
	if releasedSpec.Load() {
		t.Error("a refused Register released the caller's exporter")
	}
	spec.Exporter.Release()
}

// TestSizesRoundDown: a refusal's figures never round up to what was
// needed (192 MiB less 40 KiB read "192.0 MiB free" for 192 MiB needed).
func TestSizesRoundDown(t *testing.T) {
	for n, want := range map[uint64]string{
		192<<20 - 40<<10: "191.9 MiB", 192 << 20: "192.0 MiB", 1<<30 + 1<<30/10*9 + 1<<29/10: "1.9 GiB", 4095: "4095 bytes",
	} {
		if got := sizeStr(n); got != want {
			t.Errorf("sizeStr(%d) = %q, want %q", n, got, want)
		}
	}
	for n, want := range map[uint64]string{
		40<<10 - 1: "40 KiB", 2<<20 - 10<<10: "2.0 MiB", 2 << 20: "2.0 MiB", 2<<20 + 1: "2.1 MiB", 3 << 30: "3072.0 MiB",
	} {
		if got := shortStr(n); got != want {
			t.Errorf("shortStr(%d) = %q, want %q (never less than it is)", n, got, want)
		}
	}
}

// TestAddressSpaceCheck: under a tight RLIMIT_AS, a reservation that would
// leave the Go runtime less than its headroom is refused with ENOMEM and
// the figures, before anything is reserved; the use it claimed is given
// back. It runs in a helper process, which lowers its own limit (1 GiB
// above what it uses, so it works under the race detector's huge
// reservations too).
func TestAddressSpaceCheck(t *testing.T) {
	h := startHelper(t, partAddrSpace, helperOpts{})
	if got := h.expect("check 67108864 ", faultTimeout); got != "code=0 <nil>" {
		t.Fatalf("64 MiB with 1 GiB free: %s", got)
	}
	got := h.expect("check 2147483648 ", faultTimeout)
	for _, want := range []string{fmt.Sprintf("code=%d", ENOMEM), "reserving 2.0 GiB needs that much address space plus 128.0 MiB kept for the Go runtime", "but RLIMIT_AS (", "free (", "in use), ", " short: raise RLIMIT_AS (ulimit -v) or import less at a time"} {
		if !strings.Contains(got, want) {
			t.Fatalf("2 GiB with 1 GiB free: %q does not say %q", got, want)
		}
	}
	got = h.expect("import ", faultTimeout)
	var code, fdsBefore, fdsAfter, maps int
	if _, err := fmt.Sscanf(got, "code=%d fds=%d/%d maps=%d", &code, &fdsBefore, &fdsAfter, &maps); err != nil {
		t.Fatalf("%q: %v", got, err)
	}
	if Code(code) != ENOMEM || fdsAfter != fdsBefore || maps != 0 || !strings.Contains(got, "RLIMIT_AS") {
		t.Fatalf("a 2 GiB import with 1 GiB free: %s; want ENOMEM, no descriptor and no mapping left", got)
	}
	if got := h.expect("retry ", faultTimeout); got != "code=0 <nil>" {
		t.Fatalf("the same import once the limit is back (its use was given back?): %s", got)
	}
}
