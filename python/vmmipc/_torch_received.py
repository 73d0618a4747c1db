"""vmmipc.torch's receiver state: where received storages are mapped, the
runs mapped here and the storages over them, which tickets' uses this
process has spent, and which held tickets keep its storages safe. The
rebuilders (_torch_reductions) use it; it knows nothing of them, nor of the
sender.

A receiver maps each run anchor once (MappedRun, map_run) and makes every
storage a zero-copy view at its offset (storage_over: torch.as_tensor over
__cuda_array_interface__). Each ticket (one grant per anchor per pickle)
spends its use once, and holds it: the first storage of a run not mapped
here imports the run with it (vmmipc.import_stream(hold=True): streamed on
a miss, from the import cache on a hit); a ticket whose run is mapped here
already is a *hit*: its use is spent without receiving anything. A pickle
of a batch ends with finish_load, and its hits wait for it (LoadUses): all
of them are confirmed together, vmmipc.confirm_many(hold=True) (one short
session per exporter, held on this process's lease at the sender and
answered before it returns, no driver call), before the object reaches
its user. A storage reduced outside a batch is confirmed alone
(vmmipc.confirm(hold=True)). `spent` remembers which tickets have been,
and `confirming` which are being confirmed by another thread's load.

The lifetime rule (torch.multiprocessing's): the sender keeps every storage
of a grant alive, out of its allocator's reach, while this process holds
its ticket's use (the header's "Holds"). A received storage needs only its
newest ticket held: Holds counts, per ticket, the live storages whose
newest ticket it is, and lets go of the use (vmmipc.release, batched by the
library) when that count falls to zero: when those storages die, or a later
pickle of the same storages took over. This process's end lets go of
everything.

CPU storages sent through a sender's host arena (_torch_host) take the same
path with the target HOST: a chunk is imported onto the host once, and each
storage is torch.frombuffer over its range of the mapping.

A weak table of received storages, keyed by (anchor id, offset, size,
device), gives a storage that arrives again (another view, another send)
the same torch storage while any tensor over it lives. When the last storage
over a run dies, the device is synchronized (no kernel may still use the
memory) and the mapping reference dropped; the import cache may keep it
mapped for the next send.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import threading
import uuid
import weakref

from . import _args, _errors, _lib
from ._anchor import after_fork, reaper
from ._mapping import confirm_many, import_stream, release
from ._ticket import Ticket
from ._torch_env import torch_module

log = logging.getLogger("vmmipc")

HOST = "cpu"  # the target of CPU storages (host memory), where others name a device
_receive_device: int | None = None
_local = threading.local()  # open_tensors' device, for its thread only


def check_device(device, where: str) -> int | None:
    if device is None:
        return None
    return _args.integer(device, "device", 0, _args.I32_MAX, where)


def set_receive_device(device: int | None) -> None:
    global _receive_device
    _receive_device = check_device(device, "vmmipc.torch.set_receive_device")


@contextlib.contextmanager
def receiving_on(device: int | None, where: str):
    """What this thread unpickles inside maps onto device (an ordinal;
    None: as set_receive_device says), for open_tensors."""
    saved = getattr(_local, "device", None)
    _local.device = (check_device(device, where),) if device is not None else saved
    try:
        yield
    finally:
        _local.device = saved


def receive_device() -> int | None:
    """Where this thread maps what it unpickles now: None = the exporter's
    GPU."""
    override = getattr(_local, "device", None)
    return _receive_device if override is None else override[0]


class MappedRun:
    """One Mapping of a run, shared by the storages over it: each holds it
    (through its _Region); after the last one dies, the device is
    synchronized and the mapping reference dropped."""

    def __init__(self, mapping):
        self.mapping = mapping
        finalizer = weakref.finalize(self, _drop_mapping, mapping)
        finalizer.atexit = False  # at exit nothing is unmapped under live tensors


def _drop_mapping(mapping) -> None:
    if mapping.is_host:
        # Nothing to wait for; the reference goes with the Mapping, right
        # after this (close() would look for memoryviews of it with
        # gc.get_referrers, milliseconds each, and none was made).
        return
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

    def __init__(self, run: MappedRun, offset: int, nbytes: int):
        self.run = run
        self.addr = run.mapping.addr + offset
        self.nbytes = nbytes

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.addr, False),
                "strides": None, "version": 3}


class WeakTable:
    """A thread-safe WeakValueDictionary whose add keeps the first value."""

    def __init__(self):  # also after fork, in place
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

    def values(self) -> list:
        with self._lock:
            return list(self._values.values())


class SpentTickets:
    """Tickets whose use this process has spent (imported or confirmed),
    and the events it has waited on for them: each at most once. Bounded:
    the oldest are forgotten (a ticket is one use, so seeing it again means
    the same pickle loaded again). Holds remembers the tickets it let go
    of in one too."""

    LIMIT = 1 << 16

    def __init__(self):  # also after fork, in place
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict = collections.OrderedDict()

    def add(self, ticket) -> bool:
        """True if ticket's use was not spent here before (and is now
        marked)."""
        with self._lock:
            if ticket in self._seen:
                return False
            self._seen[ticket] = True
            if len(self._seen) > self.LIMIT:
                self._seen.popitem(last=False)
            return True

    def forget(self, ticket) -> None:
        with self._lock:
            self._seen.pop(ticket, None)

    def __contains__(self, ticket) -> bool:
        with self._lock:
            return ticket in self._seen


class Holds:
    """Which held ticket keeps each received storage safe, and how many live
    storages each held ticket keeps: its use is let go of when none is
    left. A storage's newest ticket takes over from its older one (the
    sender keeps the same memory for both: within a live anchor, one offset
    and size is one storage of the sender's). A ticket let go of covers
    nothing again (its pickle loaded again): NotFoundError. A use one of
    whose storages died is let go of only after the storage's device is
    synchronized (kernels queued on the storage may still use it; torch's
    own receiver synchronizes as well)."""

    def __init__(self):  # also after fork, in place
        self._lock = threading.Lock()
        self._count: dict = {}  # ticket -> live storages whose newest ticket it is
        self._of: dict = {}     # id(storage) -> its cell: [newest ticket, weakref to it]
        self._gone = SpentTickets()  # tickets let go of (the newest of them)
        self._dead: dict = {}   # ticket -> the device of a storage of it that died

    def attach(self, storage, ticket, device: int | None = None) -> None:
        """storage (on CUDA device `device`) is (also) covered by ticket,
        whose use this process holds. Called for every storage of every
        load: one lock, and a finalizer only for a storage seen the first
        time."""
        key, new_cell = id(storage), None
        with self._lock:
            if ticket in self._gone:
                raise _errors.NotFoundError(
                    "vmmipc.torch: this pickle's tensors were received here before and let go "
                    "of, which ended its grant: a pickle is loaded once; have the sender send "
                    "the tensors again", _errors.ENOENT, "vmmipc.torch")
            cell = self._of.get(key)
            if cell is None or cell[1]() is not storage:
                cell = new_cell = [None, weakref.ref(storage), device]
                self._of[key] = cell
            old, cell[0] = cell[0], ticket
            if old == ticket:
                return
            self._count[ticket] = self._count.get(ticket, 0) + 1
            gone, sync = (False, None) if old is None else self._uncount(old)
        if new_cell is not None:
            weakref.finalize(storage, self._storage_died, key, new_cell).atexit = False
        if gone:
            _let_go(old, sync)

    def _storage_died(self, key, cell, wait: bool = False) -> None:
        # A finalizer: it runs where the storage died, also in a garbage
        # collection started inside attach on this thread, self._lock held
        # (a storage only a reference cycle kept). Waiting there would
        # deadlock: the reaper waits for the lock instead.
        if not self._lock.acquire(blocking=wait):
            reaper.submit(self._storage_died, key, cell, True)
            return
        try:
            if self._of.get(key) is cell:
                del self._of[key]
            ticket, cell[0] = cell[0], None
            gone, sync = False, None
            if ticket is not None:
                if cell[2] is not None:
                    self._dead.setdefault(ticket, cell[2])
                gone, sync = self._uncount(ticket)
        finally:
            self._lock.release()
        if gone:
            _let_go(ticket, sync)

    def _uncount(self, ticket) -> tuple[bool, int | None]:
        """One storage fewer for ticket (self._lock held): (True, the device
        to synchronize first, or None) when none is left, and its use is to
        be let go of; else (False, None)."""
        n = self._count.get(ticket, 0) - 1
        if n > 0:
            self._count[ticket] = n
            return False, None
        self._count.pop(ticket, None)
        self._gone.add(ticket)
        return True, self._dead.pop(ticket, None)

    def let_go(self, ticket) -> None:
        """Let go of a use held for no storage: a load that failed after
        its import had spent (and held) it."""
        self._gone.add(ticket)
        _release_quietly(ticket)

    def held(self) -> int:
        """Tickets whose use this process holds for live storages (for
        tests)."""
        with self._lock:
            return len(self._count)


def _let_go(ticket, sync: int | None) -> None:
    """Let go of ticket's use, after synchronizing device sync (not None:
    a storage of it died, and work queued on it must be done before the
    sender may reuse its memory)."""
    if sync is not None:
        try:
            torch_module().cuda.synchronize(sync)
        except Exception:  # noqa: BLE001 - a finalizer: the use is let go of all the same
            log.exception("vmmipc.torch: could not synchronize cuda:%d before letting the "
                          "sender reuse a received storage's memory", sync)
    _release_quietly(ticket)


def _release_quietly(ticket) -> None:
    try:
        release(ticket)  # queued: a library thread tells the sender
    except _errors.VmmipcError:
        pass  # not held (an old sender's grant), or its sender has gone: nothing held


class Confirming:
    """Tickets a load is confirming now, and what came of it: a ticket is
    spent by one load (the first to mark it in `spent`); another thread's
    load of the same pickle waits here for that load's answer instead of
    believing a hold not granted yet. A load publishes its answers before
    it waits on anybody else's, so two loads never wait on each other."""

    def __init__(self):  # also after fork, in place
        self._lock = threading.Lock()
        self._flight: dict = {}  # ticket -> [threading.Event, the error or None]

    def claim(self, tickets, spent_tickets: SpentTickets) -> list:
        """The tickets whose use was not spent here before, marked spent
        and in flight (in one step, so that a load that finds one spent
        finds it in flight too until its answer came)."""
        with self._lock:
            owned = [t for t in tickets if spent_tickets.add(t)]
            for t in owned:
                self._flight[t] = [threading.Event(), None]
            return owned

    def done(self, tickets, errors) -> None:
        with self._lock:
            entries = [self._flight.pop(t, None) for t in tickets]
        for entry, error in zip(entries, errors):
            if entry is not None:
                entry[1] = error
                entry[0].set()

    def wait(self, ticket):
        """None once ticket's use is held here (or was never in flight),
        else the error its load got."""
        with self._lock:
            entry = self._flight.get(ticket)
        if entry is None:
            return None
        entry[0].wait()
        return entry[1]


