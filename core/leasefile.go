package core

import (
	"golang.org/x/sys/unix"
)

// The lease file: how an exporter learns that a receiver holding its memory
// has died, without a descriptor per receiver on either side (holds.go has
// the why). Both sides' system calls are here, once.
//
// The exporter keeps one memfd of one page, sealed against growing,
// shrinking and further seals. A receiver that holds gets a slot s and its
// own open file description of that memfd (the exporter reopens
// /proc/self/fd/N, which makes a new description, and sends it). The
// receiver takes an OFD write lock on byte s, maps the file (MAP_SHARED,
// read-only), marks the mapping MADV_DONTFORK and closes the descriptor:
// the mapping keeps the description, and so the lock, alive for exactly as
// long as the receiver's process lives (the kernel drops it at exit,
// SIGKILL included) or until it unmaps it, and a forked child inherits
// neither the mapping nor the lock. The exporter asks with F_OFD_GETLK on
// its own description whether byte s is still locked by somebody. Locks
// past the end of the file are allowed, so slots are not bounded by its
// size. Checked on Linux 6.18: the lock survives the close while the file
// is mapped, is gone within microseconds of SIGKILL, and is gone when the
// parent dies though a child it forked after MADV_DONTFORK lives on.

// newLeaseFile makes the exporter's lease file.
func newLeaseFile() (int, error) {
	fd, err := unix.MemfdCreate("vmmipc-leases", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, Errorf(ioCode(err), "lease file: memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(pageSize)); err != nil {
		closeFD(&fd)
		return -1, Errorf(ioCode(err), "lease file: ftruncate: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL); err != nil {
		closeFD(&fd)
		return -1, Errorf(EINTERNAL, "lease file: sealing: %w", err)
	}
	return fd, nil
}

// reopenLeaseFile opens a new description of the lease file fd, for one
// receiver (its lock is its own: OFD locks belong to descriptions).
func reopenLeaseFile(fd int) (int, error) {
	nfd, err := reopen(fd, unix.O_RDWR)
	if err != nil {
		return -1, Errorf(ioCode(err), "lease file: reopening it for a receiver: %w", err)
	}
	return nfd, nil
}

// slotLocked asks whether some other description holds a lock on byte
// slot of the lease file fd (ours holds none).
func slotLocked(fd int, slot uint64) (bool, error) {
	l := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: int64(slot), Len: 1}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_GETLK, &l); err != nil {
		return false, Errorf(EINTERNAL, "lease file: F_OFD_GETLK on slot %d: %w", slot, err)
	}
	return l.Type != unix.F_UNLCK, nil
}

// leaseMapping is a receiver's lease: the mapping that keeps its lock.
type leaseMapping []byte

// takeLease locks slot of the lease file fd (a description of the
// receiver's own, which it closes: on every path) and maps it so that the
// lock lives with the mapping.
func takeLease(fd int, slot uint64) (leaseMapping, error) {
	defer closeFD(&fd)
	if slot > maxLeaseSlot {
		return nil, Errorf(EINVAL, "protocol: lease slot %d out of range", slot)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || uint64(st.Size) != pageSize {
		return nil, Errorf(EINVAL, "protocol: the exporter's lease descriptor is not a file of one page")
	}
	l := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: int64(slot), Len: 1}
	if err := unix.FcntlFlock(uintptr(fd), unix.F_OFD_SETLK, &l); err != nil {
		return nil, Errorf(EIO, "lease: locking slot %d: %w", slot, err)
	}
	m, err := unix.Mmap(fd, 0, int(pageSize), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, Errorf(ioCode(err), "lease: mapping the lease file: %w", err)
	}
	if err := unix.Madvise(m, unix.MADV_DONTFORK); err != nil {
		_ = unix.Munmap(m)
		return nil, Errorf(EINTERNAL, "lease: MADV_DONTFORK: %w", err)
	}
	return m, nil
}

// end unmaps the lease: its lock goes with the description.
func (m leaseMapping) end() {
	if m != nil {
		_ = unix.Munmap(m)
	}
}
