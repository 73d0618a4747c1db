"""Exceptions raised by vmmipc: one class per libvmmipc status code.

Every error carries the status (``err.status``, e.g. -4), the Python
function that failed (``err.function``: vmmipc.import_stream, where the C
library's vmmipc_import_stream failed) and the library's own detail of what
failed and what to do (``err.message``, from vmmipc_last_error(), in the
Python API's terms: python_message()).
"""

from __future__ import annotations

import warnings

# Status codes, as in include/vmmipc.h (test_api checks them against it):
# OK and END, then the errors numbered from -1 down, in the header's order.
OK, END = 0, 1
(EINVAL, EBADF, EAUTH, ENOENT, EIO, EEXPORT, ECUDA, ENFILE, EFORK, EINTERNAL, ENOMEM,
 ETIMEDOUT, ECONFIG) = range(-1, -14, -1)

STATUS_NAMES = {
    OK: "VMMIPC_OK",
    END: "VMMIPC_END",
    EINVAL: "VMMIPC_EINVAL",
    EBADF: "VMMIPC_EBADF",
    EAUTH: "VMMIPC_EAUTH",
    ENOENT: "VMMIPC_ENOENT",
    EIO: "VMMIPC_EIO",
    EEXPORT: "VMMIPC_EEXPORT",
    ECUDA: "VMMIPC_ECUDA",
    ENFILE: "VMMIPC_ENFILE",
    EFORK: "VMMIPC_EFORK",
    EINTERNAL: "VMMIPC_EINTERNAL",
    ENOMEM: "VMMIPC_ENOMEM",
    ETIMEDOUT: "VMMIPC_ETIMEDOUT",
    ECONFIG: "VMMIPC_ECONFIG",
}


# The Python call behind each C function, for messages: a Python caller
# never called vmmipc_ticket_decode, it called Ticket.info().
PYTHON_NAMES = {
    "vmmipc_options_init": "vmmipc",
    "vmmipc_register": "vmmipc.register",
    "vmmipc_register_host_file": "vmmipc.register_host_file",
    "vmmipc_register_cuda": "vmmipc.share",
    "vmmipc_register_cuda_handles": "vmmipc.register_cuda_handles",
    "vmmipc_register_again": "vmmipc.register_again",
    "vmmipc_unregister": "vmmipc.unregister",
    "vmmipc_exiting": "vmmipc (at exit)",
    "vmmipc_wait": "vmmipc.wait",
    "vmmipc_live_registrations": "vmmipc.live_registrations",
    "vmmipc_live_many": "vmmipc (listing the grants still pending)",
    "vmmipc_cuda_query_range": "vmmipc.cuda_query_range",
    "vmmipc_ticket_decode": "Ticket.info",
    "vmmipc_open": "vmmipc.open",
    "vmmipc_stream_info": "vmmipc.open",
    "vmmipc_pull_next": "Stream.__next__",
    "vmmipc_close": "Stream.close",
    "vmmipc_import_stream": "vmmipc.import_stream",
    "vmmipc_confirm": "vmmipc.confirm",
    "vmmipc_confirm_many": "vmmipc.confirm_many",
    "vmmipc_release": "vmmipc.release",
    "vmmipc_holds": "vmmipc.holds",
    "vmmipc_torch_pool": "vmmipc.torch.sharing_pool",
    "vmmipc_torch_alloc": "vmmipc.torch.sharing_pool (allocating)",
    "vmmipc_torch_free": "vmmipc.torch.sharing_pool (freeing)",
    "vmmipc_pool_create": "vmmipc.torch.sharing_pool",
    "vmmipc_pool_alloc": "vmmipc.torch.sharing_pool (allocating)",
    "vmmipc_pool_free": "vmmipc.torch.sharing_pool (freeing)",
    "vmmipc_pool_trim": "vmmipc.torch.release_sharing_pool",
    "vmmipc_pool_get_info": "vmmipc.torch.sharing_pools",
    "vmmipc_pool_destroy": "vmmipc.torch.release_sharing_pool",
    "vmmipc_unmap": "Mapping.close",
    "vmmipc_cache_set_limit": "vmmipc.set_cache_limit",
    "vmmipc_cache_get_info": "vmmipc.cache_info",
    "vmmipc_strerror": "vmmipc.strerror",
    "vmmipc_last_error": "vmmipc",
    "vmmipc_version": "vmmipc.version",
}

