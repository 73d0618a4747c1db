"""Finding, loading and declaring libvmmipc.so (ctypes).

The library is loaded lazily, by the first object or call that needs it
(HostBuffer(...), share(...), an explicit reducer install), never at import:
a module the multiprocessing forkserver preloads may import vmmipc without
starting the Go runtime inside the forkserver (whose forked children could
then never use it). The pid at load time is recorded; any call from another
pid (a child made by fork() without exec) raises VmmipcForkError before
entering the library.

Where the library is looked for, in order (candidate_paths):
  1. $VMMIPC_LIBRARY, if set: an explicit choice, and the only one tried.
  2. Next to the package: libvmmipc.so in the package's directory, where
     `pip install ./python` puts it, then in the other directories of its
     __path__: an editable install (`pip install -e ./python`) imports the
     checkout's python/vmmipc/ and puts the library in site-packages/vmmipc/,
     which scikit-build-core adds to the package's __path__.
  3. The checkout's build/libvmmipc.so (`make lib`), only when this package
     is the python/ directory of a libvmmipc checkout.
  4. <prefix>/lib*/libvmmipc.so for sys.prefix and /usr/local (`make
     install`, PREFIX=/usr/local by default), then the system loader
     (libvmmipc.so by name: LD_LIBRARY_PATH, ld.so.cache).
  5. Only when none of those loads: ctypes.util.find_library, which runs
     ldconfig and a compiler in subprocesses (some 10 ms, and a process
     started where none is expected): the package's own library costs a
     stat and the dlopen, nothing more.
The first file that exists and loads is the library; one that loads but
lacks a function of this package's contract is an error, not skipped. When
none loads, the error names first a library that exists but would not load,
with dlopen's reason (the news; not the places that have none).

Also here, beside call() and options(), what every wrapper of a library
object shares: Closeable, the `with` protocol of an object with a close().
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
from typing import TypeVar
from ctypes import (CFUNCTYPE, POINTER, Structure, c_char_p, c_int, c_int32, c_uint8,
                    c_uint32, c_uint64, c_void_p)

from . import _args, _errors

LIBRARY_ENV = "VMMIPC_LIBRARY"
LIBRARY_NAME = "libvmmipc.so"
CONTRACT_VERSION = "0.2"  # the include/vmmipc.h this package binds

TICKET_SIZE = 256
DEVICE_HOST = -1
DEVICE_SAME = -2
MEMORY_HOST = 1
MEMORY_CUDA = 2
MAX_WINDOW = 1024
MAX_ACCESS_DEVICES = 64
MAX_TTL_MS = 1 << 40
MAX_CHUNKS = 1 << 26
IMPORT_NO_CACHE = 0x1
IMPORT_CONFIRM_LATER = 0x2
IMPORT_HOLD = 0x4
REGISTER_HOLD = 0x1


class vmmipc_ticket(Structure):
    _fields_ = [("bytes", c_uint8 * TICKET_SIZE)]


def ticket_array(tickets) -> ctypes.Array:
    """A C array of these tickets (Ticket values: 256 bytes each), for the
    calls that take many (vmmipc_confirm_many, vmmipc_live_many)."""
    return (vmmipc_ticket * len(tickets)).from_buffer_copy(b"".join(tickets))


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
        ("import_flags", c_uint32),
        ("register_flags", c_uint32),
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


class vmmipc_cuda_range_info(Structure):
    _fields_ = [
        ("base", c_uint64),
        ("size", c_uint64),
        ("handle_types", c_uint32),
        ("device", c_int32),
    ]


class vmmipc_cache_info(Structure):
    _fields_ = [
        ("limit_bytes", c_uint64),
        ("entries", c_uint64),
        ("referenced_bytes", c_uint64),
        ("unreferenced_bytes", c_uint64),
        ("hits", c_uint64),
        ("misses", c_uint64),
        ("evictions", c_uint64),
        ("invalidations", c_uint64),
        ("confirms_pending", c_uint64),
        ("confirms_failed", c_uint64),
        ("holds", c_uint64),
        ("holder_sessions", c_uint64),
        ("table_hits", c_uint64),
        ("table_imports", c_uint64),
    ]


class vmmipc_pool_info(Structure):
    _fields_ = [
        ("base", c_uint64),
        ("reserved_bytes", c_uint64),
        ("chunk_size", c_uint64),
        ("keep_bytes", c_uint64),
        ("mapped_bytes", c_uint64),
        ("idle_bytes", c_uint64),
        ("allocated_bytes", c_uint64),
        ("allocations", c_uint64),
        ("chunks_mapped", c_uint64),
        ("chunks_released", c_uint64),
        ("device", c_int32),
        ("torch", c_uint32),
    ]


class vmmipc_arena_block(Structure):
    _fields_ = [
        ("region", c_uint32),
        ("slot", c_uint32),
        ("generation", c_uint64),
        ("offset", c_uint64),
        ("nbytes", c_uint64),
    ]


class vmmipc_arena_info(Structure):
    _fields_ = [
        ("regions", c_uint32),
        ("regions_owned", c_uint32),
        ("slots", c_uint64),
        ("region_bytes", c_uint64),
        ("blocks_writing", c_uint64),
        ("blocks_sent", c_uint64),
        ("blocks_held", c_uint64),
        ("blocks_free", c_uint64),
        ("live_bytes", c_uint64),
        ("carved_bytes", c_uint64),
        ("takeovers", c_uint64),
    ]


# typedef int (*vmmipc_export_fn)(void *user, uint64_t index, int *fd_out);
EXPORT_FN = CFUNCTYPE(c_int, c_void_p, c_uint64, POINTER(c_int))
# typedef void (*vmmipc_release_fn)(void *user);
RELEASE_FN = CFUNCTYPE(None, c_void_p)

_T = POINTER(vmmipc_ticket)
_O = POINTER(vmmipc_options)
_STREAM = c_void_p  # vmmipc_stream *, opaque
_POOL = c_void_p  # vmmipc_pool *, opaque

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
    "vmmipc_register_again": (c_int, [_T, RELEASE_FN, c_void_p, _O, _T]),
    "vmmipc_unregister": (c_int, [_T]),
    "vmmipc_exiting": (c_int, []),
    "vmmipc_wait": (c_int, [_T, c_uint32]),
    "vmmipc_live_registrations": (c_int, [POINTER(c_uint64)]),
    "vmmipc_live_many": (c_int, [_T, ctypes.c_size_t, POINTER(c_uint8)]),
    "vmmipc_cuda_query_range": (c_int, [c_uint64, c_uint64, POINTER(vmmipc_cuda_range_info)]),
    "vmmipc_ticket_decode": (c_int, [_T, POINTER(vmmipc_ticket_info)]),
    "vmmipc_open": (c_int, [_T, _O, POINTER(_STREAM)]),
    "vmmipc_stream_info": (c_int, [_STREAM, POINTER(c_uint64), POINTER(c_uint64)]),
    "vmmipc_pull_next": (c_int, [_STREAM, POINTER(vmmipc_chunk)]),
    "vmmipc_close": (c_int, [_STREAM]),
    "vmmipc_import_stream": (c_int, [_T, c_int, _O, POINTER(vmmipc_mapping)]),
    "vmmipc_confirm": (c_int, [_T, _O]),
    "vmmipc_confirm_many": (c_int, [_T, ctypes.c_size_t, _O, POINTER(c_int)]),
    "vmmipc_release": (c_int, [_T]),
    "vmmipc_holds": (c_int, [POINTER(c_uint64)]),
    "vmmipc_unmap": (c_int, [POINTER(vmmipc_mapping)]),
    "vmmipc_cache_set_limit": (c_int, [c_uint64]),
    "vmmipc_cache_get_info": (c_int, [POINTER(vmmipc_cache_info), ctypes.c_size_t]),
    "vmmipc_arena_size": (c_int, [c_uint32, c_uint32, c_uint64, POINTER(c_uint64)]),
    "vmmipc_arena_format": (c_int, [c_void_p, c_uint64, c_uint32, c_uint32, c_uint64]),
    "vmmipc_arena_claim": (c_int, [c_void_p, c_uint64, c_uint32, POINTER(c_uint32)]),
    "vmmipc_arena_leave": (c_int, [c_void_p, c_uint64, c_uint32, c_uint32]),
    "vmmipc_arena_reap": (c_int, [c_void_p, c_uint64, c_uint32, POINTER(c_uint32)]),
    "vmmipc_arena_alloc": (c_int, [c_void_p, c_uint64, c_uint32, c_uint64,
                                   POINTER(vmmipc_arena_block)]),
    "vmmipc_arena_send": (c_int, [c_void_p, c_uint64, POINTER(vmmipc_arena_block)]),
    "vmmipc_arena_receive": (c_int, [c_void_p, c_uint64, POINTER(vmmipc_arena_block)]),
    "vmmipc_arena_free": (c_int, [c_void_p, c_uint64, POINTER(vmmipc_arena_block)]),
    "vmmipc_arena_drop": (c_int, [c_void_p, c_uint64, POINTER(vmmipc_arena_block)]),
    "vmmipc_arena_get_info": (c_int, [c_void_p, c_uint64, POINTER(vmmipc_arena_info),
                                      ctypes.c_size_t]),
    "vmmipc_pool_create": (c_int, [c_int, c_uint64, c_uint64, POINTER(_POOL)]),
    "vmmipc_pool_alloc": (c_int, [_POOL, c_uint64, POINTER(c_uint64)]),
    "vmmipc_pool_free": (c_int, [_POOL, c_uint64]),
    "vmmipc_pool_trim": (c_int, [_POOL, c_uint64, POINTER(c_uint64)]),
    "vmmipc_pool_get_info": (c_int, [_POOL, POINTER(vmmipc_pool_info), ctypes.c_size_t]),
    "vmmipc_pool_destroy": (c_int, [_POOL]),
    "vmmipc_torch_pool": (c_int, [c_int, c_uint64, POINTER(_POOL)]),
    "vmmipc_strerror": (c_char_p, [c_int]),
    "vmmipc_last_error": (c_char_p, []),
    "vmmipc_version": (c_char_p, []),
}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_load_pid: int | None = None

_HOW_TO_FIX = (
    "To fix, from a libvmmipc checkout: `pip install ./python` builds the library (it needs "
    "Go) and installs vmmipc with it inside; or `make lib` builds build/libvmmipc.so, found "
    "when vmmipc is imported from the checkout's python/ directory; or `make install` "
    f"(PREFIX=/usr/local by default); or set {LIBRARY_ENV} to the path of a libvmmipc.so")


def _checkout_root() -> str | None:
    """The libvmmipc checkout this package sits in (python/vmmipc/ of it), or
    None when it is installed elsewhere (a venv, site-packages)."""
    pkg = os.path.dirname(os.path.abspath(__file__))
    python_dir = os.path.dirname(pkg)
    root = os.path.dirname(python_dir)
    if (os.path.basename(python_dir) == "python"
            and os.path.isfile(os.path.join(root, "include", "vmmipc.h"))
            and os.path.isfile(os.path.join(root, "go.mod"))):
        return root
    return None


def _package_dirs() -> list[str]:
    """The package's own directory, then the rest of its __path__ (an
    editable install's tree, where its build put the library)."""
    package = sys.modules.get(__package__)
    dirs = [os.path.dirname(os.path.abspath(__file__))]
    dirs += [os.path.abspath(d) for d in getattr(package, "__path__", ())]
    return list(dict.fromkeys(dirs))


