package cuda

import (
	"errors"
	"math"
	"strings"
	"testing"

	"github.com/libvmmipc/libvmmipc/core"
)

// driverPresent reports whether a CUDA driver loads here; the no-driver
// tests skip on GPU machines (tests/gpu covers those).
func driverPresent(t *testing.T) bool {
	t.Helper()
	t.Setenv(LibraryEnv, "")
	err := load()
	return err == nil || !strings.Contains(err.Error(), "cannot load")
}

// everyEntry calls each exported function of the package and returns their
// errors by name.
func everyEntry() map[string]error {
	_, errRange := RegisterRange(0x7f0000000000, 2<<20)
	_, errHandles := RegisterHandles([]uint64{1}, []uint64{2 << 20})
	_, errImport := GPU{}.NewImporter(0, [16]byte{1}, nil)
	_, errSame := GPU{}.NewImporter(core.DeviceSame, [16]byte{1}, []int32{1})
	_, errPlacement := GPU{}.Placement(core.DeviceSame, [16]byte{1}, nil)
	_, _, _, _, errQuery := QueryRange(0x7f0000000000, 2<<20)
	return map[string]error{"RegisterRange": errRange, "RegisterHandles": errHandles,
		"NewImporter": errImport, "NewImporter(DeviceSame)": errSame, "Placement": errPlacement,
		"QueryRange": errQuery}
}

func TestNoDriverAtOverridePath(t *testing.T) {
	if driverPresent(t) {
		t.Skip("a CUDA driver is installed here: the no-driver path cannot be tested")
	}
	for _, path := range []string{"/nonexistent/libcuda.so.1", "/nonexistent/other.so"} {
		t.Setenv(LibraryEnv, path)
		for name, err := range everyEntry() {
			if core.CodeOf(err) != core.ECUDA {
				t.Fatalf("%s with %s=%s: code %v (%v), want ECUDA", name, LibraryEnv, path, core.CodeOf(err), err)
			}
			// Each try reads the override again: a failure is not cached.
			if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), LibraryEnv) {
				t.Fatalf("%s: message %q does not name %s and %s", name, err, path, LibraryEnv)
			}
		}
	}
}

func TestNoDriverAtDefaultPath(t *testing.T) {
	if driverPresent(t) {
		t.Skip("a CUDA driver is installed here: the no-driver path cannot be tested")
	}
	for name, err := range everyEntry() {
		if core.CodeOf(err) != core.ECUDA || !strings.Contains(err.Error(), "cannot load the CUDA driver libcuda.so.1") {
			t.Fatalf("%s: got %v (%v), want ECUDA naming libcuda.so.1", name, core.CodeOf(err), err)
		}
	}
}

func TestLibraryWithoutCUDAEntryPoints(t *testing.T) {
	if driverPresent(t) {
		t.Skip("a CUDA driver is installed here: the no-driver path cannot be tested")
	}
	// libc opens fine but has no cuInit: dlsym must fail cleanly (and the
	// library be closed again), not crash.
	t.Setenv(LibraryEnv, "libc.so.6")
	for i := 0; i < 3; i++ {
		_, err := GPU{}.NewImporter(0, [16]byte{}, nil)
		if core.CodeOf(err) != core.ECUDA || !strings.Contains(err.Error(), "libc.so.6 is not a usable CUDA driver: entry point cuInit not found") {
			t.Fatalf("got %v (%v)", core.CodeOf(err), err)
		}
	}
}

// fakeRanges answers like cuMemGetAddressRange over allocations laid end to
// end from base with the given sizes.
func fakeRanges(base uint64, sizes ...uint64) func(uint64) (uint64, uint64, error) {
	return func(p uint64) (uint64, uint64, error) {
		at := base
		for _, s := range sizes {
			if p >= at && p < at+s {
				return at, s, nil
			}
			at += s
		}
		return 0, 0, &core.Error{Code: core.ECUDA, Msg: "cuMemGetAddressRange", Err: &DriverError{Name: "CUDA_ERROR_NOT_FOUND"}}
	}
}

