"""Exceptions raised by vmmipc: one class per libvmmipc status code, made
from the table _FAILURES (the codes themselves come from STATUS_NAMES).

Every error carries the status (``err.status``, e.g. -4), the name of the C
function that failed (``err.function``) and the library's own detail of what
failed and what to do (``err.message``, from vmmipc_last_error()).
"""

from __future__ import annotations

# Every status of include/vmmipc.h (test_api checks this table against it).
STATUS_NAMES = {
    0: "VMMIPC_OK",
    1: "VMMIPC_END",
    -1: "VMMIPC_EINVAL",
    -2: "VMMIPC_EBADF",
    -3: "VMMIPC_EAUTH",
    -4: "VMMIPC_ENOENT",
    -5: "VMMIPC_EIO",
    -6: "VMMIPC_EEXPORT",
    -7: "VMMIPC_ECUDA",
    -8: "VMMIPC_ENFILE",
    -9: "VMMIPC_EFORK",
    -10: "VMMIPC_EINTERNAL",
    -11: "VMMIPC_ENOMEM",
    -12: "VMMIPC_ETIMEDOUT",
}
# The codes as module constants named as in the header without its prefix
# (OK, END, EINVAL, ...; vmmipc re-exports them).
_CODES = {name[len("VMMIPC_"):]: code for code, name in STATUS_NAMES.items()}
globals().update(_CODES)


class VmmipcError(Exception):
    """Base of every libvmmipc error.

    Attributes: ``status`` (the negative VMMIPC_E* code, or None when the
    library could not even be loaded), ``message`` (the library's detail),
    ``function`` (the C function that failed, or "" if raised in Python).
    """

    status: int | None = None

    def __init__(self, message: str, status: int | None = None, function: str = ""):
        if status is not None:
            self.status = status
        self.message = message
        self.function = function
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


# One row per failure status: its name (as in _CODES), the class raised for
# it, the builtin exceptions that class also is (so code that knows nothing of
# vmmipc still catches it as what it is), and what the status means (the
# class's docstring, after the status's full name).
_FAILURES = (
    ("EINVAL", "InvalidError", (ValueError,),
     "bad argument, malformed ticket or message.\n\n"
     "Also a ValueError: an argument out of range (checked in Python before it "
     "reaches the library, or by the library itself) is what Python code catches "
     "as ValueError, and vmmipc code as InvalidError or VmmipcError."),
    ("EBADF", "BadHandleError", (), "NULL, stale or closed handle."),
    ("EAUTH", "AuthError", (), "wrong secret, wrong uid or wrong peer pid."),
    ("ENOENT", "NotFoundError", (), "unknown, used-up, unregistered or expired registration."),
    ("EIO", "VmmipcIOError", (), "socket error, peer gone or timed out."),
    ("EEXPORT", "ExportError", (), "the sender could not export a chunk."),
    ("ECUDA", "CudaError", (), "CUDA driver missing or a driver call failed."),
    ("ENFILE", "OutOfDescriptorsError", (), "out of file descriptors."),
    ("EFORK", "VmmipcForkError", (),
     "libvmmipc used in a child created by fork() without exec.\n\n"
     "The Go runtime inside libvmmipc (and CUDA) do not survive fork(). Start "
     "helpers with the \"spawn\" or \"forkserver\" multiprocessing start methods."),
    ("EINTERNAL", "InternalError", (), "a bug in libvmmipc (a recovered panic)."),
    ("ENOMEM", "VmmipcMemoryError", (MemoryError,),
     "no address space for a reservation (RLIMIT_AS, or the CUDA driver's virtual "
     "address space). Also a MemoryError."),
    ("ETIMEDOUT", "VmmipcTimeoutError", (TimeoutError,),
     "the registration is still live (vmmipc_wait). Also a TimeoutError. "
     "vmmipc.wait() and Ticket.wait() return False instead of raising it."),
)

_BY_STATUS: dict[int, type[VmmipcError]] = {
    _CODES[status]: type(name, (VmmipcError, *also),
                         {"__doc__": f"VMMIPC_{status}: {meaning}", "__module__": __name__,
                          "status": _CODES[status]})
    for status, name, also, meaning in _FAILURES
}
# The classes are module attributes under their own names (InvalidError,
# ...): vmmipc re-exports them and pickle finds them there.
globals().update((cls.__name__, cls) for cls in _BY_STATUS.values())


class LibraryNotFoundError(VmmipcError, OSError):
    """libvmmipc.so could not be found or loaded (status is None)."""
    status = None


def error_for(status: int, message: str, function: str = "") -> VmmipcError:
    """Return the exception for a negative status (VmmipcError if unknown)."""
    cls = _BY_STATUS.get(status, VmmipcError)
    return cls(message or STATUS_NAMES.get(status, f"status {status}"), status, function)


def fork_error(function: str) -> VmmipcError:
    """The VmmipcForkError for a call of `function` in a forked child."""
    return error_for(
        _CODES["EFORK"], "called in a child after fork(): libvmmipc was loaded by the parent and its "
        "Go runtime does not survive fork(); start this process with the 'spawn' or "
        "'forkserver' multiprocessing start method (or exec a new program)", function)
