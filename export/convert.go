package main

/*
#include "abi.h"
*/
import "C"

import (
	"fmt"
	"time"
	"unsafe"

	"github.com/libvmmipc/libvmmipc/core"
)

// options is vmmipc_options read safely: only the fields that fit in the
// caller's struct_size are read; the rest keep their defaults.
type options struct {
	reg    core.RegisterOptions
	open   core.OpenOptions
	access []int32
}

func readOptions(p *C.vmmipc_options) (options, error) {
	o := options{reg: core.RegisterOptions{Uses: 1, Kind: core.MemoryHost}}
	if p == nil {
		return o, nil
	}
	n := uintptr(p.struct_size)
	if n < unsafe.Sizeof(p.struct_size) {
		return o, core.Errorf(core.EINVAL, "options: struct_size %d is too small; call vmmipc_options_init first", n)
	}
	has := func(off, size uintptr) bool { return off+size <= n }
	if has(unsafe.Offsetof(p.uses), 4) {
		o.reg.Uses = uint32(p.uses)
	}
	if has(unsafe.Offsetof(p.ttl_ms), 8) {
		o.reg.TTL = time.Duration(p.ttl_ms) * time.Millisecond
		if p.ttl_ms > 1<<40 {
			return o, core.Errorf(core.EINVAL, "options: ttl_ms %d is too large", uint64(p.ttl_ms))
		}
	}
	if has(unsafe.Offsetof(p.timeout_ms), 4) {
		o.open.Timeout = time.Duration(p.timeout_ms) * time.Millisecond
	}
	if has(unsafe.Offsetof(p.window), 4) {
		o.open.Window = uint32(p.window)
		if o.open.Window > 1024 {
			return o, core.Errorf(core.EINVAL, "options: window %d is larger than 1024", o.open.Window)
		}
	}
	if has(unsafe.Offsetof(p.memory_kind), 4) && p.memory_kind != 0 {
		o.reg.Kind = uint8(p.memory_kind)
		if p.memory_kind != C.VMMIPC_MEMORY_HOST && p.memory_kind != C.VMMIPC_MEMORY_CUDA {
			return o, core.Errorf(core.EINVAL, "options: memory_kind %d is neither VMMIPC_MEMORY_HOST nor VMMIPC_MEMORY_CUDA", uint32(p.memory_kind))
		}
	}
	if has(unsafe.Offsetof(p.access_devices), unsafe.Sizeof(p.access_devices)) && p.access_device_count > 0 {
		if p.access_devices == nil || p.access_device_count > 64 {
			return o, core.Errorf(core.EINVAL, "options: access_devices is NULL or access_device_count %d > 64", uint32(p.access_device_count))
		}
		for _, d := range unsafe.Slice((*int32)(unsafe.Pointer(p.access_devices)), int(p.access_device_count)) {
			o.access = append(o.access, d)
		}
	}
	return o, nil
}

func readTicket(p *C.vmmipc_ticket) (*core.Ticket, error) {
	if p == nil {
		return nil, core.Errorf(core.EINVAL, "ticket is NULL")
	}
	return core.DecodeTicket(C.GoBytes(unsafe.Pointer(&p.bytes[0]), C.VMMIPC_TICKET_SIZE))
}

func writeTicket(t *core.Ticket, out *C.vmmipc_ticket) error {
	b, err := t.Marshal()
	if err != nil {
		return err
	}
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&out.bytes[0])), C.VMMIPC_TICKET_SIZE), b[:])
	return nil
}

// u64s copies a C array of n uint64s.
func u64s(p *C.uint64_t, n C.uint64_t, what string) ([]uint64, error) {
	if p == nil {
		return nil, core.Errorf(core.EINVAL, "%s is NULL", what)
	}
	if n == 0 || uint64(n) > core.MaxChunks {
		return nil, core.Errorf(core.EINVAL, "count %d is 0 or above the limit of %d", uint64(n), core.MaxChunks)
	}
	return append([]uint64(nil), unsafe.Slice((*uint64)(unsafe.Pointer(p)), int(n))...), nil
}

// status records err as this thread's last error and returns its code.
func status(err error) C.int {
	if err == nil {
		return C.VMMIPC_OK
	}
	code := core.CodeOf(err)
	if code == core.End {
		return C.VMMIPC_END
	}
	setLastError(err.Error())
	return C.int(code)
}

func setLastError(msg string) {
	if msg == "" {
		return
	}
	b := []byte(msg)
	C.vmmipc_abi_set_error((*C.char)(unsafe.Pointer(&b[0])), C.size_t(len(b)))
}

// guard turns a panic in an exported function into VMMIPC_EINTERNAL.
func guard(rc *C.int, fn string) {
	if p := recover(); p != nil {
		setLastError(fmt.Sprintf("%s: internal error (please report): %v", fn, p))
		*rc = C.VMMIPC_EINTERNAL
	}
}