# Words of the C library's messages that the Python API spells otherwise,
# most specific first: its options are keyword arguments in seconds
# (timeout=, ttl=), its constants vmmipc.NAME.
_PHRASES = [
    ("raise timeout_ms", "pass a larger timeout="),
    ("vmmipc_register_cuda*", "vmmipc.share or vmmipc.register_cuda_handles"),
    ("timeout_ms", "timeout"),
    ("ttl_ms", "ttl"),
]
_C_FUNCTION = r"\bvmmipc_[a-z_]+\b"
_C_CONSTANT = (r"\bVMMIPC_(DEVICE_HOST|DEVICE_SAME|MEMORY_HOST|MEMORY_CUDA|IMPORT_NO_CACHE|"
               r"IMPORT_CONFIRM_LATER|IMPORT_HOLD|MAX_[A-Z_]+|TICKET_SIZE)\b")


def python_name(function: str) -> str:
    """The Python call behind C function `function`; any other name as it is."""
    return PYTHON_NAMES.get(function, function)


def python_message(message: str) -> str:
    """A message of the C library in the Python API's terms: C functions by
    their Python calls, constants as vmmipc.NAME, timeout_ms and ttl_ms as
    the timeout= and ttl= arguments (seconds, in Python)."""
    import re  # here: only a failure needs it, and `import vmmipc` need not import it
    for c, py in _PHRASES:
        message = message.replace(c, py)
    message = re.sub(_C_FUNCTION, lambda m: PYTHON_NAMES.get(m.group(0), m.group(0)), message)
    return re.sub(_C_CONSTANT, r"vmmipc.\1", message)


class VmmipcError(Exception):
    """Base of every libvmmipc error.

    Attributes: ``status`` (the negative VMMIPC_E* code, or None when the
    library could not even be loaded), ``message`` (the library's detail),
    ``function`` (the Python function that failed, e.g. "vmmipc.import_stream"
    where the library's vmmipc_import_stream failed; "" if unknown).
    """

    status: int | None = None

    def __init__(self, message: str, status: int | None = None, function: str = ""):
        if status is not None:
            self.status = status
        self.message = message
        self.function = python_name(function)
        super().__init__(message)

    @property
    def status_name(self) -> str:
        if self.status is None:
            return "VMMIPC_UNAVAILABLE"
        return STATUS_NAMES.get(self.status, f"VMMIPC_UNKNOWN({self.status})")

    def __str__(self) -> str:
        where = f"{self.function}: " if self.function else ""
        return f"{where}{self.message} [{self.status_name}]"

    def __reduce__(self):
        # Errors cross process boundaries (Pool results, Queue replies);
        # keep status, message and function when they do.
        return (_rebuild_error, (type(self), self.message, self.status, self.function))


def _rebuild_error(cls, message, status, function):
    return cls(message, status, function)


class InvalidError(VmmipcError, ValueError):
    """VMMIPC_EINVAL: bad argument, malformed ticket or message.

    Also a ValueError: an argument out of range (checked in Python before it
    reaches the library, or by the library itself) is what Python code
    catches as ValueError, and vmmipc code as InvalidError or VmmipcError.
    """
    status = EINVAL


class BadHandleError(VmmipcError):
    """VMMIPC_EBADF: NULL, stale or closed handle."""
    status = EBADF


class AuthError(VmmipcError):
    """VMMIPC_EAUTH: a peer failed to prove it knows the ticket's secret, or
    has the wrong uid or pid."""
    status = EAUTH


class NotFoundError(VmmipcError):
    """VMMIPC_ENOENT: unknown, used-up, unregistered or expired registration."""
    status = ENOENT


