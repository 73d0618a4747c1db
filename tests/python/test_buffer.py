"""HostBuffer and host Mappings are buffers (python/vmmipc/_exported.py):
memoryview, bytes, numpy and torch see their memory without a copy, a
receiver process sees writes made through them, and close() says which
views still hold the memory instead of unmapping it under them.

The numpy tests need numpy, which `make deps` (part of `make test` and
`make test-python`) installs; under make (VMMIPC_TESTS_REQUIRE=numpy) a
missing numpy fails them instead of skipping them, elsewhere they skip
saying so. The torch test needs torch, which nothing installs (a large
download): without it, it skips with a reason that says so (`make
test-python` lists every skip)."""

import gc
import mmap
import multiprocessing as mp
import os
import pickle
import sys

import pytest

import vmmipc
from _mp_helpers import buffer_child

PAGE = mmap.PAGESIZE
PEP688 = sys.version_info >= (3, 12)
NO_NUMPY = "numpy is not installed: `make deps` (part of `make test`) installs it, or pip install numpy"
NO_TORCH = ("torch is not installed: `make test` does not install it (a large download); "
            "pip install torch (the CPU build will do) to run this test")


def numpy_or_skip():
    """numpy; where the runner requires it (make: VMMIPC_TESTS_REQUIRE has
    numpy), its absence is a failure, never a silent skip."""
    if "numpy" in os.environ.get("VMMIPC_TESTS_REQUIRE", "").split(","):
        try:
            import numpy
        except ImportError as e:
            pytest.fail(f"VMMIPC_TESTS_REQUIRE names numpy, but it does not import ({e}): run make deps")
        return numpy
    return pytest.importorskip("numpy", reason=NO_NUMPY)
pytestmark = pytest.mark.usefixtures("server_running")


def mapped(addr: int) -> bool:
    return f"{addr:x}-" in open("/proc/self/maps").read()


@pytest.fixture(params=["owner", "imported", "mapping"])
def buf(request, hb):
    """A HostBuffer (owner or imported) or a host Mapping of hb's 16 pages."""
    if request.param == "owner":
        yield hb
    elif request.param == "imported":
        b = vmmipc.HostBuffer.from_ticket(hb.grant(), cache=False)
        yield b
        gc.collect()
        b.close()
    else:
        m = vmmipc.import_stream(hb.grant(), cache=False)
        yield m
        gc.collect()
        m.close()


def test_memoryview_is_the_memory(buf, hb):
    v = memoryview(buf)
    assert (v.format, v.itemsize, v.ndim, v.nbytes, v.readonly, v.c_contiguous) == \
        ("B", 1, 1, hb.size, False, True)
    assert len(buf) == hb.size and bytes(v[:4]) == bytes(hb.view[:4])
    v[5:10] = b"hello"
    v[0] = 42
    assert bytes(hb.view[5:10]) == b"hello" and hb[0] == 42 and buf[0] == 42
    assert bytes(buf[5:10]) == b"hello" and list(buf[5:7]) == [ord("h"), ord("e")]
    v.release()


def test_bytes_is_one_copy(hb, monkeypatch):
    """bytes() takes the buffer (one memcpy): it never goes element by
    element (3 s for 16 MiB, as it did), which these would catch."""
    def element_by_element(*args):
        raise AssertionError("bytes() went element by element")
    for cls in (vmmipc.HostBuffer, vmmipc.Mapping):
        monkeypatch.setattr(cls, "__iter__", element_by_element)
        monkeypatch.setattr(cls, "__getitem__", element_by_element)
    hb.view[-3:] = b"end"
    m = vmmipc.import_stream(hb.grant(), cache=False)
    for b in (hb, m):
        data = bytes(b)
        assert len(data) == hb.size and data[-3:] == b"end" and data == bytes(hb.view)
    monkeypatch.undo()
    m.close()


def test_numpy_sees_the_memory_without_a_copy(buf, hb):
    np = numpy_or_skip()
    a = np.frombuffer(buf, dtype=np.uint8)
    assert a.dtype == np.uint8 and a.shape == (hb.size,) and a.flags.writeable
    a[3] = 77
    assert hb[3] == 77
    b = np.asarray(buf)
    assert b.dtype == np.uint8 and b.shape == (hb.size,) and np.shares_memory(a, b)
    f = np.frombuffer(buf, dtype=np.float32)
    assert f.size == hb.size // 4
    f[1] = 1.5
    assert np.frombuffer(bytes(hb[4:8]), np.float32)[0] == 1.5
    del a, b, f


