package core

import (
	"strconv"

	"golang.org/x/sys/unix"
)

// Descriptors this package owns: whoever holds one closes it on every path,
// the error paths first of all. -1 marks a descriptor closed or never had.

// closeFD closes *fd if it is open and marks it closed, so that closing
// again, on a later error path, is harmless.
func closeFD(fd *int) {
	if *fd >= 0 {
		_ = unix.Close(*fd)
		*fd = -1
	}
}

// closeAll closes every descriptor of fds (those a message brought that
// are not kept).
func closeAll(fds []int) {
	for _, fd := range fds {
		_ = unix.Close(fd)
	}
}

// reopen opens a new open file description of the file fd names, with
// flags (O_CLOEXEC added): its own offset, mode and OFD locks. The caller
// closes it.
func reopen(fd, flags int) (int, error) { return openThrough("self", fd, flags) }

// openThrough is reopen for the descriptor fd of process proc ("self", or
// a pid in the PID namespace of our /proc), which the kernel allows only
// to a process that may read that process's memory (ptrace read access).
func openThrough(proc string, fd, flags int) (int, error) {
	return unix.Open("/proc/"+proc+"/fd/"+strconv.Itoa(fd), flags|unix.O_CLOEXEC, 0)
}
