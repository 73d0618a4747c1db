package core

import (
	"time"
)

// Bounds of the options and of a registration: one constant per bound,
// mirrored by the VMMIPC_MAX_* macros of vmmipc.h. The C ABI layer only
// copies fields; the checks are the Validate methods below, so Go callers of
// this package get them too.
const (
	MaxWindow        = 1024                         // OpenOptions.Window
	MaxAccessDevices = 64                           // ImportOptions.Access
	MaxTTL           = (1 << 40) * time.Millisecond // RegisterOptions.TTL
	MaxChunks        = 1 << 26                      // chunks of one registration: 128 TiB of 2 MiB chunks
)

// Defaults of the receiver options.
const (
	// DefaultTimeout is how long a receiver waits on a silent exporter.
	DefaultTimeout = 30 * time.Second
	// DefaultWindow is how many chunk requests a receiver keeps in flight.
	// Descriptors in flight sit in the socket (the kernel's), not in
	// either process's table.
	DefaultWindow = 16
)

// ABIDefaults are the C ABI's option defaults (vmmipc_options_init, NULL
// opts, and fields beyond a caller's struct_size) where they differ from
// the zero values here: one use (RegisterOptions' zero is unlimited) and
// host memory. The receiver's timeout is DefaultTimeout.
func ABIDefaults() (uses uint32, kind uint8) { return 1, MemoryHost }

// Device arguments of an import, as VMMIPC_DEVICE_* in vmmipc.h; values >= 0
// are CUDA ordinals.
const (
	DeviceHost int32 = -1
	DeviceSame int32 = -2
)

// Memory kinds, as VMMIPC_MEMORY_* in vmmipc.h.
const (
	MemoryHost uint8 = 1
	MemoryCUDA uint8 = 2
)

// RegisterOptions are the sender-side options of one registration. The zero
// value means unlimited uses, no ttl and no callback (the C ABI's defaults,
// from vmmipc_options_init, are uses = 1).
type RegisterOptions struct {
	Uses uint32        // receivers allowed to finish; 0 = unlimited
	TTL  time.Duration // 0 = never expires
	// OnRelease runs exactly once, when the library needs nothing this
	// registration lent any more: after it ended and, with LendsExporter,
	// after its buffer's Exporter was released.
	OnRelease func()
	// LendsExporter says that what the buffer's Exporter exports from
	// belongs to this registration's owner (a C export_fn, borrowed CUDA
	// handles): OnRelease then waits until no registration of the buffer
	// lives.
	LendsExporter bool
	// Hold makes each use a hold (holds.go): a receiver that asked to hold
	// (ImportOptions.Hold) keeps the registration from being released
	// until it lets go (Release) or its process ends. Uses are still
	// counted: the registration ends when they are spent.
	Hold bool
}

// Validate checks the bounds of o.
func (o RegisterOptions) Validate() error {
	if o.TTL < 0 || o.TTL > MaxTTL {
		return Errorf(EINVAL, "options: ttl %v is out of range (at most %d ms)", o.TTL, MaxTTL.Milliseconds())
	}
	return nil
}

// OpenOptions are the receiver-side options of a stream.
type OpenOptions struct {
	Timeout time.Duration // 0 = DefaultTimeout
	Window  uint32        // 0 = DefaultWindow; 1 = lockstep
}

// Validate checks the bounds of o.
func (o OpenOptions) Validate() error {
	if o.Window > MaxWindow {
		return Errorf(EINVAL, "options: window %d is larger than %d", o.Window, MaxWindow)
	}
	if o.Timeout < 0 {
		return Errorf(EINVAL, "options: timeout %v is negative", o.Timeout)
	}
	return nil
}

func (o OpenOptions) withDefaults() OpenOptions {
	if o.Timeout == 0 {
		o.Timeout = DefaultTimeout
	}
	if o.Window == 0 {
		o.Window = DefaultWindow
	}
	return o
}

