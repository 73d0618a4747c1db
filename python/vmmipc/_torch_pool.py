"""vmmipc.torch.sharing_pool: tensors allocated in memory made for sharing.

    with vmmipc.torch.sharing_pool():          # 1 GiB chunks on the current GPU
        model = build()                        # its tensors: a handful of chunks

A receiver's cost is per allocation handle, not per byte (include/vmmipc.h,
"Pools", has the H200's figures): torch's expandable segments map 20 MiB
chunks, so 15 GiB of weights is 766 handles; here it is 15. Inside the
block, this thread's CUDA allocations on that device go to a torch MemPool
whose pluggable allocator is libvmmipc's torch pool of the device
(vmmipc_torch_alloc / vmmipc_torch_free, one pool per device and process,
chunks allowing POSIX-fd export). Everything else about the tensors is
torch's: its caching allocator splits and caches the pool's segments as it
does its own, and vmmipc.torch shares them like any VMM tensor.

The pieces, and why:
  - One CUDAPluggableAllocator per device, kept for the process's life:
    torch calls the allocator's free hook through the pool's raw pointer
    whenever it releases a segment, also after the MemPool object is gone
    (its freed blocks are released by a later torch.cuda.empty_cache()), so
    it may never be collected. One torch MemPool per device over it, until
    release_sharing_pool() drops it (the next sharing_pool() makes another).
  - torch refuses a MemPool with a custom allocator while expandable
    segments are on ("MemPool doesn't currently support
    expandable_segments"). The block therefore turns them off, for the
    whole process, while any thread is inside one, and back on after the
    last one leaves, if they were on: allocations of other threads in that
    window get torch's cudaMalloc segments (which vmmipc cannot share). Other
    settings of PYTORCH_CUDA_ALLOC_CONF are untouched. The cudaMallocAsync
    backend has no such pools: sharing_pool refuses it, saying so.
  - torch keeps a live MemPool's free segments cached: torch.cuda.empty_cache()
    does not give them back. release_sharing_pool() drops the device's
    MemPool (torch then frees its cached segments into the torch pool, which
    gives wholly free chunks back to the driver at once) and starts a new one
    on the next sharing_pool(); tensors still alive stay valid, and their
    segments go back at a torch.cuda.empty_cache() after they die.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import NamedTuple

from . import _args, _errors, _lib
from ._torch_env import torch_module

DEFAULT_CHUNK_SIZE = 1 << 30
ALLOC_HOOK = "vmmipc_torch_alloc"
FREE_HOOK = "vmmipc_torch_free"


class PoolInfo(NamedTuple):
    """vmmipc_pool_info of a torch pool (include/vmmipc.h)."""
    base: int
    reserved_bytes: int
    chunk_size: int
    keep_bytes: int
    mapped_bytes: int     # the pool's GPU memory now
    idle_bytes: int       # ...of which no segment of torch's touches
    allocated_bytes: int  # torch's segments in it
    allocations: int
    chunks_mapped: int    # since the process began
    chunks_released: int
    device: int


class SharingPool:
    """The sharing pool of one device (what sharing_pool() yields)."""

    def __init__(self, device: int, handle: int, allocator):
        self.device = device
        self._handle = handle
        self._allocator = allocator  # torch.cuda.memory.CUDAPluggableAllocator, kept forever
        self._mempool = None         # the torch MemPool now, made on first use
        self._inside = 0             # sharing_pool() blocks in progress on it

    @property
    def chunk_size(self) -> int:
        return self.info().chunk_size

    def info(self) -> PoolInfo:
        out = _lib.vmmipc_pool_info()
        _lib.call("vmmipc_pool_get_info", self._handle, ctypes.byref(out), ctypes.sizeof(out))
        return PoolInfo(*(getattr(out, f) for f in PoolInfo._fields))

    def __repr__(self) -> str:
        i = self.info()
        return (f"<vmmipc.torch sharing pool of cuda:{self.device}: {i.chunk_size >> 20} MiB "
                f"chunks, {i.mapped_bytes >> 20} MiB mapped, {i.allocated_bytes >> 20} MiB in "
                f"torch's segments>")

    def _trim(self) -> None:
        """Give every wholly free chunk back (what it gave is counted in
        info().chunks_released, with what frees gave back before it)."""
        _lib.call("vmmipc_pool_trim", self._handle, 0, None)


_pools: dict[int, SharingPool] = {}
_lock = threading.Lock()
_expandable = {"inside": 0, "restore": False}  # sharing_pool blocks in progress, process-wide


def _device_index(torch, device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, (str, torch.device)):
        d = torch.device(device)
        if d.type != "cuda":
            raise ValueError(f"vmmipc.torch.sharing_pool: device must be a CUDA device, not {d}")
        return torch.cuda.current_device() if d.index is None else d.index
    return _args.integer(device, "device", 0, _args.I32_MAX, "vmmipc.torch.sharing_pool")


def _check_torch(torch) -> None:
    if not torch.cuda.is_available():
        raise RuntimeError("vmmipc.torch.sharing_pool needs a CUDA GPU, and torch sees none "
                           "(torch.cuda.is_available() is False)")
    if not (hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool")
            and hasattr(torch.cuda.memory, "CUDAPluggableAllocator")):
        raise RuntimeError(f"vmmipc.torch.sharing_pool needs torch.cuda.MemPool, use_mem_pool and "
                           f"memory.CUDAPluggableAllocator, which PyTorch "
                           f"{getattr(torch, '__version__', '?')} lacks: upgrade PyTorch")
    backend = torch.cuda.memory.get_allocator_backend()
    if backend != "native":
        raise RuntimeError(
            f"vmmipc.torch.sharing_pool needs PyTorch's native caching allocator, and this "
            f"process uses {backend!r} (PYTORCH_CUDA_ALLOC_CONF backend:{backend}), which has "
            "no memory pools for a pluggable allocator: drop backend:cudaMallocAsync")


def _pool(torch, device: int, chunk_size: int) -> SharingPool:
    """The device's SharingPool, made (libvmmipc's torch pool, torch's
    allocator) on first use; a chunk_size other than its own is refused."""
    with _lock:
        pool = _pools.get(device)
        handle = ctypes.c_void_p()
        # Also for an existing pool: the library checks the chunk size.
        _lib.call("vmmipc_torch_pool", device, chunk_size, ctypes.byref(handle))
        if pool is None:
            path = _library_path()
            allocator = torch.cuda.memory.CUDAPluggableAllocator(path, ALLOC_HOOK, FREE_HOOK)
            pool = _pools[device] = SharingPool(device, handle.value, allocator)
        if pool._mempool is None:
            with torch.cuda.device(device):  # a MemPool belongs to the current device
                pool._mempool = torch.cuda.MemPool(pool._allocator.allocator())
        pool._inside += 1
        return pool


def _library_path() -> str:
    """The file of the libvmmipc this process loaded, for torch to open
    again (the same library, so the same pools): the mapping that holds
    the hook, from /proc/self/maps (absolute, whatever path loaded it)."""
    handle = _lib.lib("vmmipc_torch_pool")
    addr = ctypes.cast(getattr(handle, ALLOC_HOOK), ctypes.c_void_p).value
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                lo, _, hi = fields[0].partition("-")
                if len(fields) == 6 and int(lo, 16) <= addr < int(hi, 16):
                    return fields[5].strip()
    except (OSError, ValueError):
        pass
    return handle._name  # the name it was loaded by


def _leave(pool: SharingPool) -> None:
    with _lock:
        pool._inside -= 1


def _expandable_segments_on(torch) -> bool:
    """Whether torch's allocator makes expandable segments now: its
    snapshot's settings say (the setting may change at run time); the
    environment where that is not there."""
    try:
        settings = torch.cuda.memory._snapshot().get("allocator_settings") or {}
        if "expandable_segments" in settings:
            return bool(settings["expandable_segments"])
    except (AttributeError, RuntimeError, TypeError):
        pass
    import os
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        for field in (os.environ.get(name) or "").split(","):
            key, _, value = field.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() == "true"
    return False


def _set_expandable_segments(torch, on: bool) -> None:
    """torch's allocator setting, through the accelerator-generic setter
    where this torch has it (torch.cuda.memory._set_allocator_settings is
    the older name of the same)."""
    setting = f"expandable_segments:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


@contextlib.contextmanager
def _no_expandable_segments(torch):
    """Expandable segments off while any thread is inside a sharing_pool
    block, and back on after the last one if they were on (see the module
    docstring)."""
    with _lock:
        if _expandable["inside"] == 0:
            on = _expandable_segments_on(torch)
            if on:
                _set_expandable_segments(torch, False)
            _expandable["restore"] = on
        _expandable["inside"] += 1
    try:
        yield
    finally:
        with _lock:
            _expandable["inside"] -= 1
            if _expandable["inside"] == 0 and _expandable["restore"]:
                _set_expandable_segments(torch, True)
                _expandable["restore"] = False


@contextlib.contextmanager
def sharing_pool(chunk_size: int | None = None, device=None):
    """Allocate this thread's CUDA tensors on device (None: the current one)
    in libvmmipc's torch pool of that device, in chunks of chunk_size bytes
    (a multiple of the GPU's allocation granularity, 2 MiB; None: the
    device's pool as it is, or 1 GiB for a new one). One chunk size per
    device and process: the first sharing_pool on a device sets it, another
    one later raises InvalidError. Yields the device's
    SharingPool. Tensors made inside stay in the pool after the block and
    are shared as any VMM tensor, as a handful of chunks.

    Raises ImportError without torch, RuntimeError without a GPU or with the
    cudaMallocAsync backend, TypeError/InvalidError for bad arguments,
    CudaError without a driver, VmmipcMemoryError when RLIMIT_AS leaves no
    room for the pool's address range."""
    fn = "vmmipc.torch.sharing_pool"
    torch = torch_module()
    chunk_size = 0 if chunk_size is None else _args.integer(
        chunk_size, "chunk_size", 1, _args.U64_MAX, fn,
        "a multiple of the GPU's allocation granularity, 2 MiB; None: 1 GiB")
    _check_torch(torch)
    dev = _device_index(torch, device)
    pool = _pool(torch, dev, chunk_size)
    try:
        with _no_expandable_segments(torch), torch.cuda.use_mem_pool(pool._mempool, dev):
            yield pool
    finally:
        _leave(pool)


def release_sharing_pool(device=None) -> int:
    """Give the device's sharing pool's free memory back to the driver and
    return the bytes given back during the call (by the frees of torch's
    cached segments, and by the trim after them): drops the device's torch MemPool (torch
    frees its cached segments into the pool), runs torch.cuda.empty_cache()
    and gives every wholly free chunk back. Tensors still alive in the pool
    stay valid; the next sharing_pool() starts a new MemPool on the same
    pool. 0 when the device has no sharing pool. InvalidError while a
    sharing_pool block of the device is in progress."""
    torch = torch_module()
    if not torch.cuda.is_available():
        return 0
    dev = _device_index(torch, device)
    with _lock:
        pool = _pools.get(dev)
        if pool is None:
            return 0
        if pool._inside:
            raise _errors.InvalidError(
                f"cuda:{dev}'s sharing pool is in use by {pool._inside} sharing_pool() block(s): "
                "release it after they end", _errors.EINVAL, "vmmipc.torch.release_sharing_pool")
        mempool, pool._mempool = pool._mempool, None
    # Count chunks, not _trim's answer: the frees of torch's cached
    # segments already give wholly free chunks back (beyond keep_bytes),
    # before the trim sees them.
    released0 = pool.info().chunks_released
    del mempool  # ~MemPool: torch releases the pool and frees its cached segments
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    pool._trim()
    info = pool.info()
    return (info.chunks_released - released0) * info.chunk_size


def sharing_pools() -> dict[int, SharingPool]:
    """The sharing pools of this process, by device."""
    with _lock:
        return dict(_pools)
