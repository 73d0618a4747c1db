package main

import (
	"sync"
	"unsafe"

	pointer "github.com/mattn/go-pointer"
)

// Opaque handles (vmmipc_stream *) are addresses go-pointer allocates in C
// memory: C never holds a Go pointer. They come back from C as integers
// (abi.c passes uintptr_t): a caller may hand in any value, and a Go
// pointer-typed variable holding one that is no pointer makes the runtime
// abort when it moves the stack, so handles are looked up by value in
// given and never converted back. A closed handle stays reserved for the
// next quarantineSize closes before its address is freed, so malloc cannot
// hand the same address to a new stream while a stale copy is likely still
// around: using it gives VMMIPC_EBADF instead of touching someone else's
// stream.
const quarantineSize = 65536

type handleSlot struct {
	mu   sync.Mutex
	obj  any            // nil once closed
	addr unsafe.Pointer // the handle, for pointer.Unref
}

var (
	handlesMu  sync.Mutex
	given      = map[uintptr]*handleSlot{} // live and quarantined handles
	quarantine []uintptr
)

func saveHandle(obj any) unsafe.Pointer {
	slot := &handleSlot{obj: obj}
	slot.addr = pointer.Save(slot)
	handlesMu.Lock()
	given[uintptr(slot.addr)] = slot
	handlesMu.Unlock()
	return slot.addr
}

// inSlot runs f on h's slot, under the slot's lock; the zero T when h is
// not (or no longer) in given.
func inSlot[T any](h uintptr, f func(*handleSlot) T) (v T) {
	handlesMu.Lock()
	slot := given[h]
	handlesMu.Unlock()
	if slot == nil {
		return v
	}
	slot.mu.Lock()
	defer slot.mu.Unlock()
	return f(slot)
}

// lookupHandle returns the live object behind h, or nil.
func lookupHandle(h uintptr) any {
	return inSlot(h, func(s *handleSlot) any { return s.obj })
}

// handleClosed says whether h was a handle that has been closed (and is
// still quarantined), as opposed to a value never handed out.
func handleClosed(h uintptr) bool {
	return inSlot(h, func(s *handleSlot) bool { return s.obj == nil })
}

// takeHandle marks h closed and returns what it held (nil if stale).
func takeHandle(h uintptr) any {
	obj := inSlot(h, func(s *handleSlot) any {
		obj := s.obj
		s.obj = nil
		return obj
	})
	if obj == nil {
		return nil
	}
	var freed *handleSlot
	handlesMu.Lock()
	quarantine = append(quarantine, h)
	if len(quarantine) > quarantineSize {
		freed = given[quarantine[0]]
		delete(given, quarantine[0])
		quarantine = quarantine[1:]
	}
	handlesMu.Unlock()
	if freed != nil {
		pointer.Unref(freed.addr)
	}
	return obj
}
