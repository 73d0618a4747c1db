"""Unit tests of the Python shim: errors, tickets, streams, mappings,
registrations, HostBuffer, and the ctypes declarations against the header."""

import ctypes
import fcntl
import gc
import mmap
import os
import pickle
import pickletools
import re
import shutil
import subprocess
import sys
import textwrap
import threading

import pytest

import conftest
import vmmipc
from vmmipc import _lib
from _mp_helpers import fd_changes, fd_count, fd_table, settled_fd_count, wait_for

PAGE = mmap.PAGESIZE
pytestmark = pytest.mark.usefixtures("server_running")


def header_text():
    with open(os.path.join(conftest.ROOT, "include", "vmmipc.h")) as f:
        return f.read()


def header_define(name):
    """The value of a numeric #define of vmmipc.h ("(1ull << 40)" included)."""
    m = re.search(rf"^#define {name}\s+([^/\n]+)", header_text(), re.M)
    assert m, name
    expr = re.sub(r"(\d)(?:ull|u)\b", r"\1", m.group(1).strip())
    assert re.fullmatch(r"[-()<\d\sx]+", expr), expr
    return eval(expr)


def run_python(code, **env):
    e = dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR, **env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                          capture_output=True, text=True, timeout=60)


# -- loading -----------------------------------------------------------------

def test_import_does_not_load_the_library():
    r = run_python("""
        import vmmipc
        maps = lambda: open('/proc/self/maps').read()
        assert 'libvmmipc' not in maps(), 'loaded at import'
        print(vmmipc.version())
        assert 'libvmmipc' in maps()
    """, VMMIPC_LIBRARY=conftest.LIBRARY)
    assert r.returncode == 0, r.stderr
    want = ".".join(str(header_define(f"VMMIPC_VERSION_{p}")) for p in ("MAJOR", "MINOR", "PATCH"))
    assert r.stdout.strip() == want


def test_missing_library_is_a_clear_error():
    r = run_python("""
        import vmmipc
        try:
            vmmipc.live_registrations()
        except vmmipc.LibraryNotFoundError as e:
            assert isinstance(e, OSError) and e.status is None
            print(e)
    """, VMMIPC_LIBRARY="/nonexistent/libvmmipc.so")
    assert r.returncode == 0, r.stderr
    assert "VMMIPC_LIBRARY='/nonexistent/libvmmipc.so'" in r.stdout
    assert "/nonexistent/libvmmipc.so (does not exist)" in r.stdout and "make lib" in r.stdout


def test_every_symbol_is_declared():
    lib = _lib.lib()
    for name, (restype, argtypes) in _lib.SIGNATURES.items():
        fn = getattr(lib, name)
        assert fn.restype is restype and fn.argtypes == argtypes, name
    declared = set(re.findall(r"^(?:int|const char \*)\s*(vmmipc_\w+)\(", header_text(), re.M))
    assert declared == set(_lib.SIGNATURES), declared ^ set(_lib.SIGNATURES)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to read the header")
def test_struct_layout_matches_header(tmp_path):
    fields = {  # every field, in the header's order
        "vmmipc_options": ["struct_size", "uses", "ttl_ms", "timeout_ms", "window",
                           "memory_kind", "access_device_count", "access_devices",
                           "import_flags", "register_flags"],
        "vmmipc_ticket_info": ["memory_kind", "exporter_pid", "chunk_count", "total_size",
                               "device_uuid"],
        "vmmipc_chunk": ["index", "offset", "size", "fd", "reserved_", "file_offset"],
        "vmmipc_mapping": ["addr", "size", "device", "memory_kind", "private_"],
        "vmmipc_ticket": ["bytes"],
        "vmmipc_cuda_range_info": ["base", "size", "handle_types", "device"],
        "vmmipc_cache_info": ["limit_bytes", "entries", "referenced_bytes",
                              "unreferenced_bytes", "hits", "misses", "evictions",
                              "invalidations", "confirms_pending", "confirms_failed", "holds",
                              "holder_sessions", "table_hits", "table_imports"],
        "vmmipc_arena_block": ["region", "slot", "generation", "offset", "nbytes"],
        "vmmipc_arena_info": ["regions", "regions_owned", "slots", "region_bytes",
                              "blocks_writing", "blocks_sent", "blocks_held", "blocks_free",
                              "live_bytes", "carved_bytes", "takeovers"],
    }
    lines = []
    for struct, names in fields.items():
        lines.append(f'printf("{struct} %zu\\n", sizeof({struct}));')
        for n in names:
            lines.append(f'printf("{struct}.{n} %zu %zu\\n", offsetof({struct}, {n}), '
                         f'sizeof((({struct} *)0)->{n}));')
    src = tmp_path / "layout.c"
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include \"vmmipc.h\"\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n")
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-I", os.path.join(conftest.ROOT, "include"), str(src), "-o", str(exe)],
                   check=True)
    want = dict(line.split(" ", 1) for line in
                subprocess.run([str(exe)], capture_output=True, text=True).stdout.splitlines())
    for struct, names in fields.items():
        cls = getattr(_lib, struct)
        assert [f[0] for f in cls._fields_] == names, struct
        assert ctypes.sizeof(cls) == int(want[struct]), struct
        for n in names:
            got = f"{getattr(cls, n).offset} {getattr(cls, n).size}"
            assert got == want[f"{struct}.{n}"], f"{struct}.{n}"


