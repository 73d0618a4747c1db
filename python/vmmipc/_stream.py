"""The receiver's low level: a Stream of chunks, one descriptor at a time,
and the matching export-side generators.

Descriptors the library hands out belong to the Chunk that received them
until it closes them (when iteration moves on) or detach() gives them to the
caller.
"""

from __future__ import annotations

import ctypes
import os
from ctypes import c_uint64, c_void_p
from typing import Iterator

from . import _errors, _lib
from ._lib import TICKET_SIZE
from ._register import share, unregister
from ._ticket import Ticket, as_ticket


class Chunk(_lib.Closeable):
    """One received chunk. Owns ``fd`` until close() or detach()."""
    __slots__ = ("index", "offset", "size", "fd", "file_offset", "_owned")

    def __init__(self, index: int, offset: int, size: int, fd: int, file_offset: int):
        self.index, self.offset, self.size = index, offset, size
        self.fd, self.file_offset = fd, file_offset
        self._owned = True

    def detach(self) -> int:
        """Return the descriptor and make it the caller's: the stream will no
        longer close it."""
        if not self._owned:
            raise ValueError(f"chunk {self.index}: its descriptor was already closed or detached")
        self._owned = False
        fd, self.fd = self.fd, -1
        return fd

    def close(self) -> None:
        if self._owned:
            self._owned = False
            fd, self.fd = self.fd, -1
            os.close(fd)

    @property
    def closed(self) -> bool:
        return not self._owned

    def __repr__(self) -> str:
        return (f"Chunk(index={self.index}, offset={self.offset}, size={self.size}, "
                f"fd={self.fd}, file_offset={self.file_offset})")


class Stream(_lib.Closeable):
    """A receiver's connection to one registration (vmmipc_open). Iterate it
    to get the chunks in order, one at a time: the previous chunk's fd is
    closed when iteration moves on, unless it was detached. The use is
    consumed when iteration ends; closing earlier gives it back."""

    def __init__(self, handle: int, ticket: Ticket):
        self._handle: int | None = handle
        self._pid = os.getpid()
        self.ticket = ticket
        self.done = False
        self.pulled = 0  # chunks handed out so far
        self._current: Chunk | None = None
        count, total = c_uint64(), c_uint64()
        _lib.call("vmmipc_stream_info", c_void_p(handle), ctypes.byref(count),
                  ctypes.byref(total))
        self.count, self.total_size = count.value, total.value

    def __iter__(self) -> "Stream":
        return self

    def __next__(self) -> Chunk:
        self._drop_current()
        if self._handle is None:
            if self.done:
                raise StopIteration
            raise _errors.BadHandleError("stream is closed", _errors.EBADF, "vmmipc_pull_next")
        if self.done:
            raise StopIteration
        c = _lib.vmmipc_chunk()
        rc = _lib.call("vmmipc_pull_next", c_void_p(self._handle), ctypes.byref(c))
        if rc == _errors.END:
            self.done = True
            raise StopIteration
        self._current = Chunk(c.index, c.offset, c.size, c.fd, c.file_offset)
        self.pulled += 1
        return self._current

    def _drop_current(self) -> None:
        cur, self._current = self._current, None
        if cur is not None:
            cur.close()

    def close(self) -> None:
        """Close the current chunk's fd (unless detached) and the stream."""
        self._drop_current()
        handle, self._handle = self._handle, None
        if handle is not None and os.getpid() == self._pid:
            _lib.call("vmmipc_close", c_void_p(handle))

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __repr__(self) -> str:
        state = ("done" if self.done else "closed" if self.closed
                 else f"next chunk {self.pulled}")
        try:
            pid = f" from pid {self.ticket.info().exporter_pid}"
        except Exception:  # repr must not raise (no library, fork)
            pid = ""
        return (f"<vmmipc.Stream {self.pulled} of {self.count} chunks pulled, "
                f"{self.total_size} bytes{pid}, {state}>")

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - finalizers must not raise
            pass


def open(ticket, *, timeout: float | None = None, window: int | None = None) -> Stream:  # noqa: A001
    """Connect to the ticket's exporter and claim one use (vmmipc_open).
    timeout: seconds to wait on a silent peer; window: chunk requests kept in
    flight (1 = lockstep)."""
    t = as_ticket(ticket, "vmmipc_open")
    opts = _lib.options("vmmipc_open", timeout=timeout, window=window)
    handle = c_void_p()
    _lib.call("vmmipc_open", ctypes.byref(t._c()), ctypes.byref(opts), ctypes.byref(handle))
    try:
        return Stream(handle.value, t)
    except BaseException:
        _lib.lib().vmmipc_close(handle)
        raise


def export_chunks(source, *, timeout: float | None = None,
                  window: int | None = None) -> Iterator[Chunk]:
    """Export a buffer chunk by chunk: a generator that yields one Chunk at a
    time (index, offset, size, fd, file_offset) and closes its fd when
    iteration moves on (unless detached). source is a HostBuffer, a cuda.core
    Buffer, a (dptr, size) VMM range, or a Ticket. The chunks are exported by
    this process's own server, so this process holds about one descriptor at
    a time for any number of chunks."""
    ticket, owned = _ticket_for(source)
    completed = False
    try:
        with open(ticket, timeout=timeout, window=window) as stream:
            yield from stream
            completed = stream.done
    finally:
        if owned and not completed:
            try:
                unregister(ticket)
            except _errors.VmmipcError:
                pass


def export_fds(source, **kw) -> Iterator[int]:
    """Like export_chunks, but yields the bare descriptor of each chunk (for
    from_fds()-style importers that take an iterable of fds). Each fd is
    closed when iteration moves on; dup it to keep it."""
    chunks = export_chunks(source, **kw)
    try:
        for chunk in chunks:
            yield chunk.fd
    finally:
        # Closing this generator early must close the stream now, not when
        # the inner generator happens to be collected (a traceback that
        # holds this frame keeps it alive).
        chunks.close()


def _ticket_for(source) -> tuple[Ticket, bool]:
    """(ticket, whether we registered it) for export_chunks."""
    if isinstance(source, (bytes, bytearray)) and len(source) == TICKET_SIZE:
        return as_ticket(source), False
    if hasattr(source, "grant") and callable(source.grant) and hasattr(source, "chunk_size"):
        return source.grant(uses=1), True          # HostBuffer
    if isinstance(source, tuple) and len(source) == 2:
        return share(source[0], source[1], uses=1), True
    if hasattr(source, "handle") and hasattr(source, "size"):
        return share(int(source.handle), source.size, uses=1), True  # cuda.core Buffer
    raise TypeError(f"cannot export {type(source).__name__}: pass a HostBuffer, a cuda.core "
                    "Buffer, a (dptr, size) tuple or a Ticket")
