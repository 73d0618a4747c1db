"""CPU storages between any processes (vmmipc.torch's default for CPU
tensors outside a DataLoader's workers): the sender's host arena, and the
choice between it and torch's own reducer (set_mode).

A CPU storage pickled through vmmipc.torch is moved into a block of this
process's host arena the way torch's share_memory_() moves one into shm:
its bytes are copied once into the block and the storage's data pointer is
swapped to the block (UntypedStorage._swap_data_ptr_, what share_memory_
does in C++), so every view of it here uses the shared memory from then on
and a receiver's writes are seen here. A storage already in a block is not
copied again.

The arena is a few chunks, each one memfd sealed against shrinking and
growing (CHUNK_BYTES, or one storage's size rounded up to pages when that
is larger), mapped once and registered once as an anchor
(register_host_file, unlimited uses). The library keeps its own duplicate
of the memfd; this process closes its own. A pickle makes one grant per
chunk (the batch's: register_again, uses=1, hold=True), which keeps every
storage of it in that pickle alive until the receiver has let go of what it
rebuilt from it, or has died. A block's memory is a ctypes array that the
storage holds (torch.frombuffer), through the swap; the array's finalizer
frees the block. So a block goes back to its chunk only once this
process's storage is gone and no grant keeps it: every receiver let go or
died. A chunk wholly free, other than the first of the standard size, is
given back (its anchor ends; receivers' mappings stay valid).

Why not export/arena.c's allocator (_arena.Arena): its blocks go one way, a
worker's to the process that owns the memfd, through a table in the shared
memory that both move by compare-and-swap. Here the sender owns the memory,
its receivers never touch a table, and a block's end is known in this
process only (the grant's release, the storage's death), so a Python
allocator under one lock is all it needs. register_host_file also needs a
memfd sealed against shrinking, which an Arena's is not (it is made before
its size is known to the library, for processes that cannot call Go).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import mmap
import os
import secrets
import sys
import threading
import warnings
import weakref

from . import _errors, _lib
from ._anchor import Anchor, after_fork, reaper
from ._memfd import new_memfd
from ._register import register_host_file
from ._torch_env import torch_module

CHUNK_BYTES = 64 << 20  # a chunk's size: one anchor, one mapping per receiver
ALIGN = 64              # a block's alignment (torch's CPU allocator's)
PAGE = mmap.PAGESIZE

MODES = ("vmmipc", "torch")
MODE_ENV = "VMMIPC_TORCH_CPU_SHARING"  # the mode a process starts with (children inherit it)
_warned: set = set()


def _initial_mode() -> str:
    value = os.environ.get(MODE_ENV, "vmmipc")
    if value in MODES:
        return value
    warnings.warn(f"vmmipc.torch: {MODE_ENV}={value!r} is none of {', '.join(MODES)}; "
                  "using 'vmmipc'", RuntimeWarning, stacklevel=2)
    return "vmmipc"


_mode = [_initial_mode()]


def set_mode(mode: str) -> None:
    _mode[0] = mode


def mode() -> str:
    return _mode[0]


def wanted(where) -> bool:
    """Whether a CPU storage pickled now crosses through the host arena:
    mode "vmmipc", a pickle not bound for a forked child (where, from
    _mp.fork_destination: such a child could not import it), a process
    that can run the library (not a child forked after its parent loaded
    it), and a torch that can move a storage in place. Otherwise torch's
    own reducer takes it, as without vmmipc (warned once when the library
    cannot be loaded)."""
    if _mode[0] != "vmmipc" or where is not None or not _lib.usable():
        return False
    if not can_move_in_place():
        _warn_once("swap", f"torch {torch_module().__version__} cannot move a storage's data "
                   "in place (UntypedStorage._swap_data_ptr_, torch 2.12 and later)")
        return False
    try:
        _lib.lib("vmmipc.torch")
    except _errors.LibraryNotFoundError as e:
        _warn_once("lib", f"libvmmipc cannot be loaded ({e})")
        return False
    return True


def can_move_in_place() -> bool:
    """Whether this torch can swap a storage's data pointer (torch 2.12 and
    later): without it a storage cannot be moved into a block with every view
    following, so CPU tensors outside a DataLoader take torch's own way."""
    return callable(getattr(torch_module().UntypedStorage, "_swap_data_ptr_", None))


def _warn_once(reason: str, why: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"vmmipc.torch: {why}; CPU tensors go through torch's own sharing",
                      RuntimeWarning, stacklevel=4)


_token = [secrets.token_bytes(8)]  # this process's: chunk ids never meet another's


