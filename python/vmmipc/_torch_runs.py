"""The sender's run anchors: one anchor for each contiguous run of mapped
chunks under the storages sent together, shared by every storage in it.

A storage lies in one or more chunks of an allocator segment (an expandable
segment maps 20 MiB chunks for large tensors, 2 MiB ones for small;
neighbouring storages share chunks). vmmipc.cuda_query_range gives a
storage's *covering range* on chunk boundaries. plan() takes the storages of
one pickle (or one share_tensors call) that have no anchor yet, merges their
covering ranges where they overlap or touch into runs, and registers each
run once (vmmipc.share, uses=0: the library retains every chunk). A receiver
maps a run once and every tensor is a view at its offset; the chunks mapped
are those under the storages sent, plus nothing else.

When an anchor may serve a storage: only while every chunk under the
storage is still the anchor's physical allocation. torch unmaps a chunk
only when it is wholly free (empty_cache, or trimming) and may map a new one
at the same address, so the rule is kept by *pinning*: a storage attached to
an anchor (alive, at the same address and size) pins the chunks under its
covering range, which are therefore still the anchor's. A storage without
an anchor joins a live one only if live attached storages pin every chunk
under it; otherwise it gets a new anchor, which may overlap old ones (a
tensor across two runs, a segment that grew: correct, at the cost of
mapping the shared chunks twice). An anchor with a chunk no longer pinned
(a storage of it died or moved) is retired as soon as that is noticed (the
storage's finalizer, or the next lookup of a moved one): its chunks may be
unmapped and replaced, and it should not keep memory the allocator gave
back; a lookup never serves a storage from a chunk nobody pins. Grants
made from it stay valid (the library keeps the chunks), and receivers'
mappings hold their own references.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import threading
import weakref

from . import _errors
from ._anchor import Anchor, after_fork, reaper
from ._cuda import cuda_query_range
from ._register import share
from ._torch_env import POSIX_FD_HANDLE, handle_type_names

log = logging.getLogger("vmmipc")


def _new_token() -> bytes:
    """Random and new in every process (also in children of a forkserver,
    which share the module state of the process they were forked from), so
    that anchor ids of two senders never collide in a receiver."""
    return os.urandom(16)


_token = [_new_token()]
after_fork(lambda: _token.__setitem__(0, _new_token()))


class User:
    """A storage attached to an anchor, where it was when it was attached,
    and the chunks it pins [lo, hi)."""
    __slots__ = ("ref", "ptr", "nbytes", "lo", "hi", "finalizer")

    def __init__(self, storage, lo: int, hi: int):
        self.ref = weakref.ref(storage)
        self.ptr = storage.data_ptr()
        self.nbytes = storage.nbytes()
        self.lo, self.hi = lo, hi
        self.finalizer = None  # tells RunAnchors when the storage dies; detached when it leaves

    def unchanged(self, storage) -> bool:
        return storage.data_ptr() == self.ptr and storage.nbytes() == self.nbytes

    def pins(self) -> bool:
        """Alive where it was: the chunks under it are still the anchor's."""
        storage = self.ref()
        return storage is not None and self.unchanged(storage)


class RunAnchor:
    """The anchor of one run of chunks [base, base + size) on one device."""
    __slots__ = ("anchor", "device", "base", "size", "id", "users")

    def __init__(self, anchor: Anchor, device: int, base: int, size: int, serial: int):
        self.anchor = anchor
        self.device = device
        self.base, self.size = base, size
        self.id = (_token[0], serial)  # one object: pickled once per pickle
        self.users: dict[int, User] = {}

    @property
    def retired(self) -> bool:
        return self.anchor.retired

    def pinned_spans(self) -> list[tuple[int, int]]:
        """The chunks live users pin, as sorted disjoint [lo, hi) spans."""
        spans = sorted((u.lo, u.hi) for u in self.users.values() if u.pins())
        merged: list[list[int]] = []
        for lo, hi in spans:
            if merged and lo <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        return [(lo, hi) for lo, hi in merged]

    def fully_pinned(self) -> bool:
        return self.pinned_spans() == [(self.base, self.base + self.size)]


