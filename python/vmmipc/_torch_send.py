"""vmmipc.torch, the sending half: batches, reducers and share_tensors.

A *batch* is what one pickle shares: every ForkingPickler.dump (so Queue,
Pipe, Pool, Process arguments, ForkingPickler.dumps, and serializers that
call ForkingPickler(buf).dump themselves) runs in one, and so does each
share_tensors call; `with batch():` makes one around code that calls
reduce_tensor itself. A batch

  - plans anchors first, for every CUDA tensor and storage it can find in
    the object (dicts, lists and tuples, nested): storages sent together are
    registered together, one anchor per run of chunks (_torch_runs);
  - makes ONE grant per anchor it uses (vmmipc.register_again, uses=1,
    hold=True), which keeps every storage of that anchor in this batch
    alive, out of torch's allocator's reach, until the receiver has let go
    of every storage it rebuilt from it, or has died (torch's lifetime rule;
    the header's "Holds"; _torch_receive counts them);
  - records ONE interprocess event per device, on the current stream of the
    thread that pickles, which the receiver's current stream waits on.

So re-sending a model costs per tensor only dictionary lookups and the
pickle itself: no driver call, no registration, no event; per run one grant.
Outside a batch (reduce_tensor called directly) each storage gets a batch
of its own.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import io
import os
import pickle
import threading
import time

from . import _errors, _mp
from ._torch_env import torch_module, torch_reductions
from ._torch_receive import BLOB_MAGIC, rebuild_storage, rebuild_tensor
from ._torch_runs import RunAnchor, runs

# An interprocess event is kept in the sender until it has completed and at
# least this long has passed since it was pickled; then it is used again.
EVENT_KEEP_SECONDS = 2.0

# Interprocess events kept at most (torch's own bound,
# CUDA_IPC_MAXIMUM_EVENTS_TO_USE): beyond it a pickle synchronizes its
# stream instead of sending an event, so a loop of many small sends never
# runs the driver out of event resources.
MAX_EVENTS = 1000

# Pickles of one run that may wait for their receivers at once; beyond it the
# oldest grant is ended (its receiver gets ENOENT), so a receiver that stopped
# reading cannot make the sender hold more and more (set_pickle_ttl bounds
# the wait in time).
MAX_PENDING_PICKLES = 1024

_pickle_ttl: float | None = None


def set_pickle_ttl(ttl: float | None) -> None:
    global _pickle_ttl
    _pickle_ttl = ttl


# How a receiver's stream is ordered after the sender's work (set_ordering):
#   "event": an interprocess CUDA event, recorded on the sender's current
#            stream, which the receiver's current stream waits on (as torch
#            does). CUDA keeps such events in /dev/shm: the receiver must
#            share the sender's /dev/shm (one host, one pod or --ipc=host).
#   "sync":  the sender waits, while it pickles, until the work queued on its
#            current stream has finished; the receiver waits on nothing.
#            Works between any two containers, pods included.
#   "auto":  "sync" when VMMIPC_SOCKET_DIR is set (receivers may be in other
#            containers: abstract sockets reach only the sender's network
#            namespace), else "event".
ORDERINGS = ("auto", "event", "sync")
_ordering = "auto"


def set_ordering(mode: str) -> None:
    global _ordering
    _ordering = mode


def ordering() -> str:
    """The ordering pickles get now: "event" or "sync"."""
    if _ordering != "auto":
        return _ordering
    return "sync" if os.environ.get("VMMIPC_SOCKET_DIR") else "event"


class _SentEvents:
    """Interprocess events of batches: each is kept until it has completed
    here and EVENT_KEEP_SECONDS have passed (a receiver opens the handle
    after importing, by then possibly after this process let go of the
    storage), then recorded again for a later batch (its handle is the
    same; a receiver that opens it late waits for more work, never less).
    At most MAX_EVENTS exist; past that, record returns None and the caller
    synchronizes instead."""

    def __init__(self):
        self._lock = threading.Lock()
        self._kept: collections.deque = collections.deque()  # (time, device, event, handle)
        self._free: dict[int, list] = {}  # device -> [(event, handle)] ready to record again
        self._count = 0  # events made, kept or free

    def record(self, torch, device: int) -> bytes | None:
        """Record an event on this thread's current stream of device and
        return its interprocess handle (64 bytes of plain data); None when
        MAX_EVENTS are all in use."""
        now = time.monotonic()
        with self._lock:
            while (self._kept and now - self._kept[0][0] >= EVENT_KEEP_SECONDS
                   and self._kept[0][2].query()):
                _, dev, event, handle = self._kept.popleft()
                self._free.setdefault(dev, []).append((event, handle))
            free = self._free.get(device)
            reused = free.pop() if free else None
            if reused is None:
                if self._count >= MAX_EVENTS:
                    return None
                self._count += 1
        try:
            with torch.cuda.device(device):
                if reused is None:
                    event = torch.cuda.Event(interprocess=True)
                else:
                    event, handle = reused
                event.record(torch.cuda.current_stream(device))
                if reused is None:
                    handle = event.ipc_handle()
        except BaseException:
            with self._lock:
                self._count -= 1
            raise
        with self._lock:
            self._kept.append((now, device, event, handle))
        return handle

    def counts(self) -> tuple[int, int]:
        """(events in existence, of which kept for receivers), for tests."""
        with self._lock:
            return self._count, len(self._kept)


_events = _SentEvents()


class Batch:
    """One pickle's grants (one per anchor) and events (one per device)."""

    def __init__(self):
        self.ttl = _pickle_ttl
        self.where = _mp.fork_destination()  # the pickle's: it is made on this thread
        self._grants: dict[RunAnchor, tuple] = {}
        self._events: dict[int, bytes] = {}
        self._not_vmm: set[int] = set()  # ids of storages planned and found not VMM
        self._runs: dict[int, tuple] = {}  # id(storage) -> (storage, its anchor)
        self.args: dict[int, tuple] = {}  # id(storage) -> (storage, rebuild_storage's args)

    def run_of(self, storage) -> RunAnchor | None:
        """storage's anchor as found in this batch (storages do not move
        while one thread pickles them)."""
        found = self._runs.get(id(storage))
        return found[1] if found is not None and found[0] is storage else None

    def remember(self, storage, run: RunAnchor) -> None:
        self._runs[id(storage)] = (storage, run)

    def grant(self, run: RunAnchor, storage):
        """The ticket of this batch's grant of run; storage is kept alive
        until that grant ends. NotFoundError if the anchor has ended."""
        entry = self._grants.get(run)
        if entry is None:
            keep: list = []
            entry = (run.anchor.grant(uses=1, ttl=self.ttl, keep=keep,
                                      limit=MAX_PENDING_PICKLES, hold=True), keep)
            self._grants[run] = entry
        entry[1].append(storage)
        return entry[0]

    def event(self, device: int) -> bytes | None:
        """The interprocess event handle for device (one per batch), or None
        when the sender synchronized instead (ordering "sync")."""
        if device in self._events:
            return self._events[device]
        torch = torch_module()
        handle = None if ordering() == "sync" else _events.record(torch, device)
        if handle is None:  # ordering "sync", or every event is in use
            torch.cuda.current_stream(device).synchronize()
        self._events[device] = handle
        return handle

    def plan(self, obj) -> None:
        """Anchor every VMM storage found in obj that has no anchor yet,
        together. Best effort: a storage it cannot plan is anchored (or
        refused, with a clear error) when it is reduced."""
        pending = []
        for storage in _storages_in(obj):
            run = runs.attached(storage)
            if run is not None:
                self.remember(storage, run)
                continue
            try:
                p = runs.pending(storage)
            except _errors.VmmipcError:
                continue  # its reducer raises the same error in its place
            if p is None:
                self._not_vmm.add(id(storage))
            else:
                pending.append(p)
        if pending:
            try:
                runs.plan(pending)
            except _errors.VmmipcError:
                return  # each reducer retries alone and raises for its own storage
            for p in pending:
                run = runs.attached(p.storage)
                if run is not None:
                    self.remember(p.storage, run)

    def known_not_vmm(self, storage) -> bool:
        return id(storage) in self._not_vmm


