package core

import (
	"crypto/sha256"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The grant table: how a receiver that has a buffer mapped already (a cache
// hit) checks a new grant of it without a round trip to the exporter, and
// how one that has not maps a host file's new buffer without one
// (tablemiss.go: each slot's file entry names the file).
//
// Each exporter publishes its live grants that hold nothing (registrations
// without RegisterOptions.Hold) in one memfd: a slot per grant, at
// 1 + RegID mod tableSlots, with the grant's id, uses, uses spent, ttl
// deadline (CLOCK_MONOTONIC) and a tag of the whole ticket. The exporter
// maps it writable and then seals it against writing (F_SEAL_FUTURE_WRITE),
// growing, shrinking and further seals; a receiver gets a read-only
// description of it once, in its first session with that exporter
// (helloTable), maps it read-only and closes the descriptor. A hit then
// reads the grant's slot: published, same id, same tag (so a ticket changed
// in any byte is no hit), within its ttl, a use left, and the exporter
// alive: the table's lifeline unmarked (lifeline.go; without one, its
// pid's start time and its own descriptor of the table still open, read
// in /proc). What the table does not vouch for goes to the exporter as
// before. The exporter stays the judge of every use: a hit's use is spent
// just after by a library thread (confirmer.go) or, should the receiver
// die first, from the record the hit left in the receiver's spend log
// (spendlog.go). Held grants are never published: a hold is believed only
// once the exporter granted it (holder.go).
//
// A slot is a seqlock: the writer makes the sequence odd, writes, and makes
// it even again; a reader that sees it odd or changed does not believe what
// it read. Every word is written and read with atomics (the two sides are
// different mappings of one file, often in different processes).

const (
	tableSlotSize = 64
	tableSlots    = 4095 // after the header slot: 256 KiB, faulted in as slots are used
	tableFileSize = 32   // each slot's file entry, after the slots: 128 KiB
	tableSize     = (tableSlots + 1) * (tableSlotSize + tableFileSize)
	tableMagic    = 0x5447_4d56 // "VMGT"
	tableVersion  = 3
)

// Offsets in a slot. Slot 0 is the header: magic (u32), version (u32),
// slots (u64), lifeline (u32, lifeline.go).
const (
	slotSeq      = 0  // u32: odd while written
	slotState    = 4  // u32: slotPublished or 0
	slotRegID    = 8  // u64
	slotUses     = 16 // u64: uses (low 32 bits, 0 = unlimited), spent (high 32)
	slotDeadline = 24 // u64: CLOCK_MONOTONIC nanoseconds; 0 = no ttl
	slotTag      = 32 // 32 bytes: grantTag of the ticket
)

const slotPublished = 1

// Offsets in a slot's file entry (fileEntry), written and read inside the
// slot's seqlock: the file that holds the grant's whole buffer from offset
// 0, where the exporter has one (a host-file registration), so that a
// receiver with the table may open it through /proc/<pid>/fd instead of
// asking for it (tablemiss.go).
const (
	fileFD  = 0  // u32: the exporter's descriptor number + 1; 0 = none
	fileDev = 8  // u64
	fileIno = 16 // u64
)

func fileEntry(i uint64) uint64 { return (tableSlots+1)*tableSlotSize + i*tableFileSize }

// backingFile is a file entry: fd < 0 for none.
type backingFile struct {
	fd       int
	dev, ino uint64
}

var noFile = backingFile{fd: -1}

// grantTag is what a slot holds of a ticket: a hash of its digest (which
// covers every byte of the ticket, secret included) under a label of its
// own, so that nothing read from the table can stand for a digest or a
// proof anywhere else.
func grantTag(digest [32]byte) [32]byte {
	h := sha256.New()
	h.Write([]byte("vmmipc grant table v1\x00"))
	h.Write(digest[:])
	var out [32]byte
	copy(out[:], h.Sum(nil))
	return out
}

func slotIndex(regID uint64) uint64 { return 1 + regID%tableSlots }

func word32(mem []byte, off uint64) *uint32 { return (*uint32)(unsafe.Pointer(&mem[off])) }
func word64(mem []byte, off uint64) *uint64 { return (*uint64)(unsafe.Pointer(&mem[off])) }

// store32 and load32 move 32 bytes (a tag, a proof) to and from shared
// memory at off, as four atomic words.
func store32(mem []byte, off uint64, b [32]byte) {
	for k := uint64(0); k < 32; k += 8 {
		atomic.StoreUint64(word64(mem, off+k), *(*uint64)(unsafe.Pointer(&b[k])))
	}
}

func load32(mem []byte, off uint64) (b [32]byte) {
	for k := uint64(0); k < 32; k += 8 {
		*(*uint64)(unsafe.Pointer(&b[k])) = atomic.LoadUint64(word64(mem, off+k))
	}
	return b
}

// monotonicNanos is CLOCK_MONOTONIC, which both sides read alike in one
// time namespace. One system call at load pairs it with the runtime's
// monotonic clock (CLOCK_MONOTONIC too, read through the vDSO), and each
// reading adds the time elapsed on that clock: unix.ClockGettime is a real
// system call, and a table hit reads the clock on every hit. The pairing is
// off by the length of one call, far below a ttl's millisecond. 0 (as
// before) if the clock could not be read at load: callers treat 0 as
// unknown.
func monotonicNanos() uint64 {
	if monotonicAtLoad.ns == 0 {
		return 0
	}
	return monotonicAtLoad.ns + uint64(time.Since(monotonicAtLoad.at))
}

var monotonicAtLoad = func() (m struct {
	at time.Time
	ns uint64
}) {
	var ts unix.Timespec
	before := time.Now()
	if unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts) == nil {
		m.ns = uint64(ts.Nano())
	}
	m.at = before.Add(time.Since(before) / 2) // the call's middle
	return m
}()

// grantTable is the exporter's side: made on first use, kept for the
// process's life (one descriptor, to open read-only descriptions of it for
// receivers).
type grantTable struct {
	once   sync.Once
	err    error
	fd     int
	region []byte // the table's mapping and the page before it (lifeline.go)
	mem    []byte // the table

	mu     sync.Mutex
	closed bool                   // unmapped (Server.Close): nothing is written or handed out
	count  int                    // grants published
	owner  [tableSlots + 1]uint64 // the registration published in each slot; 0 = free
}

// ready makes the table on first use and reports whether there is one.
func (gt *grantTable) ready() bool {
	gt.once.Do(func() { gt.err = gt.create() })
	return gt.err == nil
}

func (gt *grantTable) create() error {
	fd, err := unix.MemfdCreate("vmmipc-grants", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return Errorf(ioCode(err), "grant table: memfd_create: %w", err)
	}
	fail := func(what string, err error) error {
		closeFD(&fd)
		return Errorf(EINTERNAL, "grant table: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, tableSize); err != nil {
		return fail("ftruncate", err)
	}
	region, mem, err := mapTable(fd, tableSize)
	if err != nil {
		return fail("mmap", err)
	}
	// A forked child (a DataLoader worker) gets no writable table.
	if err := unix.Madvise(region, unix.MADV_DONTFORK); err != nil {
		_ = unix.Munmap(region)
		return fail("MADV_DONTFORK", err)
	}
	// Our mapping stays writable; nobody can make another, write, or
	// change the size from now on.
	seals := unix.F_SEAL_GROW | unix.F_SEAL_SHRINK | unix.F_SEAL_FUTURE_WRITE | unix.F_SEAL_SEAL
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, seals); err != nil {
		_ = unix.Munmap(region)
		return fail("sealing", err)
	}
	atomic.StoreUint32(word32(mem, 0), tableMagic)
	atomic.StoreUint32(word32(mem, 4), tableVersion)
	atomic.StoreUint64(word64(mem, 8), tableSlots)
	linkLifeline(region)
	gt.fd, gt.region, gt.mem = fd, region, mem
	return nil
}

// readOnly opens a read-only description of the table for one receiver
// (the caller closes it once sent), and gives the number of our own
// descriptor of it.
func (gt *grantTable) readOnly() (fd, own int, err error) {
	if !gt.ready() {
		return -1, -1, gt.err
	}
	gt.mu.Lock()
	defer gt.mu.Unlock()
	if gt.closed {
		return -1, -1, Errorf(EIO, "grant table: the server has closed")
	}
	fd, err = reopen(gt.fd, unix.O_RDONLY)
	if err != nil {
		return -1, -1, Errorf(ioCode(err), "grant table: reopening it read-only: %w", err)
	}
	return fd, gt.fd, nil
}

// publish puts a grant that holds nothing in its slot and reports whether
// it did: not when the slot is taken (by a grant that lives longer than the
// tableSlots registered after it) or there is no table. Hits on a grant
// not published ask the exporter.
func (gt *grantTable) publish(id uint64, uses uint32, deadline uint64, digest [32]byte, file backingFile) bool {
	if !gt.ready() {
		return false
	}
	i := slotIndex(id)
	tag := grantTag(digest)
	gt.mu.Lock()
	defer gt.mu.Unlock()
	if gt.closed || gt.owner[i] != 0 {
		return false
	}
	gt.owner[i] = id
	gt.count++
	gt.write(i, func(off uint64) {
		atomic.StoreUint64(word64(gt.mem, off+slotRegID), id)
		atomic.StoreUint64(word64(gt.mem, off+slotUses), uint64(uses))
		atomic.StoreUint64(word64(gt.mem, off+slotDeadline), deadline)
		store32(gt.mem, off+slotTag, tag)
		fe := fileEntry(i)
		atomic.StoreUint32(word32(gt.mem, fe+fileFD), uint32(file.fd+1))
		atomic.StoreUint64(word64(gt.mem, fe+fileDev), file.dev)
		atomic.StoreUint64(word64(gt.mem, fe+fileIno), file.ino)
		atomic.StoreUint32(word32(gt.mem, off+slotState), slotPublished)
	})
	return true
}

// spent records that published grant id has spent `spent` of its uses (a
// use spent, or given back): hits check it before they believe a use is
// left.
func (gt *grantTable) spent(id uint64, uses, spent uint32) {
	gt.update(id, func(off uint64) {
		atomic.StoreUint64(word64(gt.mem, off+slotUses), uint64(uses)|uint64(spent)<<32)
	})
}

// withdraw takes an ended published grant out of the table.
func (gt *grantTable) withdraw(id uint64) {
	gt.update(id, func(off uint64) {
		atomic.StoreUint32(word32(gt.mem, off+slotState), 0)
		atomic.StoreUint64(word64(gt.mem, off+slotRegID), 0)
		atomic.StoreUint32(word32(gt.mem, fileEntry(off/tableSlotSize)+fileFD), 0)
	})
	gt.mu.Lock()
	if i := slotIndex(id); gt.owner[i] == id {
		gt.owner[i] = 0
		gt.count--
	}
	gt.mu.Unlock()
}

// anyPublished reports whether any grant is published.
func (gt *grantTable) anyPublished() bool {
	gt.mu.Lock()
	defer gt.mu.Unlock()
	return gt.count > 0
}

// update rewrites id's slot if id is published there.
func (gt *grantTable) update(id uint64, f func(off uint64)) {
	if !gt.ready() {
		return
	}
	i := slotIndex(id)
	gt.mu.Lock()
	defer gt.mu.Unlock()
	if !gt.closed && gt.owner[i] == id {
		gt.write(i, f)
	}
}

// close unmaps the table and closes its descriptor (Server.Close);
// receivers' mappings of it stay valid.
func (gt *grantTable) close() {
	gt.once.Do(func() { gt.err = Errorf(EIO, "grant table: the server has closed") })
	if gt.err != nil {
		return
	}
	gt.mu.Lock()
	defer gt.mu.Unlock()
	if !gt.closed {
		gt.closed = true
		unlinkLifeline(gt.region)
		_ = unix.Munmap(gt.region)
		closeFD(&gt.fd)
	}
}

// write runs f on slot i inside its seqlock. Called with gt.mu held.
func (gt *grantTable) write(i uint64, f func(off uint64)) {
	off := i * tableSlotSize
	seq := word32(gt.mem, off+slotSeq)
	s := atomic.LoadUint32(seq)
	atomic.StoreUint32(seq, s+1)
	f(off)
	atomic.StoreUint32(seq, s+2)
}
