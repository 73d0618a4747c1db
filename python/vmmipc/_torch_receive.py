"""vmmipc.torch, the receiving half: rebuilding storages and tensors, and
open_tensors.

A receiver maps each run anchor once (_MappedRun) and makes every storage a
zero-copy view at its offset (torch.as_tensor over __cuda_array_interface__).
Each grant (one per anchor per pickle) is redeemed once, and held: the
first storage of a run not mapped here imports the run with it
(vmmipc.import_stream(hold=True): streamed on a miss, from the import cache
on a hit); a grant whose run is mapped here already is confirmed
(vmmipc.confirm(hold=True): one message, not waited for, on this process's
kept connection to the sender, no handshake, no driver call).

The lifetime rule (torch.multiprocessing's): the sender keeps every storage
of a grant alive, out of its allocator's reach, while this process holds
the grant (the header's "Holds"). A received storage needs only its newest
grant held: _Holds counts, per grant, the live storages whose newest grant
it is, and lets go of a grant (vmmipc.release, batched by the library) when
that count falls to zero: when those storages die, or a later pickle of the
same storages took over. This process's end lets go of everything.

A weak cache of received storages, keyed by (anchor id, offset, size,
device), gives a storage that arrives again (another view, another send)
the same torch storage while any tensor over it lives. When the last storage
over a run dies, the device is synchronized (no kernel may still use the
memory) and the mapping reference dropped; the import cache may keep it
mapped for the next send.
"""

from __future__ import annotations

import collections
import io
import logging
import pickle
import threading
import uuid
import weakref

from . import _args, _errors, _lib
from ._anchor import after_fork
from ._mapping import confirm, import_stream, release
from ._ticket import Ticket
from ._torch_env import torch_module

log = logging.getLogger("vmmipc")

_receive_device: int | None = None
_local = threading.local()  # open_tensors' device, for its thread only


def _check_device(device, where: str) -> int | None:
    if device is None:
        return None
    return _args.integer(device, "device", 0, _args.I32_MAX, where)


def set_receive_device(device: int | None) -> None:
    global _receive_device
    _receive_device = _check_device(device, "vmmipc.torch.set_receive_device")


def _target() -> int | None:
    """Where this thread maps what it unpickles now: None = the exporter's
    GPU."""
    override = getattr(_local, "device", None)
    return _receive_device if override is None else override[0]


class _MappedRun:
    """One Mapping of a run, shared by the storages over it: each holds it
    (through its _Region); after the last one dies, the device is
    synchronized and the mapping reference dropped."""

    def __init__(self, mapping):
        self.mapping = mapping
        finalizer = weakref.finalize(self, _drop_mapping, mapping)
        finalizer.atexit = False  # at exit nothing is unmapped under live tensors


def _drop_mapping(mapping) -> None:
    try:
        torch_module().cuda.synchronize(mapping.device)
    except Exception:  # noqa: BLE001 - unmapping must still happen
        log.exception("vmmipc.torch: could not synchronize cuda:%d before unmapping",
                      mapping.device)
    mapping.close()


class _Region:
    """[offset, offset + nbytes) of a mapped run as torch.as_tensor reads it
    (__cuda_array_interface__ v3). The storage torch makes over it holds this
    object, and so the run, until the storage is freed."""
    __slots__ = ("run", "addr", "nbytes", "__weakref__")

    def __init__(self, run: _MappedRun, offset: int, nbytes: int):
        self.run = run
        self.addr = run.mapping.addr + offset
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, False),
                "strides": None, "version": 3}


class _WeakTable:
    """A thread-safe WeakValueDictionary whose add keeps the first value."""

    def __init__(self):
        self._lock = threading.Lock()
        self._values = weakref.WeakValueDictionary()

    def get(self, key):
        with self._lock:
            return self._values.get(key)

    def add(self, key, value):
        """value, or the one another thread stored for key first."""
        with self._lock:
            return self._values.setdefault(key, value)

    def __len__(self) -> int:
        with self._lock:
            return len(self._values)


class _Redeemed:
    """Grants this process has redeemed, and the events it has waited on
    for them: each at most once. Bounded: the oldest are forgotten (a grant
    is one use, so seeing it again means the same pickle loaded again)."""

    LIMIT = 1 << 16

    def __init__(self):
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict = collections.OrderedDict()

    def add(self, grant) -> bool:
        """True if grant was not redeemed before (and is now marked)."""
        with self._lock:
            if grant in self._seen:
                return False
            self._seen[grant] = True
            if len(self._seen) > self.LIMIT:
                self._seen.popitem(last=False)
            return True

    def forget(self, grant) -> None:
        with self._lock:
            self._seen.pop(grant, None)


