"""Finding, loading and declaring libvmmipc.so (ctypes).

The library is loaded lazily, on the first call that needs it, never at
import: a module the multiprocessing forkserver preloads may import vmmipc
without starting the Go runtime inside the forkserver (whose forked children
could then never use it). The pid at load time is recorded; any call from
another pid (a child made by fork() without exec) raises VmmipcForkError
before entering the library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_int, c_int32, c_uint8,
                    c_uint32, c_uint64, c_void_p)

from . import _errors

LIBRARY_ENV = "VMMIPC_LIBRARY"
LIBRARY_NAME = "libvmmipc.so"

TICKET_SIZE = 256
DEVICE_HOST = -1
DEVICE_SAME = -2
MEMORY_HOST = 1
MEMORY_CUDA = 2


class vmmipc_ticket(Structure):
    _fields_ = [("bytes", c_uint8 * TICKET_SIZE)]


class vmmipc_options(Structure):
    _fields_ = [
        ("struct_size", c_uint32),
        ("uses", c_uint32),
        ("ttl_ms", c_uint64),
        ("timeout_ms", c_uint32),
        ("window", c_uint32),
        ("memory_kind", c_uint32),
        ("access_device_count", c_uint32),
        ("access_devices", POINTER(c_int32)),
    ]


class vmmipc_ticket_info(Structure):
    _fields_ = [
        ("memory_kind", c_uint32),
        ("exporter_pid", c_uint32),
        ("chunk_count", c_uint64),
        ("total_size", c_uint64),
        ("device_uuid", c_uint8 * 16),
    ]


class vmmipc_chunk(Structure):
    _fields_ = [
        ("index", c_uint64),
        ("offset", c_uint64),
        ("size", c_uint64),
        ("fd", c_int),
        ("reserved_", c_uint32),
        ("file_offset", c_uint64),
    ]


class vmmipc_mapping(Structure):
    _fields_ = [
        ("addr", c_uint64),
        ("size", c_uint64),
        ("device", c_int32),
        ("memory_kind", c_uint32),
        ("private_", c_uint64 * 4),
    ]


# typedef int (*vmmipc_export_fn)(void *user, uint64_t index, int *fd_out);
EXPORT_FN = CFUNCTYPE(c_int, c_void_p, c_uint64, POINTER(c_int))
# typedef void (*vmmipc_release_fn)(void *user);
RELEASE_FN = CFUNCTYPE(None, c_void_p)

_T = POINTER(vmmipc_ticket)
_O = POINTER(vmmipc_options)
_STREAM = c_void_p  # vmmipc_stream *, opaque

# name: (restype, argtypes) for every symbol of vmmipc.h.
SIGNATURES = {
    "vmmipc_options_init": (c_int, [_O, ctypes.c_size_t]),
    "vmmipc_register": (c_int, [POINTER(c_uint64), c_uint64, EXPORT_FN, RELEASE_FN,
                                c_void_p, _O, _T]),
    "vmmipc_register_host_file": (c_int, [c_int, c_uint64, c_uint64, RELEASE_FN,
                                          c_void_p, _O, _T]),
    "vmmipc_register_cuda": (c_int, [c_uint64, c_uint64, _O, _T]),
    "vmmipc_register_cuda_handles": (c_int, [POINTER(c_uint64), POINTER(c_uint64), c_uint64,
                                             RELEASE_FN, c_void_p, _O, _T]),
    "vmmipc_unregister": (c_int, [_T]),
    "vmmipc_live_registrations": (c_int, [POINTER(c_uint64)]),
    "vmmipc_ticket_decode": (c_int, [_T, POINTER(vmmipc_ticket_info)]),
    "vmmipc_open": (c_int, [_T, _O, POINTER(_STREAM)]),
    "vmmipc_stream_info": (c_int, [_STREAM, POINTER(c_uint64), POINTER(c_uint64)]),
    "vmmipc_pull_next": (c_int, [_STREAM, POINTER(vmmipc_chunk)]),
    "vmmipc_close": (c_int, [_STREAM]),
    "vmmipc_import_stream": (c_int, [_T, c_int, _O, POINTER(vmmipc_mapping)]),
    "vmmipc_unmap": (c_int, [POINTER(vmmipc_mapping)]),
    "vmmipc_strerror": (c_char_p, [c_int]),
    "vmmipc_last_error": (c_char_p, []),
    "vmmipc_version": (c_char_p, []),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_pid: int | None = None
_load_path: str | None = None


def candidate_paths() -> list[str]:
    """Where libvmmipc.so is looked for, in order."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = []
    env = os.environ.get(LIBRARY_ENV)
    if env:
        paths.append(env)
    paths.append(os.path.join(here, LIBRARY_NAME))  # installed next to the package
    # A checkout: python/vmmipc/ -> <root>/build/libvmmipc.so
    paths.append(os.path.join(os.path.dirname(os.path.dirname(here)), "build", LIBRARY_NAME))
    found = ctypes.util.find_library("vmmipc")
    if found:
        paths.append(found)
    paths.append(LIBRARY_NAME)  # let the dynamic loader search
    return paths