mapped_runs = WeakTable()  # (anchor id, target) -> MappedRun
received = WeakTable()     # (anchor id, offset, nbytes, target) -> torch storage
spent = SpentTickets()
holds = Holds()
confirming = Confirming()


def _reset_after_fork() -> None:
    # Other modules hold these objects under their own names: each starts
    # afresh in place.
    for table in (mapped_runs, received, spent, holds, confirming):
        table.__init__()


after_fork(_reset_after_fork)


def received_storages() -> int:
    """Storages received and still alive here (for tests)."""
    return len(received)


def storage_over(torch, run: MappedRun, offset: int, nbytes: int):
    """A torch storage over [offset, offset + nbytes) of a mapped run, zero
    copy; it holds the run until it is freed. InvalidError for a range
    outside the run (the pickle says where: a blob may come from anywhere)."""
    size = run.mapping.size
    if not (isinstance(offset, int) and isinstance(nbytes, int)
            and 0 <= offset and 0 < nbytes <= size - offset):
        raise _errors.InvalidError(
            f"vmmipc.torch: a received storage of {nbytes!r} bytes at offset {offset!r} lies "
            f"outside its run of {size} bytes: the pickle is damaged or not from vmmipc.torch",
            _errors.EINVAL, "vmmipc.torch")
    if run.mapping.is_host:
        # A CPU storage: torch.frombuffer over a ctypes array of the range,
        # which holds the run (frombuffer keeps the array).
        memory = (ctypes.c_char * nbytes).from_address(run.mapping.addr + offset)
        memory.run = run
        return torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()
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


