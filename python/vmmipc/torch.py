"""PyTorch integration: CUDA tensors in VMM memory through multiprocessing.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` every CUDA tensor
lives in cuMemCreate chunks, and torch shares those with pidfd_getfd, which
a container's default seccomp profile refuses ("pidfd_getfd: Operation not
permitted"). After ``import vmmipc.torch`` (or ``vmmipc.torch.install()``),
a CUDA tensor or UntypedStorage whose memory is CUDA VMM memory that allows
POSIX-fd export crosses multiprocessing (Queue, Pipe, Pool, Process
arguments; spawn and forkserver; torch.multiprocessing too) through
vmmipc instead: no pidfd_getfd, one descriptor at a time. Every other
tensor and storage (CPU, meta, the legacy cudaMalloc allocator, sparse,
nested, quantized, empty) keeps torch's own reducer, unchanged.

    import vmmipc.torch                      # before the first put
    q = torch.multiprocessing.get_context("spawn").Queue()
    q.put(model.state_dict())                # the child's q.get() maps it

What the receiver gets: tensors on the exporter's GPU (found by UUID, so
CUDA_VISIBLE_DEVICES may differ), zero-copy over the sender's memory: writes
are seen both ways. Tensors that share a storage arrive sharing one storage
(views, tied weights), within one pickle and across pickles. dtype, shape,
stride, storage offset, requires_grad and Parameter-ness are kept. Receiving
needs numpy (torch parses __cuda_array_interface__ with it).

Rules the caller keeps (the same as torch's own CUDA sharing):
  - Ordering: pickling records an event on the current CUDA stream of the
    thread that pickles, and the receiver's current stream waits on it
    before the tensor is returned. A Queue pickles in its feeder thread,
    whose current stream is the default stream: synchronize work done on
    other streams before put().
  - The sender process must outlive its receivers' imports (its vmmipc
    server serves them). The receiver's mapping holds its own references to
    the memory, so the sender may drop its tensor right after put(), and
    even return the memory to the driver (torch.cuda.empty_cache()): the
    receiver's data stays. But once the receiver has imported, the sender's
    allocator may hand the same memory to a new tensor, whose writes the
    receiver would then see: keep the sent tensor alive in the sender for as
    long as receivers use it (torch gives the same rule).
  - The fork start method cannot work (VmmipcForkError): use spawn or
    forkserver.

Design note [vmmipc.torch: lifetime, sharing and ordering]
  Sender. A storage lies in one or more allocations (an expandable segment
  maps 20 MiB chunks for large tensors, 2 MiB ones for small; neighbouring
  storages share chunks). vmmipc.cuda_query_range gives the covering range
  on chunk boundaries; that range gets ONE long-lived anchor registration
  (vmmipc.share, uses=0), shared by every storage with the same covering
  range, and kept while a storage that uses it is alive and unchanged. An
  anchor is found again only if one of its storages still lives at the
  same address and size: a live storage pins the chunks under it (torch
  unmaps only chunks that are wholly free), so those are the very chunks
  the anchor retained. A freed storage whose range was unmapped and mapped
  again with new chunks can therefore never match an old anchor; when its
  last storage dies the anchor is unregistered (on a reaper thread: that
  death can happen in a library callback, which must not call vmmipc).
  Each pickle gets its own registration, vmmipc.register_again(anchor,
  uses=1), whose release callback drops a keep-alive of the storage, so the
  storage outlives put() until its receiver has imported it. The pickle
  carries that ticket, the anchor's id (this process's random token and a
  serial), the storage's offset in the range and size, the exporter's
  device and an interprocess event handle. Storages are pickled as objects
  of their own, so the pickler's memo sends a storage once per pickle for
  all its views.
  Receiver. vmmipc.import_stream maps the range (the import cache makes a
  second send of the same anchor one round trip with no mapping); an object
  exposing __cuda_array_interface__ for [offset, offset + size) goes to
  torch.as_tensor, whose storage holds that object until the storage is
  freed; then the device is synchronized and the mapping reference dropped.
  A weak cache of received storages, keyed by (anchor id, offset, size,
  device), gives a storage that arrives again (another view, another send)
  the same torch storage; the ticket is still redeemed (one round trip) so
  the sender's keep-alive ends.
  Ordering. The sender keeps each event until it has completed and at least
  EVENT_KEEP_SECONDS have passed (checked at each pickle), so a receiver can
  always open it; the receiver opens it on the exporter's GPU and makes its
  current stream wait.

Probed on the H200 (torch 2.11.0+cu130, cuda.bindings 13.3.1, 2026-12-01),
the facts this design rests on:
  - expandable segments: a 1 GiB tensor spans 20 MiB chunks; 1 KiB tensors
    share one 2 MiB chunk (at offsets 0 and 0x400); a 3 MiB tensor sat in
    the 20 MiB chunk that also held the end of the 1 GiB one. Every chunk
    allowed CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (handle types 0x1);
    cuMemRetainAllocationHandle twice gave the same handle value; under
    expandable_segments:False it failed (CUDA_ERROR_INVALID_VALUE), so
    legacy memory is not VMM.
  - t.untyped_storage() is the same object for every view of a storage, and
    weakref.finalize on it fires only when the last view dies.
  - torch.as_tensor(obj with __cuda_array_interface__) is zero-copy, on
    cuda:0 (the pointer's device), with a storage of exactly the described
    bytes; obj stays alive while any tensor over that storage lives and is
    released after the last one.
  - /proc/self/maps cannot tell whether a VMM range is mapped (the driver
    reserves its whole window up front); cuMemGetAddressRange answers
    CUDA_ERROR_NOT_FOUND once it is unmapped.
  - torch.cuda.Event(interprocess=True): create, record and ipc_handle()
    took 14 us; a spawned child opened a handle in 0.2 ms (later ones in
    1 us), also under a seccomp filter refusing pidfd_getfd, and a handle
    whose event the sender had destroyed after it completed still opened
    and waited fine. Under that filter torch's own expandable-segment
    sharing failed with RuntimeError('pidfd_getfd: Operation not
    permitted'); legacy (cudaIpc) sharing still worked.

torch is imported lazily: without it, ``import vmmipc.torch`` works and the
functions raise ImportError saying what is missing.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import os
import queue
import threading
import time
import uuid
import weakref

import vmmipc as _vmmipc

from . import _args, _mp, _reductions

log = logging.getLogger("vmmipc")

POSIX_FD_HANDLE = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_HANDLE_TYPE_NAMES = {
    0x1: "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    0x2: "CU_MEM_HANDLE_TYPE_WIN32",
    0x4: "CU_MEM_HANDLE_TYPE_WIN32_KMT",
    0x8: "CU_MEM_HANDLE_TYPE_FABRIC",
}

# An interprocess event is kept in the sender until it has completed and at
# least this long has passed since it was pickled.
EVENT_KEEP_SECONDS = 2.0


def _torch():
    """The torch module, or an ImportError that says what is missing."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("vmmipc.torch needs PyTorch (pip install torch); it could not be "
                          f"imported: {e}") from e
    return torch


