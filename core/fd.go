package core

import "golang.org/x/sys/unix"

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
