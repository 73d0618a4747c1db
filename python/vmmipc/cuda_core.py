"""cuda.core integration: share VirtualMemoryResource buffers through vmmipc.

cuda.core cannot share VirtualMemoryResource buffers across processes by
itself. After ``import vmmipc.cuda_core`` (which registers the reducer when
cuda.core is importable, without loading libvmmipc.so, so that a forkserver
may preload it; call install() to load the library at once and get an
ImportError without cuda.core), ``queue.put(buf)`` works for such a buffer
under spawn/forkserver. The receiver streams the chunks one descriptor at a
time and gets a cuda.core Buffer over the imported mapping (unmapped when
that Buffer is closed or collected); cuda.core's own __dlpack__ works on it,
and ``buffer_mapping(buf)`` gives the Mapping with __cuda_array_interface__.
Other buffers keep cuda.core's own pickling.

Registrations: the first pickle (or grant_buffer) of a Buffer registers its
range once as an anchor (vmmipc_register_cuda, unlimited uses: the library
retains every allocation), kept while that Buffer object lives and is not
closed; every pickle is then a register_again of the anchor (no driver
call), so a receiver that has the buffer cached imports it without a
transfer: vouched for by the grant table (no round trip), else in one
authenticated session. The anchor belongs to that very Buffer object: it is dropped when the
Buffer is collected, when a later pickle finds it closed or resized, or by
drop_anchor(buf). A freed Buffer can never match a new one at the same
address. The sender may free its buffer right after put(): what was pickled
stays valid until received.

cuda.core is imported lazily: importing vmmipc never imports it.
"""

from __future__ import annotations

import threading
import weakref

from . import _errors, _lib, _mp, _reductions
from ._anchor import Anchor
from ._mapping import Mapping, import_stream
from ._register import share
from ._ticket import Ticket


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


class _Anchored:
    """A live Buffer, where it was when anchored, and its anchor."""
    __slots__ = ("ref", "ptr", "size", "anchor")

    def __init__(self, ref, ptr: int, size: int, anchor: Anchor):
        self.ref, self.ptr, self.size, self.anchor = ref, ptr, size, anchor

    def stale(self) -> bool:
        """The Buffer is gone, closed, or no longer the range anchored."""
        buf = self.ref()
        return buf is None or _is_closed(buf) or (int(buf.handle), int(buf.size)) != (
            self.ptr, self.size)


# id(buf) -> the anchor of that live Buffer. An entry is trusted only while
# its weak reference still gives that object (ids are reused). Reentrant: a
# finalizer (_drop) may run during a garbage collection inside the lock.
_anchors: dict[int, _Anchored] = {}
_anchors_lock = threading.RLock()


def _is_closed(buf) -> bool:
    closed = getattr(buf, "is_closed", None)
    return bool(closed) if closed is not None else int(buf.handle) == 0


def _drop(key: int, anchor: Anchor) -> None:
    """Finalizer of an anchored Buffer."""
    with _anchors_lock:
        if key in _anchors and _anchors[key].anchor is anchor:
            del _anchors[key]
    anchor.retire(now=True)


def _anchor_of(buf) -> Anchor | None:
    """buf's anchor, made on first use; None when buf cannot be tracked (a
    cuda.core without weak references to Buffers)."""
    ended = []
    try:
        with _anchors_lock:
            for key, a in list(_anchors.items()):
                if a.stale():
                    ended.append(_anchors.pop(key).anchor)
            a = _anchors.get(id(buf))
            if a is not None and a.ref() is buf:
                return a.anchor
            try:
                ref = weakref.ref(buf)
            except TypeError:
                return None
            ptr, size = int(buf.handle), int(buf.size)
            anchor = Anchor(share(ptr, size, uses=0))
            _anchors[id(buf)] = _Anchored(ref, ptr, size, anchor)
            # atexit=False: at exit a Queue feeder may still pickle buf.
            weakref.finalize(buf, _drop, id(buf), anchor).atexit = False
            return anchor
    finally:
        for a in ended:
            a.retire(now=True)


