"""The sender side: registrations, their callbacks, and their end.

Registering opens no descriptor. Descriptors handed in (the file of
register_host_file, the handles of register_cuda_handles) stay the caller's
but must stay valid until the registration's release callback has run.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
from ctypes import c_uint64, c_void_p
from typing import Callable

from . import _errors, _lib
from ._errors import InvalidError
from ._lib import MEMORY_HOST
from ._ticket import Ticket, _as_ticket

log = logging.getLogger("vmmipc")


class _Record:
    """What one registration pins on the Python side until it is released."""
    __slots__ = ("export_fn", "release", "ticket")

    def __init__(self, export_fn, release):
        self.export_fn = export_fn
        self.release = release
        self.ticket: Ticket | None = None


# user-pointer key -> _Record. Keys are never reused. The two trampolines
# below live as long as the module, so the library can never call a ctypes
# callback object that was freed; per-registration state is looked up by key
# and dropped when release runs (exactly once, on a library thread).
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


def _registered(function: str, rec: _Record, do_register) -> Ticket:
    """Run a register call with a fresh key for rec; undo on failure."""
    key = next(_keys)
    _records[key] = rec
    out = _lib.vmmipc_ticket()
    try:
        do_register(c_void_p(key), ctypes.byref(out))
    except BaseException:
        # release_fn is not called when registering fails: drop what we pinned.
        failed = _records.pop(key, None)
        if failed is not None and failed.release is not None:
            failed.release()
        raise
    ticket = Ticket(bytes(out.bytes))
    rec.ticket = ticket
    return ticket


def register(sizes, export_fn: Callable[[int], int], *, uses: int = 1,
             ttl: float | None = None, release: Callable[[], None] | None = None,
             memory_kind: int = MEMORY_HOST) -> Ticket:
    """Register a buffer of len(sizes) chunks; opens no descriptor.

    export_fn(index) is called on a library thread when a receiver asks for
    chunk `index`; it returns a NEW descriptor whose bytes start at offset 0,
    which the library sends and closes. release() runs exactly once, on a
    library thread, when the registration ends (uses consumed, ttl expired,
    unregister); it must not call back into vmmipc. uses=0 means unlimited;
    ttl is in seconds (None = never)."""
    sizes = [int(s) for s in sizes]
    if not sizes:
        raise InvalidError("register: sizes is empty", _errors.EINVAL, "vmmipc_register")
    if not callable(export_fn):
        raise InvalidError("register: export_fn is not callable", _errors.EINVAL,
                           "vmmipc_register")
    arr = (c_uint64 * len(sizes))(*sizes)
    opts = _lib.options(uses=uses, ttl=ttl, memory_kind=memory_kind)

    def do(user, out):
        _lib.call("vmmipc_register", arr, len(sizes), _EXPORT_CB, _RELEASE_CB, user,
                  ctypes.byref(opts), out)
    return _registered("vmmipc_register", _Record(export_fn, release), do)


def register_host_file(fd: int, size: int, chunk_size: int, *, uses: int = 1,
                       ttl: float | None = None,
                       release: Callable[[], None] | None = None) -> Ticket:
    """Register bytes [0, size) of an mmap-able file (a memfd) as chunks of
    chunk_size bytes. fd is borrowed: keep it open until release() runs."""
    opts = _lib.options(uses=uses, ttl=ttl)

    def do(user, out):
        _lib.call("vmmipc_register_host_file", int(fd), int(size), int(chunk_size),
                  _RELEASE_CB, user, ctypes.byref(opts), out)
    return _registered("vmmipc_register_host_file", _Record(None, release), do)


def share(dptr: int, size: int, *, uses: int = 1, ttl: float | None = None) -> Ticket:
    """Register the CUDA VMM range [dptr, dptr + size) (vmmipc_register_cuda).
    The library retains every allocation, so the caller may free its buffer
    right after; the memory stays valid for receivers until the registration
    ends."""
    opts = _lib.options(uses=uses, ttl=ttl)
    out = _lib.vmmipc_ticket()
    _lib.call("vmmipc_register_cuda", int(dptr), int(size), ctypes.byref(opts),
              ctypes.byref(out))
    return Ticket(bytes(out.bytes))


register_cuda = share  # the header's name


def register_cuda_handles(handles, sizes, *, uses: int = 1, ttl: float | None = None,
                          release: Callable[[], None] | None = None) -> Ticket:
    """Register CUmemGenericAllocationHandle values (borrowed until release()
    runs) of the given sizes, in order, as one buffer."""
    handles = [int(h) for h in handles]
    sizes = [int(s) for s in sizes]
    if len(handles) != len(sizes) or not handles:
        raise InvalidError(f"register_cuda_handles: {len(handles)} handles and {len(sizes)} "
                           "sizes (need the same non-zero count)", _errors.EINVAL,
                           "vmmipc_register_cuda_handles")
    h = (c_uint64 * len(handles))(*handles)
    s = (c_uint64 * len(sizes))(*sizes)
    opts = _lib.options(uses=uses, ttl=ttl)

    def do(user, out):
        _lib.call("vmmipc_register_cuda_handles", h, s, len(handles), _RELEASE_CB, user,
                  ctypes.byref(opts), out)
    return _registered("vmmipc_register_cuda_handles", _Record(None, release), do)


def unregister(ticket) -> None:
    """End a registration of this process early (NotFoundError if it is not
    ours or has already ended). Memory already imported stays valid."""
    _lib.call("vmmipc_unregister", ctypes.byref(_as_ticket(ticket)._c()))


def live_registrations() -> int:
    """Registrations of this process that have not ended yet."""
    n = c_uint64()
    _lib.call("vmmipc_live_registrations", ctypes.byref(n))
    return n.value


def version() -> str:
    """The library's version, e.g. "0.1.0"."""
    return _lib.lib("vmmipc_version").vmmipc_version().decode()


def strerror(status: int) -> str:
    """Name and describe a status ("VMMIPC_EAUTH: authentication failed")."""
    return _lib.lib("vmmipc_strerror").vmmipc_strerror(int(status)).decode()


def _unregister_all_at_exit() -> None:
    # Ends this process's registrations while Python is still whole, so that
    # no release callback has to enter an interpreter that is finalizing.
    # Runs after multiprocessing has joined the children (exitpriority < 0),
    # which may still be fetching what was pickled for them.
    if not _lib.loaded():
        return
    for rec in list(_records.values()):
        if rec.ticket is not None:
            try:
                unregister(rec.ticket)
            except _errors.VmmipcError:
                pass


def _install_exit_hook() -> None:
    import multiprocessing.util as mputil
    mputil.Finalize(None, _unregister_all_at_exit, exitpriority=-100)


_install_exit_hook()
