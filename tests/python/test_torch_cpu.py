"""CPU-side tests of vmmipc.torch (no GPU, no libvmmipc call).

Two kinds:
  - The sender's and receiver's bookkeeping (anchors, keep-alives, the
    received-storage cache, the reducers' routing, messages) with stand-ins
    for storages and for the vmmipc calls. These need neither torch nor a GPU
    and run everywhere, CI included; so does the check that the module imports
    without torch and says what is missing when used.
  - Registration with ForkingPickler, CPU tensors keeping torch's own
    reducer, and the receiver's tensor rebuilding, against torch's CPU build.
    Skipped, with the reason, where torch is not installed for this Python
    (make test-torch runs them under build/torch-venv, as CI does).
The CUDA paths themselves are tested on the GPU by tests/gpu/test_torch.py.
"""

import contextlib
import gc
import os
import subprocess
import sys
import threading
import weakref
from typing import NamedTuple

import pytest

import conftest
import vmmipc
import vmmipc.torch as vt
from vmmipc import (_anchor, _mp, _torch_batch, _torch_blob, _torch_received, _torch_reductions,
                    _torch_runs)

needs_torch = conftest.needs_torch("these tests")
PACKAGE_PARENT = conftest.PACKAGE_PARENT


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
        self.queries = []        # (ptr, size)
        self.shared = []         # (base, size, uses)
        self.again = []          # (anchor ticket, uses, ttl, release)
        self.holds = []          # the hold flag of each register_again, in order
        self.unregistered = []
        self.fail_again = 0      # register_again raises NotFoundError this many times
        self.ended = set()       # anchor tickets whose register_again raises NotFoundError
        self.ranges = {}         # ptr -> Range, else the chunk-aligned 20 MiB range around it

    def cuda_query_range(self, ptr, size):
        self.queries.append((ptr, size))
        if ptr in self.ranges:
            return self.ranges[ptr]
        if ptr == 0xdead:
            raise vmmipc.NotFoundError("not VMM memory", vmmipc.ENOENT, "vmmipc_cuda_query_range")
        lo = ptr - ptr % CHUNK
        hi = -(-(ptr + size) // CHUNK) * CHUNK
        return Range(lo, hi - lo, vt.POSIX_FD_HANDLE, 0)

    def share(self, base, size, *, uses=1, ttl=None):
        self.shared.append((base, size, uses))
        return f"anchor-{len(self.shared)}"

    def register_again(self, ticket, *, uses=1, ttl=None, release=None, hold=False):
        if self.fail_again or ticket in self.ended:
            self.fail_again = max(0, self.fail_again - 1)
            raise vmmipc.NotFoundError("it ended", vmmipc.ENOENT, "vmmipc_register_again")
        self.again.append((ticket, uses, ttl, release))
        self.holds.append(hold)
        return f"pickle-{len(self.again)}"

    def unregister(self, ticket):
        self.unregistered.append(ticket)

    def release_all(self):
        for *_, release in self.again:
            release()
        self.again.clear()


CHUNK = 20 << 20


@pytest.fixture
def fake(monkeypatch):
    f = FakeVmmipc()
    monkeypatch.setattr(_torch_runs, "cuda_query_range", f.cuda_query_range)
    monkeypatch.setattr(_torch_runs, "share", f.share)
    monkeypatch.setattr(_anchor, "register_again", f.register_again)
    monkeypatch.setattr(_anchor, "unregister", f.unregister)
    yield f
    # End what the test left pending while these stand-ins are still in
    # place, so no later test hears of this one's anchors.
    f.release_all()
    drain()


def drain():
    """Wait until the reaper has run what was queued, and what that queued."""
    for _ in range(4):
        done = threading.Event()
        _anchor.reaper.submit(done.set)
        assert done.wait(10), "the reaper thread did not run"
        gc.collect()


BASE = 20 * CHUNK  # chunk-aligned, as a segment's chunks are
R = Range(BASE, CHUNK, vt.POSIX_FD_HANDLE, 0)


def plan(anchors, *storages):
    anchors.plan([anchors.pending(s) for s in storages])


# ----------------------------------------------- the module without torch


def test_imports_without_torch_and_says_what_is_missing():
    code = (
        "import sys\n"
        "sys.modules['torch'] = None  # import torch now fails, as where it is not installed\n"
        "from multiprocessing.reduction import ForkingPickler\n"
        "import multiprocessing.connection  # registers its own reducer when imported\n"
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


def test_storages_sent_together_get_one_anchor_per_run(fake):
    """A model packed in chunks: neighbours that share or touch chunks form
    one run, registered once; a gap of unmapped (or unsent) chunks starts
    another; so does another device."""
    anchors = _torch_runs.RunAnchors()
    a = Storage(BASE, 30 << 20)                   # chunks 0-1
    b = Storage(BASE + (30 << 20), 4 << 20)       # chunk 1 (shared with a)
    c = Storage(BASE + (40 << 20), 20 << 20)      # chunk 2 (touches)
    far = Storage(BASE + (100 << 20), 1 << 20)    # chunk 5: a run of its own
    other = Storage(BASE + 1, 1 << 20, Device("cuda", 1))  # same addresses, another GPU
    fake.ranges[other.ptr] = Range(BASE, CHUNK, vt.POSIX_FD_HANDLE, 1)
    plan(anchors, a, b, far, c)
    plan(anchors, other)
    assert fake.shared == [(BASE, 60 << 20, 0), (BASE + (100 << 20), CHUNK, 0), (BASE, CHUNK, 0)]
    ra, rb, rc, rf, ro = (anchors.attached(s) for s in (a, b, c, far, other))
    assert ra is rb is rc and len({id(ra), id(rf), id(ro)}) == 3
    assert (rc.base, rc.size, ro.device) == (BASE, 60 << 20, 1)
    assert anchors.live() == 3


def test_resending_attached_storages_asks_the_driver_nothing(fake):
    anchors = _torch_runs.RunAnchors()
    s = [Storage(BASE + i * (1 << 20), 1 << 20) for i in range(40)]
    plan(anchors, *s)
    asked = len(fake.queries)
    for _ in range(3):
        assert all(anchors.attached(x) is not None for x in s)
    assert len(fake.queries) == asked and len(fake.shared) == 1


def test_a_storage_pinned_by_live_users_joins_their_anchor(fake):
    anchors = _torch_runs.RunAnchors()
    a, b = Storage(BASE, 10 << 20), Storage(BASE + (10 << 20), 10 << 20)
    plan(anchors, a, b)
    view = Storage(BASE + (4 << 20), 8 << 20)  # another storage in the same chunk, pinned by a
    plan(anchors, view)
    assert anchors.attached(view) is anchors.attached(a) and len(fake.shared) == 1


def test_a_storage_over_unpinned_chunks_gets_a_new_anchor(fake):
    """A segment that grew: the new storage starts in the anchor's last chunk
    and runs into new ones; no live user pins the new chunks, so it gets an
    anchor of its own (which overlaps the old one) and the old one stays."""
    anchors = _torch_runs.RunAnchors()
    a = Storage(BASE, 30 << 20)  # chunks 0-1
    plan(anchors, a)
    across = Storage(BASE + (35 << 20), 20 << 20)  # chunks 1-2
    plan(anchors, across)
    assert fake.shared == [(BASE, 40 << 20, 0), (BASE + CHUNK, 40 << 20, 0)]
    assert anchors.attached(across) is not anchors.attached(a) and anchors.live() == 2


def test_a_dead_storage_retires_its_anchor_and_a_new_one_never_matches(fake):
    """torch may unmap a chunk once the storages in it died and map a new one
    at the same address: an anchor with a chunk nobody pins is retired at
    once (and ended on the reaper), and a new storage there gets a new one."""
    anchors = _torch_runs.RunAnchors()
    keep, dies = Storage(BASE, 10 << 20), Storage(BASE + CHUNK, 10 << 20)
    plan(anchors, keep, dies)
    first = anchors.attached(keep)
    del dies
    gc.collect()
    drain()
    assert fake.unregistered == ["anchor-1"] and anchors.live() == 0
    assert anchors.attached(keep) is None, "its anchor was retired: it is planned again"
    new = Storage(BASE + CHUNK, 10 << 20)
    plan(anchors, keep, new)
    assert anchors.attached(new) is anchors.attached(keep) is not first and len(fake.shared) == 2


def test_a_freed_storage_is_not_trusted_before_the_reaper_hears_of_it(fake):
    anchors = _torch_runs.RunAnchors()
    old = Storage(BASE, 1 << 20)
    plan(anchors, old)
    gate = threading.Event()
    _anchor.reaper.submit(gate.wait, 10)  # the reaper is held up
    del old
    gc.collect()
    new = Storage(BASE, 1 << 20)
    plan(anchors, new)
    gate.set()
    assert len(fake.shared) == 2, "nothing pinned the chunk: the new storage needs a new anchor"
    drain()
    assert fake.unregistered == ["anchor-1"] and anchors.live() == 1


def test_a_moved_storage_leaves_its_old_anchor(fake):
    anchors = _torch_runs.RunAnchors()
    s = Storage(BASE, 1 << 20)
    plan(anchors, s)
    first = anchors.attached(s)
    s.ptr, s.size = BASE + (40 << 20), 2 << 20  # what resize_ does
    assert anchors.attached(s) is None
    drain()
    assert fake.unregistered == ["anchor-1"], "nothing pins the old range any more"
    plan(anchors, s)
    assert anchors.attached(s) not in (None, first)


def finalizers_of(obj) -> int:
    return sum(1 for info in weakref.finalize._registry.values() if info.weakref() is obj)


def test_a_storage_attached_again_keeps_one_finalizer(fake):
    """A run is retired whenever a storage in it dies (a temporary beside
    the weights); the storages that live on are attached to a new anchor at
    the next send, each still with one finalizer, not one more per send."""
    anchors = _torch_runs.RunAnchors()
    keep = Storage(BASE, 1 << 20)
    for _ in range(20):
        temporary = Storage(BASE + CHUNK, 1 << 20)  # in the next chunk of the run
        plan(anchors, keep, temporary)
        del temporary
        gc.collect()
        drain()
        assert anchors.attached(keep) is None, "a dead neighbour retired the anchor"
    plan(anchors, keep)
    assert finalizers_of(keep) == 1 and len(fake.shared) == 21


def test_an_anchor_that_lost_a_race_is_not_kept(fake):
    """Two threads plan the same storage: the anchor of the one that lost
    covers chunks its users do not pin, so it is retired at once, never
    counted live or joined later."""
    anchors = _torch_runs.RunAnchors()
    a = Storage(BASE, 1 << 20)
    b = Storage(BASE + CHUNK, 1 << 20)
    pa, pb = anchors.pending(a), anchors.pending(b)
    plan(anchors, a)                  # the other thread's anchor, of a alone
    anchors._anchor([pa, pb])         # this thread's, planned before it saw that one
    drain()
    assert anchors.live() == 1 and fake.unregistered == ["anchor-2"]
    assert anchors.attached(a).anchor.ticket == "anchor-1" and anchors.attached(b) is None


def test_an_anchor_that_ended_is_replaced_when_granting(fake):
    """A batch found an anchor whose registration has ended since: its
    grant is refused, so the storage gets a new anchor and the grant comes
    from that one."""
    anchors = _torch_runs.run_anchors
    s = Storage(BASE + (300 << 20), 1 << 20)
    plan(anchors, s)
    old = anchors.attached(s)
    fake.ended.add(old.anchor.ticket)
    b = _torch_batch.Batch()
    b._events[0] = b"event"
    args = _torch_reductions._storage_args(s, old, b)
    new = anchors.attached(s)
    assert new is not None and new is not old and old.retired
    assert args[1] == new.id and fake.again[-1][0] == new.anchor.ticket != old.anchor.ticket


def test_a_run_that_cannot_be_registered_whole_is_registered_one_by_one(fake, monkeypatch):
    anchors = _torch_runs.RunAnchors()
    a, b = Storage(BASE, 1 << 20), Storage(BASE + CHUNK, 1 << 20)

    def share(base, size, *, uses=1, ttl=None):
        if size > CHUNK:
            raise vmmipc.InvalidError("mixed chunks", vmmipc.EINVAL, "vmmipc_register_cuda")
        return fake.share(base, size, uses=uses)
    monkeypatch.setattr(_torch_runs, "share", share)
    plan(anchors, a, b)
    assert fake.shared == [(BASE, CHUNK, 0), (BASE + CHUNK, CHUNK, 0)]


def test_memory_without_posix_fd_export_is_refused_naming_what_it_allows(fake):
    fabric = Storage(BASE + 512, 4096)
    fake.ranges[fabric.ptr] = Range(BASE, CHUNK, 0x8, 0)
    with pytest.raises(vmmipc.InvalidError) as e:
        _torch_runs.RunAnchors().pending(fabric)
    msg = str(e.value)
    assert e.value.status == vmmipc.EINVAL
    assert "allows export as CU_MEM_HANDLE_TYPE_FABRIC only" in msg
    assert "needs CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR" in msg
    assert f"4096 bytes at {BASE + 512:#x}" in msg
    both = Storage(BASE, 1)
    fake.ranges[both.ptr] = Range(BASE, CHUNK, 0x9, 0)
    assert _torch_runs.RunAnchors().pending(both) is not None, "POSIX among others is fine"


def test_not_vmm_memory_is_left_to_torch(fake):
    anchors = _torch_runs.RunAnchors()
    assert anchors.pending(Storage(0xdead, 64)) is None
    assert anchors.pending(Storage(BASE, 0)) is None
    assert anchors.pending(Storage(BASE, 64, Device("cpu", None))) is None
    assert fake.queries == [(0xdead, 64)], "CPU and empty storages never ask the library"


def test_reducers_route_by_memory(fake):
    torch_way = lambda: "torch's reducer"  # noqa: E731
    ours = lambda run, b: ("vmmipc", run)  # noqa: E731
    route = _torch_reductions._reduce_through
    assert route("x", Storage(0xdead, 64), torch_way, ours) == "torch's reducer"
    assert route("x", Storage(BASE, 0), torch_way, ours) == "torch's reducer"
    assert route("x", Storage(BASE, 64, Device("cpu", None)), torch_way, ours) == "torch's reducer"
    s = Storage(BASE, 64)
    kind, run = route("x", s, torch_way, ours)
    assert kind == "vmmipc" and run is _torch_runs.run_anchors.attached(s)


def test_reducer_errors_reach_the_caller(fake, monkeypatch):
    def no_library(ptr, size):
        raise vmmipc.LibraryNotFoundError("libvmmipc.so not found")

    monkeypatch.setattr(_torch_runs, "cuda_query_range", no_library)
    with pytest.raises(vmmipc.LibraryNotFoundError, match="libvmmipc.so not found"):
        _torch_reductions._reduce_through("CUDA tensor", Storage(BASE, 64), lambda: None,
                                    lambda run, b: None)


@pytest.mark.parametrize("where", ["pool", "queue"])
def test_a_pickle_for_a_forked_child_registers_nothing(fake, monkeypatch, where):
    monkeypatch.setattr(_mp, "fork_destination", lambda: where)
    s = Storage(BASE + (3 << 20), 64)
    ours = lambda run, b: ("vmmipc", run)  # noqa: E731
    with _torch_batch.batch([s]):
        if where == "pool":
            with pytest.raises(vmmipc.VmmipcForkError, match="fork-context pool"):
                _torch_reductions._reduce_through("CUDA tensor", s, lambda: None, ours)
        else:
            fn, args = _torch_reductions._reduce_through("CUDA tensor", s, lambda: None, ours)
            assert fn is _mp.refuse_fork and args == ("queue",)
    assert fake.shared == [] and fake.again == [], "nothing registered for a forked child"


# -------------------------------------------------- grants and keep-alives


def test_a_batch_makes_one_grant_per_anchor_and_keeps_its_storages(fake):
    anchors = _torch_runs.RunAnchors()
    s = [Storage(BASE + i * (1 << 20), 1 << 20) for i in range(5)]
    far = Storage(BASE + (200 << 20), 1 << 20)
    plan(anchors, *s, far)
    alive = [weakref.ref(x) for x in s]
    b = _torch_batch.Batch()
    tickets = {b.ticket(anchors.attached(x), x) for x in s}
    tickets.add(b.ticket(anchors.attached(far), far))
    assert tickets == {"pickle-1", "pickle-2"}
    assert [(t, uses) for t, uses, *_ in fake.again] == [("anchor-1", 1), ("anchor-2", 1)]
    assert fake.holds == [True, True], "a receiver's hold must keep the sent storages"
    far_ref = weakref.ref(far)
    del s, far, b
    gc.collect()
    drain()
    assert all(r() is not None for r in alive) and far_ref() is not None, \
        "a pending grant keeps its storages alive"
    fake.again[0][3]()  # the receiver has the first run
    drain()
    assert all(r() is None for r in alive) and far_ref() is not None
    fake.again[1][3]()
    drain()
    assert far_ref() is None
    assert sorted(fake.unregistered) == ["anchor-1", "anchor-2"], "their storages died"


def test_a_new_batch_makes_new_grants(fake):
    anchors = _torch_runs.RunAnchors()
    s = Storage(BASE, 1 << 20)
    plan(anchors, s)
    run = anchors.attached(s)
    _torch_batch.Batch().ticket(run, s)
    _torch_batch.Batch().ticket(run, s)
    assert [t for t, *_ in fake.again] == ["anchor-1", "anchor-1"], "one grant per batch"


def test_the_pickle_ttl_reaches_the_grant(fake):
    anchors = _torch_runs.RunAnchors()
    s = Storage(BASE, 1 << 20)
    plan(anchors, s)
    vt.set_pickle_ttl(7.5)
    try:
        _torch_batch.Batch().ticket(anchors.attached(s), s)
    finally:
        vt.set_pickle_ttl(None)
    assert fake.again[-1][:3] == ("anchor-1", 1, 7.5)


def test_a_grant_that_fails_keeps_nothing(fake):
    anchor = _anchor.Anchor("anchor-x")
    obj = Storage(1, 1)
    alive = weakref.ref(obj)
    fake.fail_again = 1
    with pytest.raises(vmmipc.NotFoundError):
        anchor.grant(keep=[obj])
    del obj
    drain()
    assert alive() is None and anchor.pending() == []


def test_pending_grants_are_bounded(fake, caplog):
    """A receiver that never comes: beyond the limit the oldest grant is
    ended, and what it kept alive is let go. Said once per anchor (grants
    that receivers hold count too, and many may be held for long)."""
    anchor = _anchor.Anchor("anchor-z")
    kept = [Storage(i, 1) for i in range(5)]
    alive = [weakref.ref(k) for k in kept]
    with caplog.at_level("WARNING", logger=_anchor.log.name):
        tickets = [anchor.grant(keep=[k], limit=3) for k in kept]
    said = [r.getMessage() for r in caplog.records if "have not ended" in r.getMessage()]
    assert len(said) == 1 and "held by their receivers" in said[0], said
    del kept
    drain()
    assert fake.unregistered == tickets[:2] and anchor.pending() == tickets[2:]
    for (_, _, _, release), ticket in zip(fake.again, tickets):
        if ticket in fake.unregistered:
            release()  # what the library does once an unregistered grant has ended
    drain()
    assert [r() is None for r in alive] == [True, True, False, False, False]


def test_anchor_grants_are_pending_until_released(fake):
    """Grants that keep an object alive (a torch storage) end through their
    release callback. (Those that keep nothing have none and are asked
    about: test_messages.py, test_pickles_call_nothing_back_...)"""
    anchor = _anchor.Anchor("anchor-y")
    t1 = anchor.grant(uses=2, ttl=1.5, keep=object())
    t2 = anchor.grant(keep=object())
    assert anchor.pending() == [t1, t2]
    fake.again[0][3]()
    assert anchor.pending() == [t2]
    anchor.retire()
    anchor.retire()
    drain()
    assert fake.unregistered == ["anchor-y"], "retired once, on the reaper"
    assert anchor.pending() == [t2], "grants outlive their anchor"


# --------------------------------------------------- messages and settings


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
        assert (_torch_received.receive_device(), _torch_batch.Batch().ttl) == (1, 2.5)
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

    assert _torch_received._uuid_bytes(Signed()) == want
    assert _torch_received._uuid_bytes(Printed()) == want


def test_after_fork_the_child_has_fresh_state():
    """One hook (vmmipc._anchor.after_fork) resets what a forked child
    inherits: a new sender token, a new reaper, anchors it must not end."""
    token = _torch_runs._token[0]
    drain()  # the parent's reaper thread runs: the child must not count on it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a forkserver child inherits the module state like this
        ok = _torch_runs._token[0] != token
        for reaper in (_anchor.reaper, _torch_runs.reaper):  # also under an imported name
            done = threading.Event()
            reaper.submit(done.set)
            ok = ok and done.wait(10)
        os.write(w, _torch_runs._token[0] if ok else b"x" * 16)
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(r, 16)
    os.close(r)
    os.close(w)
    assert len(child) == 16 and child != token and child != b"x" * 16


# ------------------------------------------------------ receiver bookkeeping


def test_received_storages_are_found_while_alive_only():
    received = _torch_received.WeakTable()
    s = Storage(1, 1)
    assert received.add("k", s) is s
    assert received.add("k", Storage(2, 2)) is s, "the first one stays"
    assert received.get("k") is s and received.get("other") is None
    del s
    gc.collect()
    assert received.get("k") is None and len(received) == 0


def test_each_ticket_is_spent_once():
    spent = _torch_received.SpentTickets()
    assert spent.add(b"t1") and not spent.add(b"t1")
    spent.forget(b"t1")
    assert spent.add(b"t1"), "forgotten (spending it failed): spent again"
    spent.LIMIT = 3
    for t in (b"a", b"b", b"c"):
        spent.add(t)
    assert spent.add(b"t1") and not spent.add(b"c"), "bounded: the oldest go first"


def test_blobs_name_nothing_but_tensors_and_dtypes():
    import io
    import pickle
    evil = pickle.dumps(os.system)
    with pytest.raises(pickle.UnpicklingError, match="may not name"):
        _torch_blob._BlobUnpickler(io.BytesIO(evil)).load()
    with pytest.raises(ValueError, match="not a vmmipc.torch blob"):
        vt.open_tensors(b"\x80\x05junk")
    with pytest.raises(TypeError, match="takes the bytes share_tensors returned"):
        vt.open_tensors("text")


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
    assert ForkingPickler.dump.__wrapped__ is not None, "each pickle is one batch"
    assert not hasattr(ForkingPickler.dump.__wrapped__, "__wrapped__"), "wrapped once"


@needs_torch
def test_cpu_tensors_and_storages_keep_torchs_reducer_when_chosen(monkeypatch):
    """set_cpu_sharing("torch"): CPU tensors are torch's, as without vmmipc
    (the default, "vmmipc", is tests/python/test_torch_host.py's)."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    import torch.multiprocessing.reductions as tr

    def never(*a):
        raise AssertionError("a CPU tensor must not reach libvmmipc")

    monkeypatch.setattr(_torch_runs, "cuda_query_range", never)
    assert vt.get_cpu_sharing() == "vmmipc"
    vt.set_cpu_sharing("torch")
    try:
        _cpu_tensors_keep_torchs_reducer(torch, ForkingPickler, tr)
    finally:
        vt.set_cpu_sharing("vmmipc")
    with pytest.raises(ValueError, match="'vmmipc', 'torch'"):
        vt.set_cpu_sharing("file_system")


def _cpu_tensors_keep_torchs_reducer(torch, ForkingPickler, tr):
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
    for view in (base, base[2:], base[:, 3:7], base.t(), base[1::2, ::3]):
        got = _torch_reductions.tensor_over(view.untyped_storage(),
                                         *_torch_reductions.tensor_meta(torch, view))
        assert got.dtype == dt and got.shape == view.shape and got.stride() == view.stride()
        assert got.storage_offset() == view.storage_offset() and torch.equal(got, view)
        assert got.untyped_storage() is view.untyped_storage(), "a view, not a copy"


@needs_torch
@pytest.mark.filterwarnings("ignore:Named tensors:UserWarning")  # torch calls them experimental
def test_parameters_and_requires_grad_are_kept():
    import torch
    meta, over = _torch_reductions.tensor_meta, _torch_reductions.tensor_over
    p = torch.nn.Parameter(torch.randn(4, 4))
    got = over(p.untyped_storage(), *meta(torch, p))
    assert type(got) is torch.nn.Parameter and got.requires_grad and torch.equal(got, p)
    frozen = torch.nn.Parameter(torch.arange(4, dtype=torch.int8), requires_grad=False)
    got = over(frozen.untyped_storage(), *meta(torch, frozen))
    assert type(got) is torch.nn.Parameter and not got.requires_grad
    with pytest.raises(RuntimeError, match="requires_grad"):  # the word torch's own test asserts
        meta(torch, p * 2)
    z = torch.randn(4, dtype=torch.complex64).conj()  # a lazy view: the bit is not in the data
    with pytest.raises(ValueError, match="resolve_conj"):
        meta(torch, z)
    if hasattr(torch, "_namedtensor_internals"):  # torch 2.15 has no named tensors
        named = torch.zeros(2, 3, names=("N", "C"))  # torch refuses to send names; so do we
        with pytest.raises(RuntimeError, match="Named tensors don't support serialization"):
            meta(torch, named)


def test_views_of_one_storage_share_one_argument_tuple(fake):
    """Tied weights and views: one storage's rebuild arguments are one tuple
    per batch (the pickler's memo sends it once; the receiver's table makes
    one storage of it), with one grant and one event for the batch."""
    anchors = _torch_runs.run_anchors
    s = Storage(BASE, 1 << 20)
    other = Storage(BASE + (1 << 20), 1 << 20)
    plan(anchors, s, other)
    b = _torch_batch.Batch()
    b._events[0] = b"event"  # recorded once per device; no GPU here
    first = _torch_reductions._storage_args(s, anchors.attached(s), b)
    again = _torch_reductions._storage_args(s, anchors.attached(s), b)
    second = _torch_reductions._storage_args(other, anchors.attached(other), b)
    assert first is again and first != second
    assert first[0] is second[0] and len(fake.again) == 1, "one grant for the run"
    assert first[2:] == (0, 1 << 20, 0, b"event") and second[2] == 1 << 20


class NonLeaf:
    """A stand-in for a tensor that requires grad and is not a leaf."""
    requires_grad, is_leaf = True, False


def test_a_refused_tensor_leaves_no_grant(fake):
    """A non-leaf tensor that requires grad is refused (RuntimeError naming
    requires_grad, the word torch's own test asserts) before anything is
    granted: no registration is left holding its memory."""
    anchors = _torch_runs.run_anchors
    s = Storage(BASE, 1 << 20)
    plan(anchors, s)
    granted = len(fake.again)

    b = _torch_batch.Batch()
    b._events[0] = b"event"
    with pytest.raises(RuntimeError, match="requires_grad"):
        _torch_reductions._tensor_reduction(None, NonLeaf(), s, anchors.attached(s), b)
    assert len(fake.again) == granted, "the refused tensor's send made a grant"


class FakeEvent:
    """Stands in for torch.cuda.Event(interprocess=True)."""
    made = 0

    def __init__(self, interprocess=False):
        assert interprocess
        FakeEvent.made += 1
        self.handle = b"event-%d" % FakeEvent.made
        self.done = False

    def record(self, stream):
        self.done = False

    def query(self):
        return self.done

    def ipc_handle(self):
        return self.handle


class FakeCudaTorch:
    """Stands in for torch where a batch records its events or synchronizes
    instead (Batch.event): torch.cuda.device, current_stream (one a device,
    counting synchronize calls) and Event."""

    Event = FakeEvent

    def __init__(self):
        self.cuda = self  # torch.cuda.X is self.X
        self.streams = {}
        FakeEvent.made = 0

    def device(self, device):
        return contextlib.nullcontext()

    def current_stream(self, device):
        return self.streams.setdefault(device, _FakeStream())

    def syncs(self) -> dict:
        """device -> how often its stream was synchronized."""
        return {d: s.syncs for d, s in self.streams.items() if s.syncs}


class _FakeStream:
    syncs = 0

    def synchronize(self):
        self.syncs += 1


def test_ordering_follows_the_socket_directory(monkeypatch):
    """Across pods there is no shared /dev/shm for CUDA's interprocess
    events: "auto" synchronizes the sender's stream instead when a socket
    directory is set, and sends no event."""
    torch = FakeCudaTorch()
    monkeypatch.setattr(_torch_batch, "torch_module", lambda: torch)
    with pytest.raises(ValueError, match="must be one of"):
        vt.set_ordering("fence")
    monkeypatch.delenv("VMMIPC_SOCKET_DIR", raising=False)
    assert _torch_batch.ordering() == "event"
    monkeypatch.setenv("VMMIPC_SOCKET_DIR", "/run/vmmipc")
    assert _torch_batch.ordering() == "sync"
    b = _torch_batch.Batch()
    assert b.event(0) is None and b.event(0) is None, "no event: the stream synchronized"
    assert torch.syncs() == {0: 1} and FakeEvent.made == 0, "once per batch"
    try:
        vt.set_ordering("event")
        assert _torch_batch.ordering() == "event"
    finally:
        vt.set_ordering("auto")


def test_interprocess_events_are_bounded_and_reused(monkeypatch):
    """At most MAX_EVENTS exist; an event that completed and is older than
    EVENT_KEEP_SECONDS is recorded again (same handle); with every event in
    use a pickle synchronizes its stream and sends none (torch's bound)."""
    assert vt.MAX_EVENTS == _torch_batch.MAX_EVENTS == 1000, "the bound python/README.md names"
    torch = FakeCudaTorch()
    monkeypatch.setattr(_torch_batch, "MAX_EVENTS", 3)
    monkeypatch.setattr(_torch_batch, "EVENT_KEEP_SECONDS", 0.0)
    monkeypatch.setattr(_torch_batch, "torch_module", lambda: torch)
    monkeypatch.setattr(_torch_batch, "_events", _torch_batch._SentEvents())
    monkeypatch.setattr(_torch_batch, "ordering", lambda: "event")
    events = _torch_batch._events
    handles = [_torch_batch.Batch().event(0) for _ in range(3)]
    assert len(set(handles)) == 3 and events.counts() == (3, 3) and torch.syncs() == {}
    assert _torch_batch.Batch().event(0) is None, "a 4th event while 3 are in use"
    assert torch.syncs() == {0: 1}, "with no event to send, the pickle synchronizes"
    for _, _, e, _ in list(events._kept):
        e.done = True
    again = _torch_batch.Batch().event(0)
    assert again in handles, "a completed event is recorded again, not a new one made"
    assert events.counts()[0] == 3


# ------------------------------------------------- rebuild_storage's holds


class FakeReceiver:
    """Stands in for what rebuild_storage calls in the receiver: the run is
    mapped (map_run: imported with the ticket, or found mapped), a storage
    made over it, the ticket confirmed, the event waited on; and records
    which held tickets are let go of, and which devices synchronized
    (events: both, in order)."""

    def __init__(self, monkeypatch, imported=True, event_fails=False):
        """imported: True (every map_run imports the run), False (every run
        is mapped here already), or "first" (a run is imported the first
        time, then found mapped)."""
        self.confirmed, self.released, self.events = [], [], []
        self.many = []         # the tickets of each confirm_many call
        self.imports = []      # the tickets map_run imported a run with
        self.refuse = set()    # tickets confirm_many refuses (NotFoundError)
        self.waited = []       # tickets whose event was waited on
        self.mapped = set()    # anchor ids of runs mapped here (imported="first")
        self.imported, self.event_fails = imported, event_fails
        tables = (("received", _torch_received.WeakTable()),
                  ("spent", _torch_received.SpentTickets()),
                  ("holds", _torch_received.Holds()))
        for name, value in tables + (("receive_device", lambda: None),
                                     ("torch_module", lambda: self),
                                     ("map_run", self.map_run),
                                     ("storage_over", self.storage_over),
                                     ("confirm", self.confirm), ("wait_event", self.wait_event)):
            monkeypatch.setattr(_torch_reductions, name, value)
        for name, value in tables + (("confirming", _torch_received.Confirming()),
                                     ("confirm_many", self.confirm_many),
                                     ("wait_event", self.wait_event)):
            monkeypatch.setattr(_torch_received, name, value)
        monkeypatch.setattr(_torch_received, "release", self.release)
        monkeypatch.setattr(_torch_received, "torch_module", lambda: self)
        self.cuda = self

    def release(self, ticket):
        self.released.append(ticket)
        self.events.append(("release", ticket))

    def synchronize(self, device):
        self.events.append(("synchronize", device))

    def init(self):
        pass

    def map_run(self, torch, ticket, anchor_id, target):
        imported = self.imported
        if imported == "first":
            imported = anchor_id not in self.mapped
            self.mapped.add(anchor_id)
        if imported:
            self.imports.append(ticket)
        return "run", imported

    def storage_over(self, torch, run, offset, nbytes):
        return Storage(BASE + offset, nbytes)

    def confirm(self, ticket, hold=False):
        assert hold
        self.confirmed.append(ticket)

    def confirm_many(self, tickets, hold=False):
        assert hold
        self.many.append(list(tickets))
        return [vmmipc.NotFoundError("it ended", vmmipc.ENOENT, "vmmipc_confirm_many")
                if t in self.refuse else None for t in tickets]

    def wait_event(self, storage, ticket, exporter_device, event_handle, target):
        self.waited.append(ticket)
        if self.event_fails:
            raise RuntimeError("cannot open the sender's CUDA event")


@pytest.mark.parametrize("imported", [True, False], ids=["imported", "confirmed"])
def test_a_receive_that_fails_after_spending_its_use_lets_go_of_the_hold(monkeypatch, imported):
    """The run was imported (or the ticket confirmed), both holding the use,
    and then the sender's event could not be opened (another /dev/shm): the
    load fails, and the hold must go with the storage, not stay until this
    process ends (the sender would keep the sent storages that long)."""
    r = FakeReceiver(monkeypatch, imported=imported, event_fails=True)
    with pytest.raises(RuntimeError, match="CUDA event"):
        _torch_reductions.rebuild_storage("g1", ("sender", 1), 0, 64, 0, b"event")
    gc.collect()
    assert r.confirmed == ([] if imported else ["g1"])
    assert r.released == ["g1"], "the use held for the failed load was never let go of"
    assert _torch_reductions.holds.held() == 0
    r.event_fails = False
    with pytest.raises(vmmipc.NotFoundError):  # not tensors nothing holds or orders
        _torch_reductions.rebuild_storage("g1", ("sender", 1), 0, 64, 0, b"event")


def test_a_ticket_let_go_of_covers_no_storage_again(monkeypatch):
    """A pickle loaded again after this process let go of its ticket's use
    (its storages died, or a later pickle of them took over): nothing holds
    that use any more, so the sender may reuse the memory. The load must
    fail (as a miss does: the sender answers ENOENT), not hand out a
    storage that nothing keeps, nor move a live storage off the ticket
    that does keep it."""
    r = FakeReceiver(monkeypatch, imported=False)  # the run is mapped here already
    args = (("sender", 1), 0, 64, 0, None)
    s = _torch_reductions.rebuild_storage("g1", *args)
    del s
    gc.collect()
    assert r.released == ["g1"]
    with pytest.raises(vmmipc.NotFoundError, match="received here before"):
        _torch_reductions.rebuild_storage("g1", *args)  # the same pickle, loaded again
    s = _torch_reductions.rebuild_storage("g2", *args)
    assert _torch_reductions.rebuild_storage("g3", *args) is s, "sent again: g3 takes over"
    assert r.released == ["g1", "g2"]
    with pytest.raises(vmmipc.NotFoundError, match="received here before"):
        _torch_reductions.rebuild_storage("g2", *args)  # an older pickle of s, again
    assert r.released == ["g1", "g2"], "g3 must still hold s"
    del s
    gc.collect()
    assert r.released == ["g1", "g2", "g3"] and _torch_reductions.holds.held() == 0


def test_a_pickle_that_fails_ends_the_grants_it_made(fake):
    """A tensor refused (or anything else unpicklable: a lambda) after
    others of the same pickle were granted: no receiver will ever see those
    grants, so they end with the failed pickle, and the storages they kept
    are let go of, not held until this process ends."""
    anchors = _torch_runs.run_anchors
    s = Storage(BASE + (500 << 20), 1 << 20)
    plan(anchors, s)
    alive = weakref.ref(s)

    with pytest.raises(RuntimeError, match="requires_grad"):
        with _torch_batch.batch() as b:  # s is planned already (and torch not needed)
            b._events[0] = b"event"
            run = anchors.attached(s)
            ticket = _torch_reductions._storage_args(s, run, b)[0]  # s is granted
            _torch_reductions._tensor_reduction(None, NonLeaf(), s, run, b)
    assert ticket in fake.unregistered, "the failed pickle's grant is still pending"
    release = next(r for t, *_, r in fake.again if t == run.anchor.ticket)
    release()  # what the library does once the grant has ended
    del s, b
    drain()
    assert alive() is None, "the failed pickle's grant still keeps the storage"


def test_a_use_is_let_go_of_after_its_dead_storages_device_is_synchronized(monkeypatch):
    """A received storage dies while kernels queued on it may still run
    (y = x @ w; del w): its ticket's use is let go of only after the device
    is synchronized, as torch's own receiver does, or the sender could
    reuse the memory under them. A storage that a newer ticket took over
    lives on, and the sender keeps the same memory for it: no wait then."""
    r = FakeReceiver(monkeypatch, imported=False)
    w = _torch_reductions.rebuild_storage("g1", ("sender", 1), 0, 64, 0, None)
    b = _torch_reductions.rebuild_storage("g1", ("sender", 1), 64, 64, 0, None)
    assert _torch_reductions.rebuild_storage("g2", ("sender", 1), 0, 64, 0, None) is w
    assert r.events == [], "g1 still keeps b"
    assert _torch_reductions.rebuild_storage("g2", ("sender", 1), 64, 64, 0, None) is b
    assert r.events == [("release", "g1")], "g1's storages live on under g2: no wait"
    del w
    gc.collect()
    assert r.events == [("release", "g1")], "g2 still keeps b"
    del b
    gc.collect()
    assert r.events == [("release", "g1"), ("synchronize", 0), ("release", "g2")]


def test_a_storage_outside_its_run_is_refused(monkeypatch):
    """rebuild_storage's offset and size come from the pickle (from the
    network, for open_tensors): a range outside the mapped run must be
    refused before torch wraps an address that is not the run's."""
    class Mapping:
        addr, size, device = 1 << 40, 4 << 20, 0

    class NoTorch:
        def as_tensor(self, region):
            raise AssertionError(f"wrapped {region.nbytes} bytes at {region.addr:#x}")

    run = _torch_received.MappedRun.__new__(_torch_received.MappedRun)
    run.mapping = Mapping()  # no finalizer: nothing to unmap
    for offset, nbytes in ((4 << 20, 1), ((4 << 20) - 8, 16), (-8, 8), (0, (4 << 20) + 1)):
        with pytest.raises(vmmipc.InvalidError, match="outside"):
            _torch_received.storage_over(NoTorch(), run, offset, nbytes)



def test_a_storage_refused_after_its_run_was_imported_lets_go_of_the_hold(monkeypatch):
    """The import spent and held the ticket's use, then the storage was
    refused (outside its run): no storage will ever let go of that use."""
    r = FakeReceiver(monkeypatch, imported=True)

    def refuse(torch, run, offset, nbytes):
        raise vmmipc.InvalidError("lies outside its run", vmmipc.EINVAL, "vmmipc.torch")
    monkeypatch.setattr(_torch_reductions, "storage_over", refuse)
    with pytest.raises(vmmipc.InvalidError, match="outside its run"):
        _torch_reductions.rebuild_storage("g1", ("sender", 1), 1 << 40, 64, 0, None)
    assert r.released == ["g1"]


# ------------------------------------------- one pickle's hits, together


class _BatchPickler:
    """Pickles as a batch's ForkingPickler.dump does, without torch: Storage
    stand-ins through _storage_args (rebuild_storage's arguments), the
    object wrapped by finished() unless wrap is False."""

    def __init__(self, anchors, event=None):
        self.anchors, self.event = anchors, event

    def dumps(self, obj, wrap=True, finish=True) -> bytes:
        """finish=False: the storages name the batch's load, but the
        pickle does not end with finish_load (a damaged blob)."""
        import io
        import pickle
        anchors, event = self.anchors, self.event

        class Pickler(pickle.Pickler):
            def reducer_override(self, o):
                if isinstance(o, Storage):
                    return (_torch_reductions.rebuild_storage,
                            _torch_reductions._storage_args(o, anchors.attached(o), b))
                return NotImplemented

        with _torch_batch.batch() as b:
            b._events[0] = event
            buf = io.BytesIO()
            wrapped = _torch_reductions.finished(obj, b) if wrap else obj
            Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(wrapped if finish else obj)
            return buf.getvalue()


RUN_BASES = (BASE + (600 << 20), BASE + (700 << 20), BASE + (800 << 20))


def three_runs(fake, per_run=4):
    """per_run storages in each of 3 runs (chunks far apart), planned."""
    anchors = _torch_runs.run_anchors
    storages = [Storage(base + i * (1 << 20), 1 << 20) for base in RUN_BASES
                for i in range(per_run)]
    plan(anchors, *storages)
    assert len({id(anchors.attached(s)) for s in storages}) == 3
    return anchors, storages


def test_a_resent_pickle_spends_its_hits_with_one_confirm_many(fake, monkeypatch):
    """The first load imports each of the 3 runs (a miss streams, one
    import per run) and confirms nothing; the same 12 storages sent again
    are all hits, spent by ONE confirm_many of the pickle's 3 tickets (not
    one confirm per run), before loads returns; the new tickets take over
    the storages and the first load's are let go of."""
    import pickle
    anchors, storages = three_runs(fake)
    r = FakeReceiver(monkeypatch, imported="first")
    sender = _BatchPickler(anchors, event=b"event")
    first = pickle.loads(sender.dumps({"w": storages[:6], "b": tuple(storages[6:])}))
    granted = [t for t, *_ in fake.again]
    assert len(granted) == 3
    old = {f"pickle-{i}" for i in (1, 2, 3)}
    assert sorted(r.imports) == sorted(old), "one import per run, with its ticket"
    assert r.many == [] and r.confirmed == [], "the first load's storages are all in its runs"
    assert sorted(r.waited) == sorted(old), "each ticket's event waited on once"
    assert _torch_reductions.holds.held() == 3 and r.released == []

    again = pickle.loads(sender.dumps({"w": storages[:6], "b": tuple(storages[6:])}))
    new = {f"pickle-{i}" for i in (4, 5, 6)}
    assert len(r.many) == 1 and sorted(r.many[0]) == sorted(new), r.many
    assert r.confirmed == [] and len(r.imports) == 3, "no confirm alone, no import"
    assert all(x is y for x, y in zip(first["w"] + list(first["b"]),
                                       again["w"] + list(again["b"])))
    assert sorted(r.released) == sorted(old), "the new tickets took over every storage"
    assert _torch_reductions.holds.held() == 3
    del first, again
    gc.collect()
    assert sorted(r.released) == sorted(old | new) and _torch_reductions.holds.held() == 0


def test_a_refusal_among_the_hits_raises_and_holds_nothing(fake, monkeypatch):
    """One of the pickle's 3 grants has ended (the sender's ttl): the load
    raises NotFoundError, as confirm would have, lets go of the 2 uses it
    did hold, forgets the refused one, and keeps nothing of its own: the
    first load's tickets still keep the storages."""
    import pickle
    anchors, storages = three_runs(fake)
    r = FakeReceiver(monkeypatch, imported="first")
    sender = _BatchPickler(anchors)
    first = pickle.loads(sender.dumps(storages))
    blob = sender.dumps(storages)
    r.refuse.add("pickle-5")
    with pytest.raises(vmmipc.NotFoundError, match="it ended"):
        pickle.loads(blob)
    gc.collect()
    assert len(r.many) == 1 and sorted(r.released) == ["pickle-4", "pickle-6"]
    assert "pickle-5" not in _torch_reductions.spent, "a refused use is not spent"
    assert _torch_reductions.holds.held() == 3, "the first load's tickets keep its storages"
    r.refuse.clear()  # its grant answers now, but the others were let go of
    with pytest.raises(vmmipc.NotFoundError, match="received here before"):
        pickle.loads(blob)  # its held uses were let go of: loaded again it covers nothing
    assert r.many[1] == ["pickle-5"] and sorted(r.released) == ["pickle-4", "pickle-5",
                                                                "pickle-6"]
    assert _torch_reductions.holds.held() == 3
    del first
    gc.collect()
    assert _torch_reductions.holds.held() == 0


def test_a_pickle_loaded_twice(fake, monkeypatch):
    """While its storages live, a pickle loaded again gives the same
    storages and spends nothing more; once they died and its tickets were
    let go of, loading it again raises NotFoundError."""
    import pickle
    anchors, storages = three_runs(fake, per_run=2)
    r = FakeReceiver(monkeypatch, imported=False)  # every run is mapped here already
    blob = _BatchPickler(anchors).dumps(storages)
    a = pickle.loads(blob)
    b = pickle.loads(blob)
    assert all(x is y for x, y in zip(a, b)) and len(r.many) == 1 and r.confirmed == []
    del a, b
    gc.collect()
    assert len(r.released) == 3 and _torch_reductions.holds.held() == 0
    with pytest.raises(vmmipc.NotFoundError, match="received here before"):
        pickle.loads(blob)
    assert len(r.many) == 1, "nothing new was confirmed"


class _LoadsInside:
    """An object whose unpickling loads another pickle (a nested load)."""

    def __init__(self, blob):
        self.blob = blob

    def __reduce__(self):
        import pickle
        return (pickle.loads, (self.blob,))


def test_nested_objects_and_a_load_inside_a_load(fake, monkeypatch):
    """Storages deep in dicts, lists, tuples and objects are all the
    pickle's hits (one confirm_many); a pickle unpickled while another one
    is (a custom reducer's loads) has a load of its own, finished first."""
    import pickle
    anchors, storages = three_runs(fake, per_run=2)
    r = FakeReceiver(monkeypatch, imported=False)
    sender = _BatchPickler(anchors)
    inner = sender.dumps([storages[0], storages[5]])
    outer = sender.dumps({"a": [storages[1], (storages[2], {"x": storages[3]})],
                          "inner": _LoadsInside(inner), "n": 5, "t": (storages[4],)})
    got = pickle.loads(outer)

    def at(s):  # where FakeReceiver.storage_over puts a storage of s
        return BASE + s.ptr - anchors.attached(s).base
    assert got["n"] == 5 and got["a"][1][1]["x"].ptr == at(storages[3])
    assert [x.ptr for x in got["inner"]] == [at(storages[0]), at(storages[5])]
    assert got["t"][0].ptr == at(storages[4]) and got["a"][0].ptr == at(storages[1])
    assert len(r.many) == 2 and len(r.many[0]) == 2 and len(r.many[1]) == 3, r.many
    assert _torch_reductions.holds.held() == 5, "2 tickets keep the inner's, 3 the outer's"


def test_two_threads_loading_one_pickle(fake, monkeypatch):
    """Two threads load one pickle at once: one load spends its uses (one
    confirm_many), and the other waits for that answer before it returns
    the same storages, never believing a hold not granted yet; a refusal
    reaches both."""
    import pickle
    anchors, storages = three_runs(fake, per_run=2)
    r = FakeReceiver(monkeypatch, imported=False)
    sender = _BatchPickler(anchors)
    gate, inside = threading.Event(), threading.Event()
    answer = r.confirm_many

    def slow_confirm_many(tickets, hold=False):
        inside.set()
        assert gate.wait(10)
        return answer(tickets, hold=hold)
    monkeypatch.setattr(_torch_received, "confirm_many", slow_confirm_many)

    for refused in (False, True):
        blob = sender.dumps(storages)
        if refused:
            r.refuse.add(f"pickle-{len(fake.again) - 1}")
        inside.clear()
        gate.clear()
        got: dict = {}

        def load(name):
            try:
                got[name] = pickle.loads(blob)
            except vmmipc.VmmipcError as e:
                got[name] = e
        first = threading.Thread(target=load, args=("first",))
        first.start()
        assert inside.wait(10)
        second = threading.Thread(target=load, args=("second",))
        second.start()
        second.join(0.3)
        assert second.is_alive(), "the second load returned before the first was answered"
        gate.set()
        first.join(10)
        second.join(10)
        if refused:
            assert all(isinstance(got[n], vmmipc.NotFoundError) for n in got), got
        else:
            assert all(x is y for x, y in zip(got["first"], got["second"]))
            assert _torch_reductions.holds.held() == 3
        del got
        gc.collect()
    assert len(r.many) == 2, "one confirm_many a pickle, not one a load"
    assert _torch_reductions.holds.held() == 0


def test_a_storage_outside_a_batch_is_confirmed_alone(fake, monkeypatch):
    """A pickle that does not end with finish_load (reduce_tensor called
    outside a batch's dump) names no load: each hit is confirmed alone, as
    before."""
    import pickle
    anchors, storages = three_runs(fake, per_run=1)
    r = FakeReceiver(monkeypatch, imported=False)
    got = pickle.loads(_BatchPickler(anchors).dumps(storages, wrap=False))
    assert len(got) == 3 and r.many == [] and len(r.confirmed) == 3


def test_a_pickle_is_wrapped_only_when_its_plan_found_vmm_storages(fake, monkeypatch):
    """dump_in_batch wraps what it dumps only when the plan found VMM
    storages: every other pickle (CPU tensors, plain data) is unchanged."""
    found: list = []
    monkeypatch.setattr(_torch_batch, "_storages_in", lambda obj: iter(found))
    dumped = []
    dump = _torch_batch.dump_in_batch(lambda self, obj: dumped.append(obj),
                                      _torch_reductions.finished)
    dump(None, {"plain": 1})
    assert dumped == [{"plain": 1}]
    found.append(Storage(BASE + (900 << 20), 64))
    dump(None, {"vmm": 1})
    assert isinstance(dumped[1], _torch_reductions._Finished)
    assert dumped[1].obj == {"vmm": 1} and dumped[1].mark is not None


def test_a_damaged_load_is_refused():
    with pytest.raises(vmmipc.InvalidError, match="not the load it began"):
        _torch_received.finish_load([], "not a load")
    with pytest.raises(vmmipc.InvalidError, match="as its load"):
        _torch_reductions.rebuild_storage("g1", ("sender", 1), 0, 64, 0, None, "x")


def test_open_tensors_spends_a_blobs_hits_with_one_confirm_many(fake, monkeypatch):
    """A blob (share_tensors' format: the magic, then a batch's pickle)
    opened again while its runs are mapped here: one confirm_many for the
    blob; its unpickler admits LoadUses and finish_load."""
    anchors, storages = three_runs(fake, per_run=2)
    r = FakeReceiver(monkeypatch, imported=False)
    names = [f"t{i}" for i in range(len(storages))]
    blob = _torch_blob.BLOB_MAGIC + _BatchPickler(anchors).dumps(("list", names, storages))
    got = vt.open_tensors(blob)
    assert [n for n, _ in got] == names and len(r.many) == 1 and len(r.many[0]) == 3
    assert r.confirmed == [] and _torch_reductions.holds.held() == 3


@needs_torch
def test_a_pickle_without_vmm_storages_is_not_wrapped():
    """Only a pickle whose plan found storages that cross through vmmipc
    ends with finish_load: plain data, and CPU tensors under
    set_cpu_sharing("torch"), pickle as they did."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    vt.install()
    assert b"finish_load" not in bytes(ForkingPickler.dumps({"x": [1, "two"]}))
    vt.set_cpu_sharing("torch")
    try:
        sent = {"t": torch.arange(4), "x": [1, "two"]}
        data = bytes(ForkingPickler.dumps(sent))
    finally:
        vt.set_cpu_sharing("vmmipc")
    assert b"finish_load" not in data and b"LoadUses" not in data
    got = ForkingPickler.loads(data)
    assert torch.equal(got["t"], sent["t"]) and got["x"] == [1, "two"]


def test_a_loads_hits_are_one_confirm_many_of_the_library(monkeypatch):
    """LoadUses.finish against libvmmipc itself (host memory, this process
    its own receiver): 3 held grants of one anchor spent together and held
    until their storages die; with one grant ended, finish raises the
    library's NotFoundError and holds none of the load's uses."""
    import fcntl
    for name in ("spent", "holds", "confirming"):
        monkeypatch.setattr(_torch_received, name, type(getattr(_torch_received, name))())
    fd = os.memfd_create("test-load-uses", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    anchor = vmmipc.register_host_file(fd, 1 << 20, 1 << 20, uses=0)
    os.close(fd)
    try:
        for refused in (None, 1):
            ended = [threading.Event() for _ in range(3)]
            grants = [vmmipc.register_again(anchor, uses=1, hold=True, release=e.set)
                      for e in ended]
            if refused is not None:
                vmmipc.unregister(grants[refused])
            before = vmmipc.cache_info().holds
            load = _torch_received.LoadUses()
            storages = [Storage(i, 64, Device("cuda", None)) for i in range(6)]
            for i, storage in enumerate(storages):
                assert load.defer(grants[i % 3], storage, 0, None, None)
            if refused is None:
                _torch_received.finish_load(storages, load)
                assert vmmipc.cache_info().holds == before + 3
                assert not any(e.wait(0.3) for e in ended), "released while held"
            else:
                with pytest.raises(vmmipc.NotFoundError, match="unregistered"):
                    _torch_received.finish_load(storages, load)
            del storages, storage
            gc.collect()
            assert all(e.wait(10) for e in ended), "a use was still held"
            assert _torch_received.holds.held() == 0
    finally:
        vmmipc.unregister(anchor)


@needs_torch
def test_a_batch_plans_the_storages_of_a_module(monkeypatch):
    """q.put(model): a batch's plan finds a module's parameters and buffers,
    its submodules' included (so they are anchored together and the pickle
    ends with finish_load)."""
    import torch
    monkeypatch.setattr(_torch_batch, "plain_cuda", lambda torch, t: True)  # CPU stands in
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    found = {id(s) for s in _torch_batch._storages_in({"model": model})}
    want = {id(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())}
    assert found == want and len(want) == 7


def test_a_blob_whose_hits_are_never_finished_is_refused(fake, monkeypatch):
    """A blob whose storages name a load but which does not end with
    finish_load (damaged, or made to skip the check): its hits were never
    confirmed with the sender, so open_tensors refuses it, holding nothing."""
    anchors, storages = three_runs(fake, per_run=1)
    r = FakeReceiver(monkeypatch, imported=False)
    blob = _torch_blob.BLOB_MAGIC + _BatchPickler(anchors).dumps(
        ("list", ["a", "b", "c"], storages), finish=False)
    assert b"LoadUses" in blob and b"finish_load" not in blob
    with pytest.raises(vmmipc.InvalidError, match="does not end with the finish"):
        vt.open_tensors(blob)
    gc.collect()
    assert r.many == [] and r.confirmed == [] and _torch_reductions.holds.held() == 0