def _prefix_paths():
    """<prefix>/lib*/libvmmipc.so for sys.prefix and /usr/local."""
    import sysconfig  # only here: the package's own library is usually found first
    libdirs = ["lib", "lib64"]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        libdirs.append(os.path.join("lib", multiarch))
    for prefix in dict.fromkeys([sys.prefix, "/usr/local"]):
        for d in libdirs:
            yield os.path.join(prefix, d, LIBRARY_NAME)


def _candidates():
    """candidate_paths(), one at a time: the later ones (sysconfig's, the
    system loader's) are worked out only when the earlier ones are not
    there, so that loading the package's own library costs a stat and the
    dlopen, and nothing else."""
    env = os.environ.get(LIBRARY_ENV)
    if env:
        yield env
        return
    for d in _package_dirs():
        yield os.path.join(d, LIBRARY_NAME)
    root = _checkout_root()
    if root is not None:
        yield os.path.join(root, "build", LIBRARY_NAME)
    yield from _prefix_paths()
    yield LIBRARY_NAME  # the system loader: LD_LIBRARY_PATH, ld.so.cache, /usr/lib


def candidate_paths() -> list[str]:
    """Where libvmmipc.so is looked for, in order (see the module docstring).
    Entries without a slash are names for the system loader. Starts no
    process: ctypes.util.find_library, which runs ldconfig and a compiler,
    is asked only after all of these have failed (_open)."""
    return list(dict.fromkeys(_candidates()))