def test_constants_match_the_header():
    for name in ("TICKET_SIZE", "DEVICE_HOST", "DEVICE_SAME", "MEMORY_HOST", "MEMORY_CUDA",
                 "MAX_WINDOW", "MAX_ACCESS_DEVICES", "MAX_TTL_MS", "MAX_CHUNKS",
                 "IMPORT_NO_CACHE", "IMPORT_CONFIRM_LATER"):
        assert getattr(vmmipc, name) == header_define(f"VMMIPC_{name}"), name


def test_status_tables_match_the_header():
    statuses = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"^#define VMMIPC_(OK|END|E[A-Z]+) \(?(-?\d+)\)?", header_text(), re.M)}
    assert statuses == {n: getattr(vmmipc, n) for n in statuses}
    from vmmipc import _errors
    assert set(_errors.STATUS_NAMES) == set(statuses.values())
    assert {v: f"VMMIPC_{k}" for k, v in statuses.items()} == _errors.STATUS_NAMES
    for name, status in statuses.items():
        if status < 0:  # one exception class per error status
            assert type(vmmipc.error_for(status, "m")) is not vmmipc.VmmipcError, name


# -- errors ------------------------------------------------------------------

@pytest.mark.parametrize("status,cls", [
    (vmmipc.EINVAL, vmmipc.InvalidError), (vmmipc.EBADF, vmmipc.BadHandleError),
    (vmmipc.EAUTH, vmmipc.AuthError), (vmmipc.ENOENT, vmmipc.NotFoundError),
    (vmmipc.EIO, vmmipc.VmmipcIOError), (vmmipc.EEXPORT, vmmipc.ExportError),
    (vmmipc.ECUDA, vmmipc.CudaError), (vmmipc.ENFILE, vmmipc.OutOfDescriptorsError),
    (vmmipc.EFORK, vmmipc.VmmipcForkError), (vmmipc.EINTERNAL, vmmipc.InternalError),
    (vmmipc.ENOMEM, vmmipc.VmmipcMemoryError), (vmmipc.ETIMEDOUT, vmmipc.VmmipcTimeoutError),
    (vmmipc.ECONFIG, vmmipc.ConfigError),
])
def test_error_class_per_status(status, cls):
    e = vmmipc.error_for(status, "chunk 17 of 4096: what failed", "vmmipc_fn")
    assert type(e) is cls and isinstance(e, vmmipc.VmmipcError)
    assert (e.status, e.message, e.function) == (status, "chunk 17 of 4096: what failed",
                                                  "vmmipc_fn")
    assert str(e) == f"vmmipc_fn: chunk 17 of 4096: what failed [{e.status_name}]"
    assert vmmipc.strerror(status).startswith(e.status_name + ":")
    back = pickle.loads(pickle.dumps(e))  # errors cross processes intact
    assert (type(back), back.status, back.message, back.function) == (cls, status, e.message,
                                                                      e.function)


def test_errors_are_also_the_builtin_kind():
    assert isinstance(vmmipc.error_for(vmmipc.EINVAL, "m"), ValueError)
    assert isinstance(vmmipc.error_for(vmmipc.ENOMEM, "m"), MemoryError)
    e = vmmipc.error_for(vmmipc.ETIMEDOUT, "still live", "vmmipc_wait")
    # named by the Python call behind the C function (test_messages.py)
    assert isinstance(e, TimeoutError) and str(e) == "vmmipc.wait: still live [VMMIPC_ETIMEDOUT]"
    assert isinstance(vmmipc.LibraryNotFoundError("m"), OSError)
    assert isinstance(vmmipc.error_for(vmmipc.ENFILE, "m"), OSError)


