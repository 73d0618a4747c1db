"""A closed HostBuffer (or host Mapping) leaves nothing to read through.

Closed, it is an empty buffer on every Python: len() is 0, memoryview(),
bytes() and numpy.frombuffer() are empty, item access and `view` raise
ValueError. Being a ctypes array, it is also read through its address by
ctypes itself (string_at, memmove, cast, Array.__getitem__), which crashed
the process (SIGSEGV, SIGFPE) once its memory was unmapped, or read the
memory it had while something kept that mapped: now they read the zeros of
a private mapping, or find an empty array (_exported.disarm). Those routes
run in a child process, so that a crash fails the test, not the run.

Kinds of closed object: "owner" (the HostBuffer that made the memory,
closed by its one name: unmapped at once), "held" (the owner, closed while
another name holds it: unmapped at its collection), "imported" and "cached"
(HostBuffer.from_ticket without and with the import cache: with it, the
mapping stays in this process after close) and "mapping" (a host Mapping).
"""

import ctypes
import gc
import mmap
import os
import subprocess
import sys
import textwrap
import weakref

import pytest

import conftest
import vmmipc

PAGE = mmap.PAGESIZE
SECRET = b"SECRET-BYTES"
pytestmark = pytest.mark.usefixtures("server_running")

KINDS = ["owner", "held", "imported", "cached", "mapping"]

CHILD = textwrap.dedent("""
    import ctypes, sys
    import vmmipc
    kind, route = sys.argv[1:3]
    owner = vmmipc.HostBuffer(4 * 4096)
    owner.view[:12] = b"SECRET-BYTES"
    if kind in ("owner", "held"):
        x = owner
        others = [x] if kind == "held" else []  # another name: unmapped at collection
    elif kind == "mapping":
        x = vmmipc.import_stream(owner.grant(), cache=False)
    else:
        x = vmmipc.HostBuffer.from_ticket(owner.grant(), cache=(kind == "cached"))
    x.close()
    try:
        if route == "string_at":
            out = ctypes.string_at(x, 4)
        elif route == "string_at_all":
            out = ctypes.string_at(x, 4 * 4096)
        elif route == "memmove_from":
            buf = ctypes.create_string_buffer(4)
            ctypes.memmove(buf, x, 4)
            out = buf.raw
        elif route == "memmove_into":
            ctypes.memmove(x, b"EVIL", 4)
            out = "wrote"
        elif route == "cast":
            out = ctypes.cast(x, ctypes.c_char_p).value
        elif route == "array_getitem":
            out = ctypes.Array.__getitem__(x, 0)
        print("result:", repr(out))
    except Exception as e:
        print("raised:", type(e).__name__, e)
    if owner is not x and not owner.closed:
        print("owner:", bytes(owner.view[:12]))
""")


def closed_route(kind: str, route: str) -> str:
    r = subprocess.run([sys.executable, "-c", CHILD, kind, route], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR))
    assert r.returncode == 0, (f"{route} on a closed {kind} killed the process "
                               f"(status {r.returncode}): {r.stderr[-2000:]}")
    return r.stdout


def owner_untouched(kind: str, out: str) -> None:
    if kind in ("imported", "cached", "mapping"):  # the sender's memory is still there
        assert "owner: b'SECRET-BYTES'" in out, out