def _found_by_find_library(tried: set[str]) -> str | None:
    """The last resort: ctypes.util.find_library("vmmipc") (it runs
    `ldconfig -p` and a compiler in subprocesses, some 10 ms), for a library
    that only the compiler's search path or a versioned soname finds; None
    if it finds nothing not tried already."""
    try:
        import ctypes.util
        name = ctypes.util.find_library("vmmipc")
    except (ImportError, OSError):  # it cannot run (no memory, no ldconfig): it found none
        return None
    return name if name and name not in tried else None


def _load_hint(error: str) -> str:
    """What to do about a dlopen error, where its text alone does not say."""
    if "failed to map segment" in error or "cannot allocate memory" in error.lower():
        return (" (the process has no address space left to map it: its address-space limit, "
                "RLIMIT_AS or `ulimit -v`, is too small, or memory is exhausted; raise the "
                "limit, or load vmmipc before lowering it)")
    if "GLIBC_" in error:
        return (" (it was built against a newer glibc than this system's: build it here, `make "
                "lib`, or install the wheel, built for glibc 2.28)")
    return ""


def _open() -> tuple[ctypes.CDLL, str]:
    env = os.environ.get(LIBRARY_ENV)
    missing: list[str] = []
    failed: list[tuple[str, str]] = []  # (path, dlopen's error): the real causes
    seen: set[str] = set()

    def attempt(path: str):
        seen.add(path)
        if os.sep in path and not os.path.exists(path):
            missing.append(f"{path} (does not exist)")
            return None
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            if os.sep not in path and str(e).startswith(f"{path}: cannot open shared object"):
                missing.append(f"{path} (the system loader has none)")
            else:  # dlopen's message starts with the path, which the error names anyway
                failed.append((path, str(e).removeprefix(f"{path}: ")))
            return None

    for path in _candidates():
        if path not in seen and (handle := attempt(path)) is not None:
            return handle, path
    if not env and not failed:  # when one failed to load, that is the news
        last = _found_by_find_library(seen)
        if last is not None and (handle := attempt(last)) is not None:
            return handle, last
    if failed:
        # A library that exists but does not load: dlopen's reason is the
        # news, not the places where no library is.
        path, error = failed[0]
        others = [f"{p} ({e})" for p, e in failed[1:]] + missing
        if env:
            advice = (f"; point {LIBRARY_ENV} at a libvmmipc.so that loads, or unset it to "
                      "search the usual places")
        else:
            advice = f"; also tried: {'; '.join(others)}" if others else ""
        where = f" (from {LIBRARY_ENV})" if env else ""
        raise _errors.LibraryNotFoundError(
            f"cannot load {path}{where}: {error}{_load_hint(error)}{advice}")
    if env:
        raise _errors.LibraryNotFoundError(
            f"cannot load libvmmipc.so from {LIBRARY_ENV}={env!r}: {missing[0]}. Point "
            f"{LIBRARY_ENV} at a libvmmipc.so (`make lib` in a checkout builds "
            "build/libvmmipc.so), or unset it to search the usual places")
    raise _errors.LibraryNotFoundError(
        "cannot find libvmmipc.so; tried: " + "; ".join(missing)
        + "; and ctypes.util.find_library found none. " + _HOW_TO_FIX)