_local = threading.local()


def current_batch() -> Batch | None:
    stack = getattr(_local, "batches", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def batch(obj=None):
    """Share everything reduced inside as one pickle: one grant per anchor,
    one event per device. obj (optional): what will be reduced, so that its
    storages are anchored together up front (dicts, lists and tuples of
    tensors are searched)."""
    b = Batch()
    if obj is not None and b.where is None:  # never register for a forked child
        b.plan(obj)
    stack = _local.__dict__.setdefault("batches", [])
    stack.append(b)
    try:
        yield b
    finally:
        stack.pop()


_MAX_VISIT = 1 << 16  # objects one plan looks at, at most


def _storages_in(obj):
    """The untyped storages of plain CUDA tensors and storages in obj,
    searched through dicts, lists and tuples (a state dict, a list of
    (name, tensor) pairs), each once."""
    torch = torch_module()
    seen: set[int] = set()
    todo = [obj]
    visited = 0
    while todo and visited < _MAX_VISIT:
        o = todo.pop()
        visited += 1
        if isinstance(o, torch.Tensor):
            if _plain_cuda(torch, o):
                s = o.untyped_storage()
                if id(s) not in seen:
                    seen.add(id(s))
                    yield s
        elif isinstance(o, torch.UntypedStorage):
            if o.device.type == "cuda" and id(o) not in seen:
                seen.add(id(o))
                yield o
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)