// Register flags: the bits of vmmipc_options.register_flags.
const (
	RegisterHold       uint32 = 1 << 0 // RegisterOptions.Hold
	registerKnownFlags        = RegisterHold
)

// CheckRegisterFlags refuses register_flags bits this library does not know.
func CheckRegisterFlags(flags uint32) error {
	if flags&^registerKnownFlags != 0 {
		return Errorf(EINVAL, "options: register_flags %#x has unknown bits (known: %#x)", flags, registerKnownFlags)
	}
	return nil
}

// Import flags: the bits of vmmipc_options.import_flags.
const (
	ImportNoCache      uint32 = 1 << 0 // neither reuse nor keep a cached mapping
	ImportConfirmLater uint32 = 1 << 1 // a cache hit returns at once; confirmer.go confirms it
	ImportHold         uint32 = 1 << 2 // hold the use until Release or exit (holder.go)
	importKnownFlags          = ImportNoCache | ImportConfirmLater | ImportHold
)

// ImportOptions are the options of Import.
type ImportOptions struct {
	OpenOptions
	Access       []int32 // CUDA: extra devices given read-write access
	NoCache      bool    // neither reuse nor keep a cached mapping
	ConfirmLater bool    // on a hit, confirm in the background (confirmer.go)
	Hold         bool    // hold the use until Release or exit (holder.go)
}

// SetFlags sets the fields the import_flags bits stand for,
// refusing unknown bits.
func (o *ImportOptions) SetFlags(flags uint32) error {
	if flags&^importKnownFlags != 0 {
		return Errorf(EINVAL, "options: import_flags %#x has unknown bits (known: %#x)", flags, importKnownFlags)
	}
	o.NoCache = flags&ImportNoCache != 0
	o.ConfirmLater = flags&ImportConfirmLater != 0
	o.Hold = flags&ImportHold != 0
	if o.Hold && o.ConfirmLater {
		return Errorf(EINVAL, "options: import_flags %#x asks to hold and to confirm later: a hold is taken on the caller's path (one message on a kept connection), so leave VMMIPC_IMPORT_CONFIRM_LATER out", flags)
	}
	return nil
}

// Validate checks the bounds of o.
func (o ImportOptions) Validate() error {
	if err := CheckAccessCount(uint64(len(o.Access))); err != nil {
		return err
	}
	return o.OpenOptions.Validate()
}

// CheckAccessCount checks a count of access devices (before they are copied).
func CheckAccessCount(n uint64) error {
	if n > MaxAccessDevices {
		return Errorf(EINVAL, "options: %d access devices exceed the limit of %d", n, MaxAccessDevices)
	}
	return nil
}

// TTLFromMillis converts vmmipc_options.ttl_ms, checking its bound.
func TTLFromMillis(ms uint64) (time.Duration, error) {
	if ms > uint64(MaxTTL/time.Millisecond) {
		return 0, Errorf(EINVAL, "options: ttl_ms %d is larger than %d", ms, uint64(MaxTTL/time.Millisecond))
	}
	return time.Duration(ms) * time.Millisecond, nil
}

// CheckCount checks the chunk count of a register call (fn names it)
// before anything of that size is copied.
func CheckCount(n uint64, fn string) error {
	if n == 0 {
		return Errorf(EINVAL, "%s: count is 0: register at least one chunk", fn)
	}
	if n > MaxChunks {
		return Errorf(EINVAL, "%s: count %d is above the limit of %d chunks (VMMIPC_MAX_CHUNKS): register the buffer in fewer, larger chunks", fn, n, MaxChunks)
	}
	return nil
}

// KindOf checks a memory kind given as vmmipc_options.memory_kind.
func KindOf(k uint32) (uint8, error) {
	if k == uint32(MemoryHost) || k == uint32(MemoryCUDA) {
		return uint8(k), nil
	}
	return 0, Errorf(EINVAL, "options: memory_kind %d is neither VMMIPC_MEMORY_HOST (1) nor VMMIPC_MEMORY_CUDA (2)", k)
}
