package core

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
)

// A pid names a process only until it exits: the kernel hands the number out
// again. A ticket therefore also records the exporter's start time (field 22
// of /proc/<pid>/stat, clock ticks after boot), and a receiver that finds the
// pid gone, or started at another time, knows at once that the exporter has
// exited, instead of waiting on whatever now holds the address.

// processStartTime reads pid's start time from /proc.
func processStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces or
	// parentheses itself: fields 3.. start after the last ')'.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no ')' in %q", pid, b)
	}
	fields := bytes.Fields(b[i+1:])
	const startTimeField = 22 - 3 // field 22 overall, counted from field 3
	if len(fields) <= startTimeField {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields after the name, want more than %d", pid, len(fields), startTimeField)
	}
	return strconv.ParseUint(string(fields[startTimeField]), 10, 64)
}

// selfStartTime is this process's start time, or 0 if /proc cannot tell
// (then receivers skip the check).
func selfStartTime() uint64 {
	st, err := processStartTime(os.Getpid())
	if err != nil {
		return 0
	}
	return st
}

// checkExporterAlive fails at once when the ticket's exporter has exited.
// Where /proc cannot answer (not mounted, hidden), it says nothing: the
// handshake still refuses any other process.
func checkExporterAlive(t *Ticket) error {
	st, err := processStartTime(int(t.Pid))
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return Errorf(EIO, "open: the exporter (pid %d) has exited: no process has that pid any more", t.Pid)
	case err != nil || t.StartTime == 0:
		return nil
	case st != t.StartTime:
		return Errorf(EIO, "open: the exporter (pid %d, started at tick %d) has exited: pid %d now belongs to another process, started at tick %d", t.Pid, t.StartTime, t.Pid, st)
	}
	return nil
}
