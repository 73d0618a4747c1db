"""The receiver's high level: import_stream maps a whole buffer, one chunk
at a time, into one contiguous range; a Mapping holds one reference to it.

The import cache (include/vmmipc.h, vmmipc_import_stream): a process keeps
what it imported, keyed by the exporter and the buffer identity. Importing a
ticket of a buffer mapped here already returns another reference to the same
mapping (same addr, no descriptor, no driver call) and spends a use: at once
where the exporter's grant table vouches for the ticket (the use spent just
after), else after an authenticated session. Closing the last Mapping of it leaves it mapped,
unreferenced, while the exporter says the buffer lives on, within a byte
bound (set_cache_limit; cache_info tells what is held).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
import weakref
from typing import NamedTuple

from . import _args, _dlpack, _errors, _exported, _lib
from ._lib import (DEVICE_HOST, DEVICE_SAME, IMPORT_CONFIRM_LATER, IMPORT_HOLD, IMPORT_NO_CACHE,
                   MEMORY_HOST)
from ._ticket import as_ticket

log = logging.getLogger("vmmipc")


def _unmap(struct: _lib.vmmipc_mapping, pid: int) -> None:
    if os.getpid() != pid or struct.addr == 0:
        return  # a forked child must not touch the parent's library state
    _lib.call("vmmipc_unmap", ctypes.byref(struct))


class Mapping(_exported.Buffer, _lib.Closeable):
    """One reference to a buffer mapped into this process by import_stream.
    Close it (or use ``with``) to drop the reference; it is also dropped when
    the Mapping is collected. Two Mappings of the same cached import share
    one address.

    Host memory: the Mapping is a writable buffer of the whole range (format
    "B"), and so is ``view``, a memoryview of it: ``memoryview(m)``,
    ``numpy.frombuffer(m, dtype)``, ``numpy.asarray(m)`` (uint8),
    ``torch.frombuffer(m, dtype=torch.uint8)`` and ``bytes(m)`` (one copy)
    see the same bytes; len(m), m[i] and m[a:b] (a memoryview) too. The
    mapping stays until the last of them is gone, and close() refuses
    (BufferInUseError, a BufferError) while one it can see is alive: on
    Python 3.12+ every one; before 3.12 those made from ``view``, while
    those made from the Mapping itself keep it, and so its memory, alive:
    close() then leaves the unmapping to its collection (_exported.py).

    CUDA memory: ``__cuda_array_interface__`` (version 3) and ``__dlpack__``
    describe the range as a 1-D uint8 array on ``device``, so
    ``cupy.asarray(m)``, ``torch.from_dlpack(m)`` or ``cupy.from_dlpack(m)``
    see it without a copy. The array interface carries no lifetime: keep the
    Mapping open while the array is used. A DLPack export keeps the Mapping
    alive until its consumer lets go, and close() refuses (BufferError)
    while one is alive. Host mappings export DLPack too (kDLCPU).
    """

    def __new__(cls, struct: _lib.vmmipc_mapping, private: bool = False):
        # A buffer over the mapping, unless its owner never lets it out
        # (private: an imported HostBuffer, which is the buffer users hold).
        if struct.memory_kind == MEMORY_HOST and not private:
            return _exported.instance(cls, struct.addr, struct.size)
        return super().__new__(cls)

    def __init__(self, struct: _lib.vmmipc_mapping, private: bool = False):
        self._struct = struct
        self._addr: int = struct.addr
        self.size: int = struct.size
        self.device: int = struct.device
        self.memory_kind: int = struct.memory_kind
        self._memory = None
        self._dlpack_exports = 0
        self._closing = False  # closed, the unmapping left to collection
        pid = os.getpid()
        if self.memory_kind == MEMORY_HOST:
            # The reference goes when the memory's holder does: after every
            # memoryview of it (_exported.Memory).
            self._memory = _exported.Memory(self.size, addr=self._addr)
            self._finalizer = weakref.finalize(self._memory.obj, _unmap, struct, pid)
        else:
            self._finalizer = weakref.finalize(self, _unmap, struct, pid)

    @property
    def closed(self) -> bool:
        return self._closing or not self._finalizer.alive

    @property
    def addr(self) -> int:
        """Start of the mapping: a host pointer, or a CUdeviceptr. ValueError
        once closed (the address may already belong to something else)."""
        self._check_open()
        return self._addr

    @property
    def is_host(self) -> bool:
        return self.memory_kind == MEMORY_HOST

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("mapping is closed")

    @property
    def view(self) -> memoryview:
        """Writable memoryview (format 'B') of a host mapping."""
        self._check_open()
        if self._memory is None:
            raise TypeError("a CUDA mapping has no host memoryview; use addr (a "
                            "CUdeviceptr), __cuda_array_interface__, __dlpack__ or "
                            "vmmipc.cuda_core")
        return self._memory.view()

    def views_alive(self) -> int:
        """How many memoryviews of a host mapping's memory are alive besides
        ``view`` (slices, and those numpy arrays and tensors hold; DLPack
        exports aside); close() refuses while there are any. It lets go of
        the memoryview ``view`` gave out before (``view`` gives a new one).
        0 for CUDA and once closed."""
        return self._memory.views_alive() if self._memory is not None and not self.closed else 0

    # ------------------------------------------------- the buffer protocol


    def __len__(self) -> int:
        return self.size

    def __reduce_ex__(self, protocol):
        raise TypeError("a vmmipc Mapping cannot be pickled: send a ticket (register_again "
                        "of the exporter's registration, or a HostBuffer) and import that")

    # ------------------------------------------------------- array protocols

    @property
    def __cuda_array_interface__(self) -> dict:
        """CUDA Array Interface v3: the range as a 1-D uint8 device array. No
        pending work to wait for (``stream`` absent)."""
        if self.is_host:
            # AttributeError, so that hasattr() tells host mappings apart
            raise AttributeError("a host mapping has no __cuda_array_interface__; use view")
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.addr, False),
                "strides": None, "version": 3}

    def __dlpack_device__(self) -> tuple[int, int]:
        if self.is_host:
            return (_dlpack.KDL_CPU, 0)
        return (_dlpack.KDL_CUDA, self.device)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule of the range as a 1-D uint8 tensor, writable:
        DLPack 1.0 ("dltensor_versioned") when max_version >= (1, 0) is asked
        for, else unversioned ("dltensor"). The memory has no pending work in
        this process, so `stream` needs no synchronization; copy=True is
        refused (BufferError), as is a dl_device other than
        __dlpack_device__()."""
        self._check_open()
        if stream is not None and (isinstance(stream, bool)
                                   or not hasattr(type(stream), "__index__")):
            raise TypeError(f"__dlpack__: stream must be an integer or None, not "
                            f"{type(stream).__name__}")
        if copy:
            raise BufferError("vmmipc mappings are exported without a copy (copy=True)")
        device = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != device:
            raise BufferError(f"this mapping lives on DLPack device {device}, not {dl_device}")
        self._dlpack_exports += 1
        try:
            return _dlpack.export_bytes(self._addr, self.size, device[0], device[1],
                                        self._dlpack_released,
                                        versioned=max_version is not None
                                        and tuple(max_version) >= (1, 0))
        except BaseException:
            self._dlpack_exports -= 1
            raise

    def _dlpack_released(self) -> None:
        # Called once per export, by its deleter (any thread, GIL held). The
        # bound method is what kept this Mapping alive for the export.
        self._dlpack_exports -= 1

    # --------------------------------------------------------------- closing

    def close(self) -> None:
        """Drop this reference now (the mapping itself may stay in the import
        cache). Idempotent. BufferInUseError (a BufferError) while
        memoryviews, arrays or DLPack exports of it are alive. Python < 3.12:
        when anything besides the caller may hold the Mapping (a buffer
        taken from it, or another name), the reference goes with the
        Mapping's collection instead (_exported.py)."""
        self._close(False)

    def _close(self, via_exit: bool) -> None:
        if self.closed:
            return
        if self._dlpack_exports:
            raise _errors.BufferInUseError(
                f"cannot unmap: {self._dlpack_exports} DLPack export(s) of this mapping are "
                "still alive; let their consumers go first", None, "Mapping.close")
        if self._memory is not None:
            n = self._memory.views_alive()
            # A private Mapping (import_private) is no buffer of its own:
            # nothing else to count, nothing to empty.
            private = not isinstance(self, ctypes.Array)
            unmap, n = (True, n) if private else _exported.closable(self, n, via_exit)
            if n:
                raise _errors.BufferInUseError(f"cannot unmap: {_exported.in_use_message('Mapping', n)}",
                                               None, "Mapping.close")
            # An empty buffer from now on; unmapped now only if its address
            # leads away from the memory (_exported.disarm).
            if not private and (not _exported.disarm(self) or not unmap):
                self._closing = True  # unmapped with the last holder (_exported.py)
                return
        self._finalizer()
        self._memory = None

    def _unmap_private(self) -> None:
        """Drop the reference now, for an owner that never let this Mapping
        out (import_private: an imported HostBuffer, whose own
        object is the buffer users hold) and found no view of its memory
        alive. Such a Mapping is no buffer itself, so nothing can read
        through its address: it needs no disarm() (close()'s zero pages)."""
        self._finalizer()
        self._memory = None

    def __repr__(self) -> str:
        kind = "host" if self.is_host else f"cuda device {self.device}"
        state = "closed" if self.closed else f"addr={self._addr:#x}"
        return f"<vmmipc.Mapping {kind} size={self.size} {state}>"