class Chunk:
    """One registered memfd [0, size), mapped here at base, and its free
    extents (sorted, disjoint, coalesced)."""
    __slots__ = ("anchor", "id", "base", "size", "free", "live", "_mm", "_pin")

    def __init__(self, size: int, serial: int):
        fd = new_memfd("vmmipc-torch-cpu", size, "vmmipc.torch CPU arena")
        try:
            kw = {"trackfd": False} if sys.version_info >= (3, 13) else {}
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, **kw)
            try:
                ticket = register_host_file(fd, size, size, uses=0)
            except BaseException:
                mm.close()
                raise
        finally:
            os.close(fd)  # the library has its own duplicate
        self._mm = mm
        self._pin = ctypes.c_char.from_buffer(mm)  # unmapped when the chunk goes
        self.base = ctypes.addressof(self._pin)
        self.size = size
        self.anchor = Anchor(ticket)
        self.id = (_token[0], serial)
        self.free: list[tuple[int, int]] = [(0, size)]
        self.live = 0

    def take(self, size: int) -> int | None:
        """The offset of `size` bytes taken from the first extent that fits."""
        for i, (off, n) in enumerate(self.free):
            if n >= size:
                if n == size:
                    del self.free[i]
                else:
                    self.free[i] = (off + size, n - size)
                self.live += 1
                return off
        return None

    def give(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self.free, (off, 0))
        lo, hi = off, off + size
        if i < len(self.free) and self.free[i][0] == hi:  # the extent after
            hi += self.free.pop(i)[1]
        if i > 0 and sum(self.free[i - 1]) == lo:  # the extent before
            lo = self.free[i - 1][0]
            i -= 1
            self.free.pop(i)
        self.free.insert(i, (lo, hi - lo))
        self.live -= 1


class _Block:
    __slots__ = ("chunk", "offset", "nbytes")

    def __init__(self, chunk: Chunk, offset: int, nbytes: int):
        self.chunk, self.offset, self.nbytes = chunk, offset, nbytes


class HostArena:
    """This process's host arena: chunks, and its live blocks by address."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):  # also after fork, in place
        self._lock = threading.Lock()
        self._serial = itertools.count()
        self.chunk_bytes = chunk_bytes
        self.chunks: list[Chunk] = []
        self.blocks: dict[int, _Block] = {}  # the address of a live block -> it

    def share(self, storage, move: bool) -> tuple:
        """(chunk, offset, the storage a grant keeps) for a CPU storage of
        nbytes > 0: its own block if it is in one; else a new block with its
        bytes, where the storage itself is moved (move=True: torch's
        share_memory_()), or a new storage over it is what crosses (move=False:
        a storage this process received, which must keep sharing with its
        own sender)."""
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
        with self._lock:
            found = self.blocks.get(ptr)
        if found is not None and found.nbytes == nbytes:
            return found.chunk, found.offset, storage
        torch = torch_module()
        new = self._new_storage(torch, nbytes)
        new.copy_(storage)
        block = self.blocks[new.data_ptr()]
        if not move:
            return block.chunk, block.offset, new
        storage._swap_data_ptr_(new)  # new now holds the old memory, and frees it
        return block.chunk, block.offset, storage

    def _new_storage(self, torch, nbytes: int):
        size = -(-nbytes // ALIGN) * ALIGN
        chunk, off = self._alloc(size)
        block = _Block(chunk, off, nbytes)
        try:
            memory = (ctypes.c_char * nbytes).from_address(chunk.base + off)
            memory.chunk = chunk  # the chunk stays mapped while a block of it lives
            weakref.finalize(memory, self._free, block, size).atexit = False
        except BaseException:
            self._free(block, size)
            raise
        with self._lock:
            self.blocks[chunk.base + off] = block
        return torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()

    def _alloc(self, size: int) -> tuple[Chunk, int]:
        with self._lock:
            for c in self.chunks:
                off = c.take(size)
                if off is not None:
                    return c, off
        chunk = Chunk(max(self.chunk_bytes, -(-size // PAGE) * PAGE), next(self._serial))
        with self._lock:
            self.chunks.append(chunk)
            return chunk, chunk.take(size)

    def _free(self, block: _Block, size: int, wait: bool = False) -> None:
        # A finalizer: it runs where the block's storage died, also inside a
        # garbage collection on a thread that holds the lock; the reaper
        # waits for it then.
        if not self._lock.acquire(blocking=wait):
            reaper.submit(self._free, block, size, True)
            return
        try:
            chunk = block.chunk
            addr = chunk.base + block.offset
            if self.blocks.get(addr) is block:
                del self.blocks[addr]
            chunk.give(block.offset, size)
            gone = chunk.live == 0 and chunk in self.chunks and not self._keeps(chunk)
            if gone:
                self.chunks.remove(chunk)
        finally:
            self._lock.release()
        if gone:
            chunk.anchor.retire()  # on the reaper; receivers' mappings stay valid

    def _keeps(self, chunk: Chunk) -> bool:
        """Whether a wholly free chunk stays (self._lock held): the first
        one of the standard size does, for the next sends; a larger one
        (one storage's) and further ones go."""
        return next((c for c in self.chunks if c.size == self.chunk_bytes), None) is chunk

    def info(self) -> dict:
        with self._lock:
            return {"chunks": len(self.chunks),
                    "chunk_bytes": sum(c.size for c in self.chunks),
                    "blocks_live": len(self.blocks),
                    "bytes_live": sum(b.nbytes for b in self.blocks.values())}


host_arena = HostArena()


def _reset_after_fork() -> None:
    # A forked child's chunks are its parent's registrations: it starts
    # afresh (its inherited blocks free into the old object, harmlessly).
    _token[0] = secrets.token_bytes(8)
    host_arena.__init__(host_arena.chunk_bytes)


after_fork(_reset_after_fork)