def _declare(handle: ctypes.CDLL, path: str) -> None:
    missing = [name for name in SIGNATURES if not hasattr(handle, name)]
    if missing:
        try:
            version = handle.vmmipc_version
            version.restype = c_char_p
            found = "libvmmipc " + version().decode()
        except (AttributeError, UnicodeDecodeError):
            found = "a library"
        raise _errors.LibraryNotFoundError(
            f"{path} is {found} without {', '.join(missing)}: this vmmipc package binds the "
            f"libvmmipc {CONTRACT_VERSION} contract (include/vmmipc.h); rebuild the library "
            f"(`make lib`; an installed one: `pip install ./python` again, with -e if it was) "
            f"or point {LIBRARY_ENV} at a matching one")
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(handle, name)
        fn.restype = restype
        fn.argtypes = argtypes


_exit_hooks: list = []  # (fn, exitpriority), see at_exit
_exit_by_atexit = False  # chosen at load: see _install_exit_hooks


def at_exit(fn, priority: int) -> None:
    """Run fn() when a process that has loaded the library exits (not in a
    child made by fork() of it), in the order of multiprocessing finalizers
    of that exitpriority: after multiprocessing has joined the children, and
    also in multiprocessing children, which end with os._exit. Installed
    when the library is loaded, in the process that loads it: a forkserver's
    children start with the finalizers they inherit cleared, and the
    forkserver itself never loads the library. (A hook added after the load
    is installed at once.)"""
    with _lock:
        _exit_hooks.append((fn, priority))
        if loaded() and not _exit_by_atexit:
            _install_exit_hook(fn, priority)