def _plain_cuda(torch, tensor) -> bool:
    return (tensor.is_cuda and tensor.layout == torch.strided and not tensor.is_nested
            and not tensor.is_quantized)


# ------------------------------------------------------------------ reducers


def _lookup(storage, b: Batch | None):
    """(its anchor, None) for a storage that has one; (None, Pending) for
    VMM memory that needs one; (None, None) for memory vmmipc does not hold.
    Asks the driver at most; registers nothing. Raises for VMM memory
    vmmipc cannot send."""
    run = b.run_of(storage) if b is not None else None
    if run is None:
        run = runs.attached(storage)
        if run is not None and b is not None:
            b.remember(storage, run)
    if run is not None or (b is not None and b.known_not_vmm(storage)):
        return run, None
    return None, runs.pending(storage)


def _anchored(storage, pending, b: Batch | None) -> RunAnchor:
    """Register pending's storage (a run of its own) and return its anchor."""
    runs.plan([pending])
    run = runs.attached(storage)
    if run is None:
        raise _errors.InternalError("vmmipc.torch: a storage was planned but has no anchor",
                                    _errors.EINTERNAL, "vmmipc.torch")
    if b is not None:
        b.remember(storage, run)
    return run


def _anchor_of(storage, b: Batch | None) -> RunAnchor | None:
    """storage's anchor (made now if it has none), or None if its memory is
    not CUDA VMM memory. Raises for VMM memory vmmipc cannot send."""
    run, pending = _lookup(storage, b)
    return run if pending is None else _anchored(storage, pending, b)


def _raise(error):
    raise error


def _reduce_through(what: str, storage, torch_reduce, vmm_reduce):
    """The one decision of both reducers: torch's own reducer for memory
    that vmmipc does not hold; otherwise vmm_reduce(run, batch), guarded
    (fork destinations refused before anything is registered, errors
    carried to the receiver of a Queue)."""
    b = current_batch()
    where = b.where if b is not None else _mp.ASK
    try:
        run, pending = _lookup(storage, b)
    except _errors.VmmipcError as e:  # e.g. no POSIX fd, libvmmipc or libcuda missing
        return _mp.guarded_reduce(what, functools.partial(_raise, e), where)
    if run is None and pending is None:
        return torch_reduce()

    def reduce():
        anchored = run if pending is None else _anchored(storage, pending, b)
        return vmm_reduce(anchored, b)
    return _mp.guarded_reduce(what, reduce, where)


def _storage_args(storage, run: RunAnchor, b: Batch | None) -> tuple:
    """rebuild_storage's arguments for storage (one tuple per storage and
    batch, so the pickler's memo sends it once for all its views)."""
    if b is not None:
        found = b.args.get(id(storage))
        if found is not None and found[0] is storage:
            return found[1]
    else:
        b = Batch()
    try:
        ticket = b.grant(run, storage)
    except _errors.NotFoundError:
        # The anchor ended under us (Runs retired it after this batch found
        # it, or its registration ended some other way): retire it here too
        # and anchor the storage anew.
        runs.retire(run)
        run = _anchor_of(storage, None)
        b.remember(storage, run)
        ticket = b.grant(run, storage)
    device = storage.device.index
    args = (ticket, run.id, storage.data_ptr() - run.base, storage.nbytes(), device,
            b.event(device))
    b.args[id(storage)] = (storage, args)
    return args


def _storage_reduction(storage, run: RunAnchor, b: Batch | None):
    return (rebuild_storage, _storage_args(storage, run, b))


def tensor_meta(torch, tensor) -> tuple:
    """What rebuilds tensor over its storage (receive.tensor_over's
    arguments after the storage), checking that it can be sent."""
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError("cannot send a non-leaf tensor with requires_grad=True: autograd "
                           "does not cross processes; send tensor.detach() instead")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError("cannot send a tensor with a lazy conjugate or negative bit through "
                         "vmmipc: call tensor.resolve_conj() or tensor.resolve_neg() first")
    torch.utils.hooks.warn_if_has_hooks(tensor)
    return (type(tensor), tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()),
            tensor.dtype, tensor.requires_grad)


def _tensor_reduction(torch, tensor, storage, run: RunAnchor, b: Batch | None):
    # One call per tensor, its storage's arguments inline: the receiver's
    # table of received storages gives views of one storage one storage.
    # The checks first: a tensor refused must leave no grant behind.
    meta = tensor_meta(torch, tensor)
    return (rebuild_tensor, (_storage_args(storage, run, b),) + meta)


