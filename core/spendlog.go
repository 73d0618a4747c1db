package core

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/binary"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// The spend log: how a use that a receiver took on the grant table
// (granttable.go) is spent without a session of its own, and even when the
// receiver dies before its confirmation reaches the exporter.
//
// A receiver that takes an exporter's table makes one page of its own (a
// memfd sealed against resizing), maps it writable and sends the exporter
// a descriptor of it once, in the same session; the exporter maps it too
// (writable where the descriptor allows, else read only) and closes the
// descriptor. Before a table hit returns, the receiver writes a record
// there: the grant's id and HMAC(secret, label || id), so that only a
// holder of the ticket can write one that counts. It clears the record
// once the use was spent.
//
// Who spends it is the record's claim word: the receiver's confirmer (on a
// session, confirmer.go), or, while the record is open, the exporter,
// which harvests open records when it next grants (spendlogs.go: a stream
// of re-sent buffers then needs no session at all). Either side takes the
// record by compare-and-swap, so a use is spent by one of them only. The
// exporter also reads the logs of receivers that have exited (pid and
// start time) and spends each record's use that nobody spent, as the
// confirmation would have: a receiver killed right after a table hit
// leaves no grant pending. Both sides' system calls are here, once.
const (
	spendLogSize    = 4096
	spendRecordSize = 64
	spendRecords    = spendLogSize/spendRecordSize - 1 // record 0 is the header
	spendLogMagic   = 0x4c53_4d56                      // "VMSL"
)

// Offsets in a record: the registration id (0 = free), written last and
// cleared first, then the proof, then the claim word. In the header
// (record 0): the magic, then how many records were opened so far, so
// that the exporter reads only the logs that changed.
const (
	recordRegID = 0
	recordProof = 8
	recordClaim = 40
	logOpened   = 8
)

// A record's claim word: the record's generation (one per write) above
// the low byte, its state in the low byte. The generation makes the word
// unique per write, so the exporter's compare-and-swap cannot take a
// record that was rewritten after it read the id and the proof.
const (
	claimLegacy     = 0 // a receiver that does not know claims wrote it: drained only
	claimOpen       = 1 // the exporter may harvest it
	claimReceiver   = 2 // the receiver's: its confirmer spends it on a session
	claimHarvesting = 3 // the exporter is spending it
	claimLives      = 4 // the exporter spent it; the buffer lives on
	claimEnded      = 5 // the exporter spent it; the buffer ended with it
	claimDeclined   = 6 // the exporter refused it: the receiver spends it (and hears why)
)

func claimState(w uint64) uint8 { return uint8(w) }

func claimWord(gen uint64, state uint8) uint64 { return gen<<8 | uint64(state) }

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

// mapSpendLog maps a receiver's log for the exporter, after checking it
// is one page that cannot shrink (a mapping past its end would kill the
// exporter with SIGBUS): writable where the descriptor allows (writable
// false: read only, its records are never harvested). The caller closes fd.
func mapSpendLog(fd int) (mem []byte, writable bool, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Size != spendLogSize {
		return nil, false, Errorf(EINVAL, "protocol: the receiver's spend log is not a file of %d bytes", spendLogSize)
	}
	if seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0); err != nil || seals&unix.F_SEAL_SHRINK == 0 {
		return nil, false, Errorf(EINVAL, "protocol: the receiver's spend log is not sealed against shrinking")
	}
	writable = true
	mem, err = unix.Mmap(fd, 0, spendLogSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil { // opened read only, or sealed against writing
		writable = false
		mem, err = unix.Mmap(fd, 0, spendLogSize, unix.PROT_READ, unix.MAP_SHARED)
	}
	if err != nil {
		return nil, false, Errorf(ioCode(err), "spend log: mapping it: %w", err)
	}
	_ = unix.Madvise(mem, unix.MADV_DONTFORK)
	return mem, writable, nil
}

// writeRecord fills record i (1..spendRecords) of a receiver's log as
// the receiver's (claimReceiver) in generation gen: the claim first, so
// that the exporter never takes the record while it is rewritten.
func writeRecord(mem []byte, i int, id uint64, proof [32]byte, gen uint64) {
	off := uint64(i * spendRecordSize)
	atomic.StoreUint64(word64(mem, off+recordClaim), claimWord(gen, claimReceiver))
	store32(mem, off+recordProof, proof)
	atomic.StoreUint64(word64(mem, off+recordRegID), id)
}

// clearRecord frees record i. No record is cleared while open, so the
// exporter cannot be harvesting it.
func clearRecord(mem []byte, i int) {
	atomic.StoreUint64(word64(mem, uint64(i*spendRecordSize)+recordRegID), 0)
}

// openRecord opens record i (the receiver's) to the exporter, and counts
// it in the header so that the exporter reads this log again.
func openRecord(mem []byte, i int) {
	w := word64(mem, uint64(i*spendRecordSize)+recordClaim)
	c := atomic.LoadUint64(w)
	if claimState(c) == claimReceiver {
		atomic.StoreUint64(w, claimWord(c>>8, claimOpen))
		atomic.AddUint64(word64(mem, logOpened), 1)
	}
}

// takeRecord is the receiver's confirmer taking record i back to spend it
// on a session (send true), unless the exporter has spent it: then spent
// is true and lives tells whether the buffer lives on. busy: the exporter
// is spending it now; ask again.
func takeRecord(mem []byte, i int) (send, spent, lives, busy bool) {
	w := word64(mem, uint64(i*spendRecordSize)+recordClaim)
	for {
		c := atomic.LoadUint64(w)
		switch claimState(c) {
		case claimOpen, claimDeclined:
			if atomic.CompareAndSwapUint64(w, c, claimWord(c>>8, claimReceiver)) {
				return true, false, false, false
			}
		case claimHarvesting:
			return false, false, false, true
		case claimLives:
			return false, true, true, false
		case claimEnded:
			return false, true, false, false
		default: // the receiver's already
			return true, false, false, false
		}
	}
}

// readRecord reads record i as the exporter sees it: id 0 is a free one.
func readRecord(mem []byte, i int) (id uint64, proof [32]byte, claim uint64) {
	off := uint64(i * spendRecordSize)
	claim = atomic.LoadUint64(word64(mem, off+recordClaim))
	id = atomic.LoadUint64(word64(mem, off+recordRegID))
	return id, load32(mem, off+recordProof), claim
}

// harvestRecord is the exporter spending open record i of a writable log
// with spend (which checks the proof): taken false if the record was not
// open as read (the receiver took it back, or rewrote it).
func harvestRecord(mem []byte, i int, spend func(id uint64, proof [32]byte) (spent, lives bool)) (taken bool) {
	id, proof, c := readRecord(mem, i)
	if id == 0 || claimState(c) != claimOpen {
		return false
	}
	w := word64(mem, uint64(i*spendRecordSize)+recordClaim)
	if !atomic.CompareAndSwapUint64(w, c, claimWord(c>>8, claimHarvesting)) {
		return false
	}
	// The claim was c from before the id and proof were read until now, and
	// a write changes the claim first: they are the record's.
	state := uint8(claimDeclined)
	if spent, lives := spend(id, proof); spent && lives {
		state = claimLives
	} else if spent {
		state = claimEnded
	}
	atomic.StoreUint64(w, claimWord(c>>8, state))
	return true
}