def _torch_reductions():
    import torch.multiprocessing.reductions as reductions
    return reductions


def handle_type_names(bits: int) -> str:
    """CU_MEM_HANDLE_TYPE_* names of a handle-type bit mask, e.g.
    "CU_MEM_HANDLE_TYPE_FABRIC" for 0x8 ("none" for 0)."""
    names = [name for bit, name in sorted(_HANDLE_TYPE_NAMES.items()) if bits & bit]
    unknown = bits & ~sum(_HANDLE_TYPE_NAMES)
    if unknown:
        names.append(f"unknown bits {unknown:#x}")
    return " | ".join(names) or "none"


# ------------------------------------------------------------------ settings

_receive_device: int | None = None
_pickle_ttl: float | None = None


def set_receive_device(device: int | None) -> None:
    """Where this process maps the tensors it unpickles from now on (every
    thread: Queue.get, Pool results, Process arguments). None (the default):
    the exporter's GPU, found by UUID. An ordinal: that device of this
    process gets read-write access and the tensor is on it (checked when a
    tensor arrives). TypeError if not an integer, InvalidError if < 0."""
    global _receive_device
    if device is not None:
        device = _args.integer(device, "device", 0, _args.I32_MAX,
                               "vmmipc.torch.set_receive_device")
    _receive_device = device