func TestWalkRange(t *testing.T) {
	const mib = 1 << 20
	const base = 0x7f0000000000
	rangeAt := fakeRanges(base, 2*mib, 4*mib, 6*mib, 2*mib)

	spans, err := walkRange(base, 14*mib, rangeAt)
	if err != nil {
		t.Fatal(err)
	}
	want := []span{{base, 2 * mib}, {base + 2*mib, 4 * mib}, {base + 6*mib, 6 * mib}, {base + 12*mib, 2 * mib}}
	if len(spans) != len(want) {
		t.Fatalf("spans %v, want %v", spans, want)
	}
	for i := range want {
		if spans[i] != want[i] {
			t.Fatalf("spans %v, want %v", spans, want)
		}
	}
	// A sub-range on boundaries is fine too.
	if spans, err := walkRange(base+2*mib, 10*mib, rangeAt); err != nil || len(spans) != 2 {
		t.Fatalf("sub-range: %v, %v", spans, err)
	}

	bad := []struct {
		dptr, size uint64
		code       core.Code
		says       string
	}{
		{base + mib, 4 * mib, core.EINVAL, "must start on an allocation boundary"},
		{base, 3 * mib, core.EINVAL, "must end on an allocation boundary"},
		{base, 0, core.EINVAL, "size is 0"},
		{math.MaxUint64 - 10, 20, core.EINVAL, "overflows"},
		{base, 16 * mib, core.ECUDA, "cuMemGetAddressRange: CUDA_ERROR_NOT_FOUND"}, // runs past the last allocation
	}
	for _, b := range bad {
		_, err := walkRange(b.dptr, b.size, rangeAt)
		if core.CodeOf(err) != b.code || !strings.Contains(err.Error(), b.says) {
			t.Errorf("walkRange(%#x, %d): %v (%v), want %v saying %q", b.dptr, b.size, core.CodeOf(err), err, b.code, b.says)
		}
	}
	var de *DriverError
	if _, err := walkRange(base, 16*mib, rangeAt); !errors.As(err, &de) || de.Name != "CUDA_ERROR_NOT_FOUND" {
		t.Errorf("the driver error is not kept as the cause: %v", err)
	}
	// A driver answering size 0 must not loop forever.
	zero := func(p uint64) (uint64, uint64, error) { return p, 0, nil }
	if _, err := walkRange(base, mib, zero); core.CodeOf(err) != core.ECUDA {
		t.Errorf("size-0 answer: %v", err)
	}
}

func TestHandleTypes(t *testing.T) {
	if err := checkExportable("x", handlePOSIXFD|handleFabric); err != nil {
		t.Fatal(err)
	}
	err := checkExportable("allocation 3 at 0x1000", handleFabric|handleWin32)
	if core.CodeOf(err) != core.EINVAL || !strings.Contains(err.Error(), "allows export only as CU_MEM_HANDLE_TYPE_WIN32 | CU_MEM_HANDLE_TYPE_FABRIC") ||
		!strings.Contains(err.Error(), "allocation 3 at 0x1000") {
		t.Fatalf("got %v", err)
	}
	if s := handleTypeNames(0); !strings.Contains(s, "CU_MEM_HANDLE_TYPE_NONE") {
		t.Fatal(s)
	}
	if s := handleTypeNames(0x31); s != "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | unknown bits 0x30" {
		t.Fatal(s)
	}
}

func TestUUID(t *testing.T) {
	u := [16]byte{0x5a, 0x1b, 0x2c, 0x3d, 0x4e, 0x5f, 0x60, 0x71, 0x82, 0x93, 0xa4, 0xb5, 0xc6, 0xd7, 0xe8, 0xf9}
	if s := formatUUID(u); s != "GPU-5a1b2c3d-4e5f-6071-8293-a4b5c6d7e8f9" {
		t.Fatal(s)
	}
	other := u
	other[15] ^= 1
	// The exporter's GPU is found wherever CUDA_VISIBLE_DEVICES put it.
	if i := findUUID([][16]byte{other, {}, u}, u); i != 2 {
		t.Fatalf("findUUID = %d, want 2", i)
	}
	if i := findUUID([][16]byte{other}, u); i != -1 {
		t.Fatalf("findUUID = %d, want -1", i)
	}
}