def test_library_message_reaches_the_exception():
    with pytest.raises(vmmipc.InvalidError) as e:
        vmmipc.unregister(vmmipc.Ticket(bytes(256)))
    assert e.value.status == vmmipc.EINVAL
    assert e.value.function == "vmmipc.unregister"
    assert "magic" in e.value.message  # the library's own detail
    # The detail is per call: a later failure carries its own message.
    with pytest.raises(vmmipc.InvalidError) as e2:
        vmmipc.register_host_file(-1, 4096, PAGE)
    assert "fd -1" in e2.value.message and e2.value.function == "vmmipc.register_host_file"


def test_invalid_arguments():
    with pytest.raises(vmmipc.InvalidError, match="page size"):
        vmmipc.register_host_file(0, 4096, 100)
    with pytest.raises(vmmipc.InvalidError, match="ttl"):
        vmmipc.register([PAGE], lambda i: -1, ttl=-1)
    with pytest.raises(vmmipc.InvalidError, match="page size"):
        vmmipc.register([100, PAGE], lambda i: -1)  # host chunks but the last: page multiples
    with pytest.raises(ValueError):
        vmmipc.HostBuffer(PAGE, chunk_size=100)
    with pytest.raises(ValueError):
        vmmipc.HostBuffer(0)


def test_cuda_entry_points_without_a_usable_gpu():
    # No GPU here: the driver is missing (ECUDA); with one, a bogus range is
    # EINVAL (share) or ENOENT (query: not VMM memory).
    with pytest.raises((vmmipc.CudaError, vmmipc.InvalidError)) as e:
        vmmipc.share(1 << 40, 2 << 20)
    assert e.value.message
    with pytest.raises((vmmipc.CudaError, vmmipc.NotFoundError)) as e:
        vmmipc.cuda_query_range(1 << 40, 2 << 20)
    assert e.value.message and e.value.function == "vmmipc.cuda_query_range"


# -- tickets -----------------------------------------------------------------

def test_ticket_pickles_and_decodes(hb):
    t = hb.grant()
    assert isinstance(t, vmmipc.Ticket) and isinstance(t, bytes) and len(t) == vmmipc.TICKET_SIZE
    back = pickle.loads(pickle.dumps(t))
    assert type(back) is vmmipc.Ticket and back == t
    info = back.info()
    assert info == vmmipc.TicketInfo(vmmipc.MEMORY_HOST, os.getpid(), 16, 16 * PAGE, bytes(16))
    assert t.hex() not in repr(t) and "chunks=16" in repr(t)
    with pytest.raises(vmmipc.InvalidError):
        vmmipc.Ticket(b"short")


def test_hostbuffer_pickle_carries_its_ticket_as_plain_bytes(hb):
    """A HostBuffer's pickle names its rebuild function and nothing else of
    vmmipc's (the ticket is bytes: pickling a Ticket's class doubled the
    pickle's cost each way); a pickle made with a Ticket still loads."""
    data = pickle.dumps(hb)
    names = [arg for op, arg, _ in pickletools.genops(data) if op.name == "SHORT_BINUNICODE"]
    assert names == ["vmmipc._reductions", "rebuild_host_buffer"]
    fn, (ticket, chunk_size) = hb.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    assert type(ticket) is bytes and len(ticket) == vmmipc.TICKET_SIZE and chunk_size == hb.chunk_size
    vmmipc.unregister(ticket)  # that grant is never sent
    before = vmmipc.cache_info()
    with pickle.loads(data) as got, fn(hb.grant(), hb.chunk_size) as old:
        assert bytes(got[:8]) == bytes(old[:8]) == bytes(hb[:8]) and got.size == old.size == hb.size
    assert vmmipc.cache_info().misses + vmmipc.cache_info().hits == before.misses + before.hits + 2


def tampered(t, offset, value):
    b = bytearray(t)
    b[offset:offset + len(value)] = value
    return vmmipc.Ticket(b)