def set_pickle_ttl(ttl: float | None) -> None:
    """How long a pickled storage can be received, in seconds, from now on.
    None (the default): until it is received or this process ends. A pickle
    that is never received (a Queue item nobody reads) keeps its storage
    alive in this process until then. Checked as vmmipc.register_again
    checks its ttl (TypeError, InvalidError)."""
    global _pickle_ttl
    if ttl is not None:
        _args.milliseconds(ttl, "ttl", 1, _vmmipc.MAX_TTL_MS, "vmmipc.torch.set_pickle_ttl")
    _pickle_ttl = ttl


# ---------------------------------------------------------- per-process state


class _Reaper:
    """One daemon thread for work that must not run where it arises: a
    storage can die inside a library callback (whose thread must not call
    vmmipc), and freeing an object can run any finalizer."""

    def __init__(self):
        self.pid = os.getpid()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="vmmipc.torch reaper", daemon=True).start()

    def submit(self, fn, *args) -> None:
        self._queue.put((fn, args))

    def _run(self) -> None:
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("vmmipc.torch: %s failed", getattr(fn, "__qualname__", fn))
            del fn, args  # whatever they held is freed here, on this thread


_reaper_instance: _Reaper | None = None
_reaper_lock = threading.RLock()  # re-entrant: a finalizer may ask while it is held


def _reaper() -> _Reaper:
    global _reaper_instance
    r = _reaper_instance
    if r is not None and r.pid == os.getpid():
        return r
    with _reaper_lock:
        if _reaper_instance is None or _reaper_instance.pid != os.getpid():
            _reaper_instance = _Reaper()  # none yet, or inherited through fork()
        return _reaper_instance


_token = (0, b"")


def _sender_token() -> bytes:
    """Random and new in every process (also in children of a forkserver,
    which share the module state of the process they were forked from), so
    that anchor ids of two senders never collide in a receiver."""
    global _token
    pid, token = _token
    if pid != os.getpid():
        token = os.urandom(16)
        _token = (os.getpid(), token)
    return token


def _unregister_quietly(ticket) -> None:
    try:
        _vmmipc.unregister(ticket)
    except _vmmipc.NotFoundError:
        pass  # it ended already (used up, or unregistered at exit)


# --------------------------------------------------------------------- sender


class _User:
    """A storage that uses an anchor, and where it was when it started to."""
    __slots__ = ("ref", "ptr", "nbytes")

    def __init__(self, storage):
        self.ref = weakref.ref(storage)
        self.ptr = storage.data_ptr()
        self.nbytes = storage.nbytes()

    def unchanged(self, storage) -> bool:
        return storage.data_ptr() == self.ptr and storage.nbytes() == self.nbytes

    def pins(self) -> bool:
        """Alive where it was: the chunks under it are still the anchor's."""
        storage = self.ref()
        return storage is not None and self.unchanged(storage)


class _Anchor:
    """The long-lived registration of one covering chunk range."""
    __slots__ = ("key", "ticket", "serial", "users", "retired")

    def __init__(self, key, ticket, serial):
        self.key = key              # (device, base, size)
        self.ticket = ticket
        self.serial = serial        # never reused in this process
        self.users: dict[int, _User] = {}
        self.retired = False

    def pinned(self) -> bool:
        return any(user.pins() for user in self.users.values())