func TestAccessList(t *testing.T) {
	got, err := accessList(1, []int32{0, 1, 3, 0}, 4)
	if err != nil || len(got) != 3 || got[0] != 1 || got[1] != 0 || got[2] != 3 {
		t.Fatalf("accessList = %v, %v; want [1 0 3]", got, err)
	}
	if _, err := accessList(0, []int32{4}, 4); core.CodeOf(err) != core.EINVAL || !strings.Contains(err.Error(), "access device 4 does not exist") {
		t.Fatalf("got %v", err)
	}
	if _, err := accessList(0, []int32{-1}, 4); core.CodeOf(err) != core.EINVAL {
		t.Fatalf("got %v", err)
	}
}

func TestDriverErrorMessage(t *testing.T) {
	err := core.WrapErr(core.ECUDA, &core.Error{Code: core.ECUDA, Msg: "cuMemImportFromShareableHandle",
		Err: &DriverError{Call: "cuMemImportFromShareableHandle", Result: 2, Name: "CUDA_ERROR_OUT_OF_MEMORY"}}, "import")
	if err.Error() != "import: cuMemImportFromShareableHandle: CUDA_ERROR_OUT_OF_MEMORY" || core.CodeOf(err) != core.ECUDA {
		t.Fatalf("got %q (%v)", err, core.CodeOf(err))
	}
	var de *DriverError
	if !errors.As(err, &de) || de.Result != 2 {
		t.Fatal("DriverError not reachable with errors.As")
	}
	// A cause wrapped with %w inside the message stays reachable through
	// the prefix (the old cuda-only prefix dropped it).
	inner := core.Errorf(core.EINVAL, "walk: %w", &DriverError{Call: "cuMemGetAddressRange", Result: 1, Name: "CUDA_ERROR_INVALID_VALUE"})
	err = core.WrapErr(core.ECUDA, inner, "register: at %#x", 0x1000)
	if !errors.As(err, &de) || de.Result != 1 || core.CodeOf(err) != core.EINVAL ||
		err.Error() != "register: at 0x1000: walk: CUDA_ERROR_INVALID_VALUE" {
		t.Fatalf("got %q (%v)", err, core.CodeOf(err))
	}
}

// TestQueryRangeArguments: a bad range is refused before the driver is
// even looked for, so it is EINVAL with or without one.
func TestQueryRangeArguments(t *testing.T) {
	for _, c := range []struct {
		dptr, size uint64
		says       string
	}{
		{0x7f0000000000, 0, "size is 0"},
		{math.MaxUint64 - 10, 20, "overflows 64 bits"},
		{math.MaxUint64, 2, "overflows 64 bits"},
	} {
		_, _, _, _, err := QueryRange(c.dptr, c.size)
		if core.CodeOf(err) != core.EINVAL || !strings.Contains(err.Error(), c.says) {
			t.Errorf("QueryRange(%#x, %d): %v (%v), want EINVAL saying %q", c.dptr, c.size, core.CodeOf(err), err, c.says)
		}
	}
}

// TestArgumentsBeforeDriver: a caller's mistake is EINVAL whether or not a
// driver can be loaded (here none can: the override names no file).
func TestArgumentsBeforeDriver(t *testing.T) {
	t.Setenv(LibraryEnv, "/nonexistent/libcuda.so.1")
	_, zero := RegisterRange(0, 0)
	_, null := RegisterRange(0, 2<<20)
	_, empty := RegisterRange(0x7f0000000000, 0)
	_, wraps := RegisterRange(^uint64(0)-4095, 8192)
	_, noHandles := RegisterHandles(nil, nil)
	_, uneven := RegisterHandles([]uint64{1}, []uint64{1, 2})
	_, _, _, _, noSize := QueryRange(0x7f0000000000, 0)
	for name, err := range map[string]error{"RegisterRange(0, 0)": zero, "RegisterRange(NULL)": null,
		"RegisterRange(size 0)": empty, "RegisterRange(wraps)": wraps, "RegisterHandles(none)": noHandles,
		"RegisterHandles(uneven)": uneven, "QueryRange(size 0)": noSize} {
		if core.CodeOf(err) != core.EINVAL {
			t.Errorf("%s: %v (%v), want EINVAL before any driver is loaded", name, core.CodeOf(err), err)
		}
	}
}
