package main

import (
	"sync"
	"unsafe"

	pointer "github.com/mattn/go-pointer"
)

// Opaque handles (vmmipc_stream *) are go-pointer keys: C never holds a Go
// pointer. A closed handle's key is kept reserved for the next
// quarantineSize closes before it is freed, so malloc cannot hand the same
// address to a new stream while a stale copy is likely still around: using
// it gives VMMIPC_EBADF instead of touching someone else's stream.
const quarantineSize = 65536

type handleSlot struct {
	mu  sync.Mutex
	obj any // nil once closed
}

var (
	quarantineMu sync.Mutex
	quarantine   []unsafe.Pointer
)

func saveHandle(obj any) unsafe.Pointer {
	return pointer.Save(&handleSlot{obj: obj})
}

// lookupHandle returns the live object behind p, or nil.
func lookupHandle(p unsafe.Pointer) any {
	slot, _ := pointer.Restore(p).(*handleSlot)
	if slot == nil {
		return nil
	}
	slot.mu.Lock()
	defer slot.mu.Unlock()
	return slot.obj
}

// takeHandle marks p closed and returns what it held (nil if stale).
func takeHandle(p unsafe.Pointer) any {
	slot, _ := pointer.Restore(p).(*handleSlot)
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
	quarantineMu.Lock()
	quarantine = append(quarantine, p)
	var free unsafe.Pointer
	if len(quarantine) > quarantineSize {
		free, quarantine = quarantine[0], quarantine[1:]
	}
	quarantineMu.Unlock()
	if free != nil {
		pointer.Unref(free)
	}
	return obj
}