class _KeepAlive:
    """Release callback of one pickle's registration: lets go of the storage
    once the library needs it no more. The last reference goes to the reaper,
    so the storage is freed on a thread of ours, not the library's."""
    __slots__ = ("storage",)

    def __init__(self, storage):
        self.storage = storage

    def __call__(self) -> None:
        storage, self.storage = self.storage, None
        _reaper().submit(_let_go, storage)


def _let_go(storage) -> None:
    """Runs on the reaper; the reference it was given dies when it returns."""


class _Anchors:
    """This process's anchors, by covering range and by storage."""

    def __init__(self):
        self._lock = threading.Lock()   # never held across a vmmipc call
        self._by_range: dict[tuple, _Anchor] = {}
        self._by_storage: dict[int, _Anchor] = {}
        self._serials = itertools.count(1)

    def ticket_for(self, storage, rng, ttl) -> tuple:
        """A new registration (uses=1) of the anchor covering storage, which
        keeps the storage alive until it ends; and the anchor's id."""
        anchor = self._anchor_for(storage, rng)
        try:
            ticket = _vmmipc.register_again(anchor.ticket, uses=1, ttl=ttl,
                                            release=_KeepAlive(storage))
        except _vmmipc.NotFoundError:
            # The anchor ended under us (unregistered by hand, or at exit):
            # forget it and make another.
            with self._lock:
                self._retire(anchor)
            anchor = self._anchor_for(storage, rng)
            ticket = _vmmipc.register_again(anchor.ticket, uses=1, ttl=ttl,
                                            release=_KeepAlive(storage))
        return ticket, (_sender_token(), anchor.serial)

    def _anchor_for(self, storage, rng) -> _Anchor:
        key = (rng.device, rng.base, rng.size)
        with self._lock:
            found = self._find(storage, key)
        if found is not None:
            return found
        made = _Anchor(key, _vmmipc.share(rng.base, rng.size, uses=0), next(self._serials))
        _reaper()  # started now, from this thread, before any storage can die
        with self._lock:
            found = self._find(storage, key)
            if found is None:
                self._by_range[key] = made
                self._attach(made, storage)
                return made
        _unregister_quietly(made.ticket)  # another thread made one meanwhile
        return found

    def _find(self, storage, key) -> _Anchor | None:
        """The live anchor for storage, attaching it if need be (lock held)."""
        sid = id(storage)
        current = self._by_storage.get(sid)
        if current is not None:
            user = current.users.get(sid)
            if user is not None and user.ref() is storage:
                if not current.retired and user.unchanged(storage):
                    return current
                self._detach(current, sid)  # resized, or its anchor ended
        anchor = self._by_range.get(key)
        if anchor is None:
            return None
        if not anchor.pinned():
            # Every storage it served is gone or elsewhere: the chunks now at
            # this range may be new ones. Never reuse it.
            self._retire(anchor)
            return None
        self._attach(anchor, storage)
        return anchor

    def _attach(self, anchor: _Anchor, storage) -> None:
        sid = id(storage)
        anchor.users[sid] = _User(storage)
        self._by_storage[sid] = anchor
        finalizer = weakref.finalize(storage, _storage_freed, self, sid)
        finalizer.atexit = False  # at exit the process's end unregisters all

    def _detach(self, anchor: _Anchor, sid: int) -> None:
        anchor.users.pop(sid, None)
        if self._by_storage.get(sid) is anchor:
            del self._by_storage[sid]
        if not anchor.retired and not anchor.pinned():
            self._retire(anchor)

    def _retire(self, anchor: _Anchor) -> None:
        if anchor.retired:
            return
        anchor.retired = True
        if self._by_range.get(anchor.key) is anchor:
            del self._by_range[anchor.key]
        for sid in anchor.users:
            if self._by_storage.get(sid) is anchor:
                del self._by_storage[sid]
        anchor.users.clear()
        # Registrations made from it stay valid (the library keeps the memory
        # exported while any lives); receivers' cached mappings of it go.
        _reaper().submit(_unregister_quietly, anchor.ticket)

    def storage_freed(self, sid: int) -> None:
        """On the reaper: a storage that used an anchor has died."""
        with self._lock:
            anchor = self._by_storage.get(sid)
            if anchor is None:
                return
            user = anchor.users.get(sid)
            if user is not None and user.ref() is None:  # not a new storage at that id
                self._detach(anchor, sid)

    def live(self) -> int:
        """Anchors not retired (for tests)."""
        with self._lock:
            return len(self._by_range)


