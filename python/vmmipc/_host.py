"""HostBuffer: chunked host shared memory that pickles through vmmipc.

The owner holds ONE memfd of `size` bytes, sealed against shrinking and
growing, mapped once, and ONE anchor registration of it
(vmmipc_register_host_file, unlimited uses) for its whole life. The library
keeps its own duplicate of the memfd, so the owner's descriptor is only
needed to map the memory. Each grant (each pickle) is a register_again of
the anchor: no descriptor, no new buffer identity, so a receiver that has
the buffer cached imports it without a round trip (the sender's grant
table vouches for the pickle; vmmipc.h, vmmipc_import). The chunks cross
to the receiver as one short-lived descriptor of the memfd (they lie back
to back in it: one run, mapped with one mmap by vmmipc_import_stream; the
low-level vmmipc.open() stream still gets one descriptor per chunk), or,
where the receiver has the sender's grant table already, the receiver
opens the memfd itself through /proc (vmmipc.h, vmmipc_import_stream), so
both sides hold about one descriptor at a time, and the receiver's writes
are the sender's memory.

Lifetime: close() (or collection) unregisters the anchor and closes the
owner's memfd and mapping. Registrations already made by grant() or pickling
live on until used, expired or unregistered; the library keeps the memory
exported until the last of them has ended, and receivers' mappings stay
valid after that. wait() blocks until every such registration has ended.
"""

from __future__ import annotations

import copyreg
import mmap
import os
import sys
import time
import weakref

from . import _args, _errors, _exported, _lib
from ._anchor import Anchor
from ._mapping import import_private
from ._memfd import map_shared, new_memfd
from ._register import register_host_file, unregister
from ._ticket import Ticket, as_ticket

PAGE_SIZE = mmap.PAGESIZE
DEFAULT_CHUNK_SIZE = 2 << 20  # 2 MiB, the CUDA granularity, for symmetry


def _release_owner(fd: int, anchor: Anchor) -> None:
    """Finalizer of an owning HostBuffer: end the anchor, close the memfd."""
    try:
        anchor.retire(now=True)  # only marked in a forked child
    finally:
        os.close(fd)


def _renamed_pickle_args(pickle_uses, pickle_ttl, deprecated: dict):
    """HostBuffer(uses=, ttl=): the deprecated names of pickle_uses= and
    pickle_ttl= (they set per-pickle values, not the buffer's)."""
    for old, new in (("uses", "pickle_uses"), ("ttl", "pickle_ttl")):
        if old in deprecated:
            _errors.renamed(f"HostBuffer({old}=)", f"HostBuffer({new}=)", stacklevel=4)
    unknown = set(deprecated) - {"uses", "ttl"}
    if unknown:
        raise TypeError(f"HostBuffer() got an unexpected keyword argument {sorted(unknown)[0]!r}")
    return deprecated.get("uses", pickle_uses), deprecated.get("ttl", pickle_ttl)


def _pickle_uses(uses) -> int:
    return _args.u32(uses, "pickle_uses", "HostBuffer", "0 = unlimited")


def _pickle_ttl(ttl):
    if ttl is not None:
        _args.milliseconds(ttl, "pickle_ttl", 1, _lib.MAX_TTL_MS, "HostBuffer", "None = never")
    return ttl


