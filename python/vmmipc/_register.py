"""The sender side: registrations, their callbacks, and their end.

Registering opens no descriptor. What the caller hands in stays the
caller's: the fd of register_host_file may be closed right after the call
(the library keeps one duplicate of its own), the handles of
register_cuda_handles must stay valid until the registration's release
callback has run.

When a registration ends, when its release callback runs and why "sent" is
not "done": include/vmmipc.h, "Lifetime, for every register call" (the one
place those rules are written). wait(ticket) blocks until a registration has
ended and its release callback has returned.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from ctypes import c_uint64, c_void_p
from typing import Callable

from . import _args, _errors, _lib
from ._errors import InvalidError
from ._lib import MAX_CHUNKS, MEMORY_HOST
from ._ticket import Ticket, as_ticket

log = logging.getLogger("vmmipc")


class _Record:
    """What one registration pins on the Python side until it is released."""
    __slots__ = ("export_fn", "release", "ticket")

    def __init__(self, export_fn, release):
        self.export_fn = export_fn
        self.release = release
        self.ticket: Ticket | None = None


# user-pointer key -> _Record, only for registrations with a Python callback.
# Keys are never reused. The two trampolines below live as long as the
# module, so the library can never call a ctypes callback object that was
# freed; per-registration state is looked up by key and dropped when release
# runs (exactly once, on a library thread).
_records: dict[int, _Record] = {}
_keys = itertools.count(1)


def _export_trampoline(user, index, fd_out):
    rec = _records.get(user)
    if rec is None or rec.export_fn is None:
        return 1
    try:
        fd = rec.export_fn(index)
        fd = fd.__index__()
        if fd < 0:
            log.error("vmmipc export_fn(%d) returned %d, not a descriptor", index, fd)
            return 1
        fd_out[0] = fd
        return 0
    except OSError as e:
        log.exception("vmmipc export_fn(%d) failed", index)
        return e.errno or 1
    except BaseException:  # noqa: BLE001 - nothing may escape into the library
        log.exception("vmmipc export_fn(%d) failed", index)
        return 1


def _release_trampoline(user):
    rec = _records.pop(user, None)
    if rec is None or rec.release is None:
        return
    try:
        rec.release()
    except BaseException:  # noqa: BLE001
        log.exception("vmmipc release callback failed")


_EXPORT_CB = _lib.EXPORT_FN(_export_trampoline)
_RELEASE_CB = _lib.RELEASE_FN(_release_trampoline)
_NO_RELEASE = _lib.RELEASE_FN()  # NULL: the library calls nothing


def _callable(value, name: str, function: str):
    if value is not None and not callable(value):
        raise TypeError(f"{_errors.python_name(function)}: {name} must be callable or None, "
                        f"not {type(value).__name__}")
    return value


def _registered(rec: _Record | None, do_register) -> Ticket:
    """Run do_register(release_fn, user, ticket_out) and return the ticket.
    With a record (a Python callback to run), it is filed under a fresh key
    that the trampolines find; without one the library gets NULL and calls
    nothing back. On failure the library calls nothing (the header says
    so), and neither does Python: the record is dropped, release is not run."""
    out = _lib.vmmipc_ticket()
    if rec is None:
        do_register(_NO_RELEASE, None, ctypes.byref(out))
        return Ticket._made(out.bytes)
    key = next(_keys)
    _records[key] = rec
    try:
        do_register(_RELEASE_CB, c_void_p(key), ctypes.byref(out))
    except BaseException:
        del _records[key]
        raise
    ticket = Ticket._made(out.bytes)
    rec.ticket = ticket
    return ticket


def _record_for(release) -> _Record | None:
    return None if release is None else _Record(None, release)


def register(sizes, export_fn: Callable[[int], int], *, uses: int = 1,
             ttl: float | None = None, release: Callable[[], None] | None = None,
             memory_kind: int = MEMORY_HOST) -> Ticket:
    """Register a buffer of len(sizes) chunks; opens no descriptor.

    export_fn(index) is called on a library thread when a receiver asks for
    chunk `index`; it returns a NEW descriptor whose bytes start at offset 0,
    which the library sends and closes. release() runs exactly once, on a
    library thread, when the registration has ended (uses consumed, ttl
    expired, unregister) and no export_fn call is in flight; it must not call
    back into vmmipc; it is not run when registering fails (the call raises
    instead). uses=0 means unlimited; ttl is in seconds (None = never). Each
    call makes a new buffer identity; register_again gives more tickets of
    the same one."""
    fn = "vmmipc_register"
    sizes = _args.integers(sizes, "sizes", 0, _args.U64_MAX, fn, MAX_CHUNKS)
    if not sizes:
        raise InvalidError("sizes is empty: a buffer has at least one chunk", _errors.EINVAL, fn)
    if not callable(export_fn):
        raise TypeError(f"{_errors.python_name(fn)}: export_fn must be callable, not "
                        f"{type(export_fn).__name__}")
    _callable(release, "release", fn)
    arr = (c_uint64 * len(sizes))(*sizes)
    opts = _lib.options(fn, uses=uses, ttl=ttl, memory_kind=memory_kind)

    def do(release_fn, user, out):
        _lib.call(fn, arr, len(sizes), _EXPORT_CB, release_fn, user, ctypes.byref(opts), out)
    # export_fn is called through the trampoline: this always has a record.
    return _registered(_Record(export_fn, release), do)


def register_host_file(fd: int, size: int, chunk_size: int, *, uses: int = 1,
                       ttl: float | None = None,
                       release: Callable[[], None] | None = None) -> Ticket:
    """Register bytes [0, size) of a memfd sealed against shrinking as chunks
    of chunk_size bytes. The library keeps one duplicate of fd of its own
    (until the last registration of that file has ended), so fd may be
    closed right after this returns. Registering the same file with the same
    size and chunk_size as a live registration gives the same buffer
    identity."""
    fn = "vmmipc_register_host_file"
    fd = _args.integer(fd, "fd", _args.I32_MIN, _args.I32_MAX, fn)
    size = _args.u64(size, "size", fn)
    chunk_size = _args.u64(chunk_size, "chunk_size", fn)
    _callable(release, "release", fn)
    opts = _lib.options(fn, uses=uses, ttl=ttl)

    def do(release_fn, user, out):
        _lib.call(fn, fd, size, chunk_size, release_fn, user, ctypes.byref(opts), out)
    return _registered(_record_for(release), do)


def share(dptr: int, size: int, *, uses: int = 1, ttl: float | None = None) -> Ticket:
    """Register the CUDA VMM range [dptr, dptr + size) (vmmipc_register_cuda),
    which must start and end on allocation boundaries (cuda_query_range finds
    them). The library retains every allocation, so the caller may free its
    buffer right after; the memory stays valid for receivers until the last
    registration of it ends. Registering the same allocations again gives the
    same buffer identity; register_again is the cheap way."""
    fn = "vmmipc_register_cuda"
    dptr = _args.u64(dptr, "dptr", fn)
    size = _args.u64(size, "size", fn)
    opts = _lib.options(fn, uses=uses, ttl=ttl)
    out = _lib.vmmipc_ticket()
    _lib.call(fn, dptr, size, ctypes.byref(opts), ctypes.byref(out))
    return Ticket._made(out.bytes)


register_cuda = share  # the header's name


def register_cuda_handles(handles, sizes, *, uses: int = 1, ttl: float | None = None,
                          release: Callable[[], None] | None = None) -> Ticket:
    """Register CUmemGenericAllocationHandle values (borrowed until release()
    runs) of the given sizes, in order, as one buffer."""
    fn = "vmmipc_register_cuda_handles"
    handles = _args.integers(handles, "handles", 0, _args.U64_MAX, fn, MAX_CHUNKS)
    sizes = _args.integers(sizes, "sizes", 0, _args.U64_MAX, fn, MAX_CHUNKS)
    if len(handles) != len(sizes) or not handles:
        raise InvalidError(f"{len(handles)} handles and {len(sizes)} sizes (need the same "
                           "non-zero count)", _errors.EINVAL, fn)
    _callable(release, "release", fn)
    h = (c_uint64 * len(handles))(*handles)
    s = (c_uint64 * len(sizes))(*sizes)
    opts = _lib.options(fn, uses=uses, ttl=ttl)

    def do(release_fn, user, out):
        _lib.call(fn, h, s, len(handles), release_fn, user, ctypes.byref(opts), out)
    return _registered(_record_for(release), do)


def register_again(ticket, *, uses: int = 1, ttl: float | None = None,
                   release: Callable[[], None] | None = None, hold: bool = False) -> Ticket:
    """A new registration of the memory named by `ticket`, a live
    registration of this process (vmmipc_register_again): a new ticket with
    its own uses, ttl and secret and the same buffer identity, so a receiver
    that has the buffer cached imports it at once (without hold, the grant
    table vouches for it; with hold, in one round trip). Opens no
    descriptor and makes no driver call. The memory stays exported while any
    registration made from it lives, even after `ticket` itself has ended.
    hold=True (VMMIPC_REGISTER_HOLD): a receiver that imports or confirms
    with hold=True holds its use, and `release` runs only once every such
    receiver has let go (vmmipc.release) or ended (see the header, "Holds").
    NotFoundError if `ticket` is not a live registration of this process."""
    fn = "vmmipc_register_again"
    t = as_ticket(ticket, fn)
    _callable(release, "release", fn)
    opts = _lib.options(fn, uses=uses, ttl=ttl,
                        register_flags=_lib.REGISTER_HOLD if hold else 0)

    def do(release_fn, user, out):
        _lib.call(fn, ctypes.byref(t._c()), release_fn, user, ctypes.byref(opts), out)
    return _registered(_record_for(release), do)


def register_again_quiet(anchor: _lib.vmmipc_ticket, uses: int, ttl: float | None) -> Ticket:
    """register_again without a release callback or hold, of the live
    registration whose C ticket is `anchor`: what Anchor.grant makes for a
    HostBuffer's pickle, with the anchor's ticket converted once (the
    arguments are checked by options(), as register_again checks them)."""
    fn = "vmmipc_register_again"
    opts = _lib.options(fn, uses=uses, ttl=ttl)

    def do(release_fn, user, out):
        _lib.call(fn, ctypes.byref(anchor), release_fn, user, ctypes.byref(opts), out)
    return _registered(None, do)


def unregister(ticket) -> None:
    """End a registration of this process early (NotFoundError if it is not
    ours or has already ended). Memory already imported stays valid. Its
    release callback runs once no export is in flight: before this returns,
    or shortly after on a library thread (wait() tells when)."""
    _lib.call("vmmipc_unregister", ctypes.byref(as_ticket(ticket, "vmmipc_unregister")._c()))


def library_live_registrations() -> int:
    """Registrations of this process that have not ended yet, as the
    library counts them (vmmipc.live_registrations leaves out the grants
    anchors made ahead: _anchor.py)."""
    n = c_uint64()
    _lib.call("vmmipc_live_registrations", ctypes.byref(n))
    return n.value


def live_many(tickets: list[Ticket]) -> list[bool]:
    """Which of these tickets of this process name registrations that have
    not ended, in one call (vmmipc_live_many): the anchors forget their
    ended grants with it. Tickets of other processes, or changed in a byte,
    are not live."""
    fn = "vmmipc_live_many"
    n = len(tickets)
    if n == 0:
        return []
    live = (ctypes.c_uint8 * n)()
    _lib.call(fn, _lib.ticket_array(tickets), n, live)
    return [b == 1 for b in live]


def holds() -> int:
    """Uses of this process's registrations that receivers hold now
    (register_again(hold=True); see the header, "Holds")."""
    n = c_uint64()
    _lib.call("vmmipc_holds", ctypes.byref(n))
    return n.value


def version() -> str:
    """The library's version, e.g. "0.2.0"."""
    return _lib.lib("vmmipc_version").vmmipc_version().decode()


def strerror(status: int) -> str:
    """Name and describe a status ("VMMIPC_EAUTH: authentication failed")."""
    status = _args.i32(status, "status", "vmmipc_strerror")
    return _lib.lib("vmmipc_strerror").vmmipc_strerror(status).decode()


def _unregister_all_at_exit() -> None:
    # Ends this process's registrations that call back into Python while
    # Python is still whole, so that no release callback has to enter an
    # interpreter that is finalizing. Runs after multiprocessing has joined
    # the children (exitpriority < 0), which may still be fetching what was
    # pickled for them, and after Queue feeder threads were flushed.
    # Receivers that come now hear that the exporter is exiting, not that
    # someone unregistered what they were sent.
    _lib.call("vmmipc_exiting")
    for rec in list(_records.values()):
        if rec.ticket is not None:
            try:
                unregister(rec.ticket)
            except _errors.VmmipcError:
                pass


_lib.at_exit(_unregister_all_at_exit, -100)