def test_bad_tickets(hb):
    t = hb.grant(uses=0)
    with pytest.raises(vmmipc.InvalidError, match="magic"):
        vmmipc.import_stream(tampered(t, 0, b"XXXX"))
    with pytest.raises(vmmipc.InvalidError):
        vmmipc.Ticket(bytes(256)).info()
    secret = bytes(b ^ 0xFF for b in t[40:72])  # the 256-bit secret (ticket format 3)
    with pytest.raises(vmmipc.AuthError, match="secret"):
        vmmipc.open(tampered(t, 40, secret))
    wrong_pid = (os.getpid() + 1).to_bytes(4, "little")
    # That pid is gone (EIO), or another process that cannot have our socket (EAUTH).
    with pytest.raises((vmmipc.VmmipcIOError, vmmipc.AuthError), match="pid"):
        vmmipc.open(tampered(t, 12, wrong_pid))
    with pytest.raises(vmmipc.InvalidError, match="host memory"):
        vmmipc.import_stream(t, 0)  # host ticket onto a GPU
    vmmipc.unregister(t)
    with pytest.raises(vmmipc.NotFoundError, match="unregistered"):
        vmmipc.open(t)
    with pytest.raises(vmmipc.NotFoundError):
        vmmipc.unregister(t)


def test_uses_are_counted(hb):
    t = hb.grant(uses=2)
    for _ in range(2):
        with vmmipc.import_stream(t) as m:
            assert m.view == hb.view
    with pytest.raises(vmmipc.NotFoundError, match="used up"):
        vmmipc.import_stream(t)


# -- streams -----------------------------------------------------------------

def test_stream_yields_chunks_and_closes_each_fd(hb):
    live = vmmipc.live_registrations()
    t = hb.grant()
    base = settled_fd_count()
    seen = []
    with vmmipc.open(t) as s:
        assert (s.count, s.total_size) == (16, 16 * PAGE)
        for c in s:
            assert (c.index, c.offset, c.size) == (len(seen), len(seen) * PAGE, PAGE)
            assert all(prev.closed and prev.fd == -1 for prev in seen)
            data = os.pread(c.fd, c.size, c.file_offset)  # the chunk's own bytes
            assert data == hb.view[c.offset:c.offset + c.size]
            # Both ends run in this process: each holds its socket and at most
            # the one chunk it is handling.
            assert fd_count() <= base + 4
            seen.append(c)
        assert s.done and seen[-1].closed
    assert len(seen) == 16
    assert wait_for(lambda: fd_count() == base)
    assert wait_for(lambda: vmmipc.live_registrations() == live)  # the use was consumed


def test_detach_transfers_the_fd(hb):
    t = hb.grant()
    kept = None
    with vmmipc.open(t) as s:
        for c in s:
            if c.index == 3:
                kept = c.detach()
                assert c.fd == -1 and c.closed
                with pytest.raises(ValueError):
                    c.detach()
    try:
        assert os.pread(kept, PAGE, 3 * PAGE) == hb.view[3 * PAGE:4 * PAGE]  # still open: ours
    finally:
        os.close(kept)


def test_closing_a_stream_early_gives_the_use_back(hb):
    t = hb.grant()
    base = settled_fd_count()
    s = vmmipc.open(t, window=1)  # the use is spent once all 16 chunks were sent
    next(s), next(s)
    s.close()
    # The server (in this same process) closes its end when it sees ours go.
    assert s.closed and wait_for(lambda: fd_count() == base)
    with pytest.raises(vmmipc.BadHandleError):
        next(s)
    with vmmipc.import_stream(t) as m:  # the use is still there
        assert m.view == hb.view


# -- register with an export function ----------------------------------------