class _Holds:
    """Which held grant keeps each received storage safe, and how many live
    storages each held grant keeps: a grant is let go of when none is left.
    A storage's newest grant takes over from its older one (the sender
    keeps the same memory for both: within a live anchor, one offset and
    size is one storage of the sender's)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._count: dict = {}  # grant -> live storages whose newest grant it is
        self._of: dict = {}     # id(storage) -> its cell: [newest grant, weakref to it]

    def attach(self, storage, grant) -> None:
        """storage is (also) covered by grant, which this process holds.
        Called for every storage of every load: one lock, and a finalizer
        only for a storage seen the first time."""
        key, new_cell = id(storage), None
        with self._lock:
            cell = self._of.get(key)
            if cell is None or cell[1]() is not storage:
                cell = new_cell = [None, weakref.ref(storage)]
                self._of[key] = cell
            old, cell[0] = cell[0], grant
            if old == grant:
                return
            self._count[grant] = self._count.get(grant, 0) + 1
            gone = old is not None and self._uncount(old)
        if new_cell is not None:
            weakref.finalize(storage, self._storage_died, key, new_cell).atexit = False
        if gone:
            _release_quietly(old)

    def _storage_died(self, key, cell) -> None:
        with self._lock:
            if self._of.get(key) is cell:
                del self._of[key]
            grant, cell[0] = cell[0], None
            gone = grant is not None and self._uncount(grant)
        if gone:
            _release_quietly(grant)

    def _uncount(self, grant) -> bool:
        """One storage fewer for grant (self._lock held); True when none is
        left, and the grant is to be let go of."""
        n = self._count.get(grant, 0) - 1
        if n > 0:
            self._count[grant] = n
            return False
        self._count.pop(grant, None)
        return True

    def held(self) -> int:
        """Grants this process holds for live storages (for tests)."""
        with self._lock:
            return len(self._count)


def _release_quietly(grant) -> None:
    try:
        release(grant)  # queued: a library thread tells the sender
    except _errors.VmmipcError:
        pass  # not held (an old sender's grant), or its sender has gone: nothing held


_runs = _WeakTable()      # (anchor id, target) -> _MappedRun
_received = _WeakTable()  # (anchor id, offset, nbytes, target) -> torch storage
_redeemed = _Redeemed()
_holds = _Holds()


def _reset_after_fork() -> None:
    global _runs, _received, _redeemed, _holds
    _runs, _received, _redeemed, _holds = _WeakTable(), _WeakTable(), _Redeemed(), _Holds()


after_fork(_reset_after_fork)


def received_storages() -> int:
    """Storages received and still alive here (for tests)."""
    return len(_received)


def _storage_over(torch, run: _MappedRun, offset: int, nbytes: int):
    region = _Region(run, offset, nbytes)
    tensor = torch.as_tensor(region)
    if tensor.data_ptr() != region.addr or tensor.device != torch.device("cuda",
                                                                          run.mapping.device):
        raise RuntimeError(
            f"torch.as_tensor did not wrap the imported memory in place (got {tensor.device} "
            f"at {tensor.data_ptr():#x}, wanted cuda:{run.mapping.device} at {region.addr:#x})")
    return tensor.untyped_storage()


def _uuid_bytes(torch_uuid) -> bytes:
    """The 16 bytes of torch's device-properties uuid (its .bytes are a list
    of possibly signed chars; older builds only print it)."""
    raw = getattr(torch_uuid, "bytes", None)
    if raw is not None:
        return bytes(b & 0xFF for b in raw)
    return uuid.UUID(str(torch_uuid).removeprefix("GPU-")).bytes


def _ordinal_of_exporter(torch, ticket, exporter_device: int) -> int:
    want = Ticket(ticket).info().device_uuid
    for ordinal in range(torch.cuda.device_count()):
        if _uuid_bytes(torch.cuda.get_device_properties(ordinal).uuid) == want:
            return ordinal
    raise RuntimeError(f"the exporter's GPU (its cuda:{exporter_device}, UUID "
                       f"{uuid.UUID(bytes=bytes(want))}) is not visible in this process, so its "
                       "event cannot be waited on; make it visible (CUDA_VISIBLE_DEVICES)")


def _mapped_run(torch, grant, anchor_id, target) -> tuple[_MappedRun, bool]:
    """The run's mapping here, and whether getting it redeemed grant."""
    key = (anchor_id, target)
    run = _runs.get(key)
    if run is not None:
        return run, False
    device = _lib.DEVICE_SAME if target is None else target
    # A miss streams the run with this grant; a hit (the import cache kept
    # the run mapped) spends it with one message on the kept connection.
    # Either way the grant is held.
    mapping = import_stream(grant, device, hold=True)
    made = _MappedRun(mapping)
    run = _runs.add(key, made)
    if run is not made:  # another thread mapped it first: ours goes
        mapping.close()
    return run, True


