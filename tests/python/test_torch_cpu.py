"""CPU-side tests of vmmipc.torch (no GPU, no libvmmipc call).

Two kinds:
  - The sender's and receiver's bookkeeping (anchors, keep-alives, the
    received-storage cache, the reducers' routing, messages) with stand-ins
    for storages and for the vmmipc calls. These need neither torch nor a GPU
    and run everywhere, CI included; so does the check that the module imports
    without torch and says what is missing when used.
  - Registration with ForkingPickler, CPU tensors keeping torch's own
    reducer, and the receiver's tensor rebuilding, against torch's CPU build.
    Skipped, with the reason, where torch is not installed (CI has none).
The CUDA paths themselves are tested on the GPU by tests/gpu/test_torch.py.
"""

import gc
import importlib.util
import os
import subprocess
import sys
import threading
import weakref
from typing import NamedTuple

import pytest

import vmmipc
import vmmipc.torch as vt

HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="PyTorch is not installed here (CI has none); these tests need its "
    "CPU build: pip install torch --index-url https://download.pytorch.org/whl/cpu")

# the directory this vmmipc was imported from, for a child Python
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(vmmipc.__file__)))


# ---------------------------------------------------------------- stand-ins


class Range(NamedTuple):  # what vmmipc.cuda_query_range returns
    base: int
    size: int
    handle_types: int
    device: int


class Device:
    def __init__(self, type_="cuda", index=0):
        self.type = type_
        self.index = index


class Storage:
    """Stands in for a CUDA UntypedStorage: an address, a size, a device, and
    weak references (moving it models resize_)."""

    def __init__(self, ptr, nbytes, device=None):
        self.ptr, self.size = ptr, nbytes
        self.device = device or Device()

    def data_ptr(self):
        return self.ptr

    def nbytes(self):
        return self.size


class FakeVmmipc:
    """Records the vmmipc calls the sender makes."""

    def __init__(self):
        self.shared = []         # (base, size, uses)
        self.again = []          # (anchor ticket, uses, ttl, release)
        self.unregistered = []
        self.fail_again = 0      # register_again raises NotFoundError this many times

    def share(self, base, size, *, uses=1, ttl=None):
        self.shared.append((base, size, uses))
        return f"anchor-{len(self.shared)}"

    def register_again(self, ticket, *, uses=1, ttl=None, release=None):
        if self.fail_again:
            self.fail_again -= 1
            raise vmmipc.NotFoundError("it ended", vmmipc.ENOENT, "vmmipc_register_again")
        self.again.append((ticket, uses, ttl, release))
        return f"pickle-{len(self.again)}"

    def unregister(self, ticket):
        self.unregistered.append(ticket)


@pytest.fixture
def fake(monkeypatch):
    f = FakeVmmipc()
    for name in ("share", "register_again", "unregister"):
        # raising=False: the names exist once the new Python API is merged
        monkeypatch.setattr(vmmipc, name, getattr(f, name), raising=False)
    yield f
    # End what the test left pending while these stand-ins are still in
    # place, so no later test hears of this one's anchors.
    for *_, release in f.again:
        release()
    f.again.clear()
    drain()


def drain():
    """Wait until the reaper has run what was queued, and what that queued."""
    for _ in range(4):
        done = threading.Event()
        vt._reaper().submit(done.set)
        assert done.wait(10), "the reaper thread did not run"
        gc.collect()


R = Range(0x10000000, 20 << 20, vt.POSIX_FD_HANDLE, 0)


# ----------------------------------------------- the module without torch


def test_imports_without_torch_and_says_what_is_missing():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # import torch now fails, as where it is not installed\n"
        "from multiprocessing.reduction import ForkingPickler\n"
        "import vmmipc\n"
        "before = dict(ForkingPickler._extra_reducers)\n"
        "import vmmipc.torch as vt\n"
        "assert dict(ForkingPickler._extra_reducers) == before, 'registered something'\n"
        "assert vt.handle_type_names(8) == 'CU_MEM_HANDLE_TYPE_FABRIC'\n"
        "for call in (vt.install, lambda: vt.is_vmm_tensor(0), lambda: vt.reduce_tensor(0)):\n"
        "    try:\n"
        "        call()\n"
        "    except ImportError as e:\n"
        "        assert 'vmmipc.torch needs PyTorch (pip install torch)' in str(e), str(e)\n"
        "    else:\n"
        "        raise AssertionError('no ImportError')\n"
        "print('ok')\n")
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr


# ------------------------------------------------------- sender bookkeeping