def _install_exit_hooks() -> None:
    """At load (with _lock held). A process that has imported
    multiprocessing (every multiprocessing child has) gets the hooks as its
    finalizers. One that has not gets one atexit function that runs them,
    and importing multiprocessing for that alone would be most of the cost
    of the first call: multiprocessing, imported later, registers its own
    atexit function later, which therefore runs first (atexit runs the last
    registered first), joining the children before these hooks run, as its
    finalizers would."""
    global _exit_by_atexit
    if "multiprocessing.util" in sys.modules:
        for fn, priority in _exit_hooks:
            _install_exit_hook(fn, priority)
    else:
        import atexit
        _exit_by_atexit = True
        atexit.register(_run_exit_hooks)


def _install_exit_hook(fn, priority: int) -> None:
    import multiprocessing.util as mputil
    mputil.Finalize(None, lambda: loaded() and fn(), exitpriority=priority)


def _run_exit_hooks() -> None:
    """The atexit function: every hook, the highest exitpriority first, as
    multiprocessing runs finalizers; one that fails does not stop the rest."""
    if not loaded():
        return  # a child made by fork() of the loading process
    with _lock:
        order = sorted(enumerate(_exit_hooks), key=lambda h: (h[1][1], h[0]), reverse=True)
    for _, (fn, _priority) in order:
        try:
            fn()
        except Exception:  # noqa: BLE001 - as multiprocessing's finalizers: report, go on
            import traceback
            traceback.print_exc()


def lib(function: str = "") -> ctypes.CDLL:
    """The loaded library, loading it on first use. Raises
    LibraryNotFoundError if it cannot be loaded, and VmmipcForkError in a
    child created by fork() after the parent loaded it."""
    global _lib, _load_pid
    if _lib is None:
        with _lock:
            if _lib is None:
                handle, path = _open()
                _declare(handle, path)
                _lib, _load_pid = handle, os.getpid()
                _install_exit_hooks()
    if os.getpid() != _load_pid:
        raise _errors.fork_error(function or "vmmipc")
    return _lib


def usable() -> bool:
    """Whether this process may call into the library (loading it if need
    be): False in a child made by fork() after the parent loaded it (its Go
    runtime is not there), without loading anything."""
    return _lib is None or _load_pid == os.getpid()


def loaded() -> bool:
    """Whether this process has loaded the library (without loading it)."""
    return _lib is not None and _load_pid == os.getpid()


# The calls that never enter Go (vmmipc.h, "Arenas"), and vmmipc_last_error:
# callable in a child made by fork() after the parent loaded the library.
FORK_SAFE = frozenset(name for name in SIGNATURES if name.startswith("vmmipc_arena_"))


def call_fork_safe(function: str, *args) -> int:
    """Call one of FORK_SAFE, also in a forked child of the process that
    loaded the library (the parent's handle; the call never enters Go), and
    raise on a negative status."""
    if function not in FORK_SAFE:
        raise ValueError(f"{function} is not callable after fork()")
    handle = _lib if _lib is not None else lib(function)
    status = getattr(handle, function)(*args)
    if status >= 0:
        return status
    msg = handle.vmmipc_last_error()  # plain C (abi.c): no Go either
    raise _errors.error_for(status, msg.decode("utf-8", "replace") if msg else "", function)


