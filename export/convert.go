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

// options is vmmipc_options as read from C: only the fields that fit in the
// caller's struct_size are read; the rest keep their defaults. Bounds are
// checked by core's Validate methods, not here.
type options struct {
	uses   uint32
	ttl    time.Duration
	kind   uint8
	open   core.OpenOptions
	access []int32
	flags  uint32 // import_flags, checked by core
	hold   bool   // register_flags VMMIPC_REGISTER_HOLD
}

// defaultOptions are the options of NULL opts, and those of the fields a
// short struct lacks: core.ABIDefaults.
func defaultOptions() options {
	uses, kind := core.ABIDefaults()
	return options{uses: uses, kind: kind}
}

func readOptions(p *C.vmmipc_options) (options, error) {
	o := defaultOptions()
	if p == nil {
		return o, nil
	}
	n := uintptr(p.struct_size)
	if n < unsafe.Sizeof(p.struct_size) {
		return o, core.Errorf(core.EINVAL, "options: opts->struct_size is %d, smaller than the %d bytes of struct_size itself, so no field can be read: fill the struct with vmmipc_options_init(opts, sizeof *opts) first, or pass NULL for the defaults", n, unsafe.Sizeof(p.struct_size))
	}
	has := func(off, size uintptr) bool { return off+size <= n }
	if has(unsafe.Offsetof(p.uses), 4) {
		o.uses = uint32(p.uses)
	}
	if has(unsafe.Offsetof(p.ttl_ms), 8) {
		ttl, err := core.TTLFromMillis(uint64(p.ttl_ms))
		if err != nil {
			return o, err
		}
		o.ttl = ttl
	}
	if has(unsafe.Offsetof(p.timeout_ms), 4) {
		o.open.Timeout = time.Duration(p.timeout_ms) * time.Millisecond
	}
	if has(unsafe.Offsetof(p.window), 4) {
		o.open.Window = uint32(p.window)
	}
	if has(unsafe.Offsetof(p.memory_kind), 4) && p.memory_kind != 0 {
		kind, err := core.KindOf(uint32(p.memory_kind))
		if err != nil {
			return o, err
		}
		o.kind = kind
	}
	if has(unsafe.Offsetof(p.access_devices), unsafe.Sizeof(p.access_devices)) && p.access_device_count > 0 {
		if p.access_devices == nil {
			return o, core.Errorf(core.EINVAL, "options: access_devices is NULL but access_device_count is %d", uint32(p.access_device_count))
		}
		if err := core.CheckAccessCount(uint64(p.access_device_count)); err != nil {
			return o, err
		}
		o.access = append(o.access, unsafe.Slice((*int32)(unsafe.Pointer(p.access_devices)), int(p.access_device_count))...)
	}
	if has(unsafe.Offsetof(p.import_flags), 4) {
		o.flags = uint32(p.import_flags)
	}
	if has(unsafe.Offsetof(p.register_flags), 4) {
		if err := core.CheckRegisterFlags(uint32(p.register_flags)); err != nil {
			return o, err
		}
		o.hold = uint32(p.register_flags)&core.RegisterHold != 0
	}
	return o, nil
}

func (o options) register() core.RegisterOptions {
	return core.RegisterOptions{Uses: o.uses, TTL: o.ttl, Hold: o.hold}
}

func (o options) importOptions() (core.ImportOptions, error) {
	io := core.ImportOptions{OpenOptions: o.open, Access: o.access}
	err := io.SetFlags(o.flags) // before io is read: a return list's order is unspecified
	return io, err
}

// readTicket decodes the ticket argument of call fn.
func readTicket(fn string, p *C.vmmipc_ticket) (*core.Ticket, error) {
	if p == nil {
		return nil, core.Errorf(core.EINVAL, "%s: ticket is NULL", fn)
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

// copyOut copies the first size bytes of *full (all of it at most) to
// out, and says how many: a caller built against an older, shorter struct
// gets the fields it knows of, and nothing is written past them.
func copyOut[T any](out, full *T, size C.size_t) uintptr {
	n := min(uintptr(size), unsafe.Sizeof(*full))
	copy(unsafe.Slice((*byte)(unsafe.Pointer(out)), n), unsafe.Slice((*byte)(unsafe.Pointer(full)), n))
	return n
}

// u64s copies a C array of n uint64s (what names it), once
// core.CheckCount has accepted n.
func u64s(p *C.uint64_t, n C.uint64_t, what string) ([]uint64, error) {
	if p == nil {
		return nil, core.Errorf(core.EINVAL, "%s is NULL", what)
	}
	return append([]uint64(nil), unsafe.Slice((*uint64)(unsafe.Pointer(p)), int(n))...), nil
}

// call runs the body of an exported function: it recovers a panic into
// VMMIPC_EINTERNAL and records an error as this thread's last error.
func call(fn string, body func() error) (rc C.int) {
	defer func() {
		if p := recover(); p != nil {
			setLastError(fmt.Sprintf("%s: internal error (please report): %v", fn, p))
			rc = C.VMMIPC_EINTERNAL
		}
	}()
	return status(body())
}

// callOn is call for an export that works on handle h: body gets what
// find (streamOf, poolOf) says lives behind it, or the call fails with
// find's error.
func callOn[T any](fn string, h C.uintptr_t, find func(string, C.uintptr_t) (T, error), body func(T) error) C.int {
	return call(fn, func() error {
		v, err := find(fn, h)
		if err != nil {
			return err
		}
		return body(v)
	})
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
