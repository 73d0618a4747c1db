"""vmmipc.torch's sender state: batches, their grants and events, and how
a storage finds its run anchor. The reducers (_torch_reductions) use it; it
knows nothing of them, nor of the receiver.

A *batch* is what one pickle shares: every ForkingPickler.dump (so Queue,
Pipe, Pool, Process arguments, ForkingPickler.dumps, and serializers that
call ForkingPickler(buf).dump themselves) runs in one (dump_in_batch), and
so does each share_tensors call; `with batch():` makes one around code that
calls reduce_tensor itself. A batch

  - plans anchors first, for every CUDA tensor and storage it can find in
    the object (dicts, lists, tuples and modules, nested): storages sent
    together are registered together, one anchor per run of chunks
    (_torch_runs);
  - makes ONE grant per anchor it uses (vmmipc.register_again, uses=1,
    hold=True), which keeps every storage of that anchor in this batch
    alive, out of torch's allocator's reach, until the receiver has let go
    of every storage it rebuilt from it, or has died (torch's lifetime rule;
    the header's "Holds"; the receiver counts them: _torch_received);
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
import os
import threading
import time

from . import _errors, _mp
from ._anchor import end_quietly
from ._torch_env import plain_cuda, torch_module
from ._torch_runs import RunAnchor, run_anchors

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
        self._found: dict[int, tuple] = {}  # id(storage) -> (storage, its run anchor)
        self.args: dict[int, tuple] = {}  # id(storage) -> (storage, rebuild_storage's args)
        self.found_vmm = False  # plan found VMM storages in the object
        self.found_cpu = False  # plan found CPU storages (with bytes) in the object
        # Set when the pickle ends with the receiver's finish (dump_in_batch's
        # wrap): every storage names it, so that the receiver's hits wait for
        # that finish and are confirmed together.
        self.mark = None

    def run_of(self, storage) -> RunAnchor | None:
        """storage's anchor as found in this batch (storages do not move
        while one thread pickles them)."""
        found = self._found.get(id(storage))
        return found[1] if found is not None and found[0] is storage else None

    def remember(self, storage, run: RunAnchor) -> None:
        self._found[id(storage)] = (storage, run)

    def ticket(self, run: RunAnchor, storage, limit: int | None = MAX_PENDING_PICKLES):
        """The ticket of this batch's grant of run (made on first use);
        storage is kept alive until that grant ends. limit: the run's
        pickles that may wait for their receivers at once (Anchor.grant).
        NotFoundError if the anchor has ended."""
        entry = self._grants.get(run)
        if entry is None:
            keep: list = []
            entry = (run.anchor.grant(uses=1, ttl=self.ttl, keep=keep, limit=limit,
                                      hold=True), keep)
            self._grants[run] = entry
        entry[1].append(storage)
        return entry[0]

    def end_grants(self) -> None:
        """End this batch's grants: its pickle failed, so no receiver will
        come for them (one that has already taken a use keeps its hold)."""
        for ticket, _ in self._grants.values():
            end_quietly(ticket)

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
            if storage.device.type == "cpu":
                self.found_cpu = True
                continue
            run = run_anchors.attached(storage)
            if run is not None:
                self.remember(storage, run)
                self.found_vmm = True
                continue
            try:
                p = run_anchors.pending(storage)
            except _errors.VmmipcError:
                continue  # its reducer raises the same error in its place
            if p is None:
                self._not_vmm.add(id(storage))
            else:
                pending.append(p)
                self.found_vmm = True
        if pending:
            try:
                run_anchors.plan(pending)
            except _errors.VmmipcError:
                return  # each reducer retries alone and raises for its own storage
            for p in pending:
                run = run_anchors.attached(p.storage)
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
    storages are anchored together up front (dicts, lists, tuples and
    modules are searched). If the block raises, its pickle is taken as
    lost: the grants it made end."""
    b = Batch()
    if obj is not None and b.where is None:  # never register for a forked child
        b.plan(obj)
    stack = _local.__dict__.setdefault("batches", [])
    stack.append(b)
    try:
        yield b
    except BaseException:
        b.end_grants()  # else each waits for a receiver that never comes, keeping its storages
        raise
    finally:
        stack.pop()