def received_on_host(storage) -> bool:
    """Whether a CPU storage lies in host memory this process received
    through vmmipc.torch (a chunk of another process's host arena)."""
    ptr = storage.data_ptr()
    return any(r.mapping.is_host and r.mapping.addr <= ptr < r.mapping.addr + r.mapping.size
               for r in mapped_runs.values())


def map_run(torch, ticket, anchor_id, target) -> tuple[MappedRun, bool]:
    """The run's mapping here (target HOST: a chunk of a sender's host
    arena), and whether getting it spent ticket's use."""
    key = (anchor_id, target)
    run = mapped_runs.get(key)
    if run is not None:
        return run, False
    device = {None: _lib.DEVICE_SAME, HOST: _lib.DEVICE_HOST}.get(target, target)
    # A miss streams the run with this ticket; a hit (the import cache kept
    # the run mapped) spends it in one short session. Either way the use is
    # held, on this process's lease at the sender.
    mapping = import_stream(ticket, device, hold=True)
    made = MappedRun(mapping)
    run = mapped_runs.add(key, made)
    if run is not made:  # another thread mapped it first: ours goes
        mapping.close()
    return run, True


def wait_event(storage, ticket, exporter_device, event_handle, target) -> None:
    """Make this thread's current stream wait on the sender's event."""
    torch = torch_module()
    event_device = (storage.device.index if target is None
                    else _ordinal_of_exporter(torch, ticket, exporter_device))
    try:
        event = torch.cuda.Event.from_ipc_handle(event_device, event_handle)
    except RuntimeError as e:
        raise RuntimeError(
            f"cannot open the sender's CUDA event ({e}): CUDA keeps interprocess events in "
            "/dev/shm, which this process does not share with the sender (another pod or "
            "container). Have the sender call vmmipc.torch.set_ordering('sync') (the default "
            "when VMMIPC_SOCKET_DIR is set), or share /dev/shm (--ipc=host, one pod)") from e
    torch.cuda.current_stream(storage.device).wait_event(event)