def share_buffer(buf, **kw) -> Ticket:
    """Deprecated name of grant_buffer()."""
    _errors.renamed("vmmipc.cuda_core.share_buffer", "vmmipc.cuda_core.grant_buffer")
    return grant_buffer(buf, **kw)


def grant_buffer(buf, *, uses: int = 1, ttl: float | None = None) -> Ticket:
    """A grant of a VirtualMemoryResource buffer (its whole
    [ptr, ptr + size) range, which must end on an allocation boundary) for
    `uses` receivers and `ttl` seconds: what pickling does. Returns its
    ticket."""
    if _is_closed(buf):
        raise ValueError("cannot share a closed Buffer")
    anchor = _anchor_of(buf)
    if anchor is None:
        return share(int(buf.handle), int(buf.size), uses=uses, ttl=ttl)
    return anchor.grant(uses=uses, ttl=ttl)


def drop_anchor(buf) -> bool:
    """End buf's anchor registration now (shares already made stay valid
    until received), so the library lets go of the allocations as soon as
    those have ended. Returns whether buf had one."""
    with _anchors_lock:
        a = _anchors.get(id(buf))
        if a is None or a.ref() is not buf:
            return False
        del _anchors[id(buf)]
    a.anchor.retire(now=True)
    return True


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


def import_buffer(ticket, device: int | None = None, *, timeout: float | None = None,
                  cache: bool = True):
    """Import a CUDA ticket and return a cuda.core Buffer over the mapping
    (unmapped when the Buffer is closed or collected). device: None = the
    exporter's GPU (found by UUID), or a CUDA ordinal; cache as for
    vmmipc.import_stream."""
    core = _core()
    if device is None:
        device = _lib.DEVICE_SAME
    mapping = import_stream(ticket, device, timeout=timeout, cache=cache)
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


def buffer_mapping(buf) -> Mapping:
    """The vmmipc Mapping under a Buffer that import_buffer returned (for
    its __cuda_array_interface__); TypeError for any other Buffer."""
    mr = getattr(buf, "memory_resource", None)
    if mr is None or type(mr) is not _resource_class():
        raise TypeError("not a Buffer imported by vmmipc.cuda_core")
    return mr.mapping


def _rebuild_buffer(ticket):
    return import_buffer(ticket)


def reduce_buffer(buf):
    """ForkingPickler reducer for cuda.core Buffer: VMM buffers go through
    vmmipc, all others through cuda.core's own __reduce__."""
    if not is_vmm_buffer(buf):
        return buf.__reduce__()
    return _mp.guarded_reduce("cuda.core Buffer",
                              lambda: (_rebuild_buffer, (grant_buffer(buf),)))


def _buffer_reductions() -> _reductions.Reductions:
    """What vmmipc.cuda_core registers: reduce_buffer for cuda.core's Buffer,
    with multiprocessing. ImportError without cuda.core."""
    return _reductions.Reductions(forking=((_core().Buffer, reduce_buffer),))


def install() -> None:
    """Register reduce_buffer for cuda.core's Buffer with multiprocessing and
    load libvmmipc.so, so that a missing library raises here, before any
    child is started. Raises ImportError if cuda.core is missing,
    LibraryNotFoundError if the library cannot be loaded."""
    _reductions.init_reductions(_buffer_reductions())
    _lib.lib("vmmipc.cuda_core.install")


try:
    # Loads no library: a forkserver may preload this module.
    _reductions.init_reductions(_buffer_reductions())
except ImportError:
    pass  # no cuda.core: the functions above raise a clear ImportError when used

__all__ = ["buffer_mapping", "drop_anchor", "import_buffer", "install", "is_vmm_buffer",
           "grant_buffer", "reduce_buffer", "share_buffer"]
