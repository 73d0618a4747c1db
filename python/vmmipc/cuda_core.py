"""cuda.core integration: share VirtualMemoryResource buffers through vmmipc.

cuda.core cannot share VirtualMemoryResource buffers across processes by
itself. After ``import vmmipc.cuda_core`` (which installs the reducer when
cuda.core is importable; call install() to get an ImportError otherwise),
``queue.put(buf)`` works for such a buffer under spawn/forkserver: pickling
registers the range with this process's vmmipc server (no descriptor is
opened; the library retains every allocation, so the sender may free its
buffer right away), and the receiver streams the chunks one descriptor at a
time and gets a cuda.core Buffer over the imported mapping. That Buffer is
unmapped when it is closed or collected. Other buffers keep cuda.core's own
pickling.

cuda.core is imported lazily: importing vmmipc never imports it.
"""

from __future__ import annotations

import threading

from . import _lib, _mp
from ._mapping import Mapping, import_stream
from ._register import share
from ._ticket import Ticket

_installed = False
_install_lock = threading.Lock()


def _core():
    """The cuda.core module that has Buffer and VirtualMemoryResource."""
    try:
        import cuda.core as core
        if hasattr(core, "VirtualMemoryResource"):
            return core
    except ImportError:
        pass
    try:
        import cuda.core.experimental as core  # cuda.core < 1.0
        return core
    except ImportError as e:
        raise ImportError("vmmipc.cuda_core needs cuda.core (pip install cuda-core); "
                          f"it could not be imported: {e}") from e


def is_vmm_buffer(buf) -> bool:
    """Whether buf is a cuda.core Buffer allocated by a VirtualMemoryResource."""
    core = _core()
    return isinstance(buf, core.Buffer) and isinstance(
        getattr(buf, "memory_resource", None), core.VirtualMemoryResource)


def share_buffer(buf, *, uses: int = 1, ttl: float | None = None) -> Ticket:
    """Register a VirtualMemoryResource buffer (its whole [ptr, ptr + size)
    range, which must end on an allocation boundary) and return its ticket."""
    if getattr(buf, "is_closed", False):
        raise ValueError("cannot share a closed Buffer")
    return share(int(buf.handle), int(buf.size), uses=uses, ttl=ttl)


_resource_cls = None  # made on first use: cuda.core is imported lazily


def _resource_class():
    global _resource_cls
    if _resource_cls is not None:
        return _resource_cls
    core = _core()

    class ImportedMemoryResource(core.MemoryResource):
        """Owns one vmmipc mapping: deallocate() unmaps it. It allocates
        nothing."""

        def __init__(self, mapping: Mapping):
            self._mapping = mapping
            self._armed = False  # a Buffer that failed to build must not unmap

        def allocate(self, size, stream=None, **kw):
            raise TypeError("an imported vmmipc buffer's resource cannot allocate")

        def deallocate(self, ptr, size, stream=None, **kw):
            if not self._armed:
                return
            if stream is not None and hasattr(stream, "sync"):
                try:
                    stream.sync()  # pending work on the memory finishes first
                except Exception:  # noqa: BLE001 - unmap anyway
                    pass
            self._mapping.close()

        @property
        def is_device_accessible(self) -> bool:
            return True

        @property
        def is_host_accessible(self) -> bool:
            return False

        @property
        def is_managed(self) -> bool:
            return False

        @property
        def device_id(self) -> int:
            return self._mapping.device

        @property
        def mapping(self) -> Mapping:
            return self._mapping

    _resource_cls = ImportedMemoryResource
    return _resource_cls


def import_buffer(ticket, device: int | None = None, *, timeout: float | None = None):
    """Import a CUDA ticket and return a cuda.core Buffer over the mapping
    (unmapped when the Buffer is closed or collected). device: None = the
    exporter's GPU (found by UUID), or a CUDA ordinal."""
    core = _core()
    if device is None:
        device = _lib.DEVICE_SAME
    mapping = import_stream(ticket, device, timeout=timeout)
    try:
        _ensure_context(core, mapping.device)
        mr = _resource_class()(mapping)
        buf = core.Buffer.from_handle(mapping.addr, mapping.size, mr=mr)
        mr._armed = True  # from here on, closing the Buffer unmaps
        return buf
    except BaseException:
        mapping.close()
        raise


def _ensure_context(core, device: int) -> None:
    """Make device's primary context current if no context is: cuda.core
    records the Buffer's deallocation stream, which needs one, and a freshly
    spawned child has none yet (cuda.core's own IPC unpickling does the
    same)."""
    try:
        from cuda.bindings import driver
        err, ctx = driver.cuCtxGetCurrent()
        if err == driver.CUresult.CUDA_SUCCESS and int(ctx) != 0:
            return
    except Exception:  # noqa: BLE001 - fall through to cuda.core
        pass
    core.Device(device).set_current()


def _rebuild_buffer(ticket):
    return import_buffer(ticket)


def reduce_buffer(buf):
    """ForkingPickler reducer for cuda.core Buffer: VMM buffers go through
    vmmipc, all others through cuda.core's own __reduce__."""
    if not is_vmm_buffer(buf):
        return buf.__reduce__()
    refused = _mp.check_not_fork("cuda.core Buffer")
    if refused is not None:
        return refused
    return (_rebuild_buffer, (share_buffer(buf),))


def install() -> None:
    """Register reduce_buffer for cuda.core's Buffer with ForkingPickler
    (idempotent). Raises ImportError if cuda.core is missing."""
    global _installed
    with _install_lock:
        if _installed:
            return
        from multiprocessing.reduction import ForkingPickler
        ForkingPickler.register(_core().Buffer, reduce_buffer)
        _installed = True


try:
    install()
except ImportError:
    pass  # no cuda.core: the functions above raise a clear ImportError when used

__all__ = ["import_buffer", "install", "is_vmm_buffer", "reduce_buffer", "share_buffer"]
