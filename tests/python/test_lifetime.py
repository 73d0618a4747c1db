"""Lifetime you can wait on, registrations of one buffer identity, the
HostBuffer's anchor, the import cache, closed Mappings, and the array
protocols of a Mapping (DLPack capsule mechanics checked through ctypes, as
a consumer would use them)."""

import ctypes
import gc
import mmap
import os
import pickle
import subprocess
import sys
import threading
import time

import pytest

import conftest
import vmmipc
from vmmipc import _dlpack
from _mp_helpers import MMAP_DUP, fd_count, settled_fd_count, wait_for

PAGE = mmap.PAGESIZE
REG_ID, BUFFER_ID, SECRET = slice(24, 32), slice(32, 40), slice(40, 72)  # ticket format 3
pytestmark = pytest.mark.usefixtures("server_running")


def memfd_with(data):
    import fcntl
    fd = os.memfd_create("test-chunk", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd


# -- register_again and wait --------------------------------------------------

def test_shares_of_a_hostbuffer_are_one_buffer_identity(hb):
    t1, t2 = hb.grant(), hb.grant()
    other = vmmipc.HostBuffer(PAGE)
    t3 = other.grant()
    assert t1[BUFFER_ID] == t2[BUFFER_ID] != t3[BUFFER_ID]
    assert t1[REG_ID] != t2[REG_ID] and t1[SECRET] != t2[SECRET]
    assert hb.pending_tickets() == [t1, t2]
    other.unregister_all()
    other.close()


def test_register_again_keeps_the_export_until_the_last_registration():
    chunks = [bytes([i]) * PAGE for i in range(4)]
    asked, released = [], []

    def export(i):
        asked.append(i)
        return memfd_with(chunks[i])

    t = vmmipc.register([PAGE] * 4, export, release=lambda: released.append("first"))
    again = vmmipc.register_again(t, uses=1, release=lambda: released.append("again"))
    assert again[BUFFER_ID] == t[BUFFER_ID] and again.info() == t.info()
    with vmmipc.import_stream(t, cache=False) as m:
        assert m.view == b"".join(chunks)
    # t has ended, but its export_fn is still lent to `again`: not released.
    assert vmmipc.wait(t, 0) is False and released == []
    with vmmipc.import_stream(again, cache=False) as m:  # exported anew, by the same export_fn
        assert m.view == b"".join(chunks)
    assert asked == [0, 1, 2, 3] * 2
    assert vmmipc.wait(again, 5) and vmmipc.wait(t, 5)
    assert sorted(released) == ["again", "first"]


def test_register_again_refuses_what_it_cannot_name(hb):
    t = hb.grant()
    vmmipc.unregister(t)
    with pytest.raises(vmmipc.NotFoundError):
        vmmipc.register_again(t)  # ended
    bad = bytearray(hb.grant())
    bad[SECRET] = bytes(b ^ 1 for b in bad[SECRET])
    with pytest.raises(vmmipc.AuthError):
        vmmipc.register_again(vmmipc.Ticket(bad))
    with pytest.raises(vmmipc.InvalidError):
        vmmipc.register_again(vmmipc.Ticket(bytes(256)))


def test_failed_registration_runs_no_release():
    from vmmipc import _register
    released, records = [], len(_register._records)
    with pytest.raises(vmmipc.InvalidError, match="page size"):  # refused by the library
        vmmipc.register([100, PAGE], never_export, release=lambda: released.append(1))
    t = vmmipc.HostBuffer(PAGE).grant()
    vmmipc.unregister(t)
    with pytest.raises(vmmipc.NotFoundError):
        vmmipc.register_again(t, release=lambda: released.append(2))
    assert released == [] and len(_register._records) == records


def never_export(i):
    raise AssertionError("export_fn must not run")


def test_wait_returns_once_ended_and_released():
    gate, entered = threading.Event(), threading.Event()

    def release():
        entered.set()
        gate.wait(10)

    t = vmmipc.register([PAGE], lambda i: memfd_with(b"w" * PAGE), uses=0, release=release)
    assert vmmipc.wait(t, 0) is False and t.wait(0) is False
    t0 = time.monotonic()
    assert t.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    # unregister runs release (blocked on the gate) before it returns: do it aside
    ender = threading.Thread(target=vmmipc.unregister, args=(t,))
    ender.start()
    assert entered.wait(5)
    assert t.wait(0.05) is False, "release_fn has not returned: still not waitable"
    gate.set()
    assert t.wait(5) is True
    ender.join(5)
    assert vmmipc.wait(t, 0) is True  # and it stays so


def test_wait_on_a_foreign_ticket(hb):
    t = bytearray(hb.grant())
    t[12:16] = (os.getpid() + 1).to_bytes(4, "little")  # another exporter's ticket
    with pytest.raises(vmmipc.VmmipcError) as e:
        vmmipc.wait(vmmipc.Ticket(t), 0)
    assert e.value.status in (vmmipc.ENOENT, vmmipc.EAUTH), e.value


def test_hostbuffer_wait_covers_every_pickle(hb):
    data = [pickle.dumps(hb), pickle.dumps(hb)]
    assert len(hb.pending_tickets()) == 2
    assert hb.wait(0) is False and hb.wait(0.02) is False
    for d in data:
        pickle.loads(d).close()
    assert hb.wait(5) is True and hb.pending_tickets() == []


# -- the anchor ---------------------------------------------------------------

def test_anchor_lives_with_the_hostbuffer():
    live, fds = vmmipc.live_registrations(), settled_fd_count()
    b = vmmipc.HostBuffer(4 * PAGE, chunk_size=PAGE)
    assert vmmipc.live_registrations() == live + 1, "one anchor registration"
    assert fd_count() == fds + 2 + MMAP_DUP  # its memfd and the library's duplicate
    t = b.grant()
    assert vmmipc.live_registrations() == live + 2 and fd_count() == fds + 2 + MMAP_DUP
    del b
    gc.collect()  # collected: anchor ended, own fds closed; the share lives on
    assert vmmipc.live_registrations() == live + 1 and fd_count() == fds + 1
    with vmmipc.import_stream(t, cache=False) as m:
        assert m.size == 4 * PAGE
    assert wait_for(lambda: (vmmipc.live_registrations(), fd_count()) == (live, fds))


def test_closed_hostbuffer_cannot_be_shared():
    b = vmmipc.HostBuffer(PAGE)
    b.close()
    with pytest.raises(ValueError, match="closed"):
        b.grant()
    with pytest.raises(ValueError, match="closed"):
        pickle.dumps(b)


# -- the import cache ---------------------------------------------------------

def test_cache_hits_share_one_mapping(hb):
    before = vmmipc.cache_info()
    m1 = vmmipc.import_stream(hb.grant())
    m2 = vmmipc.import_stream(hb.grant())  # another ticket of the same buffer
    assert m1.addr == m2.addr and m2.view == hb.view
    info = vmmipc.cache_info()
    assert (info.misses, info.hits) == (before.misses + 1, before.hits + 1)
    m1.close()
    assert m2.view == hb.view  # the other reference keeps it mapped
    addr = m2.addr
    m2.close()
    info = vmmipc.cache_info()
    assert info.unreferenced_bytes >= hb.size
    with vmmipc.import_stream(hb.grant()) as m3:  # unreferenced, still cached: a hit
        assert m3.addr == addr
    assert vmmipc.cache_info().hits == before.hits + 2
    with vmmipc.import_stream(hb.grant(), cache=False) as m4:  # bypasses it: maps anew
        assert m4.addr != addr and m4.view == hb.view
    assert vmmipc.cache_info().hits == before.hits + 2


def mapped(addr):
    return f"{addr:x}-" in open("/proc/self/maps").read()


def test_cache_entry_is_invalidated_when_the_buffer_ends():
    # Earlier tests' ended buffers leave the cache within a poll (250 ms):
    # one leaving between `before` and the check below would offset the
    # count (seen under load: entries 1 == 1 + 1).
    assert wait_for(lambda: vmmipc.cache_info().unreferenced_bytes == 0), vmmipc.cache_info()
    b = vmmipc.HostBuffer(4 * PAGE, chunk_size=PAGE)
    before = vmmipc.cache_info()
    m = vmmipc.import_stream(b.grant())
    addr = m.addr
    m.close()
    assert mapped(addr) and vmmipc.cache_info().entries == before.entries + 1
    # A miss the sender's table vouched for spends its use just after:
    # spent while the anchor lives, it leaves the buffer live and cached.
    assert wait_for(lambda: vmmipc.cache_info().confirms_pending == 0)
    b.close()  # the anchor was its last registration: the buffer ends
    assert wait_for(lambda: not mapped(addr)), "still mapped after the buffer ended"
    assert vmmipc.cache_info().invalidations > before.invalidations


def test_cache_limit(hb):
    limit = vmmipc.cache_info().limit_bytes
    try:
        m = vmmipc.import_stream(hb.grant())
        addr = m.addr
        m.close()
        assert vmmipc.cache_info().unreferenced_bytes >= hb.size and mapped(addr)
        evictions = vmmipc.cache_info().evictions
        vmmipc.set_cache_limit(hb.size - 1)  # no room for it: undone for room
        info = vmmipc.cache_info()
        assert info.limit_bytes == hb.size - 1 and info.unreferenced_bytes < hb.size
        assert info.evictions > evictions and not mapped(addr)
        vmmipc.import_stream(hb.grant()).close()  # too large to keep: undone at once
        vmmipc.set_cache_limit(0)  # off: nothing unreferenced stays
        assert vmmipc.cache_info()[:4] == (0, 0, 0, 0)
    finally:
        vmmipc.set_cache_limit(limit)
    assert vmmipc.cache_info().limit_bytes == limit


# -- Mapping ------------------------------------------------------------------

def test_closed_mapping_refuses_addr(hb):
    m = vmmipc.import_stream(hb.grant(), cache=False)
    addr = m.addr
    m.close()
    with pytest.raises(ValueError, match="closed"):
        m.addr
    assert "closed" in repr(m) and f"{addr:x}" not in repr(m)
    with pytest.raises(ValueError):
        m.__dlpack__()


def test_host_mapping_has_no_cuda_array_interface(hb):
    with vmmipc.import_stream(hb.grant()) as m:
        assert not hasattr(m, "__cuda_array_interface__")
        assert m.__dlpack_device__() == (_dlpack.KDL_CPU, 0)


def fake_cuda_mapping(addr=0x7F0000001000, size=1 << 21, device=3):
    """A Mapping over a made-up CUDA struct (no GPU here), never unmapped."""
    from vmmipc import _lib
    s = _lib.vmmipc_mapping(addr=addr, size=size, device=device,
                            memory_kind=vmmipc.MEMORY_CUDA)
    m = vmmipc.Mapping(s)
    s.addr = 0  # nothing for its finalizer to undo: the library never made it
    return m


def test_cuda_array_interface_fields():
    m = fake_cuda_mapping()
    assert m.__cuda_array_interface__ == {"shape": (1 << 21,), "typestr": "|u1",
                                          "data": (0x7F0000001000, False), "strides": None,
                                          "version": 3}
    assert m.__dlpack_device__() == (_dlpack.KDL_CUDA, 3)
    with pytest.raises(TypeError, match="CUDA"):
        m.view


# A consumer's side of the DLPack protocol, through the C API.
_get_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_get_pointer.restype, _get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi["PyCapsule_SetName"]
_set_name.restype, _set_name.argtypes = ctypes.c_int, [ctypes.py_object, ctypes.c_char_p]
_get_name = ctypes.pythonapi["PyCapsule_GetName"]
_get_name.restype, _get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
# kept alive: a capsule keeps a pointer to its name
USED = {False: b"used_dltensor", True: b"used_dltensor_versioned"}


def consume(capsule, versioned=False):
    """Take the tensor as a consumer does: rename the capsule, keep the
    pointer; the caller calls the deleter when done."""
    name = b"dltensor_versioned" if versioned else b"dltensor"
    assert _get_name(capsule) == name
    ptr = _get_pointer(capsule, name)
    assert _set_name(capsule, USED[versioned]) == 0
    struct = _dlpack.DLManagedTensorVersioned if versioned else _dlpack.DLManagedTensor
    return ptr, struct.from_address(ptr)


@pytest.mark.parametrize("versioned", [False, True])
def test_dlpack_tensor_fields(versioned):
    m = fake_cuda_mapping()
    cap = m.__dlpack__(stream=None, max_version=(1, 2) if versioned else None)
    ptr, managed = consume(cap, versioned)
    if versioned:
        assert (managed.version.major, managed.version.minor, managed.flags) == (1, 0, 0)
    t = managed.dl_tensor
    assert (t.data, t.device.device_type, t.device.device_id) == (0x7F0000001000, 2, 3)
    assert (t.ndim, t.shape[0], bool(t.strides), t.byte_offset) == (1, 1 << 21, False, 0)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (_dlpack.KDL_UINT, 8, 1)
    managed.deleter(ptr)
    assert _dlpack.live_exports() == 0
    assert m._dlpack_exports == 0
    with pytest.raises(BufferError):
        m.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        m.__dlpack__(dl_device=(2, 0))
    with pytest.raises(TypeError):
        m.__dlpack__(stream="s")


def test_dlpack_consumer_keeps_the_mapping_alive(hb):
    hb[:4] = b"dlpk"
    m = vmmipc.import_stream(hb.grant(), cache=False)
    addr, exports = m.addr, _dlpack.live_exports()
    ptr, managed = consume(m.__dlpack__())
    gc.collect()  # the capsule is gone (consumed): the tensor lives on
    with pytest.raises(BufferError, match="DLPack"):
        m.close()
    del m
    gc.collect()
    assert f"{addr:x}-" in open("/proc/self/maps").read(), "unmapped under a consumer"
    assert ctypes.string_at(managed.dl_tensor.data, 4) == b"dlpk"
    managed.deleter(ptr)  # the consumer lets go: the Mapping goes with it
    gc.collect()
    assert _dlpack.live_exports() == exports
    assert f"{addr:x}-" not in open("/proc/self/maps").read()


@pytest.mark.parametrize("versioned", [False, True])
def test_unconsumed_capsule_releases_on_its_own(hb, versioned):
    m = vmmipc.import_stream(hb.grant(), cache=False)
    exports = _dlpack.live_exports()
    cap = m.__dlpack__(max_version=(1, 0) if versioned else None)
    assert _dlpack.live_exports() == exports + 1
    with pytest.raises(BufferError):
        m.close()
    del cap  # never consumed: its destructor runs the deleter, once
    assert _dlpack.live_exports() == exports
    m.close()
    assert m.closed


def test_numpy_from_dlpack_and_frombuffer(hb):
    np = pytest.importorskip("numpy", minversion="2.1")  # DLPack 1.0
    hb[:8] = bytes(range(8))
    a = np.frombuffer(hb.view, dtype=np.uint8)
    assert a[:8].tolist() == list(range(8))
    with pytest.raises(BufferError):
        hb.close()  # numpy holds a view
    del a
    m = vmmipc.import_stream(hb.grant(), cache=False)
    x = np.from_dlpack(m)  # numpy >= 2 asks for DLPack 1.0: a writable array
    assert x.shape == (hb.size,) and x.dtype == np.uint8 and bytes(x[:8]) == bytes(range(8))
    x[0] = 99  # shared memory, no copy
    assert hb[0] == 99
    with pytest.raises(BufferError):
        m.close()
    del x
    gc.collect()
    m.close()


# -- cuda_core's anchors, keyed by the Buffer object (no GPU: a stand-in) -----

class StandInBuffer:
    """What vmmipc.cuda_core reads of a cuda.core Buffer."""

    def __init__(self, handle, size):
        self.handle, self.size, self.is_closed = handle, size, False


def test_cuda_core_keeps_one_anchor_per_live_buffer(monkeypatch):
    import vmmipc.cuda_core as vc
    anchors = []

    def host_share(ptr, size, *, uses=1, ttl=None):  # stands in for vmmipc_register_cuda
        t = vmmipc.register([PAGE], lambda i: memfd_with(b"c" * PAGE), uses=uses, ttl=ttl)
        anchors.append(t)
        return t

    def ended(t):
        try:
            vmmipc.unregister(t)
            return False
        except vmmipc.NotFoundError:
            return True

    monkeypatch.setattr(vc, "share", host_share)
    live = vmmipc.live_registrations()
    a = StandInBuffer(0x10000, PAGE)
    sent = [vc.grant_buffer(a), vc.grant_buffer(a, uses=2)]
    assert len(anchors) == 1, "one anchor, then register_again per share"
    assert sent[0][BUFFER_ID] == sent[1][BUFFER_ID] == anchors[0][BUFFER_ID]
    assert vmmipc.live_registrations() == live + 3
    # Freed, and a new Buffer at the same address: it never gets the old anchor.
    a.is_closed = True
    b = StandInBuffer(0x10000, PAGE)
    sent.append(vc.grant_buffer(b))
    assert len(anchors) == 2 and sent[2][BUFFER_ID] == anchors[1][BUFFER_ID]
    assert ended(anchors[0]), "the closed Buffer's anchor was not ended"
    # Resized in place: a new anchor for the new range.
    b.size = 2 * PAGE
    sent.append(vc.grant_buffer(b))
    assert len(anchors) == 3 and ended(anchors[1])
    # Collected: its anchor ends with it.
    del b
    gc.collect()
    assert ended(anchors[2])
    c = StandInBuffer(0x20000, PAGE)
    sent.append(vc.grant_buffer(c))
    assert vc.drop_anchor(c) and not vc.drop_anchor(c) and ended(anchors[3])
    with pytest.raises(ValueError, match="closed"):
        vc.grant_buffer(a)
    for t in sent:
        vmmipc.unregister(t)
    assert vmmipc.live_registrations() == live


# -- a register call's user data is any value --------------------------------

STACK_MOVES = """
import ctypes, sys, time
import vmmipc
from vmmipc import _lib
hb = vmmipc.HostBuffer(1 << 20, chunk_size=4096)
t = hb.grant(uses=0)
again, ticket = _lib.lib().vmmipc_register_again, t._c()
opts, release = _lib.options("test", uses=1), _lib.RELEASE_FN(lambda user: None)
deadline, calls = time.monotonic() + float(sys.argv[1]), 0
while time.monotonic() < deadline:
    vmmipc.import_stream(t, cache=False).close()  # grows the calling goroutine's stack
    for user in range(1, 51):  # user data that no pointer could be
        out = _lib.vmmipc_ticket()
        _lib.check("vmmipc_register_again", again(ctypes.byref(ticket), release,
                   ctypes.c_void_p(user), ctypes.byref(opts), ctypes.byref(out)))
        vmmipc.unregister(vmmipc.Ticket(bytes(out.bytes)))
        calls += 1
print("ok", calls)
"""


def test_user_data_that_is_not_a_pointer_survives_stack_moves():
    """C callers pass any value as a register call's void *user (this
    package passes a small integer key). The library carries it as an
    integer: kept in a Go pointer type, a value such as 0x1bb made the Go
    runtime abort ("invalid pointer found on stack") whenever it moved the
    stack of a call in flight, which GOGC=1 and an import between calls
    made happen within a second (the abort seen in pytest runs under load)."""
    env = dict(os.environ, GOGC="1", PYTHONPATH=conftest.PYTHON_DIR)
    r = subprocess.run([sys.executable, "-c", STACK_MOVES, "3"], env=env, capture_output=True,
                       text=True, timeout=120)
    said = [ln for ln in r.stderr.splitlines() if "fatal error" in ln or "bad pointer" in ln]
    assert r.returncode == 0 and r.stdout.startswith("ok"), (r.returncode,
                                                            said or r.stderr[-2000:])


# -- the socket directory's files at exit --------------------------------------

AT_EXIT = """
import os, sys
import vmmipc
hb = vmmipc.HostBuffer(4096)
hb.grant()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # exit(): the atexit handler it inherited must leave the files
os.waitpid(pid, 0)
print(sorted(os.listdir(sys.argv[1])))
"""


def test_exit_removes_the_socket_files_but_a_forked_child_does_not():
    """With VMMIPC_SOCKET_DIR the exporter's socket and lock are removed when
    it calls exit(); a child made by fork() that exits first leaves them to
    the exporter, which still serves."""
    import tempfile
    with tempfile.TemporaryDirectory(prefix="vmmipc-") as d:  # short: a socket path has 107 bytes
        exit_leaves_files(d)


def exit_leaves_files(d):
    env = dict(os.environ, VMMIPC_SOCKET_DIR=str(d), PYTHONPATH=conftest.PYTHON_DIR)
    r = subprocess.run([sys.executable, "-c", AT_EXIT, str(d)], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    after_child = eval(r.stdout.strip())
    assert [n.rsplit(".", 1)[1] for n in after_child] == ["lock", "sock"], after_child
    assert os.listdir(d) == [], "the exporter's exit() removes its files"
