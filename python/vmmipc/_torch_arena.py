"""CPU tensors through an arena (_arena): a DataLoader's batches built in
blocks of memory its main process owns, and sent as plain data.

The writer's side (a DataLoader worker, once its Collate has run): a batch's
tensors are stacked straight into a block of the worker's region
(new_tensor); pickling a CPU storage (storage_args: the worker's result
queue pickles each batch) sends the block it is in, or first copies it into
one (ints and floats default_collate makes into tensors, a custom
collate_fn's output), as torch's share_memory_() moves a storage into shm.
The worker keeps no reference to a sent block; a block it filled and never
sent is dropped when its storage dies.

The owner's side (the main process): rebuild_storage receives the block
(SENT -> HELD) and gives a storage over the owner's own mapping, zero-copy
and writable; when that storage dies (the last view of it: a finalizer on
the UntypedStorage) the block is freed, and the worker allocates it again,
its pages already in memory. A block arriving twice while its storage lives
gives the same storage.
"""

from __future__ import annotations

import os
import warnings
import weakref

from . import _errors
from ._arena import Arena, owned
from ._torch_env import torch_module


class _Local:
    """A block this writer allocated, while its storage here lives."""
    __slots__ = ("arena", "block", "sent", "parked")

    def __init__(self, arena: Arena, block: tuple):
        self.arena, self.block, self.sent, self.parked = arena, block, False, []


class _Writer:
    """This process's writer state: the arena it writes into, and the
    blocks whose storages live here (by data pointer and by slot)."""

    def __init__(self):
        self.pid = os.getpid()
        self.arena: Arena | None = None
        self.by_ptr: dict[int, _Local] = {}
        self.by_slot: dict[tuple, _Local] = {}
        self.warned: set[str] = set()


_writer = _Writer()


def _here() -> _Writer:
    global _writer
    if _writer.pid != os.getpid():  # a forked child: none of the parent's is ours
        _writer = _Writer()
    return _writer


def start_writing(arena: Arena) -> None:
    """From now on this process (a DataLoader worker) writes into arena."""
    _here().arena = arena


def writing_arena() -> Arena | None:
    """The arena this process writes into, if it is a writer."""
    return _here().arena


def _warn_once(reason: str, text: str) -> None:
    w = _here()
    if reason not in w.warned:
        w.warned.add(reason)
        warnings.warn(f"vmmipc.torch (pid {os.getpid()}): {text}; this batch and others like it "
                      "go another way instead: this worker's host arena where it can run "
                      "libvmmipc (spawn and forkserver workers), else torch's own shared memory",
                      RuntimeWarning, stacklevel=3)


def new_tensor(arena: Arena, numel: int, dtype):
    """A 1-D tensor of numel elements over a new block of this writer's
    region, or None (warned once) when there is no region or no room."""
    torch = torch_module()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    w = _here()
    parked = []
    while True:
        block = arena.alloc(nbytes)
        if block is None:
            for b in parked:
                arena.drop(b)
            _warn_once("room", f"no room in the arena for {nbytes} bytes (every region owned, "
                       "or this worker's region full: the main process holds too many batches, "
                       "or a batch is larger than a region)")
            return None
        older = w.by_slot.get(block[:2])
        if older is None:
            break
        # The owner freed a block whose storage still lives here (a batch
        # this worker kept after sending it): never write under it.
        older.parked.append(block)
    _, _, _, offset, _ = block
    t = torch.frombuffer(arena.view[offset:offset + nbytes], dtype=dtype, count=numel)
    storage = t.untyped_storage()
    local = _Local(arena, block)
    ptr = storage.data_ptr()
    w.by_ptr[ptr] = local
    w.by_slot[block[:2]] = local
    weakref.finalize(storage, _local_died, w, local, ptr)
    return t


def _local_died(w: _Writer, local: _Local, ptr: int) -> None:
    if w.by_ptr.get(ptr) is local:
        del w.by_ptr[ptr]
    if w.by_slot.get(local.block[:2]) is local:
        del w.by_slot[local.block[:2]]
    if not local.sent:
        local.arena.drop(local.block)
    for b in local.parked:
        local.arena.drop(b)


def storage_args(storage) -> tuple | None:
    """rebuild_storage's arguments for a CPU storage pickled by a writer,
    sending its block (copying it into one first if it is in none, or was
    sent already); None where torch's own reducer is to be used (not a
    writer, not CPU, empty, or no room: warned once)."""
    arena = writing_arena()
    nbytes = storage.nbytes()
    if arena is None or storage.device.type != "cpu" or nbytes == 0:
        return None
    local = _here().by_ptr.get(storage.data_ptr())
    keep = None
    if local is None or local.sent or local.block[4] != nbytes:
        torch = torch_module()
        keep = new_tensor(arena, nbytes, torch.uint8)
        if keep is None:
            return None
        keep.copy_(torch.empty((0,), dtype=torch.uint8).set_(storage))
        local = _here().by_ptr[keep.untyped_storage().data_ptr()]
    if not arena.send(local.block):
        return None  # this worker is exiting: its region is given back
    local.sent = True
    region, slot, generation, _, _ = local.block
    del keep  # its storage dies here: sent, so the block stays
    return (arena.id, region, slot, generation, nbytes)


_received: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()


def rebuild_storage(arena_id: str, region: int, slot: int, generation: int, nbytes: int):
    """Unpickling side of an arena block, in the arena's owner: an
    UntypedStorage over the block, held until it dies."""
    key = (arena_id, region, slot, generation)
    found = _received.get(key)
    if found is not None:
        return found
    arena = owned(arena_id)
    if arena is None:
        raise _errors.NotFoundError(
            f"an arena block (region {region}, slot {slot}) arrived in process {os.getpid()}, "
            f"which does not own arena {arena_id}: arena blocks go only to the process that made "
            "the arena (a DataLoader's main process); send tensors elsewhere after a clone(), "
            "or through torch's own sharing", _errors.ENOENT, "unpickle")
    block = arena.receive(region, slot, generation)
    if block[4] != nbytes:
        arena.free(block)
        raise _errors.InvalidError(f"an arena block of {block[4]} bytes arrived as {nbytes} "
                                   "bytes: a damaged pickle", _errors.EINVAL, "unpickle")
    torch = torch_module()
    offset = block[3]
    storage = torch.frombuffer(arena.view[offset:offset + nbytes],
                               dtype=torch.uint8).untyped_storage()
    weakref.finalize(storage, arena.free, block)
    _received[key] = storage
    return storage


# ---------------------------------------------------------------- collate


def _collate_tensor(batch, *, collate_fn_map=None):
    """torch's collate_tensor_fn, with the output in an arena block instead
    of a new shared-memory segment (the same place in default_collate)."""
    torch = torch_module()
    from torch.utils.data._utils.collate import collate_tensor_fn
    elem = batch[0]
    arena = writing_arena()
    if (arena is None or elem.device.type != "cpu" or elem.layout != torch.strided
            or elem.is_nested or elem.is_quantized):
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    numel = sum(x.numel() for x in batch)
    out = new_tensor(arena, numel, elem.dtype) if numel else None
    if out is None:
        return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    return torch.stack(batch, 0, out=out.view(len(batch), *elem.size()))


def collate_in_worker(batch):
    """default_collate in a worker, each tensor batch stacked into an arena
    block (_collate_tensor)."""
    torch = torch_module()
    from torch.utils.data._utils import collate
    fn_map = dict(collate.default_collate_fn_map)
    fn_map[torch.Tensor] = _collate_tensor
    return collate.collate(batch, collate_fn_map=fn_map)