def _storage_freed(anchors: _Anchors, sid: int) -> None:
    # A weakref.finalize callback: runs wherever the storage died.
    _reaper().submit(anchors.storage_freed, sid)


class _SentEvents:
    """Interprocess events of pickled storages, kept until they have
    completed here and EVENT_KEEP_SECONDS have passed (a receiver opens the
    handle after importing, by then possibly after this process dropped its
    keep-alive of the storage)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: collections.deque = collections.deque()

    def record(self, torch, device: int) -> bytes:
        """Record an event on this thread's current stream of device and
        return its interprocess handle (64 bytes of plain data)."""
        with torch.cuda.device(device):
            event = torch.cuda.Event(interprocess=True)
            event.record(torch.cuda.current_stream(device))
            handle = event.ipc_handle()
        now = time.monotonic()
        with self._lock:
            self._kept.append((now, event))
            while (self._kept and now - self._kept[0][0] >= EVENT_KEEP_SECONDS
                   and self._kept[0][1].query()):
                self._kept.popleft()
        return handle


_anchors = _Anchors()
_events = _SentEvents()


def _vmm_range(storage):
    """The covering CudaRange of a storage in CUDA VMM memory, or None if
    vmmipc does not hold it (CPU, cudaMalloc, empty)."""
    if storage.device.type != "cuda" or storage.nbytes() == 0:
        return None
    try:
        return _vmmipc.cuda_query_range(storage.data_ptr(), storage.nbytes())
    except _vmmipc.NotFoundError:
        return None


def _require_posix_fd(rng, storage) -> None:
    if rng.handle_types & POSIX_FD_HANDLE:
        return
    raise _vmmipc.InvalidError(
        f"cannot send this CUDA storage (cuda:{storage.device.index}, {storage.nbytes()} bytes "
        f"at {storage.data_ptr():#x}) through vmmipc: its VMM memory allows export as "
        f"{handle_type_names(rng.handle_types)} only, and vmmipc needs "
        f"{_HANDLE_TYPE_NAMES[POSIX_FD_HANDLE]}. Allocate it with POSIX-fd export (what "
        "PyTorch's expandable segments request by default), or with expandable segments off "
        "(torch's own CUDA IPC then shares it)", _vmmipc.EINVAL, "vmmipc.torch")


def _raise(error):
    raise error


def _reduce_through(what: str, storage, torch_reduce, vmm_reduce):
    """The one decision of both reducers: torch's own reducer for memory
    that vmmipc does not hold; otherwise vmm_reduce(range), guarded (fork
    destinations refused, errors carried to the receiver of a Queue)."""
    try:
        rng = _vmm_range(storage)
    except _vmmipc.VmmipcError as e:  # e.g. libvmmipc or libcuda missing
        return _mp.guarded_reduce(what, functools.partial(_raise, e))
    if rng is None:
        return torch_reduce()
    return _mp.guarded_reduce(what, functools.partial(vmm_reduce, rng))


def _storage_reduction(storage, rng):
    _require_posix_fd(rng, storage)
    torch = _torch()
    device = storage.device.index
    event_handle = _events.record(torch, device)
    ticket, anchor_id = _anchors.ticket_for(storage, rng, _pickle_ttl)
    return (_rebuild_storage, (ticket, anchor_id, storage.data_ptr() - rng.base,
                               storage.nbytes(), device, event_handle))


def _tensor_reduction(torch, tensor, storage, rng):
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError("cannot send a non-leaf tensor that requires grad: autograd does "
                           "not cross processes; send tensor.detach() instead")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError("cannot send a tensor with a lazy conjugate or negative bit through "
                         "vmmipc: call tensor.resolve_conj() or tensor.resolve_neg() first")
    _require_posix_fd(rng, storage)
    torch.utils.hooks.warn_if_has_hooks(tensor)
    # The storage goes in as an object of its own: the pickler's memo then
    # sends it once for all the tensors of this pickle that view it.
    return (_rebuild_tensor, (type(tensor), storage, tensor.storage_offset(),
                              tuple(tensor.size()), tuple(tensor.stride()), tensor.dtype,
                              tensor.requires_grad))


def _plain_cuda(torch, tensor) -> bool:
    return (tensor.is_cuda and tensor.layout == torch.strided and not tensor.is_nested
            and not tensor.is_quantized)


def reduce_tensor(tensor):
    """ForkingPickler reducer for torch.Tensor and torch.nn.Parameter: CUDA
    tensors in VMM memory go through vmmipc, all others through torch's own
    reduce_tensor."""
    torch = _torch()
    own = _torch_reductions().reduce_tensor
    if not _plain_cuda(torch, tensor):
        return own(tensor)
    storage = tensor.untyped_storage()
    return _reduce_through("CUDA tensor", storage, lambda: own(tensor),
                           lambda rng: _tensor_reduction(torch, tensor, storage, rng))


def reduce_storage(storage):
    """ForkingPickler reducer for torch.UntypedStorage: CUDA storages in VMM
    memory go through vmmipc, all others through torch's own reduce_storage
    (which refuses CUDA storages). Typed storages need no reducer of ours:
    torch's reduces them to their UntypedStorage."""
    own = _torch_reductions().reduce_storage
    return _reduce_through("CUDA storage", storage, lambda: own(storage),
                           lambda rng: _storage_reduction(storage, rng))


