"""PyTorch integration: CUDA tensors in VMM memory through multiprocessing,
and whole models at once for frameworks that carry handles themselves.

With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` every CUDA tensor
lives in cuMemCreate chunks, and torch shares those with pidfd_getfd, which
a container's default seccomp profile refuses ("pidfd_getfd: Operation not
permitted"). After ``import vmmipc.torch`` (or ``vmmipc.torch.install()``),
a CUDA tensor or UntypedStorage in VMM memory crosses multiprocessing
(Queue, Pipe, Pool, Process arguments; spawn and forkserver;
torch.multiprocessing too) and ForkingPickler bytes through vmmipc instead:
no pidfd_getfd, one descriptor at a time. VMM memory that does not allow
POSIX-fd export raises InvalidError, saying why. CPU tensors and storages
cross as views of the sender's host arena, held by the receiver, with no
descriptor per storage, on torch 2.12 and later (set_cpu_sharing;
docs/dataloader.md, "CPU tensors between any processes"). Every other
tensor and storage (meta, the legacy cudaMalloc allocator, sparse, nested,
quantized, empty) keeps torch's own reducer, unchanged.

    import vmmipc.torch                      # before the first put
    q = torch.multiprocessing.get_context("spawn").Queue()
    q.put(model.state_dict())                # the child's q.get() maps it

    blob = vmmipc.torch.share_tensors(model.state_dict())   # bytes, any transport
    weights = vmmipc.torch.open_tensors(blob)                # in the receiver

A model costs per run of chunks, not per tensor: the storages of one pickle
are registered together, one anchor per contiguous run of chunks, with one
grant per run and one event per device; the receiver maps each run once and
every tensor is a view into it. Re-sending the same tensors (weight sync
after each optimizer step) makes no registration and no driver call per
tensor in the sender, and no connection, handshake or driver call per
tensor in the receiver. ARCHITECTURE.md ("vmmipc.torch") has the design.

What the receiver gets: tensors on the exporter's GPU (found by UUID, so
CUDA_VISIBLE_DEVICES may differ), zero-copy over the sender's memory: writes
are seen both ways. Tensors that share a storage arrive sharing one storage
(views, tied weights), within one pickle and across pickles while the
sender's run anchor lives (a retired run arrives anew). dtype, shape,
stride, storage offset, requires_grad and Parameter-ness are kept. Receiving
needs numpy (torch parses __cuda_array_interface__ with it).

Rules the caller keeps (the same as torch's own CUDA sharing):
  - Ordering: pickling records an event on the current CUDA stream of the
    thread that pickles, and the receiver's current stream waits on it
    before the tensors are returned. A Queue pickles in its feeder thread,
    whose current stream is the default stream: synchronize work done on
    other streams before put(). CUDA keeps those events in /dev/shm, which
    two pods do not share: with VMMIPC_SOCKET_DIR set (how receivers in
    other containers are reached), pickling instead waits until that
    stream's work has finished (set_ordering says which).
  - The sender process must outlive its receivers' imports (its vmmipc
    server serves them). It keeps each sent storage alive, out of its
    allocator's reach, until the receiver has let go of every storage it
    rebuilt from it, or has died (torch's rule), so the sender may drop its
    tensors right after sending; a pickle never received keeps them until
    set_pickle_ttl's time passes. Do not free a sent storage's memory
    under it (storage.resize_(0)): torch's allocator could then reuse it.
  - A pickle loaded again while tensors from it live gives the same
    storages; once they have all died, its grant has ended, and loading it
    again raises NotFoundError: have the sender send again.
  - The fork start method cannot work (VmmipcForkError): use spawn or
    forkserver.

Memory made for sharing: inside ``with vmmipc.torch.sharing_pool():``
tensors are allocated in 1 GiB chunks (settable) of libvmmipc's pool, so a
model is a handful of handles for a receiver instead of hundreds (see
_torch_pool.py and docs/performance.md, "Chunk size").

torch is imported lazily: without it, ``import vmmipc.torch`` works and the
functions raise ImportError saying what is missing.
"""