def import_stream(ticket, device: int | None = None, *, timeout: float | None = None,
                  window: int | None = None, access_devices=(), cache: bool = True,
                  confirm_later: bool = False, hold: bool = False) -> Mapping:
    """Map the whole buffer named by the ticket (vmmipc_import_stream): reserve
    the range, then receive, map and close one chunk at a time; or, when
    this process has the buffer cached, another reference to that mapping.

    device: None picks DEVICE_HOST for host tickets and DEVICE_SAME (the
    exporter's GPU, by UUID) for CUDA tickets; or a CUDA ordinal.
    access_devices: more ordinals that get read-write access (CUDA).
    timeout: seconds to wait on a silent peer (None: 30). window: chunk
    requests in flight (None: the library's choice; 1 = lockstep).
    cache=False neither reuses nor keeps a cached mapping
    (VMMIPC_IMPORT_NO_CACHE). confirm_later=True: a cache hit returns at
    once and spends its use in the background (VMMIPC_IMPORT_CONFIRM_LATER:
    only for tickets from a channel trusted for the data itself; at exit
    this process waits for those still queued, EXIT_CONFIRM_SECONDS at
    most). hold=True (VMMIPC_IMPORT_HOLD): the use is held until
    release(ticket) or this process ends, so a sender that registered with
    hold=True keeps the memory from reuse meanwhile (not with
    confirm_later).
    VmmipcMemoryError if the address range cannot be reserved."""
    return _import(ticket, device, timeout, window, access_devices, cache, confirm_later, hold,
                   private=False)