def test_torch_sees_the_memory_without_a_copy(hb):
    torch = pytest.importorskip("torch", reason=NO_TORCH)
    t = torch.frombuffer(hb, dtype=torch.uint8)
    assert t.shape == (hb.size,)
    t[9] = 99
    assert hb[9] == 99
    # torch releases its view at once and holds the HostBuffer instead:
    # close() ends it, but the memory stays mapped for the tensor until both
    # are gone.
    hb.close()
    t[10] = 7
    assert int(t[9]) == 99 and int(t[10]) == 7
    del t


def test_a_receiver_sees_writes_through_the_buffer(hb):
    """Zero copy across processes: the sender writes through memoryview(hb),
    a spawned child reads it through memoryview of what it received and
    writes back through numpy-or-memoryview; the sender sees that write."""
    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=buffer_child, args=(q, results))
    p.start()
    try:
        v = memoryview(hb)
        v[100:105] = b"HELLO"
        q.put(hb)
        got = results.get(timeout=60)
        assert got == ("ok", b"HELLO", hb.size), got
        assert bytes(v[200:205]) == b"WORLD", "the child's write is not in the sender's memory"
        v.release()
    finally:
        q.put(None)
        p.join(timeout=30)


def test_close_names_what_holds_the_memory():
    b = vmmipc.HostBuffer(4 * PAGE)
    part = b.view[:10]
    with pytest.raises(vmmipc.BufferInUseError) as e:
        b.close()
    assert isinstance(e.value, BufferError) and isinstance(e.value, vmmipc.VmmipcError)
    msg = str(e.value)
    assert "HostBuffer.close: 1 view of its memory is still alive" in msg, msg
    assert "delete them (or call .release() on memoryviews) and close again" in msg, msg
    assert not b.closed and b[0] == 0  # still open and usable
    v = memoryview(b)  # a buffer of the HostBuffer itself, on any Python
    with pytest.raises(vmmipc.BufferInUseError, match="2 views of its memory are still alive"):
        b.close()
    part.release()
    v.release()
    b.close()
    assert b.closed
    with pytest.raises(ValueError, match="closed"):
        b.view


def test_close_with_a_numpy_view(hb):
    np = numpy_or_skip()
    b = vmmipc.HostBuffer(4 * PAGE)
    addr = np.frombuffer(b.view, np.uint8).ctypes.data
    a = np.frombuffer(b.view, np.uint8)  # made from view: seen on every Python
    with pytest.raises(vmmipc.BufferInUseError, match="1 view of its memory is still alive"):
        b.close()
    del a
    whole = np.asarray(b)  # its base is a memoryview of b: seen on every Python
    with pytest.raises(vmmipc.BufferInUseError, match="1 view of its memory is still alive"):
        b.close()
    del whole
    direct = np.frombuffer(b, np.uint8)
    direct[0] = 5
    if PEP688:
        with pytest.raises(vmmipc.BufferInUseError, match="numpy arrays"):
            b.close()
        del direct
        b.close()
        assert not mapped(addr)
    else:
        # Python < 3.12 cannot see it, but it holds the HostBuffer: close()
        # ends sharing and leaves the memory mapped until the array is gone.
        b.close()
        assert b.closed and direct[0] == 5 and mapped(addr)
        with pytest.raises(ValueError, match="closed"):
            b.grant()
        del direct
        gc.collect()
        assert mapped(addr), "unmapped while the closed HostBuffer is still referenced"
        del b
        gc.collect()
        assert not mapped(addr)


def test_closed_buffers_give_no_memory(hb):
    m = vmmipc.import_stream(hb.grant(), cache=False)
    b = vmmipc.HostBuffer(PAGE)
    m.close()  # by its one name: unmapped at once (other names: at collection)
    b.close()
    for x in (m, b):
        # an empty buffer on every Python, not unmapped memory (more in
        # test_closed_buffer.py)
        assert memoryview(x).nbytes == 0
        with pytest.raises(ValueError, match="closed"):
            x[0]


def test_pickling_goes_through_vmmipc(hb):
    other = pickle.loads(pickle.dumps(hb))  # a registration, not a copy of the bytes
    assert isinstance(other, vmmipc.HostBuffer) and not other.is_owner
    other[0] = 1
    assert hb[0] == 1
    other.close()
    m = vmmipc.import_stream(hb.grant(), cache=False)
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(m)
    m.close()
    assert {hb: 1}[hb] == 1 and hash(m) == hash(m)