def test_storages_with_one_covering_range_share_one_anchor(fake):
    anchors = vt._Anchors()
    a, b = Storage(R.base, 1024), Storage(R.base + 1024, 1024)
    ticket_a, id_a = anchors.ticket_for(a, R, None)
    ticket_b, id_b = anchors.ticket_for(b, R, None)
    ticket_a2, id_a2 = anchors.ticket_for(a, R, 7.5)
    assert fake.shared == [(R.base, R.size, 0)], "one anchor, registered with uses=0"
    assert id_a == id_b == id_a2
    assert (ticket_a, ticket_b, ticket_a2) == ("pickle-1", "pickle-2", "pickle-3")
    assert [(t, uses, ttl) for t, uses, ttl, _ in fake.again] == [
        ("anchor-1", 1, None), ("anchor-1", 1, None), ("anchor-1", 1, 7.5)]
    assert anchors.live() == 1


def test_other_ranges_get_other_anchors(fake):
    anchors = vt._Anchors()
    s = Storage(R.base, 1024)
    _, id1 = anchors.ticket_for(s, R, None)
    t = Storage(R.base + R.size, 1024)
    _, id2 = anchors.ticket_for(t, Range(R.base + R.size, 20 << 20, 1, 0), None)
    _, id3 = anchors.ticket_for(Storage(R.base, 2048), Range(R.base, R.size, 1, 1), None)
    assert len(fake.shared) == 3 and len({id1, id2, id3}) == 3, "device and range both count"


def test_pickle_keeps_storage_alive_until_released_then_anchor_ends(fake):
    anchors = vt._Anchors()
    s = Storage(R.base, 4096)
    alive = weakref.ref(s)
    anchors.ticket_for(s, R, None)
    release = fake.again[-1][3]
    del s
    gc.collect()
    drain()
    assert alive() is not None, "the pending registration must keep the storage alive"
    assert fake.unregistered == []
    release()  # what the library does once the receiver has imported
    drain()
    assert alive() is None, "released: the storage may die"
    assert fake.unregistered == ["anchor-1"], "its last storage died: the anchor ends"
    assert anchors.live() == 0


def test_anchor_lives_while_any_storage_using_it_lives(fake):
    anchors = vt._Anchors()
    a, b = Storage(R.base, 1024), Storage(R.base + 4096, 1024)
    anchors.ticket_for(a, R, None)
    anchors.ticket_for(b, R, None)
    for _, _, _, release in fake.again:
        release()
    del a
    drain()
    assert fake.unregistered == [] and anchors.live() == 1
    anchors.ticket_for(Storage(R.base + 8192, 512), R, None)  # b pins it: reused
    assert len(fake.shared) == 1
    fake.again[-1][3]()
    del b
    drain()
    assert fake.unregistered == ["anchor-1"] and anchors.live() == 0


def test_a_freed_and_reused_range_never_matches_the_old_anchor(fake):
    anchors = vt._Anchors()
    old = Storage(R.base, 1 << 20)
    _, old_id = anchors.ticket_for(old, R, None)
    fake.again[-1][3]()
    # The reaper is held up, so it has not heard of the death yet when a new
    # storage at the same place is pickled: that one must still get a new
    # anchor (the chunks there may be new ones).
    gate = threading.Event()
    vt._reaper().submit(gate.wait, 10)
    del old
    gc.collect()
    new = Storage(R.base, 1 << 20)
    _, new_id = anchors.ticket_for(new, R, None)
    gate.set()
    assert len(fake.shared) == 2 and new_id != old_id
    drain()
    assert fake.unregistered == ["anchor-1"]
    assert anchors.live() == 1


def test_a_moved_storage_leaves_its_old_anchor(fake):
    anchors = vt._Anchors()
    s = Storage(R.base, 1 << 20)
    _, first = anchors.ticket_for(s, R, None)
    s.ptr, s.size = R.base + (40 << 20), 2 << 20  # what resize_ does
    moved = Range(R.base + (40 << 20), 20 << 20, 1, 0)
    _, second = anchors.ticket_for(s, moved, None)
    assert first != second and len(fake.shared) == 2
    drain()
    assert fake.unregistered == ["anchor-1"], "nothing pins the old range any more"
    # and the old range is not found again through the moved storage
    _, third = anchors.ticket_for(Storage(R.base, 1 << 20), R, None)
    assert third not in (first, second)


def test_an_anchor_that_ended_under_us_is_replaced(fake):
    anchors = vt._Anchors()
    s = Storage(R.base, 1024)
    _, first = anchors.ticket_for(s, R, None)
    fake.fail_again = 1  # e.g. someone called vmmipc.unregister on the anchor
    ticket, second = anchors.ticket_for(s, R, None)
    assert ticket == "pickle-2" and second != first and len(fake.shared) == 2
    drain()
    assert fake.unregistered == ["anchor-1"]