def import_private(ticket, device: int, *, timeout: float | None = None, cache: bool = True,
                   confirm_later: bool = False, hold: bool = False) -> Mapping:
    """import_stream for an owner that never hands the Mapping out (an
    imported HostBuffer, whose own object is the buffer users hold): the
    Mapping exports no buffer itself, and the owner drops it with
    _unmap_private()."""
    return _import(ticket, device, timeout, None, (), cache, confirm_later, hold, private=True)


def _import(ticket, device, timeout, window, access_devices, cache, confirm_later, hold,
            private) -> Mapping:
    fn = "vmmipc_import_stream"
    t = as_ticket(ticket, fn)
    if device is not None:
        device = _args.integer(device, "device", DEVICE_SAME, _args.I32_MAX, fn,
                               "DEVICE_HOST = -1, DEVICE_SAME = -2, or a CUDA ordinal")
    flags = ((0 if cache else IMPORT_NO_CACHE) | (IMPORT_CONFIRM_LATER if confirm_later else 0)
             | (IMPORT_HOLD if hold else 0))
    opts = _lib.options(fn, timeout=timeout, window=window, access_devices=access_devices,
                        import_flags=flags)
    if device is None:
        device = DEVICE_HOST if t.info().memory_kind == MEMORY_HOST else DEVICE_SAME
    out = _lib.vmmipc_mapping()
    _lib.call(fn, ctypes.byref(t._c()), device, ctypes.byref(opts), ctypes.byref(out))
    return Mapping(out, private)


def confirm(ticket, *, later: bool = False, hold: bool = False,
            timeout: float | None = None) -> None:
    """Spend one use of a ticket without importing anything
    (vmmipc_confirm): for a receiver that has the memory mapped already,
    through another ticket of the same buffer, so that the sender's
    registration ends. later=True returns at once and a library thread
    confirms (VMMIPC_IMPORT_CONFIRM_LATER; cache_info counts it).
    hold=True holds the use, as import_stream(hold=True) does (if the sender
    registered with hold=True): one short session, held on this process's
    lease at the exporter and answered before this returns (a grant that
    ended raises NotFoundError)."""
    fn = "vmmipc_confirm"
    t = as_ticket(ticket, fn)
    flags = (IMPORT_CONFIRM_LATER if later else 0) | (IMPORT_HOLD if hold else 0)
    opts = _lib.options(fn, timeout=timeout, import_flags=flags)
    _lib.call(fn, ctypes.byref(t._c()), ctypes.byref(opts))


