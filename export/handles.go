package main

import (
	"sync"
	"unsafe"

	pointer "github.com/mattn/go-pointer"
)

// Opaque handles (vmmipc_stream *) are go-pointer keys: C never holds a Go
// pointer. They come back from C as integers (abi.c passes uintptr_t): a
// caller may hand in any value, and a Go pointer-typed variable holding one
// that is no pointer makes the runtime abort when it moves the stack. A
// value becomes a pointer again only once it is found among the handles
// given out. A closed handle's key is kept reserved for the next
// quarantineSize closes before it is freed, so malloc cannot hand the same
// address to a new stream while a stale copy is likely still around: using
// it gives VMMIPC_EBADF instead of touching someone else's stream.
const quarantineSize = 65536

type handleSlot struct {
	mu  sync.Mutex
	obj any // nil once closed
}

var (
	handlesMu  sync.Mutex
	given      = map[uintptr]unsafe.Pointer{} // live and quarantined handles
	quarantine []uintptr
)

func saveHandle(obj any) unsafe.Pointer {
	p := pointer.Save(&handleSlot{obj: obj})
	handlesMu.Lock()
	given[uintptr(p)] = p
	handlesMu.Unlock()
	return p
}

// slotOf returns the slot behind handle h, or nil if h is no handle given
// out (or one freed since).
func slotOf(h uintptr) *handleSlot {
	handlesMu.Lock()
	p, ok := given[h]
	handlesMu.Unlock()
	if !ok {
		return nil
	}
	slot, _ := pointer.Restore(p).(*handleSlot)
	return slot
}

// lookupHandle returns the live object behind h, or nil.
func lookupHandle(h uintptr) any {
	slot := slotOf(h)
	if slot == nil {
		return nil
	}
	slot.mu.Lock()
	defer slot.mu.Unlock()
	return slot.obj
}

// takeHandle marks h closed and returns what it held (nil if stale).
func takeHandle(h uintptr) any {
	slot := slotOf(h)
	if slot == nil {
		return nil
	}
	slot.mu.Lock()
	obj := slot.obj
	slot.obj = nil
	slot.mu.Unlock()
	if obj == nil {
		return nil
	}
	var free unsafe.Pointer
	handlesMu.Lock()
	quarantine = append(quarantine, h)
	if len(quarantine) > quarantineSize {
		free = given[quarantine[0]]
		delete(given, quarantine[0])
		quarantine = quarantine[1:]
	}
	handlesMu.Unlock()
	if free != nil {
		pointer.Unref(free)
	}
	return obj
}