def is_vmm_tensor(obj) -> bool:
    """Whether a tensor's (or storage's) memory is CUDA VMM memory, so that
    pickling it goes through vmmipc rather than torch's CUDA IPC."""
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        if not _plain_cuda(torch, obj):
            return False
        obj = obj.untyped_storage()
    return _vmm_range(obj) is not None


# ------------------------------------------------------------------- receiver


class _Region:
    """[addr, addr + nbytes) of a vmmipc Mapping as torch.as_tensor reads it
    (__cuda_array_interface__ v3). The storage torch makes over it holds this
    object until the storage is freed; then the device is synchronized (no
    kernel may still use the memory) and the mapping reference dropped."""

    def __init__(self, mapping, offset: int, nbytes: int):
        self.addr = mapping.addr + offset
        self.nbytes = nbytes
        self.device = mapping.device
        finalizer = weakref.finalize(self, _drop_mapping, mapping)
        finalizer.atexit = False  # at exit nothing is unmapped under live tensors

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, False),
                "strides": None, "version": 3}


def _drop_mapping(mapping) -> None:
    try:
        _torch().cuda.synchronize(mapping.device)
    except Exception:  # noqa: BLE001 - unmapping must still happen
        log.exception("vmmipc.torch: could not synchronize cuda:%d before unmapping",
                      mapping.device)
    mapping.close()


class _Received:
    """Storages this process received, weakly, by where they live in the
    sender: a storage that arrives again (another view, another send) is
    the same torch storage while any tensor over it lives."""

    def __init__(self):
        self._lock = threading.Lock()
        self._storages = weakref.WeakValueDictionary()

    def get(self, key):
        with self._lock:
            return self._storages.get(key)

    def add(self, key, storage):
        """storage, or the one another thread stored for key first."""
        with self._lock:
            return self._storages.setdefault(key, storage)

    def __len__(self) -> int:
        with self._lock:
            return len(self._storages)


_received = _Received()