# ------------------------------------------------ one load's hits, together


class LoadUses:
    """The hits of one load of a batch's pickle: tickets whose run is mapped
    here already, with their storages, waiting for finish_load to spend
    them together. The sender's pickle names one mark that unpickles to
    this class, and the unpickler's memo makes one object of it per load:
    two threads loading one pickle, or one pickle loaded twice, never share
    one. A load that fails before finish_load spent nothing and holds
    nothing (its storages die with it)."""

    __slots__ = ("_hits", "_finished")

    def __init__(self):
        self._hits: dict = {}  # ticket -> [exporter device, event, target, [(storage, device)]]
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def defer(self, ticket, storage, exporter_device, event_handle, target) -> bool:
        """Keep storage for finish (True), or False once finished (a
        storage unpickled after finish_load ran: it is confirmed alone)."""
        if self._finished:
            return False
        entry = self._hits.get(ticket)
        if entry is None:
            entry = self._hits[ticket] = [exporter_device, event_handle, target, []]
        entry[3].append((storage, storage.device.index))
        return True

    def finish(self) -> None:
        """Spend this load's hits with one confirm_many (one session per
        exporter), wait on their events, and attach the storages to their
        held tickets. On a refusal let go of every use this load held and
        raise the error confirm would have raised: nothing stays held or
        pending."""
        hits, self._hits, self._finished = self._hits, {}, True
        if not hits:
            return
        owned = confirming.claim(hits, spent)  # the others: spent before, or in flight
        errors: list = [None] * len(owned)
        try:
            if owned:
                errors = confirm_many(owned, hold=True)
        except BaseException as e:  # raised only for bad arguments: nothing was spent
            errors = [e] * len(owned)
        finally:
            for t, error in zip(owned, errors):
                if error is not None:
                    spent.forget(t)
            confirming.done(owned, errors)
        held = {t for t, error in zip(owned, errors) if error is None}
        try:
            for error in errors:
                if error is not None:
                    raise error
            for t in held:
                exporter_device, event_handle, target, storages = hits[t]
                if event_handle is not None:  # None: the sender synchronized instead
                    wait_event(storages[0][0], t, exporter_device, event_handle, target)
            for t in hits:
                if t not in held:
                    error = confirming.wait(t)
                    if error is not None:
                        raise error
                    for storage, device in hits[t][3]:  # NotFoundError: let go of before
                        holds.attach(storage, t, device)
        except BaseException:
            for t in held:  # spent and held, and no storage will let go of it
                holds.let_go(t)
            raise
        for t in held:
            for storage, device in hits[t][3]:
                holds.attach(storage, t, device)


def finish_load(obj, load):
    """The last call of a batch's pickle, after every storage was rebuilt:
    spend the load's hits together (LoadUses.finish) and return obj."""
    if not isinstance(load, LoadUses):
        raise _errors.InvalidError(
            f"vmmipc.torch: a pickle's finish names a {type(load).__name__}, not the load it "
            "began: the pickle is damaged or not from vmmipc.torch", _errors.EINVAL,
            "vmmipc.torch")
    load.finish()
    return obj