_MAX_VISIT = 1 << 16  # objects one plan looks at, at most


def _storages_in(obj):
    """The untyped storages of plain CUDA tensors and storages in obj, and
    of CPU ones that have bytes, searched through dicts, lists, tuples and
    modules (a state dict, a list of (name, tensor) pairs, a model), each
    once."""
    torch = torch_module()
    seen: set[int] = set()
    todo = [obj]
    visited = 0
    while todo and visited < _MAX_VISIT:
        o = todo.pop()
        visited += 1
        if isinstance(o, torch.Tensor):
            if plain_cuda(torch, o) or _plain_cpu(torch, o):
                s = o.untyped_storage()
                if id(s) not in seen:
                    seen.add(id(s))
                    yield s
        elif isinstance(o, torch.UntypedStorage):
            wanted = o.device.type == "cuda" or (o.device.type == "cpu" and o.nbytes() > 0)
            if wanted and id(o) not in seen:
                seen.add(id(o))
                yield o
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)
        elif isinstance(o, torch.nn.Module):  # q.put(model): its parameters and buffers
            todo.extend(o.parameters(recurse=False))
            todo.extend(o.buffers(recurse=False))
            todo.extend(o.children())


def _plain_cpu(torch, t) -> bool:
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_nested
            and not t.is_quantized and t.untyped_storage().nbytes() > 0)


# ------------------------------------------------------------ anchor lookup


def find_run(storage, b: Batch | None):
    """(its anchor, None) for a storage that has one; (None, Pending) for
    VMM memory that needs one; (None, None) for memory vmmipc does not hold.
    Asks the driver at most; registers nothing. Raises for VMM memory
    vmmipc cannot send."""
    run = b.run_of(storage) if b is not None else None
    if run is None:
        run = run_anchors.attached(storage)
        if run is not None and b is not None:
            b.remember(storage, run)
    if run is not None or (b is not None and b.known_not_vmm(storage)):
        return run, None
    return None, run_anchors.pending(storage)


def anchor_pending(storage, pending, b: Batch | None) -> RunAnchor:
    """Register pending's storage (a run of its own) and return its anchor."""
    run_anchors.plan([pending])
    run = run_anchors.attached(storage)
    if run is None:
        raise _errors.InternalError("vmmipc.torch: a storage was planned but has no anchor",
                                    _errors.EINTERNAL, "vmmipc.torch")
    if b is not None:
        b.remember(storage, run)
    return run


def run_anchor_of(storage, b: Batch | None) -> RunAnchor | None:
    """storage's run anchor (made now if it has none), or None if its memory
    is not CUDA VMM memory. Raises for VMM memory vmmipc cannot send."""
    run, pending = find_run(storage, b)
    return run if pending is None else anchor_pending(storage, pending, b)


# ---------------------------------------------------- one pickle, one batch


def dump_in_batch(pickler_dump, wrap=None, cpu_shared=None):
    """Wrap ForkingPickler.dump so that each pickle is one batch, planned
    from the object being pickled (vmmipc.torch's Reductions.dump). A
    pickle whose plan found VMM storages, or CPU storages when
    cpu_shared(where) says they cross through vmmipc, dumps wrap(obj,
    batch) instead (the receiver's hits then wait for its end and are
    confirmed together); the others are pickled as they are."""
    def dump(self, obj):
        with batch(obj) as b:
            if wrap is not None and (b.found_vmm or (b.found_cpu and cpu_shared is not None
                                                     and cpu_shared(b.where))):
                obj = wrap(obj, b)
            return pickler_dump(self, obj)
    dump.__wrapped__ = pickler_dump
    dump.__doc__ = pickler_dump.__doc__
    return dump

