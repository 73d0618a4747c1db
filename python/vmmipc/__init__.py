"""vmmipc: share CUDA VMM allocations, or chunked host shared memory, between
processes one file descriptor at a time (Python shim over libvmmipc.so).

Importing vmmipc does not load libvmmipc.so: the first call that needs it
does. The contract is include/vmmipc.h; names follow it.

    import vmmipc
    hb = vmmipc.HostBuffer(64 << 20, chunk_size=1 << 20)
    queue.put(hb)                  # spawn/forkserver: the child maps the same memory

    ticket = vmmipc.share(dptr, size)          # a CUDA VMM range
    with vmmipc.import_stream(ticket) as m:    # in another process
        ...m.addr, m.size, m.device...
"""

from ._errors import (AuthError, BadHandleError, CudaError, ExportError, InternalError,
                      InvalidError, LibraryNotFoundError, NotFoundError, OutOfDescriptorsError,
                      VmmipcError, VmmipcForkError, VmmipcIOError, error_for)
from ._errors import (EAUTH, EBADF, ECUDA, EEXPORT, EFORK, EINTERNAL, EINVAL, EIO, END,
                      ENFILE, ENOENT, OK)
from ._lib import DEVICE_HOST, DEVICE_SAME, MEMORY_CUDA, MEMORY_HOST, TICKET_SIZE
from ._ticket import Ticket, TicketInfo
from ._register import (live_registrations, register, register_cuda, register_cuda_handles,
                        register_host_file, share, strerror, unregister, version)
from ._stream import Chunk, Stream, export_chunks, export_fds, open
from ._mapping import Mapping, import_stream
from ._host import DEFAULT_CHUNK_SIZE, HostBuffer
from . import _mp

__version__ = "0.1.0"

_mp.install()

__all__ = [
    "AuthError", "BadHandleError", "Chunk", "CudaError", "DEFAULT_CHUNK_SIZE", "DEVICE_HOST",
    "DEVICE_SAME", "EAUTH", "EBADF", "ECUDA", "EEXPORT", "EFORK", "EINTERNAL", "EINVAL", "EIO",
    "END", "ENFILE", "ENOENT", "ExportError", "HostBuffer", "InternalError", "InvalidError",
    "LibraryNotFoundError", "MEMORY_CUDA", "MEMORY_HOST", "Mapping", "NotFoundError", "OK",
    "OutOfDescriptorsError", "Stream", "TICKET_SIZE", "Ticket", "TicketInfo", "VmmipcError",
    "VmmipcForkError", "VmmipcIOError", "error_for", "export_chunks", "export_fds",
    # not "open": `from vmmipc import *` must not shadow the builtin
    "import_stream", "live_registrations", "register", "register_cuda", "register_cuda_handles",
    "register_host_file", "share", "strerror", "unregister", "version",
]