def _open() -> tuple[ctypes.CDLL, str]:
    env = os.environ.get(LIBRARY_ENV)
    if env and not os.path.exists(env):
        raise _errors.LibraryNotFoundError(
            f"{LIBRARY_ENV}={env!r} does not exist; point it at a built libvmmipc.so "
            "(make lib builds build/libvmmipc.so)")
    tried = []
    for path in candidate_paths():
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (missing)")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"{path} ({e})")
            if path == env:
                break  # an explicit choice that fails is an error, not a hint
    raise _errors.LibraryNotFoundError(
        "cannot load libvmmipc.so; tried: " + "; ".join(tried) +
        f". Build it with `make lib`, install it, or set {LIBRARY_ENV} to its path")


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def lib(function: str = "") -> ctypes.CDLL:
    """The loaded library, loading it on first use. Raises VmmipcForkError in
    a child created by fork() after the parent loaded it."""
    global _lib, _load_pid, _load_path
    if _lib is not None:
        if os.getpid() != _load_pid:
            raise _errors.fork_error(function or "vmmipc")
        return _lib
    with _lock:
        if _lib is None:
            handle, path = _open()
            _declare(handle)
            _lib, _load_pid, _load_path = handle, os.getpid(), path
    if os.getpid() != _load_pid:
        raise _errors.fork_error(function or "vmmipc")
    return _lib


def loaded() -> bool:
    """Whether this process has loaded the library (without loading it)."""
    return _lib is not None and _load_pid == os.getpid()


def loaded_path() -> str | None:
    return _load_path


def last_error() -> str:
    """This thread's detail of its last failed call ("" if none)."""
    msg = lib("vmmipc_last_error").vmmipc_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(function: str, status: int) -> int:
    """Raise the exception for a negative status; return OK/END unchanged.
    Must be called on the thread that made the call (the detail is
    thread-local)."""
    if status >= 0:
        return status
    raise _errors.error_for(status, last_error(), function)


def call(function: str, *args) -> int:
    """Call vmmipc_<function> and raise on a negative status."""
    fn = getattr(lib(function), function)
    return check(function, fn(*args))


def options(*, uses: int | None = None, ttl: float | None = None, timeout: float | None = None,
            window: int | None = None, memory_kind: int | None = None,
            access_devices=()) -> vmmipc_options:
    """A vmmipc_options filled with the library's defaults, then the given
    fields. ttl and timeout are seconds. access_devices is kept alive by the
    returned struct (``_keep``)."""
    o = vmmipc_options()
    call("vmmipc_options_init", ctypes.byref(o), ctypes.sizeof(o))
    if uses is not None:
        if not 0 <= uses < 2**32:
            raise _errors.InvalidError(f"uses={uses} must be in [0, 2**32) (0 = unlimited)",
                                       _errors.EINVAL)
        o.uses = uses
    if ttl is not None:
        if ttl <= 0:
            raise _errors.InvalidError(f"ttl={ttl} must be positive seconds (None = never)",
                                       _errors.EINVAL)
        o.ttl_ms = max(1, int(round(ttl * 1000)))
    if timeout is not None:
        ms = int(round(timeout * 1000))
        if not 0 < ms < 2**32:
            raise _errors.InvalidError(f"timeout={timeout} must be positive seconds",
                                       _errors.EINVAL)
        o.timeout_ms = ms
    if window is not None:
        o.window = window
    if memory_kind is not None:
        o.memory_kind = memory_kind
    devs = list(access_devices or ())
    if devs:
        arr = (c_int32 * len(devs))(*devs)
        o.access_device_count = len(devs)
        o.access_devices = ctypes.cast(arr, POINTER(c_int32))
        o._keep = arr
    return o