from __future__ import annotations

import os

import vmmipc as _vmmipc

from . import (_args, _reductions, _torch_arena, _torch_batch, _torch_env, _torch_host,
               _torch_received, _torch_reductions)
from ._arena import Arena
from ._torch_batch import EVENT_KEEP_SECONDS, MAX_EVENTS, MAX_PENDING_PICKLES, batch
from ._torch_blob import open_tensors, share_tensors
from ._torch_env import POSIX_FD_HANDLE, handle_type_names
from ._torch_pool import PoolInfo, SharingPool, release_sharing_pool, sharing_pool, sharing_pools
from ._torch_reductions import is_vmm_tensor, reduce_storage, reduce_tensor


def set_receive_device(device: int | None) -> None:
    """Where this process maps the tensors it unpickles from now on (every
    thread: Queue.get, Pool results, Process arguments). None (the default):
    the exporter's GPU, found by UUID. An ordinal: that device of this
    process gets read-write access and the tensor is on it (checked when a
    tensor arrives). TypeError if not an integer, InvalidError if < 0."""
    _torch_received.set_receive_device(device)


def set_pickle_ttl(ttl: float | None) -> None:
    """How long what this process pickles from now on can be received, in
    seconds. None (the default): until it is received or this process
    ends. A pickle that is never received (a Queue item nobody reads) keeps
    its storages alive in this process until then. Checked as
    vmmipc.register_again checks its ttl (TypeError, InvalidError)."""
    if ttl is not None:
        _args.milliseconds(ttl, "ttl", 1, _vmmipc.MAX_TTL_MS, "vmmipc.torch.set_pickle_ttl")
    _torch_batch.set_pickle_ttl(ttl)


def set_ordering(mode: str) -> None:
    """How receivers' streams are ordered after the work this process queued
    before pickling, from now on: "event" (an interprocess CUDA event the
    receiver's current stream waits on, as torch does; the receiver must
    share this process's /dev/shm, where CUDA keeps such events), "sync"
    (pickling waits until the work queued on the current stream has
    finished; works between any containers), or "auto" (the default: "sync"
    when VMMIPC_SOCKET_DIR is set, else "event"). ValueError for others."""
    if mode not in _torch_batch.ORDERINGS:
        raise ValueError(f"vmmipc.torch.set_ordering: mode must be one of "
                         f"{', '.join(map(repr, _torch_batch.ORDERINGS))}, not {mode!r}")
    _torch_batch.set_ordering(mode)


def set_cpu_sharing(mode: str) -> None:
    """How this process pickles CPU tensors and storages outside a
    DataLoader's workers, from now on (every thread), like
    torch.multiprocessing.set_sharing_strategy: "vmmipc" (the default) moves
    each storage into a block of this process's host arena and sends the
    block (a grant of its chunk: no descriptor per storage on either side;
    the receiver holds it until its storage dies); "torch" leaves them to
    torch's own reducer (its sharing strategy). Under "vmmipc", pickles
    bound for a forked child, and processes forked after their parent
    loaded libvmmipc, still use torch's (docs/dataloader.md, "CPU tensors
    between any processes"). ValueError for other modes. A process starts
    with the mode VMMIPC_TORCH_CPU_SHARING names, if set (so that it
    reaches spawned children and DataLoader workers)."""
    if mode not in _torch_host.MODES:
        raise ValueError(f"vmmipc.torch.set_cpu_sharing: mode must be one of "
                         f"{', '.join(map(repr, _torch_host.MODES))}, not {mode!r}")
    _torch_host.set_mode(mode)


def get_cpu_sharing() -> str:
    """The mode set_cpu_sharing set: "vmmipc" or "torch"."""
    return _torch_host.mode()


