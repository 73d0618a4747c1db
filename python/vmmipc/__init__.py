"""vmmipc: share CUDA VMM allocations, or chunked host shared memory, between
processes one file descriptor at a time (Python shim over libvmmipc.so).

Importing vmmipc does not load libvmmipc.so: the first object or call that
needs it does (HostBuffer(...), share(...), vmmipc.cuda_core.install()), so
a missing library raises there, before any child process is started. The contract is include/vmmipc.h; names follow it.

    import vmmipc
    hb = vmmipc.HostBuffer(64 << 20, chunk_size=1 << 20)
    queue.put(hb)                  # spawn/forkserver: the child maps the same memory

    ticket = vmmipc.share(dptr, size)          # a CUDA VMM range
    with vmmipc.import_stream(ticket) as m:    # in another process
        ...m.addr, m.size, m.device...
"""

from ._errors import (AuthError, BadHandleError, BufferInUseError, ConfigError, CudaError, ExportError, InternalError,
                      InvalidError, LibraryNotFoundError, NotFoundError, OutOfDescriptorsError,
                      VmmipcError, VmmipcForkError, VmmipcIOError, VmmipcMemoryError,
                      VmmipcTimeoutError, error_for)
from ._errors import (EAUTH, EBADF, ECONFIG, ECUDA, EEXPORT, EFORK, EINTERNAL, EINVAL, EIO, END,
                      ENFILE, ENOENT, ENOMEM, ETIMEDOUT, OK)
from ._lib import (DEVICE_HOST, DEVICE_SAME, IMPORT_CONFIRM_LATER, IMPORT_HOLD, IMPORT_NO_CACHE,
                   MAX_ACCESS_DEVICES, MAX_CHUNKS, MAX_TTL_MS, MAX_WINDOW, MEMORY_CUDA,
                   MEMORY_HOST, TICKET_SIZE)
from ._ticket import Ticket, TicketInfo, wait
from ._register import (holds, register, register_again, register_cuda,
                        register_cuda_handles, register_host_file, share, strerror, unregister,
                        version)
from ._mapping import (CacheInfo, Mapping, cache_info, confirm, confirm_many, import_stream,
                       release, set_cache_limit)
from ._anchor import live_registrations
from ._host import DEFAULT_CHUNK_SIZE, HostBuffer
from . import _reductions

# Imported when first used, not by `import vmmipc`: what HostBuffer, share
# and import_stream do needs neither (python3 -X importtime -c 'import
# vmmipc' shows what importing costs).
_LATER = {
    "Chunk": "_stream", "Stream": "_stream", "export_chunks": "_stream",
    "export_fds": "_stream", "open": "_stream",
    "CudaRange": "_cuda", "cuda_query_range": "_cuda",
}


def __getattr__(name: str):
    # The version's one home is include/vmmipc.h (the wheel's metadata reads
    # it there too): __version__ asks the library, when first read, so that
    # `import vmmipc` still loads no library.
    if name == "__version__":
        return version()
    module = _LATER.get(name)
    if module == "_stream":
        from . import _stream as module
    elif module == "_cuda":
        from . import _cuda as module
    else:
        raise AttributeError(f"module 'vmmipc' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value  # once: later reads do not come here
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LATER))


_reductions.init_reductions()

__all__ = [
    "AuthError", "BadHandleError", "BufferInUseError", "CacheInfo", "ConfigError", "Chunk", "CudaError", "CudaRange",
    "DEFAULT_CHUNK_SIZE", "DEVICE_HOST", "DEVICE_SAME", "EAUTH", "EBADF", "ECONFIG", "ECUDA", "EEXPORT",
    "EFORK", "EINTERNAL", "EINVAL", "EIO", "END", "ENFILE", "ENOENT", "ENOMEM", "ETIMEDOUT",
    "ExportError", "HostBuffer", "IMPORT_CONFIRM_LATER", "IMPORT_HOLD", "IMPORT_NO_CACHE", "InternalError", "InvalidError",
    "LibraryNotFoundError", "MAX_ACCESS_DEVICES", "MAX_CHUNKS", "MAX_TTL_MS", "MAX_WINDOW",
    "MEMORY_CUDA", "MEMORY_HOST", "Mapping", "NotFoundError", "OK", "OutOfDescriptorsError",
    "Stream", "TICKET_SIZE", "Ticket", "TicketInfo", "VmmipcError", "VmmipcForkError",
    "VmmipcIOError", "VmmipcMemoryError", "VmmipcTimeoutError", "cache_info", "confirm",
    "confirm_many",
    "cuda_query_range", "error_for", "export_chunks", "export_fds",
    # not "open": `from vmmipc import *` must not shadow the builtin
    "holds", "import_stream", "live_registrations", "register", "register_again", "register_cuda",
    "register_cuda_handles", "register_host_file", "release", "set_cache_limit", "share", "strerror",
    "unregister", "version", "wait",
]