def _storage_over(torch, mapping, offset: int, nbytes: int):
    region = _Region(mapping, offset, nbytes)
    tensor = torch.as_tensor(region)
    if tensor.data_ptr() != region.addr or tensor.device != torch.device("cuda", region.device):
        raise RuntimeError(
            f"torch.as_tensor did not wrap the imported memory in place (got {tensor.device} "
            f"at {tensor.data_ptr():#x}, wanted cuda:{region.device} at {region.addr:#x})")
    return tensor.untyped_storage()


def _uuid_bytes(torch_uuid) -> bytes:
    """The 16 bytes of torch's device-properties uuid (its .bytes are a list
    of possibly signed chars; older builds only print it)."""
    raw = getattr(torch_uuid, "bytes", None)
    if raw is not None:
        return bytes(b & 0xFF for b in raw)
    return uuid.UUID(str(torch_uuid).removeprefix("GPU-")).bytes


def _ordinal_of_exporter(torch, ticket, exporter_device: int) -> int:
    want = ticket.info().device_uuid
    for ordinal in range(torch.cuda.device_count()):
        if _uuid_bytes(torch.cuda.get_device_properties(ordinal).uuid) == want:
            return ordinal
    raise RuntimeError(f"the exporter's GPU (its cuda:{exporter_device}, UUID "
                       f"{uuid.UUID(bytes=bytes(want))}) is not visible in this process, so its "
                       "event cannot be waited on; make it visible (CUDA_VISIBLE_DEVICES)")


def _rebuild_storage(ticket, anchor_id, offset, nbytes, exporter_device, event_handle):
    """Unpickling side of a VMM storage."""
    torch = _torch()
    torch.cuda.init()  # a fresh child may not have touched CUDA yet
    target = _receive_device
    import_device = _vmmipc.DEVICE_SAME if target is None else target
    key = (anchor_id, offset, nbytes, target)
    storage = _received.get(key)
    if storage is not None:
        # Redeem the ticket anyway (one round trip through the import cache)
        # so that the sender's keep-alive ends; the mapping is ours already.
        _vmmipc.import_stream(ticket, import_device).close()
    else:
        mapping = _vmmipc.import_stream(ticket, import_device)
        try:
            storage = _received.add(key, _storage_over(torch, mapping, offset, nbytes))
        except BaseException:
            mapping.close()
            raise
    event_device = (storage.device.index if target is None
                    else _ordinal_of_exporter(torch, ticket, exporter_device))
    event = torch.cuda.Event.from_ipc_handle(event_device, event_handle)
    torch.cuda.current_stream(storage.device).wait_event(event)
    return storage


def _rebuild_tensor(cls, storage, storage_offset, size, stride, dtype, requires_grad):
    """Unpickling side of a VMM tensor (its storage is unpickled first)."""
    torch = _torch()
    tensor = torch.empty((0,), dtype=dtype, device=storage.device).set_(
        storage, storage_offset, size, stride)
    if issubclass(cls, torch.nn.Parameter):
        # As a constructor argument: integer Parameters must say False there.
        return cls(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


# ---------------------------------------------------------------- installing

_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Register reduce_tensor for torch.Tensor and torch.nn.Parameter and
    reduce_storage for the UntypedStorage classes torch registers, after
    torch.multiprocessing's own (idempotent). Raises ImportError without
    torch."""
    global _installed
    torch = _torch()
    import torch.multiprocessing  # noqa: F401 - its init_reductions first, so ours replace it
    with _install_lock:
        if _installed:
            return
        for cls in (torch.Tensor, torch.nn.Parameter):
            _reductions.register(cls, reduce_tensor)
        for cls in torch._storage_classes:
            if cls.__name__ == "UntypedStorage":
                _reductions.register(cls, reduce_storage)
        _installed = True


try:
    install()
except ImportError:
    pass  # no torch: the functions above raise a clear ImportError when used

__all__ = ["EVENT_KEEP_SECONDS", "POSIX_FD_HANDLE", "handle_type_names", "install",
           "is_vmm_tensor", "reduce_storage", "reduce_tensor", "set_pickle_ttl",
           "set_receive_device"]
