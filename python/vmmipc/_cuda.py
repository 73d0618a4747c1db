"""CUDA ranges: which allocation-aligned range covers a device pointer."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

from . import _args, _lib


class CudaRange(NamedTuple):
    base: int          # start of the allocation that holds dptr
    size: int          # to the end of the allocation that holds dptr + size - 1
    handle_types: int  # CU_MEM_HANDLE_TYPE_* bits allowed (1 = POSIX fd)
    device: int        # ordinal of the GPU it lives on


def cuda_query_range(dptr: int, size: int) -> CudaRange:
    """The smallest range on allocation boundaries that covers
    [dptr, dptr + size) of CUDA VMM memory (vmmipc_cuda_query_range): what
    share() needs for a buffer that starts or ends inside an allocation. Opens
    no descriptor, takes no reference, needs no current context.
    NotFoundError if dptr (or dptr + size - 1) is not mapped VMM memory
    (cudaMalloc, host memory); CudaError without a driver."""
    fn = "vmmipc_cuda_query_range"
    dptr = _args.u64(dptr, "dptr", fn)
    size = _args.u64(size, "size", fn)
    out = _lib.vmmipc_cuda_range_info()
    _lib.call(fn, dptr, size, ctypes.byref(out))
    return CudaRange(out.base, out.size, out.handle_types, out.device)
