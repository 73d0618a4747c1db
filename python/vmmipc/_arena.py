"""Arenas (vmmipc.h, "Arenas"): host memory that one process owns and
shares with the processes it starts, carved into blocks that go back and
forth by index, with no descriptor per block.

The owner (a DataLoader's main process) makes the arena before it starts
its workers: an unnamed memfd (nothing in /dev/shm; the memory goes when
the last process that maps it exits), mapped MAP_SHARED once, sparse (a
page costs memory only once touched). A child made by fork() inherits the
mapping; a child started by spawn or forkserver gets the descriptor once,
while it is started (multiprocessing's DupFd: passed to the new process by
the start method itself), maps it and closes it. The block calls are the
library's plain-C ones (_lib.call_fork_safe): a forked child has no Go
runtime, and needs none.

Who calls what: a writer (a worker) claims a region, allocates, fills and
sends blocks there; the owner receives (the block is then held) and frees.
This module knows nothing of torch; _torch_arena builds tensors on it.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import threading
import weakref

from . import _errors, _lib
from ._memfd import map_shared

REGIONS = 32                 # concurrent writers (DataLoader workers) per arena
SLOTS = 16384                # blocks per region, live or free
REGION_BYTES = 4 << 30       # address space per region; memory only as touched

_owned: "weakref.WeakValueDictionary[str, Arena]" = weakref.WeakValueDictionary()
_attached: dict[str, "Arena"] = {}  # in a writer: the arenas it mapped, by id


def _block(t: tuple) -> _lib.vmmipc_arena_block:
    return _lib.vmmipc_arena_block(*t)


def _tuple(b: _lib.vmmipc_arena_block) -> tuple:
    return (b.region, b.slot, b.generation, b.offset, b.nbytes)


class Arena:
    """An arena this process owns (Arena(...)) or maps as a writer (an
    Arena unpickled in a spawned child, or inherited through fork()).
    Blocks are tuples (region, slot, generation, offset, nbytes)."""

    def __init__(self, regions: int = REGIONS, slots: int = SLOTS,
                 region_bytes: int = REGION_BYTES):
        size = ctypes.c_uint64()
        _lib.call_fork_safe("vmmipc_arena_size", regions, slots, region_bytes,
                            ctypes.byref(size))
        fd = os.memfd_create("vmmipc-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size.value)
            self._map(fd, size.value)
        except BaseException:
            os.close(fd)
            raise
        _lib.call_fork_safe("vmmipc_arena_format", self.base, self.size, regions, slots,
                            region_bytes)
        self.fd = fd
        self.id = secrets.token_hex(8)
        self.owner_pid = os.getpid()
        _owned[self.id] = self

    def _map(self, fd: int, size: int) -> None:
        self.size = size
        self.mm = map_shared(
            fd, size, f"an arena (memory only as touched) of {size}",
            "; make a smaller one, e.g. vmmipc.torch.loader_options(arena=vmmipc.torch.Arena("
            "regions=N, region_bytes=B)): N workers at most, B the most a worker's live batches "
            "take", "vmmipc arena")
        self._anchor = ctypes.c_char.from_buffer(self.mm)  # pins the mapping: never unmapped
        self.base = ctypes.addressof(self._anchor)
        self.view = memoryview(self.mm)
        self._lock = threading.Lock()  # a region's single writer: one thread at a time
        self._region: int | None = None
        self._region_pid = 0

    def __del__(self):
        fd = getattr(self, "fd", -1)
        if fd >= 0 and getattr(self, "owner_pid", None) == os.getpid():
            self.fd = -1
            os.close(fd)

    # -------------------------------------------------------- crossing

    def __reduce__(self):
        from multiprocessing import context, reduction
        if context.get_spawning_popen() is None:
            raise TypeError("a vmmipc arena can only be handed to a process being started "
                            "(a DataLoader worker under spawn or forkserver: its collate_fn); "
                            "its blocks cross as plain data")
        return (_attach, (self.id, self.owner_pid, reduction.DupFd(self.fd), self.size))

    def owns(self) -> bool:
        return self.owner_pid == os.getpid()

    # ---------------------------------------------------------- writer

    def region(self) -> int | None:
        """This process's region, claimed on first use (given back when
        the process exits cleanly; else taken over after it died). None
        when every region has a live owner."""
        pid = os.getpid()
        if self._region_pid != pid:
            self._lock = threading.Lock()  # a forked child: the parent's may be held
            self._region, self._region_pid = None, pid
            r = ctypes.c_uint32()
            try:
                _lib.call_fork_safe("vmmipc_arena_claim", self.base, self.size, pid,
                                    ctypes.byref(r))
            except _errors.VmmipcMemoryError:
                return None
            self._region = r.value
            from multiprocessing import util
            util.Finalize(None, self._leave, exitpriority=0)
        return self._region

    def _leave(self) -> None:
        """Gives this process's region back (at a clean exit)."""
        with self._lock:
            region, self._region = self._region, None
            if region is not None and self._region_pid == os.getpid():
                try:
                    _lib.call_fork_safe("vmmipc_arena_leave", self.base, self.size, region,
                                        os.getpid())
                except _errors.VmmipcError:
                    pass  # taken over already

    def alloc(self, nbytes: int) -> tuple | None:
        """A WRITING block of nbytes in this process's region, or None if
        there is no region or no room (the caller falls back)."""
        region = self.region()
        if region is None:
            return None
        b = _lib.vmmipc_arena_block()
        with self._lock:
            try:
                _lib.call_fork_safe("vmmipc_arena_alloc", self.base, self.size, region, nbytes,
                                    ctypes.byref(b))
            except (_errors.VmmipcMemoryError, _errors.NotFoundError):
                return None  # no room, or the region is no longer ours (exiting)
        return _tuple(b)

    def send(self, block: tuple) -> bool:
        """WRITING -> SENT; False if this process no longer owns the
        region (it left: exiting)."""
        with self._lock:
            if self._region_pid != os.getpid() or self._region is None:
                return False
            _lib.call_fork_safe("vmmipc_arena_send", self.base, self.size,
                                ctypes.byref(_block(block)))
        return True

    def drop(self, block: tuple) -> bool:
        """Frees a block this writer never sent; False if it was sent."""
        with self._lock:
            try:
                _lib.call_fork_safe("vmmipc_arena_drop", self.base, self.size,
                                    ctypes.byref(_block(block)))
            except _errors.NotFoundError:
                return False
        return True

    # ----------------------------------------------------------- owner

    def receive(self, region: int, slot: int, generation: int) -> tuple:
        """The SENT block named, now HELD, with its offset and size from
        the table. NotFoundError if it is not sent in that generation."""
        b = _lib.vmmipc_arena_block(region, slot, generation, 0, 0)
        _lib.call_fork_safe("vmmipc_arena_receive", self.base, self.size, ctypes.byref(b))
        return _tuple(b)

    def free(self, block: tuple) -> None:
        _lib.call_fork_safe("vmmipc_arena_free", self.base, self.size,
                            ctypes.byref(_block(block)))

    def reap(self) -> int:
        """Gives back the regions of writers that died; how many."""
        n = ctypes.c_uint32()
        _lib.call_fork_safe("vmmipc_arena_reap", self.base, self.size, os.getpid(),
                            ctypes.byref(n))
        return n.value

    def info(self) -> dict:
        """The arena's counters (vmmipc_arena_info), after reaping the
        regions of dead writers."""
        self.reap()
        i = _lib.vmmipc_arena_info()
        _lib.call_fork_safe("vmmipc_arena_get_info", self.base, self.size, ctypes.byref(i),
                            ctypes.sizeof(i))
        return {name: getattr(i, name) for name, _ in i._fields_}


def _attach(arena_id: str, owner_pid: int, dupfd, size: int) -> Arena:
    """Unpickling side of an Arena, in a process being started: maps it
    (once per process) and closes the descriptor."""
    a = _owned.get(arena_id) or _attached.get(arena_id)
    if a is not None:
        return a
    fd = dupfd.detach()
    a = Arena.__new__(Arena)
    try:
        a._map(fd, size)
    finally:
        os.close(fd)
    a.fd = -1
    a.id = arena_id
    a.owner_pid = owner_pid
    _attached[arena_id] = a
    return a


def owned(arena_id: str) -> Arena | None:
    """The arena of that id if this process owns it."""
    a = _owned.get(arena_id)
    return a if a is not None and a.owns() else None
