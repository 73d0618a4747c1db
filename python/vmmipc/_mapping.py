"""The receiver's high level: import_stream maps a whole buffer, one chunk
at a time, into one contiguous range; a Mapping undoes it."""

from __future__ import annotations

import ctypes
import os
import sys
import weakref

from . import _lib
from ._lib import DEVICE_HOST, DEVICE_SAME, MEMORY_HOST
from ._ticket import _as_ticket


def _unmap(struct: _lib.vmmipc_mapping, pid: int) -> None:
    if os.getpid() != pid or struct.addr == 0:
        return  # a forked child must not touch the parent's library state
    _lib.call("vmmipc_unmap", ctypes.byref(struct))


_view_types: dict[int, type] = {}


def _host_bytes(addr: int, size: int):
    """A ctypes byte array over [addr, addr + size) that supports weakrefs, so
    the unmapping can wait for the last memoryview of it."""
    cls = _view_types.get(size)
    if cls is None:
        cls = type("_MappedBytes", (ctypes.c_ubyte * size,), {})
        if len(_view_types) < 64:
            _view_types[size] = cls
    return cls.from_address(addr)


class Mapping:
    """A buffer mapped into this process by import_stream. Close it (or use
    ``with``) to unmap; it is also unmapped when collected. For host memory,
    ``view`` is a writable memoryview of the whole range; the mapping stays
    until the last memoryview of it is gone, and close() refuses (BufferError)
    while one is alive."""

    def __init__(self, struct: _lib.vmmipc_mapping):
        self._struct = struct
        self.addr: int = struct.addr
        self.size: int = struct.size
        self.device: int = struct.device
        self.memory_kind: int = struct.memory_kind
        self._view: memoryview | None = None
        self._mem = None
        pid = os.getpid()
        if self.memory_kind == MEMORY_HOST:
            self._mem = _host_bytes(self.addr, self.size)
            self._finalizer = weakref.finalize(self._mem, _unmap, struct, pid)
        else:
            self._finalizer = weakref.finalize(self, _unmap, struct, pid)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    @property
    def is_host(self) -> bool:
        return self.memory_kind == MEMORY_HOST

    @property
    def view(self) -> memoryview:
        """Writable memoryview (format 'B') of a host mapping."""
        if self.closed:
            raise ValueError("mapping is closed")
        if self._mem is None:
            raise TypeError("a CUDA mapping has no host memoryview; use addr "
                            "(a CUdeviceptr) or vmmipc.cuda_core")
        if self._view is None:
            self._view = memoryview(self._mem).cast("B")
        return self._view

    def close(self) -> None:
        """Unmap now. Idempotent."""
        if self.closed:
            return
        if self._mem is not None:
            if self._view is not None:
                self._view.release()  # BufferError if exported (e.g. numpy)
                self._view = None
            # our attribute + getrefcount's argument; more means live views
            if sys.getrefcount(self._mem) > 2:
                raise BufferError("cannot unmap: memoryviews of this mapping are still "
                                  "alive; release them first")
        self._finalizer()
        self._mem = None

    def __enter__(self) -> "Mapping":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        kind = "host" if self.is_host else f"cuda device {self.device}"
        state = "closed" if self.closed else f"addr={self.addr:#x}"
        return f"<vmmipc.Mapping {kind} size={self.size} {state}>"


def import_stream(ticket, device: int | None = None, *, timeout: float | None = None,
                  window: int | None = None, access_devices=()) -> Mapping:
    """Map the whole buffer named by the ticket (vmmipc_import_stream): reserve
    the range, then receive, map and close one chunk at a time. device: None
    picks DEVICE_HOST for host tickets and DEVICE_SAME (the exporter's GPU,
    by UUID) for CUDA tickets; or a CUDA ordinal."""
    t = _as_ticket(ticket)
    if device is None:
        device = DEVICE_HOST if t.info().memory_kind == MEMORY_HOST else DEVICE_SAME
    opts = _lib.options(timeout=timeout, window=window, access_devices=access_devices)
    out = _lib.vmmipc_mapping()
    _lib.call("vmmipc_import_stream", ctypes.byref(t._c()), int(device), ctypes.byref(opts),
              ctypes.byref(out))
    return Mapping(out)