def test_keep_alive_hands_the_storage_to_the_reaper():
    s = Storage(1, 1)
    alive = weakref.ref(s)
    keep = vt._KeepAlive(s)
    del s
    keep()
    assert keep.storage is None
    drain()
    assert alive() is None


# --------------------------------------------------- routing and messages


def test_reducers_route_by_memory(monkeypatch):
    calls = []

    def query(ptr, size):
        calls.append((ptr, size))
        if ptr == 0xdead:
            raise vmmipc.NotFoundError("not VMM memory", vmmipc.ENOENT, "vmmipc_cuda_query_range")
        return R

    monkeypatch.setattr(vmmipc, "cuda_query_range", query, raising=False)
    torch_way = lambda: "torch's reducer"  # noqa: E731
    ours = lambda rng: ("vmmipc", rng)  # noqa: E731
    assert vt._reduce_through("x", Storage(0xdead, 64), torch_way, ours) == "torch's reducer"
    assert vt._reduce_through("x", Storage(R.base, 64), torch_way, ours) == ("vmmipc", R)
    assert vt._reduce_through("x", Storage(R.base, 0), torch_way, ours) == "torch's reducer"
    cpu = Storage(R.base, 64, Device("cpu", None))
    assert vt._reduce_through("x", cpu, torch_way, ours) == "torch's reducer"
    assert calls == [(0xdead, 64), (R.base, 64)], "CPU and empty storages never ask the library"


def test_reducer_errors_reach_the_caller(monkeypatch):
    def no_library(ptr, size):
        raise vmmipc.LibraryNotFoundError("libvmmipc.so not found")

    monkeypatch.setattr(vmmipc, "cuda_query_range", no_library, raising=False)
    with pytest.raises(vmmipc.LibraryNotFoundError, match="libvmmipc.so not found"):
        vt._reduce_through("CUDA tensor", Storage(R.base, 64), lambda: None, lambda rng: None)


def test_memory_without_posix_fd_export_is_refused_naming_what_it_allows():
    fabric = Range(R.base, R.size, 0x8, 0)
    with pytest.raises(vmmipc.InvalidError) as e:
        vt._require_posix_fd(fabric, Storage(R.base + 512, 4096))
    msg = str(e.value)
    assert e.value.status == vmmipc.EINVAL
    assert "allows export as CU_MEM_HANDLE_TYPE_FABRIC only" in msg
    assert "needs CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" in msg
    assert "4096 bytes at 0x10000200" in msg
    vt._require_posix_fd(Range(R.base, R.size, 0x9, 0), Storage(R.base, 1))  # POSIX among others


def test_handle_type_names():
    assert vt.handle_type_names(0) == "none"
    assert vt.handle_type_names(1) == "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR"
    assert vt.handle_type_names(0x9) == ("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR | "
                                         "CU_MEM_HANDLE_TYPE_FABRIC")
    assert vt.handle_type_names(0x30) == "unknown bits 0x30"


def test_settings_are_checked():
    for bad, error in ((-1, vmmipc.InvalidError), (True, TypeError), (1.0, TypeError),
                       ("0", TypeError)):
        with pytest.raises(error, match="set_receive_device"):
            vt.set_receive_device(bad)
    for bad, error in ((0, vmmipc.InvalidError), (-1.0, vmmipc.InvalidError),
                       (float("inf"), vmmipc.InvalidError), (float("nan"), vmmipc.InvalidError),
                       (True, TypeError), ("1", TypeError)):
        with pytest.raises(error, match="set_pickle_ttl"):
            vt.set_pickle_ttl(bad)
    try:
        vt.set_receive_device(1)
        vt.set_pickle_ttl(2.5)
        assert (vt._receive_device, vt._pickle_ttl) == (1, 2.5)
    finally:
        vt.set_receive_device(None)
        vt.set_pickle_ttl(None)


def test_uuid_bytes_from_torch_properties():
    want = bytes(range(0xF0, 0x100))

    class Signed:  # torch's .bytes: a list of (signed) chars
        bytes = [b - 256 if b > 127 else b for b in want]

    class Printed:  # no .bytes: only its text
        def __str__(self):
            import uuid
            return "GPU-" + str(uuid.UUID(bytes=want))

    assert vt._uuid_bytes(Signed()) == want
    assert vt._uuid_bytes(Printed()) == want


def test_sender_token_is_per_process():
    assert vt._sender_token() == vt._sender_token()
    assert len(vt._sender_token()) == 16
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forkserver child inherits the module state like this
        os.write(w, vt._sender_token())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 16)
    os.close(r)
    os.close(w)
    assert len(child) == 16 and child != vt._sender_token()


# ------------------------------------------------------ receiver bookkeeping