def confirm_many(tickets, *, hold: bool = False,
                 timeout: float | None = None) -> list:
    """Spend one use of each ticket, as confirm() does each, with one
    connection and one round trip per exporter (vmmipc_confirm_many): for
    a receiver that has the memory of many tickets mapped already.
    hold=True holds each use, as confirm(hold=True) does. Returns one entry
    per ticket: None where its use was spent, else the exception confirm()
    would have raised for it (the first one carries the library's detail).
    Raises only for bad arguments."""
    fn = "vmmipc_confirm_many"
    ts = [as_ticket(t, fn) for t in tickets]
    n = len(ts)
    arr = _lib.ticket_array(ts)
    status = (ctypes.c_int * n)()
    opts = _lib.options(fn, timeout=timeout, import_flags=IMPORT_HOLD if hold else 0)
    rc = _lib.lib(fn).vmmipc_confirm_many(arr, n, ctypes.byref(opts), status)
    if rc >= 0:
        return [None] * n
    detail = _errors.python_message(_lib.last_error())
    if all(s == 0 for s in status):  # an argument error: nothing was confirmed
        raise _errors.error_for(rc, detail, fn)
    out, first = [], True
    for i, s in enumerate(status):
        if s >= 0:
            out.append(None)
            continue
        out.append(_errors.error_for(s, detail if first else f"ticket {i}: "
                                     + _errors.STATUS_NAMES.get(s, f"status {s}"), fn))
        first = False
    return out


def release(ticket) -> None:
    """Let go of a use of `ticket` this process holds (import_stream or
    confirm with hold=True): returns at once, a library thread tells the
    exporter with others. NotFoundError if this process holds none (let go
    of already, or its exporter has gone)."""
    fn = "vmmipc_release"
    _lib.call(fn, ctypes.byref(as_ticket(ticket, fn)._c()))


class CacheInfo(NamedTuple):
    limit_bytes: int         # bound on unreferenced bytes; 0 = off
    entries: int             # mappings the cache knows, referenced or not
    referenced_bytes: int    # bytes of mappings with references
    unreferenced_bytes: int  # bytes kept mapped with no reference
    hits: int                # imports answered from the cache
    misses: int              # imports that mapped anew
    evictions: int           # unreferenced mappings undone for room
    invalidations: int       # mappings undone because the buffer ended or the exporter exited
    confirms_pending: int    # uses of hits spent after the hit returned (confirm_later, table hits), queued or in flight
    confirms_failed: int     # ...that failed
    holds: int               # uses this process holds (hold=True), not yet released
    holder_sessions: int     # live leases at exporters (a page mapped each, no descriptor)
    table_hits: int          # hits the exporter's grant table vouched for, without a round trip
    table_imports: int       # misses mapped from the file the table names, without a round trip (among misses)


def set_cache_limit(nbytes: int) -> None:
    """Bound the bytes of unreferenced cached mappings of this process (0
    turns the cache off); mappings beyond it are undone before this returns.
    The default is 32 GiB, or $VMMIPC_CACHE_BYTES."""
    fn = "vmmipc_cache_set_limit"
    _lib.call(fn, _args.u64(nbytes, "nbytes", fn))


def cache_info() -> CacheInfo:
    """This process's import cache: its bound, what it holds, and its
    counters."""
    out = _lib.vmmipc_cache_info()
    _lib.call("vmmipc_cache_get_info", ctypes.byref(out), ctypes.sizeof(out))
    return CacheInfo(*(getattr(out, name) for name in CacheInfo._fields))


# How long a process that is exiting waits for the confirmations its cache
# hits queued (confirm_later: import_stream, confirm, HostBuffer.from_ticket;
# and the hits and imports the senders' grant tables vouched for). They run
# on a library thread; were the process to end first, each confirm_later
# grant would stay pending, keeping what it lends alive until its ttl (the
# sender of a table hit or import spends it from this process's spend log).
# A stream's batch waits up to 10 ms for others (core/confirmer.go) and
# takes a few milliseconds more; the bound is for a sender that has stopped
# answering.
EXIT_CONFIRM_SECONDS = 5.0


def _finish_confirmations_at_exit() -> None:
    deadline = time.monotonic() + EXIT_CONFIRM_SECONDS
    try:
        while (pending := cache_info().confirms_pending):
            if time.monotonic() >= deadline:
                log.warning("vmmipc: exiting with %d confirmations still pending after %.0f s; "
                            "their senders keep those grants until their ttl", pending,
                            EXIT_CONFIRM_SECONDS)
                return
            time.sleep(0.001)
    except _errors.VmmipcError:
        return  # the library cannot say; nothing to wait for then


_lib.at_exit(_finish_confirmations_at_exit, -90)  # before _register's, at -100