class HostBuffer(_exported.Buffer, _lib.Closeable):
    """Chunked host shared memory. The HostBuffer is a writable buffer of the
    whole range (format "B"), and so is ``view``, a memoryview of it:
    ``memoryview(hb)``, ``numpy.frombuffer(hb, dtype)``, ``numpy.asarray(hb)``
    (uint8), ``torch.frombuffer(hb, dtype=torch.uint8)`` see the same bytes
    without a copy, ``bytes(hb)`` copies them at once; len(hb), hb[i] and
    hb[a:b] (a memoryview) too. close() refuses (BufferInUseError, a
    BufferError) while views it can see are alive: ``view`` itself if it
    was kept (v = hb.view), and memoryviews, arrays and tensors made from
    it; on Python 3.12+ also every one made from the HostBuffer itself;
    before 3.12 those hold the HostBuffer, and so its memory, alive: close()
    then leaves the unmapping to its collection (_exported.py).

    A closed HostBuffer is an empty buffer, on every Python: len(hb) == 0,
    memoryview(hb), bytes(hb) and numpy.frombuffer(hb) are empty, and hb[i],
    hb[a:b], ``view`` and iteration raise ValueError. ``size`` stays what it
    was. ctypes routes that read through its address (ctypes.string_at,
    memmove, cast) read zeros of a private mapping, never the memory it had.

    HostBuffer(size, chunk_size) creates the memory (the owner) and loads
    libvmmipc.so. Pickling it (pickle, multiprocessing Queue/Pipe/Pool/
    Process) registers it for ``pickle_uses`` receivers (default 1) and
    ``pickle_ttl`` seconds (default None: until used or unregistered);
    unpickling maps it, so the receiver sees and writes the same bytes.
    Without a ttl those registrations are made ahead, one with the buffer
    and 32 at a time for a loop of pickles (_anchor.py), and
    vmmipc.live_registrations() counts only those a pickle has named.
    """

    def __new__(cls, size: int, chunk_size: int = DEFAULT_CHUNK_SIZE, *,
                name: str = "vmmipc-hostbuffer", pickle_uses: int = 1,
                pickle_ttl: float | None = None, **deprecated):
        where = "HostBuffer"
        pickle_uses, pickle_ttl = _renamed_pickle_args(pickle_uses, pickle_ttl, deprecated)
        size = _args.integer(size, "size", 1, sys.maxsize, where)
        chunk_size = _args.integer(chunk_size, "chunk_size", PAGE_SIZE, sys.maxsize, where,
                                   f"a multiple of the page size {PAGE_SIZE}")
        if chunk_size % PAGE_SIZE:
            raise _errors.InvalidError(f"chunk_size={chunk_size} is not a multiple of the page "
                                       f"size {PAGE_SIZE}", _errors.EINVAL, where)
        if not isinstance(name, str):
            raise TypeError(f"{where}: name must be a str, not {type(name).__name__}")
        _pickle_uses(pickle_uses), _pickle_ttl(pickle_ttl)  # checked before anything is made
        _lib.lib(where)  # a missing library fails here, before any child starts
        fd = new_memfd(name, size)
        try:
            kw = {"trackfd": False} if sys.version_info >= (3, 13) else {}
            mm = map_shared(fd, size, f"a HostBuffer of size={size}", "", where, **kw)
            try:
                anchor = register_host_file(fd, size, chunk_size, uses=0)
            except BaseException:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            raise
        memory = _exported.Memory(size, buffer=mm)  # keeps mm mapped while it lives
        self = _exported.instance(cls, memory.addr, size)
        self._init(size, chunk_size, pickle_uses, pickle_ttl)
        self._fd = fd
        self._anchor: Anchor | None = Anchor(anchor)
        if pickle_ttl is None:
            self._anchor.make_ahead(pickle_uses)  # the first pickle calls no library
        self._mmap = mm
        self._memory = memory
        self._mapping = None
        # atexit=False: at exit a Queue feeder thread may still be pickling
        # this buffer; the process's end closes the fd and the server anyway.
        self._finalizer = weakref.finalize(self, _release_owner, fd, self._anchor)
        self._finalizer.atexit = False
        return self

    def __init__(self, *args, **kwargs):
        """Everything happened in __new__, which places the object over the
        memory it made (_exported.instance)."""

    def _init(self, size, chunk_size, uses, ttl):
        """uses and ttl were checked (__new__), or are an import's 1, None."""
        self._closed = False
        self._size = size
        self._chunk_size = chunk_size
        self._pickle_uses = uses
        self._pickle_ttl = ttl

    @classmethod
    def from_ticket(cls, ticket, chunk_size: int | None = None, *,
                    timeout: float | None = None, cache: bool = True,
                    confirm_later: bool = False, hold: bool = False) -> "HostBuffer":
        """Import a host ticket (what unpickling does): a HostBuffer over a
        mapping of the sender's memory (from the import cache if this process
        has it mapped already; confirm_later and hold as for
        vmmipc.import_stream)."""
        t = as_ticket(ticket, "HostBuffer.from_ticket")
        if chunk_size is None:
            info = t.info()
            per = -(-info.total_size // info.chunk_count)
            chunk_size = -(-per // PAGE_SIZE) * PAGE_SIZE
        else:
            chunk_size = _args.integer(chunk_size, "chunk_size", PAGE_SIZE, sys.maxsize,
                                       "HostBuffer.from_ticket")
        mapping = import_private(t, _lib.DEVICE_HOST, timeout=timeout, cache=cache,
                                 confirm_later=confirm_later, hold=hold)
        self = _exported.instance(cls, mapping._addr, mapping.size)  # mapping outlives self
        self._init(mapping.size, chunk_size, 1, None)
        self._fd = -1
        self._anchor = None
        self._mmap = None
        self._memory = None
        self._mapping = mapping
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
    def pickle_uses(self) -> int:
        """Receivers each pickle (or grant()) admits; 0 = unlimited."""
        return self._pickle_uses

    @pickle_uses.setter
    def pickle_uses(self, uses: int) -> None:
        self._pickle_uses = _pickle_uses(uses)

    @property
    def pickle_ttl(self) -> float | None:
        """Seconds each pickle's registration lives (None = until used)."""
        return self._pickle_ttl

    @pickle_ttl.setter
    def pickle_ttl(self, ttl: float | None) -> None:
        self._pickle_ttl = _pickle_ttl(ttl)

    @property
    def is_owner(self) -> bool:
        """True for the process that created the memory, False for importers."""
        return self._mapping is None

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def view(self) -> memoryview:
        """Writable memoryview (format 'B') of the whole buffer. While one is
        kept (v = hb.view), close() refuses (BufferInUseError); delete it or
        v.release() it. ValueError once closed."""
        if self._closed:
            raise ValueError("HostBuffer is closed")
        return self._memory.view() if self._mapping is None else self._mapping.view

    def fileno(self) -> int:
        """The owner's memfd (borrowed; do not close it)."""
        if not self.is_owner or self.closed:
            raise ValueError("only an open owning HostBuffer has a memfd")
        return self._fd

    def __len__(self) -> int:
        """The bytes it exposes: size, and 0 once closed (as its buffer)."""
        return 0 if self._closed else self._size

    def __reduce_ex__(self, protocol):
        # Instances are of per-size subclasses (_exported.instance), which
        # copyreg's table does not name: use the reducer installed for
        # HostBuffer (never ctypes', which would copy the bytes).
        reduce = copyreg.dispatch_table.get(HostBuffer)
        if reduce is None:
            raise TypeError("HostBuffer pickles through vmmipc's reducer, which `import "
                            "vmmipc` installs")
        return reduce(self)

    # --------------------------------------------------------------- sharing

    def share(self, **kw) -> Ticket:
        """Deprecated name of grant() (it never made a new registration of
        the memory, as vmmipc.share does: it grants its anchor)."""
        _errors.renamed("HostBuffer.share", "HostBuffer.grant")
        return self.grant(**kw)

    def grant(self, *, uses: int | None = None, ttl: float | None = None) -> Ticket:
        """A grant of this buffer (what pickling does): a
        register_again of its anchor, for `uses` receivers (default
        pickle_uses) and `ttl` seconds (default pickle_ttl). Opens no
        descriptor. It lives on after close() until used, expired or
        unregistered."""
        if self._mapping is not None:
            raise TypeError("an imported HostBuffer cannot be shared again: this process "
                            "holds a mapping, not the memfd; share it from its owner")
        if self._closed:
            raise ValueError("HostBuffer is closed: it can no longer be shared or pickled")
        return self._anchor.grant(uses=self._pickle_uses if uses is None else uses,
                                  ttl=self._pickle_ttl if ttl is None else ttl)

    def pending_tickets(self) -> list[Ticket]:
        """Tickets of this buffer's shares and pickles that have not ended
        (used up, expired or unregistered), in the order they were made."""
        if self._anchor is None:
            return []
        return self._anchor.pending()  # its grants have no callback: as the library counts them

    def unregister_all(self) -> int:
        """End every pending share of this buffer; returns how many."""
        n = 0
        for t in self.pending_tickets():
            try:
                unregister(t)
                n += 1
            except _errors.NotFoundError:
                pass  # ended meanwhile
        return n

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait until every share and pickle of this buffer made so far has
        ended (used, expired or unregistered) and been released: True then,
        False after `timeout` seconds. "Ended" means every chunk was sent,
        not that receivers are done with the memory."""
        deadline = time.monotonic() + _args.milliseconds(
            timeout, "timeout", 0, _args.U32_MAX, "HostBuffer.wait", "0 = just check") / 1000
        while True:
            # Not pending_tickets(): a grant that has ended counts here until
            # its release has run too (Ticket.wait waits for both).
            pending = [] if self._anchor is None else self._anchor.pending()
            if not pending:
                return True
            if not pending[0].wait(max(0.0, deadline - time.monotonic())):
                return False

    # --------------------------------------------------------------- closing

    def close(self) -> None:
        """Drop this process's view of the memory. BufferInUseError (a
        BufferError) while views of it are alive, ``view`` itself included
        where it was kept; it stays open then. The owner also ends its
        anchor registration and closes its memfd; shares already made stay
        fetchable until they end, and receivers' mappings stay valid. The
        HostBuffer is an empty buffer from then on (the class docstring).
        When anything besides the caller may hold the HostBuffer (a buffer
        taken from it before 3.12, a tensor, or just another name), the
        memory is unmapped at its collection instead (_exported.py)."""
        self._close(False)

    def _close(self, via_exit: bool) -> None:
        if self._closed:
            return
        n = self._memory.views_alive() if self._mapping is None else self._mapping.views_alive()
        unmap, n = _exported.closable(self, n, via_exit)
        if n:
            raise _errors.BufferInUseError(_exported.in_use_message("HostBuffer", n), None,
                                           "HostBuffer.close")
        self._closed = True
        # Empty from now on; its address leads away from the memory unless
        # disarm() could not map the zero pages that it leads to instead.
        if _exported.disarm(self) and unmap:
            if self._mapping is not None:
                mapping, self._mapping = self._mapping, None
                mapping._unmap_private()  # its views were counted above
            else:
                self._memory = None  # mm's last export (the memory's holder) goes
                self._mmap.close()
        if self._finalizer is not None:
            self._finalizer()  # the anchor ends; its grants stay pending_tickets()

    def __repr__(self) -> str:
        role = "owner" if self.is_owner else "imported"
        state = " closed" if self.closed else ""
        return (f"<vmmipc.HostBuffer {role} size={self._size} chunk_size={self._chunk_size} "
                f"n_chunks={self.n_chunks}{state}>")