def test_received_storages_are_found_while_alive_only():
    received = vt._Received()
    s = Storage(1, 1)
    assert received.add("k", s) is s
    assert received.add("k", Storage(2, 2)) is s, "the first one stays"
    assert received.get("k") is s and received.get("other") is None
    del s
    gc.collect()
    assert received.get("k") is None and len(received) == 0


# ------------------------------------------------------------- with torch


@needs_torch
def test_install_registers_ours_after_torchs_and_is_idempotent():
    import torch
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing.reductions as tr
    vt.install()
    vt.install()
    reducers = ForkingPickler._extra_reducers
    assert reducers[torch.Tensor] is vt.reduce_tensor
    assert reducers[torch.nn.Parameter] is vt.reduce_tensor
    assert reducers[torch.UntypedStorage] is vt.reduce_storage
    assert reducers[torch.storage.TypedStorage] is tr.reduce_typed_storage, \
        "typed storages keep torch's reducer (it reduces them to their UntypedStorage)"


@needs_torch
def test_cpu_tensors_and_storages_keep_torchs_reducer(monkeypatch):
    import torch
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing.reductions as tr

    def never(*a):
        raise AssertionError("a CPU tensor must not reach libvmmipc")

    monkeypatch.setattr(vmmipc, "cuda_query_range", never, raising=False)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert vt.reduce_tensor(t)[0] is tr.rebuild_tensor
    assert vt.reduce_storage(t.untyped_storage())[0] in (tr.rebuild_storage_fd,
                                                         tr.rebuild_storage_filename)
    assert not vt.is_vmm_tensor(t)
    p = torch.nn.Parameter(torch.ones(5))
    sent = {"t": t, "view": t[1:, ::2], "p": p}
    got = ForkingPickler.loads(ForkingPickler.dumps(sent))
    assert torch.equal(got["t"], t) and torch.equal(got["view"], t[1:, ::2])
    assert isinstance(got["p"], torch.nn.Parameter) and got["p"].requires_grad
    assert got["view"].untyped_storage().data_ptr() == got["t"].untyped_storage().data_ptr()


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_tensor_metadata_round_trip(dtype):
    """_tensor_reduction's arguments rebuild the same view over the storage
    (the receiver's half, on a CPU storage instead of an imported one)."""
    import torch
    dt = getattr(torch, dtype)
    base = torch.arange(60).to(dt).reshape(6, 10)
    rng = Range(0, 1 << 21, vt.POSIX_FD_HANDLE, 0)
    for view in (base, base[2:], base[:, 3:7], base.t(), base[1::2, ::3]):
        fn, args = vt._tensor_reduction(torch, view, view.untyped_storage(), rng)
        assert fn is vt._rebuild_tensor and args[1] is view.untyped_storage()
        got = vt._rebuild_tensor(*args)
        assert got.dtype == dt and got.shape == view.shape and got.stride() == view.stride()
        assert got.storage_offset() == view.storage_offset() and torch.equal(got, view)
        assert got.untyped_storage() is view.untyped_storage(), "a view, not a copy"


@needs_torch
def test_parameters_and_requires_grad_are_kept():
    import torch
    rng = Range(0, 1 << 21, vt.POSIX_FD_HANDLE, 0)
    p = torch.nn.Parameter(torch.randn(4, 4))
    fn, args = vt._tensor_reduction(torch, p, p.untyped_storage(), rng)
    got = fn(*args)
    assert type(got) is torch.nn.Parameter and got.requires_grad and torch.equal(got, p)
    frozen = torch.nn.Parameter(torch.arange(4, dtype=torch.int8), requires_grad=False)
    got = vt._rebuild_tensor(*vt._tensor_reduction(torch, frozen, frozen.untyped_storage(),
                                                    rng)[1])
    assert type(got) is torch.nn.Parameter and not got.requires_grad
    with pytest.raises(RuntimeError, match="non-leaf tensor that requires grad"):
        vt._tensor_reduction(torch, p * 2, p.untyped_storage(), rng)
    z = torch.randn(4, dtype=torch.complex64).conj()  # a lazy view: the bit is not in the data
    with pytest.raises(ValueError, match="resolve_conj"):
        vt._tensor_reduction(torch, z, z.untyped_storage(), rng)


@needs_torch
def test_views_of_one_storage_reduce_to_one_storage_object():
    import torch
    rng = Range(0, 1 << 21, vt.POSIX_FD_HANDLE, 0)
    w = torch.randn(8, 8)
    tied = {"embed": w, "head": w.t(), "row": w[3]}
    storages = {name: vt._tensor_reduction(torch, t, t.untyped_storage(), rng)[1][1]
                for name, t in tied.items()}
    assert storages["embed"] is storages["head"] is storages["row"], \
        "the pickler's memo then sends the storage once"