def last_error() -> str:
    """This thread's detail of its last failed call ("" if none)."""
    msg = lib("vmmipc_last_error").vmmipc_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def check(function: str, status: int) -> int:
    """Raise the exception for a negative status; return OK/END unchanged.
    Must be called on the thread that made the call (the detail is
    thread-local). The error names the Python call behind C `function`, and
    the library's detail is put in the Python API's terms
    (_errors.python_message)."""
    if status >= 0:
        return status
    raise _errors.error_for(status, _errors.python_message(last_error()), function)


def call(function: str, *args) -> int:
    """Call vmmipc_<function> and raise on a negative status."""
    fn = getattr(lib(function), function)
    return check(function, fn(*args))


@functools.cache
def _defaults() -> bytes:
    """The library's vmmipc_options_init output, asked for once: it is the
    same on every call (the library's defaults), and asking costs a call into
    Go on every import and grant. A failed call is not cached."""
    o = vmmipc_options()
    call("vmmipc_options_init", ctypes.byref(o), ctypes.sizeof(o))
    return bytes(o)


# options() results by their arguments (each with its type: True is not 1),
# for those without access devices: a pickle or unpickle asks for the same
# few each time. The library only reads the struct, so one may serve every
# call and thread; nobody writes to what options() returns.
_options_made: dict[tuple, vmmipc_options] = {}


def options(function: str, *, uses=None, ttl=None, timeout=None, window=None,
            memory_kind=None, access_devices=(), import_flags: int = 0,
            register_flags: int = 0) -> vmmipc_options:
    """A vmmipc_options filled with the library's defaults, then the given
    fields, never to be written to (it may be shared). Every field is
    checked before the library is touched (errors name the parameter and
    `function`). ttl and timeout are seconds; None keeps the default (never,
    30 s). access_devices is kept alive by the returned struct (``_keep``)."""
    key = None
    if not access_devices:
        key = (type(uses), uses, type(ttl), ttl, type(timeout), timeout, type(window), window,
               type(memory_kind), memory_kind, type(import_flags), import_flags,
               type(register_flags), register_flags)
        try:
            made = _options_made.get(key)
        except TypeError:  # unhashable: _make_options says what is wrong with it
            key = made = None
        if made is not None:
            return made
    o = _make_options(function, uses, ttl, timeout, window, memory_kind, access_devices,
                      import_flags, register_flags)
    if key is not None and len(_options_made) < 64:
        _options_made[key] = o
    return o


def _make_options(function, uses, ttl, timeout, window, memory_kind, access_devices,
                  import_flags, register_flags) -> vmmipc_options:
    fields = {}
    if uses is not None:
        fields["uses"] = _args.u32(uses, "uses", function, "0 = unlimited")
    if ttl is not None:
        fields["ttl_ms"] = _args.milliseconds(ttl, "ttl", 1, MAX_TTL_MS, function,
                                              "None = never")
    if timeout is not None:
        fields["timeout_ms"] = _args.milliseconds(timeout, "timeout", 1, _args.U32_MAX, function,
                                                  "None = the default, 30 s")
    if window is not None:
        fields["window"] = _args.integer(window, "window", 0, MAX_WINDOW, function,
                                         "0 = the library's choice, 1 = lockstep")
    if memory_kind is not None:
        fields["memory_kind"] = _args.u32(memory_kind, "memory_kind", function)
    devs = _args.integers(access_devices or (), "access_devices", _args.I32_MIN, _args.I32_MAX,
                          function, MAX_ACCESS_DEVICES)
    o = vmmipc_options.from_buffer_copy(_defaults())
    for name, value in fields.items():
        setattr(o, name, value)
    if devs:
        arr = (c_int32 * len(devs))(*devs)
        o.access_device_count = len(devs)
        o.access_devices = ctypes.cast(arr, POINTER(c_int32))
        o._keep = arr
    o.import_flags = import_flags
    o.register_flags = register_flags
    return o


_Self = TypeVar("_Self", bound="Closeable")


class Closeable:
    """`with obj:` calls obj.close() at the end of the block, whatever happens
    in it (Chunk, Stream, Mapping, HostBuffer: each owns something, and its
    own close() lets it go)."""
    __slots__ = ()  # Chunk has slots; a base with a __dict__ would undo them

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
