package core

import (
	"strconv"

	"golang.org/x/sys/unix"
)

// A miss that the grant table vouches for: host memory new to this
// process, mapped without a round trip to the exporter. Where the
// exporter's table (granttable.go) vouches for the ticket as for a hit and
// names the file that holds the buffer (a host-file registration: one
// memfd, chunks back to back from offset 0), the receiver opens that file
// itself through /proc/<pid>/fd/<n>, which the kernel allows only a
// process that may read the exporter's memory anyway (its uid, or
// CAP_SYS_PTRACE; not a non-dumpable exporter), checks it is the very file
// the table names (device and inode: a descriptor number handed out again
// is refused) and the memfd a stream would send (HostImporter.Map's
// checks), maps it whole and closes it. The use is taken, recorded and
// spent as a table hit's (cache.go hitOnTable). Anything else streams, and
// the exporter judges the ticket.

// importFromTable maps t's buffer from the file its exporter's table
// names; ok is false where it cannot (then stream: nothing was kept).
func importFromTable(t *Ticket, key cacheKey, opts ImportOptions, cacheable bool) (ref Ref, ok bool, err error) {
	if t.Kind != MemoryHost || opts.Hold {
		return Ref{}, false, nil
	}
	answer, u := vouch(t, true)
	switch answer {
	case tableSpentHere:
		return Ref{}, true, Errorf(ENOENT, "import: registration %d was used up: this process has spent its last use already", t.RegID)
	case tableAsk:
		return Ref{}, false, nil
	}
	imp := &HostImporter{}
	if err := mapBackingFile(t, u, imp); err != nil {
		settle(t, u.record, false) // not spent: the stream takes the use
		return Ref{}, false, nil
	}
	e := newEntry(key, t, uint64(uintptr(imp.base)), imp, true) // lives: the spend's answer tells
	e.fromTable = true
	ref = imports.add(e, cacheable)
	imports.spendTaken(e, t, u.record, opts.Timeout)
	return ref, true, nil
}

// mapBackingFile reserves t's range and maps the exporter's file that u
// names there, once the exporter is known alive (as for a table hit) and
// the file opened is the one named.
func mapBackingFile(t *Ticket, u vouchedUse, imp *HostImporter) error {
	if !procShowsOurPIDs() {
		return Errorf(EIO, "this /proc is not of our PID namespace")
	}
	if err := u.exporterAlive(t); err != nil {
		return err
	}
	file := u.file
	if checkAddressSpace(t.Total, "", "") != nil {
		return Errorf(ENOMEM, "no address space for %d bytes", t.Total)
	}
	fd, err := openThrough(strconv.FormatUint(uint64(t.Pid), 10), file.fd, unix.O_RDWR)
	if err != nil {
		return Errorf(ioCode(err), "opening the exporter's file: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Dev != file.dev || st.Ino != file.ino {
		return Errorf(EIO, "the exporter's descriptor %d is not the file its table names", file.fd)
	}
	if _, err := imp.Reserve(t.Total); err != nil {
		return err
	}
	if err := imp.Map(Chunk{FD: fd, Offset: 0, FileOffset: 0, Size: t.Total}); err != nil {
		_ = imp.Unmap()
		return err
	}
	return nil
}