# What each route gives on a closed object: zeros, an empty string or an
# empty array, never the memory it had; a write lands where nobody sees it.
ROUTES = {
    "string_at": "result: b'\\x00\\x00\\x00\\x00'",
    "string_at_all": f"result: {bytes(4 * 4096)!r}",  # of the old size
    "memmove_from": "result: b'\\x00\\x00\\x00\\x00'",
    "memmove_into": "result: 'wrote'",
    "cast": "result: b''",  # to c_char_p
    # SIGFPE on 3.9-3.11 (a division by the length of a 0-byte class), a
    # byte object over unmapped memory on 3.12+.
    "array_getitem": "raised: IndexError invalid index",
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
def test_closed_route_finds_nothing(kind, route):
    out = closed_route(kind, route)
    assert ROUTES[route] in out, out[:300]
    owner_untouched(kind, out)  # nor did a write reach the shared memory


# -- what Python sees of a closed buffer (in this process) ---------------------

@pytest.fixture(params=KINDS)
def closed(request):
    """A closed object of each kind, and the owner of its memory."""
    owner = vmmipc.HostBuffer(4 * PAGE)
    owner.view[:len(SECRET)] = SECRET
    kind = request.param
    holder = []
    if kind in ("owner", "held"):
        x = owner
        if kind == "held":
            holder.append(x)
    elif kind == "mapping":
        x = vmmipc.import_stream(owner.grant(), cache=False)
    else:
        x = vmmipc.HostBuffer.from_ticket(owner.grant(), cache=(kind == "cached"))
    x.close()
    yield kind, x
    holder.clear()
    owner.unregister_all()
    owner.close()


def test_memoryview_is_empty(closed):
    kind, x = closed
    v = memoryview(x)
    assert (v.nbytes, v.format, v.readonly) == (0, "B", False)
    v.release()


def test_bytes_is_empty(closed):
    assert bytes(closed[1]) == b""


def test_numpy_frombuffer_is_empty(closed):
    np = pytest.importorskip("numpy")
    assert np.frombuffer(closed[1], np.uint8).size == 0


def test_len_agrees_with_the_buffer(closed):
    kind, x = closed
    if kind == "mapping":
        pytest.skip("a Mapping's len() is its size, closed or not (python/vmmipc/_mapping.py)")
    assert len(x) == len(memoryview(x)) == len(bytes(x)) == 0
    assert x.size == 4 * PAGE  # what it was


def test_item_access_and_view_raise_value_error(closed):
    kind, x = closed
    for access in (lambda: x[0], lambda: x[0:4], lambda: x.view, lambda: list(iter(x))):
        with pytest.raises(ValueError, match="closed"):
            access()


def test_pickling_a_closed_buffer_is_refused(closed):
    import pickle
    kind, x = closed
    if kind == "mapping":
        pytest.skip("a Mapping is never pickled, closed or not (python/vmmipc/_mapping.py)")
    with pytest.raises(ValueError, match="closed"):  # imported ones too: no grant of nothing
        pickle.dumps(x)


# -- `view`: close() refuses while it is kept ----------------------------------

@pytest.mark.parametrize("kind", ["owner", "imported"])
def test_close_refuses_while_view_is_kept(kind, hb):
    x = hb if kind == "owner" else vmmipc.HostBuffer.from_ticket(hb.grant(), cache=False)
    x.view[0] = 42  # a view used and dropped at once holds nothing
    v = x.view
    with pytest.raises(vmmipc.BufferInUseError, match="1 view of its memory is still alive"):
        x.close()
    assert not x.closed and v[0] == 42, "close() released the view it refused for"
    v[1] = 43
    del v
    x.close()
    assert x.closed


def test_a_kept_view_counts_with_the_others(hb):
    v, part = hb.view, hb.view[:10]
    with pytest.raises(vmmipc.BufferInUseError, match="2 views of its memory are still alive"):
        hb.close()
    assert v[0] == part[0], "close() released the view it refused for"
    del v
    with pytest.raises(vmmipc.BufferInUseError, match="1 view of its memory is still alive"):
        hb.close()
    part.release()
    hb.close()


# -- nothing stays mapped that should not ---------------------------------------

def memfd_at(addr: int) -> bool:
    """Whether a HostBuffer's memfd is mapped at addr (once it is unmapped,
    something else may be mapped there)."""
    return any(line.startswith(f"{addr:x}-") and "memfd:vmmipc" in line
               for line in open("/proc/self/maps"))


def anonymous_over(addr: int, size: int) -> bool:
    """Whether [addr, addr + size) lies in one mapping of no file. The
    kernel may merge it with a neighbour of the same flags (another closed
    buffer's zero pages), so its line need not start or end there."""
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        if lo <= addr and addr + size <= hi:
            return len(fields) == 5  # no pathname: anonymous
    return False


def test_close_unmaps_the_memory_and_the_zero_pages_are_kept_for_the_next():
    b = vmmipc.HostBuffer(16 * PAGE)
    memory = ctypes.addressof(b)
    assert memfd_at(memory)
    b.close()
    zeros = ctypes.addressof(b)  # where its address leads now
    assert zeros != memory and not memfd_at(memory) and anonymous_over(zeros, 16 * PAGE)
    assert ctypes.string_at(zeros, 16 * PAGE) == bytes(16 * PAGE)
    c = vmmipc.HostBuffer(16 * PAGE)
    c.close()
    assert ctypes.addressof(c) == zeros, "a closed buffer of the same size got pages of its own"
    del b, c
    gc.collect()
    assert anonymous_over(zeros, 16 * PAGE), "the kept zero pages went with the objects"


def test_zero_pages_beyond_the_bound_go_with_the_object(monkeypatch):
    from vmmipc import _exported
    monkeypatch.setattr(_exported, "TOMBSTONE_BYTES", 0)
    b = vmmipc.HostBuffer(13 * PAGE)  # a size no other test closes
    b.close()
    assert ctypes.string_at(b, 13 * PAGE) == bytes(13 * PAGE)
    assert 13 * PAGE not in _exported._tombstones
    tomb = weakref.ref(b._exported_tombstone)  # the zero pages' mmap: unmapped when freed
    del b
    gc.collect()
    assert tomb() is None, "zero pages beyond the bound outlived their object"


def test_held_buffer_keeps_its_memory_until_collected():
    b = vmmipc.HostBuffer(16 * PAGE)
    memory = ctypes.addressof(b)
    other_name = b
    b.close()
    assert memfd_at(memory), "unmapped while something may still read it"
    assert len(other_name) == 0 and bytes(other_name) == b""
    del b, other_name
    gc.collect()
    assert not memfd_at(memory)


def test_without_address_space_for_the_zero_pages_the_memory_stays_until_collected():
    """When the zero pages cannot be mapped (RLIMIT_AS), close() does not
    unmap what the object's address still leads to: reads through it see
    the memory it had, valid until the object goes, never a crash."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import ctypes, gc, resource, vmmipc
        def vm_size():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        b = vmmipc.HostBuffer(64 << 20)
        b.view[:6] = b"STILL!"
        memory = ctypes.addressof(b)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (4 << 20), resource.RLIM_INFINITY))
        b.close()
        print("closed:", b.closed, len(b), bytes(b), ctypes.string_at(b, 6))
        # the memfd's mapping there (once unmapped, another may take the place)
        mapped = lambda: any(l.startswith(f"{memory:x}-") and "memfd:vmmipc" in l
                             for l in open("/proc/self/maps"))
        print("mapped while it lives:", ctypes.addressof(b) == memory and mapped())
        del b
        gc.collect()
        print("mapped after:", mapped())
    """)], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["closed: True 0 b'' b'STILL!'", "mapped while it lives: True",
                                       "mapped after: False"], out.stdout
