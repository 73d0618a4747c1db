package core

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// The spend log: how a use that a receiver took on the grant table
// (granttable.go) is spent even when the receiver dies before its
// confirmation reaches the exporter.
//
// A receiver that takes an exporter's table makes one page of its own (a
// memfd sealed against resizing), maps it writable and sends the exporter
// a descriptor of it once, in the same session; the exporter maps it read
// only and closes the descriptor. Before a table hit returns, the receiver
// writes a record there: the grant's id and HMAC(secret, label || id), so
// that only a holder of the ticket can write one that counts. It clears
// the record once the exporter has answered the hit's confirmation. The
// exporter reads the logs of receivers that have exited (pid and start
// time) and spends each record's use, as the confirmation would have:
// a receiver killed right after a table hit leaves no grant pending.
// Both sides' system calls are here, once.

const (
	spendLogSize    = 4096
	spendRecordSize = 64
	spendRecords    = spendLogSize/spendRecordSize - 1 // record 0 is the header
	spendLogMagic   = 0x4c53_4d56                      // "VMSL"
)

// Offsets in a record: the registration id (0 = free), written last and
// cleared first, then the proof.
const (
	recordRegID = 0
	recordProof = 8
)

// spendProof is what a record must carry for registration id: only a
// holder of its ticket (its secret) can make it.
func spendProof(secret Secret, id uint64) [32]byte {
	mac := hmac.New(sha256.New, secret[:])
	mac.Write([]byte("vmmipc spend log v1\x00"))
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], id)
	mac.Write(b[:])
	var out [32]byte
	copy(out[:], mac.Sum(nil))
	return out
}

// newSpendLog makes a receiver's log: the descriptor to send (the caller
// closes it) and the writable mapping it keeps.
func newSpendLog() (int, []byte, error) {
	fd, err := unix.MemfdCreate("vmmipc-spends", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, nil, Errorf(ioCode(err), "spend log: memfd_create: %w", err)
	}
	fail := func(what string, err error) (int, []byte, error) {
		closeFD(&fd)
		return -1, nil, Errorf(EINTERNAL, "spend log: %s: %w", what, err)
	}
	if err := unix.Ftruncate(fd, spendLogSize); err != nil {
		return fail("ftruncate", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_GROW|unix.F_SEAL_SHRINK|unix.F_SEAL_SEAL); err != nil {
		return fail("sealing", err)
	}
	mem, err := unix.Mmap(fd, 0, spendLogSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fail("mmap", err)
	}
	_ = unix.Madvise(mem, unix.MADV_DONTFORK) // a forked child cannot spend its parent's uses
	atomic.StoreUint32(word32(mem, 0), spendLogMagic)
	return fd, mem, nil
}

// mapSpendLog maps a receiver's log read-only for the exporter, after
// checking it is one page that cannot shrink (a mapping past its end would
// kill the exporter with SIGBUS). The caller closes fd.
func mapSpendLog(fd int) ([]byte, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != spendLogSize {
		return nil, Errorf(EINVAL, "protocol: the receiver's spend log is not a file of %d bytes", spendLogSize)
	}
	if seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return nil, Errorf(EINVAL, "protocol: the receiver's spend log is not sealed against shrinking")
	}
	mem, err := unix.Mmap(fd, 0, spendLogSize, unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, Errorf(ioCode(err), "spend log: mapping it: %w", err)
	}
	_ = unix.Madvise(mem, unix.MADV_DONTFORK)
	return mem, nil
}

// writeRecord fills record i (1..spendRecords) of a receiver's log.
func writeRecord(mem []byte, i int, id uint64, proof [32]byte) {
	off := uint64(i * spendRecordSize)
	store32(mem, off+recordProof, proof)
	atomic.StoreUint64(word64(mem, off+recordRegID), id)
}

// clearRecord frees record i.
func clearRecord(mem []byte, i int) {
	atomic.StoreUint64(word64(mem, uint64(i*spendRecordSize)+recordRegID), 0)
}

// readRecord reads record i as the exporter sees it: id 0 is a free one.
func readRecord(mem []byte, i int) (id uint64, proof [32]byte) {
	off := uint64(i * spendRecordSize)
	id = atomic.LoadUint64(word64(mem, off+recordRegID))
	return id, load32(mem, off+recordProof)
}