def _covers(spans: list[tuple[int, int]], lo: int, hi: int) -> bool:
    i = bisect.bisect_right(spans, (lo, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= lo and hi <= spans[i][1]


class Pending:
    """A storage that needs an anchor, and its covering range."""
    __slots__ = ("storage", "range")

    def __init__(self, storage, rng):
        self.storage, self.range = storage, rng


class RunAnchors:
    """This process's run anchors, by storage."""

    def __init__(self):
        self._lock = threading.Lock()  # never held across a vmmipc call
        self._by_storage: dict[int, RunAnchor] = {}
        self._live: list[RunAnchor] = []
        self._serials = itertools.count(1)
        after_fork(self._forget_all)

    def attached(self, storage) -> RunAnchor | None:
        """storage's anchor if it has a live one and is where it was when
        attached (no driver call)."""
        sid = id(storage)
        with self._lock:
            run = self._by_storage.get(sid)
            if run is None:
                return None
            user = run.users.get(sid)
            if user is not None and user.ref() is storage:
                if not run.retired and user.unchanged(storage):
                    return run
                self._detach(run, sid)  # resized, or its anchor ended
            return None

    def pending(self, storage) -> Pending | None:
        """What plan() needs for a storage without an anchor; None if its
        memory is not CUDA VMM memory (cudaMalloc, empty). Raises if it is VMM
        memory vmmipc cannot send (no POSIX-fd export)."""
        if storage.device.type != "cuda" or storage.nbytes() == 0:
            return None
        try:
            rng = cuda_query_range(storage.data_ptr(), storage.nbytes())
        except _errors.NotFoundError:
            return None
        if not rng.handle_types & POSIX_FD_HANDLE:
            raise no_posix_fd(storage, rng.handle_types)
        return Pending(storage, rng)

    def plan(self, pending: list[Pending]) -> None:
        """Attach each pending storage to an anchor: a live one that pins its
        chunks, or one new anchor per run of their merged covering ranges.
        A run that cannot be registered whole is registered storage by
        storage (so that the error, if any, names one storage)."""
        rest = self._attach_pinned(pending)
        for group in _groups(rest):
            if len(group) > 1:
                try:
                    self._anchor(group)
                    continue
                except _errors.VmmipcError as e:
                    log.debug("vmmipc.torch: a run of %d storages could not be registered "
                              "whole (%s); registering them one by one", len(group), e)
            for p in group:
                self._anchor([p])

    def _attach_pinned(self, pending: list[Pending]) -> list[Pending]:
        """Attach what live anchors pin; return the others."""
        rest = []
        with self._lock:
            spans = {}
            for p in pending:
                r = p.range
                for run in self._live:
                    if (run.device != r.device or r.base < run.base
                            or r.base + r.size > run.base + run.size):
                        continue
                    if run not in spans:
                        spans[run] = run.pinned_spans()
                    if _covers(spans[run], r.base, r.base + r.size):
                        self._attach(run, p)
                        break
                else:
                    rest.append(p)
        return rest

    def _anchor(self, group: list[Pending]) -> RunAnchor:
        """Register one run, group's merged covering ranges, and attach
        group to its new anchor."""
        lo = min(p.range.base for p in group)
        hi = max(p.range.base + p.range.size for p in group)
        device = group[0].range.device
        made = RunAnchor(Anchor(share(lo, hi - lo, uses=0)), device, lo, hi - lo,
                         next(self._serials))
        with self._lock:
            for p in group:
                self._attach(made, p)
            if made.fully_pinned():
                self._live.append(made)
            else:  # storages found another anchor meanwhile: none may hold what it does not pin
                self._retire(made)
        return made

    def _attach(self, run: RunAnchor, p: Pending) -> None:
        """Lock held. A storage attached elsewhere keeps that anchor."""
        storage = p.storage
        sid = id(storage)
        current = self._by_storage.get(sid)
        if current is not None and not current.retired:
            user = current.users.get(sid)
            if user is not None and user.ref() is storage and user.unchanged(storage):
                return
            self._detach(current, sid)
        user = User(storage, p.range.base, p.range.base + p.range.size)
        user.finalizer = weakref.finalize(storage, _storage_freed, self, sid)
        user.finalizer.atexit = False  # at exit the process's end unregisters all
        run.users[sid] = user
        self._by_storage[sid] = run

    def _detach(self, run: RunAnchor, sid: int) -> None:
        """Lock held."""
        user = run.users.pop(sid, None)
        if user is not None:
            user.finalizer.detach()
        if self._by_storage.get(sid) is run:
            del self._by_storage[sid]
        if not run.retired and not run.fully_pinned():
            self._retire(run)

    def _retire(self, run: RunAnchor) -> None:
        """Lock held."""
        run.anchor.retire()  # on the reaper
        if run in self._live:
            self._live.remove(run)
        for sid, user in run.users.items():
            user.finalizer.detach()
            if self._by_storage.get(sid) is run:
                del self._by_storage[sid]
        run.users.clear()

    def retire(self, run: RunAnchor) -> None:
        """Retire run, whose anchor registration ended outside RunAnchors (a
        grant of it was refused): its storages get a new anchor when next planned."""
        with self._lock:
            self._retire(run)

    def storage_freed(self, sid: int) -> None:
        """On the reaper: a storage that used an anchor has died."""
        with self._lock:
            run = self._by_storage.get(sid)
            if run is None:
                return
            user = run.users.get(sid)
            if user is not None and user.ref() is None:  # not a new storage at that id
                self._detach(run, sid)

    def _forget_all(self) -> None:
        """After fork: the parent's anchors are not this process's (their
        retire() only marks them)."""
        self._lock = threading.Lock()
        for run in self._live:
            run.anchor.retire()
        self._by_storage.clear()
        self._live.clear()

    def live(self) -> int:
        """Anchors not retired (for tests)."""
        with self._lock:
            return len(self._live)


def _storage_freed(anchors: RunAnchors, sid: int) -> None:
    # A weakref.finalize callback: runs wherever the storage died.
    reaper.submit(anchors.storage_freed, sid)


def _groups(pending: list[Pending]) -> list[list[Pending]]:
    """Group storages into runs, one group each: same device, covering
    ranges that overlap or touch."""
    out: list[list[Pending]] = []
    end = 0
    for p in sorted(pending, key=lambda p: (p.range.device, p.range.base)):
        r = p.range
        if out and r.device == out[-1][0].range.device and r.base <= end:
            out[-1].append(p)
            end = max(end, r.base + r.size)
        else:
            out.append([p])
            end = r.base + r.size
    return out


def no_posix_fd(storage, handle_types: int) -> Exception:
    return _errors.InvalidError(
        f"cannot send this CUDA storage (cuda:{storage.device.index}, {storage.nbytes()} bytes "
        f"at {storage.data_ptr():#x}) through vmmipc: its VMM memory allows export as "
        f"{handle_type_names(handle_types)} only, and vmmipc needs "
        "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR. Allocate it with POSIX-fd export (what "
        "PyTorch's expandable segments request by default), or with expandable segments off "
        "(torch's own CUDA IPC then shares it)", _errors.EINVAL, "vmmipc.torch")


run_anchors = RunAnchors()
