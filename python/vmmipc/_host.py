"""HostBuffer: chunked host shared memory that pickles through vmmipc.

The owner holds ONE memfd of `size` bytes, sealed against shrinking and
growing, mapped once. Pickling registers the file with
vmmipc_register_host_file (no descriptor is opened); each chunk crosses to
the receiver as its own short-lived descriptor (a fresh dup of the memfd)
with its file offset. Unpickling maps the chunks one at a time into one
contiguous range (vmmipc_import_stream), so both sides hold about one
descriptor at a time, and the receiver's writes are the sender's memory.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import sys
import threading
import weakref

from . import _errors, _lib
from ._mapping import import_stream
from ._register import _records, register_host_file, unregister
from ._ticket import Ticket

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_CHUNK_SIZE = 2 << 20  # 2 MiB, the CUDA granularity, for symmetry


class _SharedFD:
    """A descriptor closed when the last of its holders lets go: the owning
    HostBuffer and every registration not yet released."""

    def __init__(self, fd: int):
        self.fd = fd
        self._refs = 1
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            if self._refs == 0:
                raise ValueError("the HostBuffer's memfd is already closed")
            self._refs += 1

    def release(self) -> None:
        with self._lock:
            self._refs -= 1
            last = self._refs == 0
        if last:
            os.close(self.fd)


class _HostRelease:
    """Release callback of one registration: drops its hold on the memfd. Runs
    on a library thread; must not call into vmmipc."""
    __slots__ = ("shared",)

    def __init__(self, shared: _SharedFD):
        self.shared = shared

    def __call__(self) -> None:
        self.shared.release()


def _memfd(name: str, size: int) -> int:
    flags = os.MFD_CLOEXEC | getattr(os, "MFD_ALLOW_SEALING", 0)
    fd = os.memfd_create(name, flags)
    try:
        os.ftruncate(fd, size)
        seals = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0)
        if seals and hasattr(fcntl, "F_ADD_SEALS"):
            # A receiver must never see SIGBUS: the file can no longer shrink.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except BaseException:
        os.close(fd)
        raise
    return fd


class HostBuffer:
    """Chunked host shared memory with a writable memoryview of the whole
    range (``view``; also indexing, len() and, on Python 3.12+, memoryview(hb)).

    HostBuffer(size, chunk_size) creates the memory (the owner). Pickling it
    (pickle, multiprocessing Queue/Pipe/Pool/Process) registers it with this
    process's vmmipc server for ``pickle_uses`` receivers (default 1) and
    ``pickle_ttl`` seconds (default None: until used or unregistered);
    unpickling maps it, so the receiver sees and writes the same bytes.
    """

    def __init__(self, size: int, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                 name: str = "vmmipc-hostbuffer", uses: int = 1, ttl: float | None = None):
        size, chunk_size = int(size), int(chunk_size)
        if size <= 0:
            raise ValueError(f"HostBuffer size must be positive, got {size}")
        if chunk_size <= 0 or chunk_size % PAGE_SIZE:
            raise ValueError(f"chunk_size {chunk_size} must be a positive multiple of the "
                             f"page size {PAGE_SIZE}")
        fd = _memfd(name, size)
        try:
            kw = {"trackfd": False} if sys.version_info >= (3, 13) else {}
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, **kw)
        except BaseException:
            os.close(fd)
            raise
        self._init(size, chunk_size, uses, ttl)
        self._shared = _SharedFD(fd)
        self._mmap = mm
        self._mapping = None
        self._view = memoryview(mm)
        self._finalizer = weakref.finalize(self, _SharedFD.release, self._shared)

    def _init(self, size, chunk_size, uses, ttl):
        self._size = size
        self._chunk_size = chunk_size
        self.pickle_uses = uses
        self.pickle_ttl = ttl

    @classmethod
    def from_ticket(cls, ticket, chunk_size: int | None = None, *,
                    timeout: float | None = None) -> "HostBuffer":
        """Import a host ticket (what unpickling does): a HostBuffer over a
        mapping of the sender's memory."""
        mapping = import_stream(ticket, _lib.DEVICE_HOST, timeout=timeout)
        if chunk_size is None:
            info = Ticket(ticket).info()
            per = -(-info.total_size // info.chunk_count)
            chunk_size = -(-per // PAGE_SIZE) * PAGE_SIZE
        self = cls.__new__(cls)
        self._init(mapping.size, chunk_size, 1, None)
        self._shared = None
        self._mmap = None
        self._mapping = mapping
        self._view = mapping.view
        self._finalizer = None
        return self

    # ------------------------------------------------------------ properties

    @property
    def size(self) -> int:
        return self._size

    @property
    def chunk_size(self) -> int:
        return self._chunk_size

    @property
    def n_chunks(self) -> int:
        return -(-self._size // self._chunk_size)

    @property
    def is_owner(self) -> bool:
        """True for the process that created the memory, False for importers."""
        return self._mapping is None

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def view(self) -> memoryview:
        """Writable memoryview (format 'B') of the whole buffer."""
        if self._view is None:
            raise ValueError("HostBuffer is closed")
        return self._view

    def fileno(self) -> int:
        """The owner's memfd (borrowed; do not close it)."""
        if not self.is_owner or self.closed:
            raise ValueError("only an open owning HostBuffer has a memfd")
        return self._shared.fd

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key):
        return self.view[key]

    def __setitem__(self, key, value) -> None:
        self.view[key] = value

    def __buffer__(self, flags: int) -> memoryview:  # Python 3.12+ (PEP 688)
        return memoryview(self.view)

    # --------------------------------------------------------------- sharing

    def share(self, *, uses: int | None = None, ttl: float | None = None) -> Ticket:
        """Register this buffer once (what pickling does) and return the
        ticket. The memfd stays open until the registration ends."""
        if not self.is_owner:
            raise TypeError("an imported HostBuffer cannot be shared again: this process "
                            "holds a mapping, not the memfd; share it from its owner")
        if self.closed:
            raise ValueError("HostBuffer is closed")
        self._shared.acquire()
        return register_host_file(
            self._shared.fd, self._size, self._chunk_size,
            uses=self.pickle_uses if uses is None else uses,
            ttl=self.pickle_ttl if ttl is None else ttl,
            release=_HostRelease(self._shared))

    def pending_tickets(self) -> list[Ticket]:
        """Tickets of this buffer's registrations that have not ended."""
        if self._shared is None:
            return []
        return [rec.ticket for rec in list(_records.values())
                if isinstance(rec.release, _HostRelease) and rec.release.shared is self._shared
                and rec.ticket is not None]

    def unregister_all(self) -> int:
        """End every pending registration of this buffer; returns how many."""
        n = 0
        for t in self.pending_tickets():
            try:
                unregister(t)
                n += 1
            except _errors.NotFoundError:
                pass  # ended meanwhile
        return n

    def __reduce__(self):
        from ._mp import reduce_host_buffer
        return reduce_host_buffer(self)

    # --------------------------------------------------------------- closing

    def close(self) -> None:
        """Drop this process's view of the memory (BufferError while exported
        memoryviews are alive). The owner's memfd stays open until pending
        registrations end; receivers' mappings stay valid."""
        view, self._view = self._view, None
        if view is None:
            return
        try:
            if self._mapping is not None:
                self._mapping.close()  # releases the view it lent us
            else:
                view.release()
                self._mmap.close()
        except BufferError:
            # Still exported (numpy, slices held elsewhere): stay open.
            self._view = self._mapping.view if self._mapping is not None else memoryview(self._mmap)
            raise
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> "HostBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "imported"
        state = " closed" if self.closed else ""
        return (f"<vmmipc.HostBuffer {role} size={self._size} chunk_size={self._chunk_size} "
                f"n_chunks={self.n_chunks}{state}>")


def rebuild_host_buffer(ticket, chunk_size):
    """Unpickling side of a HostBuffer."""
    return HostBuffer.from_ticket(ticket, chunk_size)