def reduce_tensor(tensor):
    """ForkingPickler reducer for torch.Tensor and torch.nn.Parameter: CUDA
    tensors in VMM memory that allows POSIX-fd export go through vmmipc;
    other VMM memory raises (InvalidError, saying why); every other tensor
    goes through torch's own reduce_tensor. Returns (rebuild, args) like
    torch's: a receiver calls rebuild(*args)."""
    torch = torch_module()
    own = torch_reductions().reduce_tensor
    if not _plain_cuda(torch, tensor):
        return own(tensor)
    storage = tensor.untyped_storage()
    return _reduce_through("CUDA tensor", storage, lambda: own(tensor),
                           lambda run, b: _tensor_reduction(torch, tensor, storage, run, b))


def reduce_storage(storage):
    """ForkingPickler reducer for torch.UntypedStorage: CUDA storages in VMM
    memory go through vmmipc, all others through torch's own reduce_storage
    (which refuses CUDA storages). Typed storages need no reducer of ours:
    torch's reduces them to their UntypedStorage."""
    own = torch_reductions().reduce_storage
    return _reduce_through("CUDA storage", storage, lambda: own(storage),
                           lambda run, b: _storage_reduction(storage, run, b))


def is_vmm_tensor(obj) -> bool:
    """Whether a tensor's (or storage's) memory is CUDA VMM memory, so that
    pickling it goes through vmmipc rather than torch's CUDA IPC."""
    torch = torch_module()
    if isinstance(obj, torch.Tensor):
        if not _plain_cuda(torch, obj):
            return False
        obj = obj.untyped_storage()
    if runs.attached(obj) is not None:
        return True
    try:
        return runs.pending(obj) is not None
    except _errors.InvalidError:
        return True  # VMM memory, just not sendable


# ------------------------------------------------------------- share_tensors

class _PlainPickler(pickle.Pickler):
    """Pickles share_tensors' blob: tensors through reduce_tensor, and the
    rest (names, dtypes as strings) as plain data."""

    def reducer_override(self, obj):
        torch = torch_module()
        if isinstance(obj, torch.Tensor):
            return reduce_tensor(obj)
        if isinstance(obj, torch.UntypedStorage):
            return reduce_storage(obj)
        return NotImplemented


def share_tensors(named_tensors) -> bytes:
    """Share many CUDA tensors at once, for frameworks that carry handles
    themselves (HTTP, ZMQ, Ray): returns plain bytes for ONE receiver, who
    passes them to open_tensors. named_tensors: a dict name -> tensor (a
    state dict) or a list of (name, tensor) pairs. Storages are anchored
    together (one anchor per run of chunks), with one grant per anchor and
    one event per device; each tensor keeps its storage offset, shape,
    stride, dtype, requires_grad and Parameter-ness, and tensors sharing a
    storage arrive sharing one. The tensors stay alive here, out of torch's
    allocator's reach, until the receiver has let go of every tensor it
    opened from them, or has died (torch.multiprocessing's rule, as for a
    Queue); a blob never opened keeps them until set_pickle_ttl's time
    passes."""
    torch = torch_module()
    if isinstance(named_tensors, dict):
        items, kind = list(named_tensors.items()), "dict"
    else:
        items, kind = list(named_tensors), "list"
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError("share_tensors takes a dict name -> tensor or a list of (name, "
                            f"tensor) pairs; item {i} is {type(item).__name__}")
    tensors = [t for _, t in items]
    with batch(tensors) as b:
        for name, t in items:
            if not _plain_cuda(torch, t) or _anchor_of(t.untyped_storage(), b) is None:
                raise _errors.InvalidError(
                    f"share_tensors: {name!r} is a {t.device} tensor outside CUDA VMM memory "
                    "(CPU, the legacy cudaMalloc allocator, sparse or nested): share_tensors "
                    "sends CUDA tensors of expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                    "expandable_segments:True) or other VMM memory only", _errors.EINVAL,
                    "vmmipc.torch.share_tensors")
        buf = io.BytesIO()
        buf.write(BLOB_MAGIC)
        _PlainPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(
            (kind, [name for name, _ in items], tensors))
        return buf.getvalue()


# ------------------------------------------------------------- installing


def dump_in_batch(pickler_dump):
    """Wrap ForkingPickler.dump so that each pickle is one batch, planned
    from the object being pickled."""
    def dump(self, obj):
        with batch(obj):
            return pickler_dump(self, obj)
    dump.__wrapped__ = pickler_dump
    dump.__doc__ = pickler_dump.__doc__
    return dump


__all__ = ["EVENT_KEEP_SECONDS", "MAX_EVENTS", "batch", "is_vmm_tensor", "reduce_storage",
           "reduce_tensor", "share_tensors"]