def memfd_with(data):
    """A memfd holding data, sealed against shrinking (host chunks must be)."""
    import fcntl
    fd = os.memfd_create("test-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


def test_register_export_fn_and_release_once():
    chunks = [bytes([i]) * PAGE for i in range(8)]
    asked, released = [], threading.Event()
    calls = []

    def export(i):
        asked.append(i)
        return memfd_with(chunks[i])

    def release():
        calls.append(threading.get_ident())
        released.set()

    base = settled_fd_count()
    t = vmmipc.register([PAGE] * 8, export, uses=1, release=release)
    assert fd_count() == base  # registering opens nothing
    with vmmipc.import_stream(t) as m:
        assert m.view == b"".join(chunks)
        assert (m.size, m.device, m.memory_kind) == (8 * PAGE, vmmipc.DEVICE_HOST,
                                                      vmmipc.MEMORY_HOST)
    assert asked == list(range(8))
    assert released.wait(5) and len(calls) == 1
    assert wait_for(lambda: fd_count() == base)  # every exported fd was closed


def test_export_fn_failure_names_the_chunk():
    def export(i):
        if i == 5:
            raise OSError(28, "no space")
        return memfd_with(b"x" * PAGE)

    t = vmmipc.register([PAGE] * 8, export, uses=0)
    base = settled_fd_count()
    with pytest.raises(vmmipc.ExportError, match="chunk 5") as e:
        vmmipc.import_stream(t)
    assert "28" in e.value.message  # export_fn's return value: the errno
    assert wait_for(lambda: fd_count() == base)  # all or nothing: nothing left open
    vmmipc.unregister(t)


def test_release_runs_on_unregister_and_ttl():
    done = []
    t = vmmipc.register([PAGE], lambda i: memfd_with(b"y" * PAGE), release=lambda: done.append(1))
    vmmipc.unregister(t)
    assert wait_for(lambda: done == [1])
    t = vmmipc.register([PAGE], lambda i: memfd_with(b"y" * PAGE), ttl=0.05,
                        release=lambda: done.append(2))
    assert wait_for(lambda: done == [1, 2])
    with pytest.raises(vmmipc.NotFoundError, match="expired"):
        vmmipc.open(t)


# -- export-side generators --------------------------------------------------

def test_export_fds_yields_one_fd_at_a_time(hb):
    live, base = vmmipc.live_registrations(), settled_fd_count()
    got = []
    for c in vmmipc.export_chunks(hb):
        assert fd_count() <= base + 4  # as above: both ends are here
        got.append(os.pread(c.fd, c.size, c.file_offset))
    assert b"".join(got) == hb.view
    fds = []
    for fd in vmmipc.export_fds(hb):
        os.fstat(fd)  # open while it is the current one
        fds.append(fd)
    assert len(fds) == 16
    assert wait_for(lambda: fd_count() == base)
    assert wait_for(lambda: vmmipc.live_registrations() == live)


def test_export_generator_closed_early_unregisters(hb):
    live, base = vmmipc.live_registrations(), settled_fd_count()
    before = fd_table()
    g = vmmipc.export_fds(hb, window=1)  # with a wider window all 16 chunks go at once
    next(g)
    assert vmmipc.live_registrations() == live + 1
    g.close()
    assert wait_for(lambda: fd_count() == base), fd_changes(before)
    assert wait_for(lambda: vmmipc.live_registrations() == live)


# -- mappings and HostBuffer -------------------------------------------------

def test_mapping_refuses_to_unmap_under_a_live_view(hb):
    m = vmmipc.import_stream(hb.grant())
    part = m.view[PAGE:2 * PAGE]
    with pytest.raises(BufferError):
        m.close()
    assert not m.closed and part == hb.view[PAGE:2 * PAGE]
    part.release()
    m.close()
    assert m.closed
    m.close()  # idempotent
    with pytest.raises(ValueError):
        m.view


def test_mapping_is_unmapped_when_collected(hb):
    m = vmmipc.import_stream(hb.grant(), cache=False)  # a cached one would stay mapped
    addr = m.addr
    view = m.view[:PAGE]
    del m
    gc.collect()
    assert view == hb.view[:PAGE]  # a live view keeps the memory mapped
    maps = open("/proc/self/maps").read()
    assert f"{addr:x}-" in maps
    view.release()
    del view
    gc.collect()
    assert f"{addr:x}-" not in open("/proc/self/maps").read()


def test_hostbuffer_owner_basics(hb):
    assert (len(hb), hb.size, hb.chunk_size, hb.n_chunks) == (16 * PAGE, 16 * PAGE, PAGE, 16)
    assert hb.is_owner and not hb.closed
    seals = fcntl.fcntl(hb.fileno(), fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
    hb[0:3] = b"abc"
    assert bytes(hb[0:3]) == b"abc" and hb.view.readonly is False
    odd = vmmipc.HostBuffer(3 * PAGE + 5, chunk_size=2 * PAGE)  # short last chunk
    odd[-5:] = b"tail!"
    imported = pickle.loads(pickle.dumps(odd))
    assert (imported.size, imported.chunk_size, imported.n_chunks) == (3 * PAGE + 5, 2 * PAGE, 2)
    assert bytes(imported[-5:]) == b"tail!"
    imported.close()
    odd.close()


def test_hostbuffer_roundtrip_shares_memory(hb):
    other = pickle.loads(pickle.dumps(hb))
    assert not other.is_owner and other.view == hb.view
    other[5:10] = b"hello"
    assert bytes(hb[5:10]) == b"hello"
    with pytest.raises(TypeError, match="imported"):
        pickle.dumps(other)
    other.close()
    assert other.closed


def test_hostbuffer_close_refuses_while_exported():
    b = vmmipc.HostBuffer(PAGE)
    part = b.view[:10]
    with pytest.raises(BufferError):
        b.close()
    part.release()
    b.close()
    assert b.closed


def test_hostbuffer_memfd_outlives_owner_until_release():
    base = settled_fd_count()
    b = vmmipc.HostBuffer(4 * PAGE, chunk_size=PAGE)
    b[:4] = b"keep"
    t = b.grant()
    b.close()
    assert fd_count() == base + 1  # the registration still holds the memfd
    with vmmipc.import_stream(t) as m:  # and it can still be fetched
        assert bytes(m.view[:4]) == b"keep"
    assert wait_for(lambda: fd_count() == base)


def test_version_has_one_home():
    # include/vmmipc.h owns the version: the library reports it, __version__
    # asks the library (when read: test_import_does_not_load_the_library
    # holds), pyproject.toml's metadata reads the header, and no Python file
    # writes a version of its own.
    import ast
    want = ".".join(str(header_define(f"VMMIPC_VERSION_{p}")) for p in ("MAJOR", "MINOR", "PATCH"))
    assert vmmipc.version() == want
    assert vmmipc.__version__ == want
    with open(os.path.join(conftest.PYTHON_DIR, "pyproject.toml")) as f:
        assert 'input = "../include/vmmipc.h"' in f.read()
    package = os.path.join(conftest.PYTHON_DIR, "vmmipc")
    for name in os.listdir(package):
        if name.endswith(".py"):
            with open(os.path.join(package, name)) as f:
                tree = ast.parse(f.read())
            assigned = [t.id for node in ast.walk(tree) if isinstance(node, ast.Assign)
                        for t in node.targets if isinstance(t, ast.Name)]
            assert "__version__" not in assigned, f"{name} writes a version of its own"


def test_old_names_warn_and_still_work():
    # Renamed in 0.2 (a name says one thing): HostBuffer.share -> grant,
    # HostBuffer(uses=, ttl=) -> pickle_uses=, pickle_ttl=. The old names
    # work for one release and warn.
    with pytest.warns(DeprecationWarning, match=r"HostBuffer\(uses=\) is deprecated: use "
                                                r"HostBuffer\(pickle_uses=\)") as w:
        hb = vmmipc.HostBuffer(PAGE, uses=2)
    assert w[0].filename == __file__, "the warning names the caller's line (default filters show it)"
    with pytest.warns(DeprecationWarning, match=r"HostBuffer\(ttl=\) is deprecated"):
        vmmipc.HostBuffer(PAGE, ttl=5).close()
    assert hb.pickle_uses == 2
    with pytest.raises(TypeError, match="unexpected keyword argument 'usess'"):
        vmmipc.HostBuffer(PAGE, usess=2)
    hb.view[:4] = b"old!"
    with pytest.warns(DeprecationWarning, match=r"HostBuffer\.share is deprecated: use HostBuffer\.grant") as w:
        t = hb.share(uses=1)
    assert w[0].filename == __file__
    assert hb.pending_tickets() == [t]  # a grant of the anchor, as grant() makes
    with vmmipc.import_stream(t, cache=False) as m:
        assert bytes(m.view[:4]) == b"old!"
    hb.unregister_all()
    hb.close()


def test_cuda_core_share_buffer_is_grant_buffer_renamed():
    # vmmipc.cuda_core.share_buffer -> grant_buffer (no GPU needed: a closed
    # Buffer is refused by grant_buffer, reached through the old name).
    import types
    import vmmipc.cuda_core as vc
    closed = types.SimpleNamespace(is_closed=True, handle=0, size=0)
    with pytest.raises(ValueError, match="closed Buffer"):
        vc.grant_buffer(closed)
    with pytest.warns(DeprecationWarning, match="share_buffer is deprecated: use "
                                                "vmmipc.cuda_core.grant_buffer"):
        with pytest.raises(ValueError, match="closed Buffer"):
            vc.share_buffer(closed)
