"""The memfds this package makes and maps itself (a HostBuffer's, a
vmmipc.torch CPU arena chunk's, a DataLoader arena's), with running out of
descriptors or of address space told as vmmipc tells it everywhere else."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os

from . import _errors


def sealed_memfd(name: str, size: int) -> int:
    """A memfd of `size` bytes that can neither shrink nor grow, nor take
    another seal."""
    flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        # A receiver must never see SIGBUS: the file can no longer shrink.
        # And no seal can be added any more: a receiver gets a read-write
        # descriptor of it, and could otherwise add F_SEAL_WRITE or
        # F_SEAL_FUTURE_WRITE, refusing every later receiver of the
        # registrations already pickled (registering would add F_SEAL_SEAL
        # anyway; include/vmmipc.h).
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def new_memfd(name: str, size: int, what: str = "HostBuffer") -> int:
    """sealed_memfd() for `what` (named in errors), with running out of
    descriptors as OutOfDescriptorsError (also an OSError), saying which
    limit and what to do."""
    try:
        return sealed_memfd(name, size)
    except OSError as e:
        if e.errno == errno.EMFILE:
            why = ("this process has as many descriptors open as its limit allows "
                   "(RLIMIT_NOFILE); close some, or raise the soft limit (`ulimit -n`, or "
                   "resource.setrlimit(resource.RLIMIT_NOFILE, ...))")
        elif e.errno == errno.ENFILE:
            why = ("the system's file table is full (fs.file-max); close descriptors, in this "
                   "process or others, or raise fs.file-max")
        else:
            raise
        err = _errors.OutOfDescriptorsError(
            f"cannot create the {what}'s memfd: {e.strerror}: {why}", _errors.ENFILE, what)
        err.errno = e.errno
        raise err from None


def map_shared(fd: int, size: int, what: str, remedy: str, where: str, **kw) -> mmap.mmap:
    """mmap of [0, size) of fd, shared and writable, with running out of
    address space as VmmipcMemoryError naming `what`, its size and, after
    the cause, `remedy` ("; do this")."""
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, **kw)
    except OSError as e:
        if e.errno != errno.ENOMEM:
            raise
        raise _errors.VmmipcMemoryError(
            f"cannot map {what} bytes ({size / 2**30:.1f} GiB): mmap: {e.strerror}; the address "
            f"space (RLIMIT_AS) or the memory overcommit policy does not allow it{remedy}",
            _errors.ENOMEM, where) from None