def rebuild_storage(grant, anchor_id, offset, nbytes, exporter_device, event_handle):
    """Unpickling side of a VMM storage."""
    target = _target()
    key = (anchor_id, offset, nbytes, target)
    storage = _received.get(key)
    redeemed = False
    if storage is None:
        torch = torch_module()
        torch.cuda.init()  # a fresh child may not have touched CUDA yet
        run, redeemed = _mapped_run(torch, grant, anchor_id, target)
        storage = _received.add(key, _storage_over(torch, run, offset, nbytes))
    if _redeemed.add(grant):  # the first storage of this grant here
        try:
            if not redeemed:
                confirm(grant, hold=True)
            if event_handle is not None:  # None: the sender synchronized instead
                _wait_event(storage, grant, exporter_device, event_handle, target)
        except BaseException:
            _redeemed.forget(grant)
            raise
    _holds.attach(storage, grant)
    return storage


def _wait_event(storage, grant, exporter_device, event_handle, target) -> None:
    """Make this thread's current stream wait on the sender's event."""
    torch = torch_module()
    event_device = (storage.device.index if target is None
                    else _ordinal_of_exporter(torch, grant, exporter_device))
    try:
        event = torch.cuda.Event.from_ipc_handle(event_device, event_handle)
    except RuntimeError as e:
        raise RuntimeError(
            f"cannot open the sender's CUDA event ({e}): CUDA keeps interprocess events in "
            "/dev/shm, which this process does not share with the sender (another pod or "
            "container). Have the sender call vmmipc.torch.set_ordering('sync') (the default "
            "when VMMIPC_SOCKET_DIR is set), or share /dev/shm (--ipc=host, one pod)") from e
    torch.cuda.current_stream(storage.device).wait_event(event)


def rebuild_tensor(storage_args, cls, storage_offset, size, stride, dtype, requires_grad):
    """Unpickling side of a VMM tensor: its storage, then the view."""
    return tensor_over(rebuild_storage(*storage_args), cls, storage_offset, size, stride, dtype,
                       requires_grad)


def tensor_over(storage, cls, storage_offset, size, stride, dtype, requires_grad):
    """A tensor of class cls viewing storage as the sender's did."""
    torch = torch_module()
    tensor = torch.empty((0,), dtype=dtype, device=storage.device).set_(
        storage, storage_offset, size, stride)
    if issubclass(cls, torch.nn.Parameter):
        # As a constructor argument: integer Parameters must say False there.
        return cls(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


# -------------------------------------------------------------- open_tensors

BLOB_MAGIC = b"vmmipc.torch/1\n"  # then a pickle _BlobUnpickler reads


class _BlobUnpickler(pickle.Unpickler):
    """share_tensors' blob holds plain data and calls of our two rebuild
    functions only: anything else is refused, so opening a blob from the
    network runs no other code."""

    _CLASSES = {("torch", "Tensor"), ("torch._tensor", "Tensor"),
                ("torch.nn.parameter", "Parameter")}

    def find_class(self, module, name):
        if (module, name) == (__name__, "rebuild_storage"):
            return rebuild_storage
        if (module, name) == (__name__, "rebuild_tensor"):
            return rebuild_tensor
        if (module, name) == (Ticket.__module__, "Ticket"):
            return Ticket
        if (module, name) in self._CLASSES or module == "torch":
            torch = torch_module()
            found = super().find_class(module, name)
            if (module, name) in self._CLASSES or isinstance(found, torch.dtype):
                return found
        raise pickle.UnpicklingError(f"a vmmipc.torch blob may not name {module}.{name}")


def open_tensors(blob: bytes, device: int | None = None):
    """Open what share_tensors returned, in another process: a dict name ->
    tensor (or a list of (name, tensor) pairs, as it was shared) of
    zero-copy CUDA tensors, valid until this process drops them. device:
    None maps onto the exporter's GPU (by UUID); an ordinal maps there."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"open_tensors takes the bytes share_tensors returned, not "
                        f"{type(blob).__name__}")
    blob = bytes(blob)
    if not blob.startswith(BLOB_MAGIC):
        raise ValueError("not a vmmipc.torch blob (share_tensors makes them; this one has "
                         f"another header: {blob[:16]!r})")
    saved = getattr(_local, "device", None)
    _local.device = (_check_device(device, "vmmipc.torch.open_tensors"),) if device is not None \
        else saved
    try:
        kind, names, tensors = _BlobUnpickler(io.BytesIO(blob[len(BLOB_MAGIC):])).load()
    finally:
        _local.device = saved
    pairs = list(zip(names, tensors))
    return dict(pairs) if kind == "dict" else pairs