class VmmipcIOError(VmmipcError):
    """VMMIPC_EIO: socket error, peer gone or timed out."""
    status = EIO


class ExportError(VmmipcError):
    """VMMIPC_EEXPORT: the sender could not export a chunk."""
    status = EEXPORT


class CudaError(VmmipcError):
    """VMMIPC_ECUDA: CUDA driver missing or a driver call failed."""
    status = ECUDA


class OutOfDescriptorsError(VmmipcError, OSError):
    """VMMIPC_ENFILE: out of file descriptors (this process's RLIMIT_NOFILE,
    or the system's table). Also an OSError; ``errno`` is EMFILE or ENFILE
    where Python saw which (HostBuffer's memfd_create), else None."""
    status = ENFILE


class VmmipcForkError(VmmipcError):
    """VMMIPC_EFORK: libvmmipc used in a child created by fork() without exec.

    The Go runtime inside libvmmipc (and CUDA) do not survive fork(). Start
    helpers with the "spawn" or "forkserver" multiprocessing start methods.
    """
    status = EFORK


class InternalError(VmmipcError):
    """VMMIPC_EINTERNAL: a bug in libvmmipc (a recovered panic)."""
    status = EINTERNAL


class VmmipcMemoryError(VmmipcError, MemoryError):
    """VMMIPC_ENOMEM: no address space for a reservation (RLIMIT_AS, or the
    CUDA driver's virtual address space). Also a MemoryError."""
    status = ENOMEM


class VmmipcTimeoutError(VmmipcError, TimeoutError):
    """VMMIPC_ETIMEDOUT: the registration is still live (vmmipc_wait). Also a
    TimeoutError. vmmipc.wait() and Ticket.wait() return False instead of
    raising it."""
    status = ETIMEDOUT


class ConfigError(VmmipcError):
    """VMMIPC_ECONFIG: this process's configuration is wrong, not the I/O:
    VMMIPC_SOCKET_DIR missing, not a directory, too long or unsafe (here or
    as a ticket names it), or a bad value of a VMMIPC_* variable. The
    message names the variable and says what to change."""
    status = ECONFIG


class BufferInUseError(VmmipcError, BufferError):
    """close() of a HostBuffer or host Mapping while views of its memory
    (memoryviews, numpy arrays, torch tensors) are alive; it stays open.
    Raised in Python (status is None). Also a BufferError."""
    status = None

    @property
    def status_name(self) -> str:
        return "in use"


class LibraryNotFoundError(VmmipcError, OSError):
    """libvmmipc.so could not be found or loaded (status is None)."""
    status = None


_BY_STATUS = {
    cls.status: cls
    for cls in (InvalidError, BadHandleError, AuthError, NotFoundError, VmmipcIOError,
                ExportError, CudaError, OutOfDescriptorsError, VmmipcForkError, InternalError,
                VmmipcMemoryError, VmmipcTimeoutError, ConfigError)
}


def error_for(status: int, message: str, function: str = "") -> VmmipcError:
    """Return the exception for a negative status (VmmipcError if unknown)."""
    cls = _BY_STATUS.get(status, VmmipcError)
    return cls(message or STATUS_NAMES.get(status, f"status {status}"), status, function)


def fork_error(function: str) -> VmmipcForkError:
    """The VmmipcForkError for a call of `function` in a forked child."""
    return VmmipcForkError(
        "called in a child after fork(): libvmmipc was loaded by the parent and its "
        "Go runtime does not survive fork(); start this process with the 'spawn' or "
        "'forkserver' multiprocessing start method (or exec a new program)",
        EFORK, function)


def renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn (DeprecationWarning) that `old` is the previous name of `new`,
    pointing at the user's line: stacklevel 3 is the caller's caller, for a
    renamed function that calls this itself. The old names go in the
    release after 0.2."""
    warnings.warn(f"{old} is deprecated: use {new} (same behaviour); {old} goes in the next "
                  "release", DeprecationWarning, stacklevel=stacklevel)