def host_arena_info() -> dict:
    """This process's host arena (the CPU tensors it sent): chunks and
    their bytes, blocks live and their bytes. A block is live while this
    process's storage over it lives or a receiver holds it."""
    return _torch_host.host_arena.info()


class Collate:
    """A DataLoader collate_fn (what loader_options() gives): in a worker,
    collate_fn (None: torch's default_collate, with each tensor batch
    stacked straight into an arena block) and every CPU tensor of the
    result sent as an arena block; in the main process (num_workers=0),
    collate_fn or default_collate as they are. Picklable to spawn and
    forkserver workers (the arena's descriptor goes once per worker), where
    unpickling it imports vmmipc.torch, which installs the reducers."""

    def __init__(self, arena: Arena, collate_fn=None):
        self.arena = arena
        self.collate_fn = collate_fn

    def __call__(self, batch):
        torch = _torch_env.torch_module()
        if torch.utils.data.get_worker_info() is None:
            from torch.utils.data._utils.collate import default_collate
            return (self.collate_fn or default_collate)(batch)
        _torch_arena.start_writing(self.arena)
        if self.collate_fn is not None:
            return self.collate_fn(batch)
        return _torch_arena.collate_in_worker(batch)


_default_arena: list = []  # [(pid, Arena)]


def default_arena() -> Arena:
    """This process's arena for DataLoaders (made on first use: an unnamed
    memfd of 32 regions of 4 GiB of address space, memory only as
    touched), shared by every loader_options() call without arena=."""
    if not _default_arena or _default_arena[0][0] != os.getpid():
        _default_arena[:] = [(os.getpid(), Arena())]
    return _default_arena[0][1]


def loader_options(collate_fn=None, *, arena: Arena | None = None) -> dict:
    """The one line for a DataLoader whose CPU batches cross through an
    arena this (main) process owns, with no descriptor per batch:

        loader = DataLoader(ds, batch_size=64, num_workers=4,
                            **vmmipc.torch.loader_options())

    Returns {"collate_fn": ...}: collate_fn (None: torch's default_collate,
    stacking each tensor batch straight into an arena block) run in the
    workers, every CPU tensor of its result sent as an arena block. Call it
    in the main process, before the loader's workers start (the arena is
    made here). With fork (Linux's default before Python 3.14), spawn and
    forkserver; pin_memory and persistent_workers as they are.
    docs/dataloader.md has the design and the limits."""
    return {"collate_fn": Collate(arena if arena is not None else default_arena(), collate_fn)}


def arena_info(arena: Arena | None = None) -> dict:
    """The counters of arena (default_arena()): blocks being written, sent,
    held by this process and free, live and carved bytes, regions owned
    (vmmipc.h, vmmipc_arena_info), after giving back the regions of workers
    that died."""
    return (arena if arena is not None else default_arena()).info()


def install() -> None:
    """Register reduce_tensor for torch.Tensor and torch.nn.Parameter and
    reduce_storage for the UntypedStorage classes torch registers, after
    torch.multiprocessing's own, and make each ForkingPickler.dump one batch
    (idempotent). Loads no library. Raises ImportError without torch."""
    _reductions.init_reductions(_torch_reductions.reductions())


try:
    install()
except ImportError:
    pass  # no torch: the functions above raise a clear ImportError when used

__all__ = ["Arena", "arena_info", "batch", "Collate", "default_arena", "EVENT_KEEP_SECONDS",
           "get_cpu_sharing", "handle_type_names", "host_arena_info", "install", "is_vmm_tensor",
           "loader_options", "MAX_EVENTS", "MAX_PENDING_PICKLES", "open_tensors", "PoolInfo",
           "POSIX_FD_HANDLE", "reduce_storage", "reduce_tensor", "release_sharing_pool",
           "set_cpu_sharing", "set_ordering", "set_pickle_ttl", "set_receive_device",
           "share_tensors", "sharing_pool", "sharing_pools", "SharingPool"]
