package core

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Before dialing, a receiver asks two things of a ticket: can its exporter
// be reached from here at all, and is it still the process that issued it?
// A pid names a process only until it exits (the kernel hands the number
// out again), and only inside its PID namespace; a ticket therefore also
// records the exporter's start time (field 22 of /proc/<pid>/stat, clock
// ticks after boot) and namespaces (namespaces.go), and an exporter with a
// socket directory holds a lock there for as long as it lives
// (socketdir.go). A receiver that finds the exporter gone knows at once,
// instead of waiting on whatever now holds the address.

// checkBeforeDial runs what every connection to t's exporter checks first:
// that its address can reach it from here, and that it is alive.
func checkBeforeDial(t *Ticket) error {
	if err := checkReachable(t); err != nil {
		return err
	}
	return checkExporterAlive(t)
}

// checkReachable refuses tickets whose abstract address cannot reach the
// exporter from here, saying what to set instead.
func checkReachable(t *Ticket) error {
	if !strings.HasPrefix(t.Address, "@") {
		return nil
	}
	switch {
	case t.NS.netNS() == nsOther:
		return Errorf(EIO, "open: nothing listens at %s for us: the exporter is in another network namespace, and abstract sockets do not cross network namespaces; set %s for the exporter to a directory both sides mount at the same path (%s: its network namespace field differs from ours)", t.Address, SocketDirEnv, orDamaged)
	case t.NS.pidNS() == nsOther:
		return Errorf(EIO, "open: the exporter (pid %d in its own namespace) is in another PID namespace and no shared socket directory is set: its pid means nothing here, so neither its liveness nor its socket's owner can be checked; set %s for the exporter to a directory both sides mount at the same path (%s: its PID namespace field differs from ours)", t.Pid, SocketDirEnv, orDamaged)
	}
	return nil
}

// errZombie is a process that has exited and waits for its parent to reap
// it: /proc still shows its pid and start time, but nothing runs there. A
// zombie exporter answers no one (though a forked child of it may still
// hold its listening socket, so a connection would wait out its timeout),
// and a zombie receiver writes nothing more: both count as exited.
var errZombie = fmt.Errorf("the process has exited and waits to be reaped by its parent (a zombie): %w", fs.ErrNotExist)

// processStartTime reads pid's start time from /proc (errZombie, an
// fs.ErrNotExist, for a process that has exited but is not reaped yet).
func processStartTime(pid int) (uint64, error) {
	return startTimeIn(fmt.Sprintf("/proc/%d/stat", pid))
}

// startTimeIn reads the start time from a /proc/<pid>/stat file. Every
// connection reads it (checkPidAlive), so it takes three system calls
// (open, read, close) into one buffer, not os.ReadFile's ten
// (it registers the file with the poller and stats it first).
func startTimeIn(path string) (uint64, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	var buf [2048]byte // the line is a few hundred bytes: 52 numbers and a name of at most 64
	n := 0
	for n < len(buf) {
		m, err := unix.Read(fd, buf[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			unix.Close(fd)
			return 0, &fs.PathError{Op: "read", Path: path, Err: err}
		}
		if m == 0 {
			break
		}
		n += m
	}
	unix.Close(fd)
	b := buf[:n]
	// The command name (field 2) is in parentheses and may hold spaces or
	// parentheses itself: fields 3.. start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("%s: no ')' in %q", path, b)
	}
	fields := bytes.Fields(b[i+1:])
	const startTimeField = 22 - 3 // field 22 overall, counted from field 3
	if len(fields) <= startTimeField {
		return 0, fmt.Errorf("%s: %d fields after the name, want more than %d", path, len(fields), startTimeField)
	}
	if state := string(fields[0]); state == "Z" || state == "X" { // field 3: zombie, dead
		return 0, &fs.PathError{Op: "read", Path: path, Err: errZombie}
	}
	return strconv.ParseUint(string(fields[startTimeField]), 10, 64)
}

// selfStartTime is this process's start time, or 0 if /proc cannot tell
// (then receivers skip the check). /proc/self is this process whichever
// PID namespace the mounted /proc belongs to.
func selfStartTime() uint64 {
	st, err := startTimeIn("/proc/self/stat")
	if err != nil {
		return 0
	}
	return st
}

// checkExporterAlive fails at once when the ticket's exporter has exited.
// Where nothing can answer (another PID namespace and no lock, /proc not
// ours), it says nothing: the handshake still refuses any other process.
func checkExporterAlive(t *Ticket) error {
	if err := checkPidAlive(t); err != nil {
		return err
	}
	return checkLockHeld(t)
}

// checkPidAlive checks the ticket's pid and start time in /proc, where the
// pid means the exporter: in its PID namespace, with a /proc of it.
func checkPidAlive(t *Ticket) error {
	if t.NS.pidNS() != nsSame || !procShowsOurPIDs() {
		return nil
	}
	st, err := processStartTime(int(t.Pid))
	switch {
	case errors.Is(err, errZombie):
		return Errorf(EIO, "open: the exporter (pid %d) has exited: its parent has not reaped it yet", t.Pid)
	case errors.Is(err, fs.ErrNotExist):
		return Errorf(EIO, "open: the exporter (pid %d) has exited, %s: no process has that pid any more", t.Pid, orDamaged)
	case err != nil || t.StartTime == 0 || !sameClock(t):
		return nil
	case st != t.StartTime:
		return Errorf(EIO, "open: the exporter (pid %d, started at tick %d) has exited, %s: pid %d now belongs to another process, started at tick %d", t.Pid, t.StartTime, orDamaged, t.Pid, st)
	}
	return nil
}

// sameClock reports whether start times read here compare with the
// ticket's: the same time namespace, or none on either side (a kernel
// without time namespaces).
func sameClock(t *Ticket) bool {
	return t.NS.timeNS() == nsSame || (t.NS.Time == 0 && selfNamespaces().Time == 0)
}

// checkLockHeld checks that the exporter of a filesystem socket still
// holds its lock next to it. The lock is a POSIX record lock: the kernel
// drops it when the process exits or execs, and a forked child never
// inherits it, so it answers in every namespace that sees the directory.
//
// First it checks the directory's path as the exporter did (checkPath): a
// path that another uid could re-point would lead to a lock and a socket
// of theirs, which could say "exited" of a live exporter, or answer in its
// place. A path it cannot follow (not mounted here, say) is left to the
// dial, which then says it cannot connect.
func checkLockHeld(t *Ticket) error {
	path, ok := lockPathFor(t.Address)
	if !ok {
		return nil
	}
	var unsafe *unsafePathError
	if _, err := checkPath(filepath.Dir(path)); errors.As(err, &unsafe) {
		return Errorf(ECONFIG, "open: the exporter's socket directory %s cannot be trusted here: %s (then set %s for the exporter to such a path)", filepath.Dir(path), unsafe.msg, SocketDirEnv)
	}
	switch held, holder := probeLock(path); {
	case held == lockFree:
		return Errorf(EIO, "open: the exporter (pid %d in its own namespace) has exited: nothing holds its lock %s any more (its socket file may be left behind)", t.Pid, path)
	case held == lockHeld && holder > 0 && t.NS.pidNS() == nsSame && uint32(holder) != t.Pid:
		return Errorf(EIO, "open: the exporter (pid %d) has exited, or the ticket's pid is damaged: its lock %s is held by pid %d", t.Pid, path, holder)
	}
	return nil
}
