"""CPU tensors between any processes through vmmipc.torch's host arena
(issue 32; docs/dataloader.md, "CPU tensors between any processes"):
torch's own CPU scenarios of test/test_multiprocessing.py, ported
(fd_sharing / fs_sharing, preserve-sharing, the pool cases, inherit_tensor,
empty tensors, is_shared, a non-leaf tensor refused in torch's words), the
lifetime rule (the sender's block held while a receiver holds it, freed
after), descriptors flat on both sides, and the issue's failure shape: a
receiver keeping 1100 CPU tensors at RLIMIT_NOFILE 1024 and 64, where
torch's default dies. Bytes are checked in each. Skipped, saying so, where
torch is not installed."""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import conftest
import vmmipc
from vmmipc import _torch_host

pytestmark = conftest.needs_torch("these tests")


def _torch_moves_storages() -> bool:
    # without torch, needs_torch skips every test anyway
    return not conftest.HAVE_TORCH or _torch_host.can_move_in_place()


# The host arena moves a storage in place (UntypedStorage._swap_data_ptr_,
# torch 2.12 and later); on older torch CPU tensors take torch's own way,
# which test_an_older_torch_keeps_its_own_sharing_and_says_so checks.
moves = pytest.mark.skipif(
    not _torch_moves_storages(),
    reason="this torch has no UntypedStorage._swap_data_ptr_ (added in torch 2.12): CPU "
           "tensors take torch's own way, as test_an_older_torch_keeps_its_own_sharing_and_says_so "
           "checks")

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_PARENT = conftest.PACKAGE_PARENT


def run_script(script: str, *args, timeout=240, path=None) -> dict:
    """Run script in a fresh Python (tests/python importable, for spawn
    children) and return the JSON its last line prints. path: run it from
    that file, so that spawned children import it as their __mp_main__ (and
    so vmmipc.torch), as a user's script is."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT, HERE, env.get("PYTHONPATH", "")])
    code = ["-c", textwrap.dedent(script)]
    if path is not None:
        with open(path, "w") as f:
            f.write(textwrap.dedent(script))
        code = [str(path)]
    r = subprocess.run([sys.executable, *code, *map(str, args)],
                       capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def settle(pred, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        gc.collect()
        time.sleep(0.02)
    return True


# ------------------------------------------- torch's fd_sharing / fs_sharing

SHARING = """
    import gc, json, os, sys, time, torch, torch.multiprocessing as mp, vmmipc, vmmipc.torch as vt
    from _torch_host_helpers import fds, fill_views
    if __name__ == "__main__":
        mp.set_sharing_strategy(sys.argv[1])  # torch's strategy: not used for these
        ctx = mp.get_context("spawn")
        x = torch.zeros(4, 3)
        q, back = ctx.Queue(), ctx.Queue()
        results = []
        for round in range(3):  # the first round starts the server; the others are flat
            x.zero_()
            before = fds()
            p = ctx.Process(target=fill_views, args=(q, back)); p.start()
            q.put([x, x[:, 1]])
            one, child_held, child_held_after = back.get(timeout=60)
            p.join(60)
            seen = [x[:, 0].tolist(), x[:, 1].tolist(), x[:, 2].tolist()]
            gc.collect()
            deadline = time.monotonic() + 10
            while vmmipc.holds() and time.monotonic() < deadline:
                time.sleep(0.02)
            results.append({"seen": seen, "one": one, "child_held": child_held,
                            "child_held_after": child_held_after, "holds": vmmipc.holds(),
                            "fds": fds() - before})
        info = vt.host_arena_info()
        shared, ptr = x.is_shared(), x.untyped_storage().data_ptr()
        named = [f for f in os.listdir("/dev/shm") if f.startswith(f"torch_{os.getpid()}_")]
        del x; gc.collect()
        print(json.dumps({"rounds": results, "info": info, "is_shared": shared,
                          "after": vt.host_arena_info(), "shm": named}))
"""


@moves
@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_a_child_fills_a_tensor_and_its_view_and_the_parent_sees_both(strategy):
    """torch's test_fd_sharing / test_fs_sharing: a spawned child fills
    [x, x[:, 1]] in place and the parent sees both writes. The two arrive
    as views of one storage, the child holds one use while it keeps them and
    none after, the sender's block is held meanwhile and free once the
    parent drops x, and after the first round the parent's descriptors do
    not move. torch's sharing strategy does not matter (nothing is named
    in /dev/shm)."""
    out = run_script(SHARING, strategy)
    for r in out["rounds"]:
        assert r["seen"] == [[1.0] * 4, [2.0] * 4, [1.0] * 4], r
        assert r["one"], "x and x[:, 1] arrived over two storages"
        assert r["child_held"] == 1 and r["child_held_after"] == 0, r
        assert r["holds"] == 0, r
    assert [r["fds"] for r in out["rounds"][1:]] == [0, 0], out["rounds"]
    assert out["info"]["blocks_live"] == 1 and out["info"]["chunks"] == 1, out
    assert out["after"]["blocks_live"] == 0, out
    assert out["shm"] == []
    # torch's CPU is_shared() asks for its own shm allocator (MapAllocator),
    # which maps one file per storage: an arena block is not one
    # (docs/dataloader.md says why and what re-sending costs).
    assert out["is_shared"] is False


OLDER_TORCH = """
    import json, warnings, torch, torch.multiprocessing as mp
    if callable(getattr(torch.UntypedStorage, "_swap_data_ptr_", None)):
        torch.UntypedStorage._swap_data_ptr_ = None  # this torch, as 2.11 and older are
    import vmmipc.torch as vt
    from multiprocessing.reduction import ForkingPickler
    from _torch_host_helpers import fill_views
    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        x = torch.zeros(4, 3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                ForkingPickler.dumps([x, x[:, 1]])
        q, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=fill_views, args=(q, back)); p.start()
        q.put([x, x[:, 1]])
        one, child_held, _ = back.get(timeout=60); p.join(60)
        print(json.dumps({"seen": x.tolist(), "one": one, "child_held": child_held,
                          "is_shared": x.is_shared(), "info": vt.host_arena_info(),
                          "warnings": [str(w.message) for w in caught]}))
"""


def test_an_older_torch_keeps_its_own_sharing_and_says_so():
    """On torch without UntypedStorage._swap_data_ptr_ (2.11 and older; made
    so here where torch has it) a storage cannot be moved into the host
    arena with its views following: CPU tensors take torch's own reducer,
    which moves them into its shm, with one warning that names the torch
    and what it lacks. torch's fd_sharing shape still holds: the child
    fills [x, x[:, 1]] and the parent sees both."""
    out = run_script(OLDER_TORCH)
    assert out["seen"] == [[1.0, 2.0, 1.0]] * 4 and out["one"], out
    assert out["is_shared"] and out["child_held"] == 0, out
    assert out["info"]["chunks"] == 0, out
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "_swap_data_ptr_" in out["warnings"][0] and "2.12" in out["warnings"][0], out


FORK_QUEUE = """
    import json, torch, torch.multiprocessing as mp, vmmipc.torch as vt
    from _torch_host_helpers import fill_views
    if __name__ == "__main__":
        ctx = mp.get_context("fork")
        x = torch.zeros(4, 3)
        q, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=fill_views, args=(q, back)); p.start()
        q.put([x, x[:, 1]])
        one, _, _ = back.get(timeout=60); p.join(60)
        print(json.dumps({"seen": x.tolist(), "one": one, "is_shared": x.is_shared(),
                          "info": vt.host_arena_info()}))
"""


def test_a_fork_context_queue_keeps_torchs_way():
    """A pickle bound for a forked child (a fork-context Queue) goes through
    torch's own reducer: such a child may not be able to run libvmmipc. It
    works as with torch alone (moved into torch's shm: is_shared())."""
    out = run_script(FORK_QUEUE)
    assert out["seen"] == [[1.0, 2.0, 1.0]] * 4 and out["one"], out
    assert out["is_shared"] and out["info"]["blocks_live"] == 0, out


# ------------------------------------------------ one process: preserve-sharing


def idle(vt) -> bool:
    """Nothing held here, as exporter or receiver, and every block free."""
    return (vmmipc.holds() == 0 and vmmipc.cache_info().holds == 0
            and vt.host_arena_info()["blocks_live"] == 0)


@pytest.fixture
def vt():
    """vmmipc.torch, in its default mode, with nothing held or live from an
    earlier test (releases are told to the sender by a library thread, a
    little later)."""
    import vmmipc.torch as vt
    assert vt.get_cpu_sharing() == "vmmipc"
    assert settle(lambda: idle(vt)), (vmmipc.holds(), vt.host_arena_info())
    return vt


def test_a_storage_and_its_views_come_back_as_one_storage(vt):
    """torch's test_preserve_sharing (a put and get in one process): a
    tensor, its storage and views of it come back over one storage, zero
    copy over this process's mapping of its own block; writes go both ways;
    a re-send copies nothing (the storage is in its block already)."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    x = torch.arange(20.0).view(5, 4)
    data = bytes(ForkingPickler.dumps([x, x.untyped_storage(), x[2:4], x, x[:, 1]]))
    ptr = x.untyped_storage().data_ptr()
    a, s, v, a2, col = ForkingPickler.loads(data)
    assert a is a2
    assert (a.untyped_storage().data_ptr() == s.data_ptr() == v.untyped_storage().data_ptr()
            == col.untyped_storage().data_ptr())
    assert a.tolist() == x.tolist() and v.tolist() == x[2:4].tolist()
    assert col.tolist() == [1.0, 5.0, 9.0, 13.0, 17.0]
    a[0, 0] = -1.0
    x[4, 3] = -2.0
    assert float(x[0, 0]) == -1.0 and float(a[4, 3]) == -2.0
    blocks = vt.host_arena_info()["blocks_live"]
    again = bytes(ForkingPickler.dumps([x, x[:, 1]]))  # no copy: the same block
    assert x.untyped_storage().data_ptr() == ptr
    assert vt.host_arena_info()["blocks_live"] == blocks
    b, bcol = ForkingPickler.loads(again)
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()  # the same storage
    del a, s, v, a2, col, b, bcol
    assert settle(lambda: vmmipc.holds() == 0)
    del x
    assert settle(lambda: vt.host_arena_info()["blocks_live"] == 0), vt.host_arena_info()


@moves
def test_a_pickle_of_many_storages_costs_one_use_of_the_library(vt, monkeypatch):
    """50 CPU tensors in one pickle: one grant of their chunk; the receiver
    imports it once (one held use) and, for the same tensors sent again,
    spends the pickle's hits with one confirm_many of one ticket."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    from vmmipc import _torch_received
    calls = {"import_stream": 0, "confirm_many": []}
    real_import, real_confirm_many = _torch_received.import_stream, _torch_received.confirm_many

    def import_stream(*a, **kw):
        calls["import_stream"] += 1
        return real_import(*a, **kw)

    def confirm_many(tickets, **kw):
        calls["confirm_many"].append(len(tickets))
        return real_confirm_many(tickets, **kw)
    monkeypatch.setattr(_torch_received, "import_stream", import_stream)
    monkeypatch.setattr(_torch_received, "confirm_many", confirm_many)
    ts = [torch.full((100,), float(i)) for i in range(50)]
    got = ForkingPickler.loads(ForkingPickler.dumps(ts))
    assert calls == {"import_stream": 1, "confirm_many": []}, calls
    assert vmmipc.holds() == 1
    again = ForkingPickler.loads(ForkingPickler.dumps(ts))
    assert calls == {"import_stream": 1, "confirm_many": [1]}, calls
    assert all(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
               for a, b in zip(got, again))  # the same storages
    assert all(t.tolist() == [float(i)] * 100 for i, t in enumerate(again))
    # the newest ticket took over from the first, whose release is told a little later
    assert settle(lambda: vmmipc.holds() == 1), vmmipc.holds()
    del got, again, ts
    assert settle(lambda: vmmipc.holds() == 0 and vt.host_arena_info()["blocks_live"] == 0)


@moves
def test_a_received_storage_sent_on_crosses_as_a_copy(vt):
    """A storage this process received through vmmipc and sends on stays
    over its sender's memory (it keeps sharing with it): what crosses is a
    copy in a block of this process's own."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    x = torch.full((8,), 3.0)
    got = ForkingPickler.loads(ForkingPickler.dumps(x))
    where = got.data_ptr()
    onward = ForkingPickler.loads(ForkingPickler.dumps(got))
    assert got.data_ptr() == where and onward.data_ptr() != where
    assert onward.tolist() == [3.0] * 8
    got.fill_(4.0)
    assert x.tolist() == [4.0] * 8 and onward.tolist() == [3.0] * 8
    del got, onward, x
    assert settle(lambda: vmmipc.holds() == 0 and vt.host_arena_info()["blocks_live"] == 0)


@moves
def test_damaged_pickles_get_clear_errors_and_hold_nothing(vt):
    """A CPU storage's pickle with a range outside its chunk, a ticket that
    is not one, or a load that is not a LoadUses: a clear error, and no use
    stays held."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    from vmmipc import _torch_reductions
    x = torch.ones(4)
    ForkingPickler.loads(ForkingPickler.dumps(x))  # x now in a block (a pickle never
    # received would keep it there: the sender's rule)
    rebuild, args = _torch_reductions.reduce_storage(x.untyped_storage())
    assert rebuild is _torch_reductions.rebuild_cpu_storage
    t, chunk_id, offset, nbytes = args[:4]
    with pytest.raises(vmmipc.InvalidError, match="outside its run"):
        rebuild(t, chunk_id, _torch_host.CHUNK_BYTES, nbytes)  # imports, then refuses
    with pytest.raises(vmmipc.InvalidError, match="as its load"):
        rebuild(t, chunk_id + ("x",), offset, nbytes, object())
    with pytest.raises((vmmipc.VmmipcError, ValueError, TypeError)):
        rebuild(b"not a ticket", ("other",), offset, nbytes)
    del x
    assert settle(lambda: idle(vt)), (vmmipc.holds(), vt.host_arena_info())


def test_a_non_leaf_tensor_is_refused_in_torchs_words(vt):
    import torch
    from multiprocessing.reduction import ForkingPickler
    x = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        ForkingPickler.dumps(x)
    p = torch.nn.Parameter(torch.arange(3.0))  # a leaf: kept a Parameter, requires_grad
    got = ForkingPickler.loads(ForkingPickler.dumps(p))
    assert isinstance(got, torch.nn.Parameter) and got.requires_grad
    assert got.tolist() == [0.0, 1.0, 2.0]


@moves
def test_the_sender_keeps_a_block_while_a_receiver_holds_it(vt):
    """The lifetime rule: the sender drops its tensor right after sending;
    its block stays (not reused) while the receiver holds the use, and goes
    back to the arena once the receiver's storage died."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    x = torch.full((1000,), 7.0)
    data = bytes(ForkingPickler.dumps(x))
    del x
    gc.collect()
    assert vt.host_arena_info()["blocks_live"] == 1  # the grant keeps it for its receiver
    got = ForkingPickler.loads(data)
    other = ForkingPickler.loads(ForkingPickler.dumps(torch.full((1000,), 8.0)))
    assert got.data_ptr() != other.data_ptr()  # never reused under a held block
    assert got.tolist() == [7.0] * 1000 and other.tolist() == [8.0] * 1000
    assert vmmipc.holds() == 2
    del got, other
    assert settle(lambda: vmmipc.holds() == 0 and vt.host_arena_info()["blocks_live"] == 0)


@moves
def test_a_backlog_of_pickles_is_never_cut(vt):
    """1500 pickles made before any is received (a Queue's backlog, blobs
    kept for later) all arrive: a chunk's grants waiting for receivers are
    not bounded as a CUDA run's are (MAX_PENDING_PICKLES), since every small
    tensor of a process shares one chunk."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    blobs = [bytes(ForkingPickler.dumps(torch.full((4,), float(i)))) for i in range(1500)]
    got = [ForkingPickler.loads(b) for b in blobs]
    assert all(t.tolist() == [float(i)] * 4 for i, t in enumerate(got))
    assert vmmipc.holds() == 1500
    del got
    assert settle(lambda: vmmipc.holds() == 0 and vt.host_arena_info()["blocks_live"] == 0)


@moves
def test_a_storage_larger_than_a_chunk_gets_one_of_its_own_given_back_after(vt):
    """A storage larger than CHUNK_BYTES gets a chunk of its own size, which
    goes back (its anchor ends) once its block is free; the first chunk of
    the standard size stays for the next sends."""
    import torch
    from multiprocessing.reduction import ForkingPickler
    from vmmipc import _torch_host
    big = torch.arange((_torch_host.CHUNK_BYTES + 4096) // 4, dtype=torch.int32)
    small = torch.ones(10)
    got_big, got_small = ForkingPickler.loads(ForkingPickler.dumps([big, small]))
    assert torch.equal(got_big, big) and torch.equal(got_small, small)
    assert vt.host_arena_info()["chunks"] == 2
    del got_big, got_small, big, small
    assert settle(lambda: vt.host_arena_info()["blocks_live"] == 0), vt.host_arena_info()
    info = vt.host_arena_info()
    assert info["chunks"] == 1 and info["chunk_bytes"] == _torch_host.CHUNK_BYTES, info


def test_the_mode_a_process_starts_with_comes_from_the_environment():
    env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT)
    code = "import vmmipc.torch as vt; print(vt.get_cpu_sharing())"
    for value, want in (("torch", "torch"), ("vmmipc", "vmmipc"), ("bogus", "vmmipc")):
        env["VMMIPC_TORCH_CPU_SHARING"] = value
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           timeout=60)
        assert r.stdout.strip() == want, r.stderr
        assert ("is none of" in r.stderr) == (value == "bogus"), r.stderr


KILLED = """
    import gc, json, os, signal, sys, time, torch, torch.multiprocessing as mp, vmmipc, vmmipc.torch as vt
    from _torch_host_helpers import hold_forever
    if __name__ == "__main__":
        how = getattr(signal, sys.argv[1])
        ctx = mp.get_context("spawn")
        q, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=hold_forever, args=(q, back)); p.start()
        q.put(torch.full((1000,), 5.0))  # dropped here at once
        seen, child_holds = back.get(timeout=60)
        held = (vmmipc.holds(), vt.host_arena_info()["blocks_live"])
        os.kill(p.pid, how); p.join(60)
        deadline = time.monotonic() + 10
        while (vmmipc.holds() or vt.host_arena_info()["blocks_live"]) and time.monotonic() < deadline:
            gc.collect(); time.sleep(0.02)
        print(json.dumps({"seen": seen, "child_holds": child_holds, "held": held,
                          "exitcode": p.exitcode,
                          "after": (vmmipc.holds(), vt.host_arena_info()["blocks_live"])}))
"""


@moves
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_a_receiver_killed_gives_the_block_back(how):
    """A receiver SIGKILLed or SIGTERMed while it holds a tensor: its hold
    ends with it (its lease's lock goes), and the sender's block goes back
    to the arena."""
    out = run_script(KILLED, how)
    assert out["exitcode"] == -getattr(signal, how), out
    assert out["seen"] == [5.0, 5.0, 5.0] and out["child_holds"] == 1, out
    assert out["held"] == [1, 1], out
    assert out["after"] == [0, 0], out


# ------------------------------------------------------ torch's pool cases

POOL = """
    import gc, json, time, torch, torch.multiprocessing as mp, vmmipc, vmmipc.torch as vt
    from _torch_host_helpers import fill_and_double
    if __name__ == "__main__":
        ts = [torch.zeros(3) for _ in range(6)]
        with mp.get_context("spawn").Pool(2) as pool:
            got = pool.map(fill_and_double, [(t, float(i)) for i, t in enumerate(ts)])
            pool.close(); pool.join()
        # the workers have exited: their results stay readable (the mappings are ours)
        out = {"filled": [t.tolist() for t in ts], "got": [t.tolist() for t in got]}
        del got; gc.collect()
        deadline = time.monotonic() + 10
        while vmmipc.holds() and time.monotonic() < deadline:
            time.sleep(0.02)
        out["holds"] = vmmipc.holds()
        del ts; gc.collect()
        out["blocks"] = vt.host_arena_info()["blocks_live"]
        print(json.dumps(out))
"""


def test_pool_workers_fill_what_they_receive_and_return_tensors():
    """torch's pool cases: a spawn Pool's workers receive CPU tensors (and
    fill them in place: the parent sees it) and return new ones, read after
    the workers exited; then nothing is held and every block is free."""
    out = run_script(POOL)
    assert out["filled"] == [[float(i)] * 3 for i in range(6)], out
    assert out["got"] == [[2.0 * i] * 3 for i in range(6)], out
    assert out["holds"] == 0 and out["blocks"] == 0, out


# ----------------------------------------------- inherit_tensor, empty tensors

INHERIT = """
    import json, torch, torch.multiprocessing as mp, vmmipc.torch as vt
    from multiprocessing.reduction import ForkingPickler
    from _torch_host_helpers import fill_inherited
    if __name__ == "__main__":
        moved = torch.zeros(5, 5)
        ForkingPickler.loads(ForkingPickler.dumps(moved))  # moved into this process's arena
        torchs = torch.zeros(5, 5).share_memory_()
        ctx = mp.get_context("fork")
        for t, v in ((moved, 7.0), (torchs, 9.0)):
            p = ctx.Process(target=fill_inherited, args=(t, v)); p.start(); p.join(60)
            assert p.exitcode == 0
        print(json.dumps({"moved": moved.eq(7).all().item(), "torchs": torchs.eq(9).all().item()}))
"""


def test_an_inherited_tensor_is_filled_by_a_forked_child():
    """torch's inherit_tensor: a forked child fills a tensor it inherited;
    the parent sees it, for a tensor in the host arena (a MAP_SHARED
    mapping, inherited) as for one in torch's shm."""
    assert run_script(INHERIT) == {"moved": True, "torchs": True}


EMPTY = """
    import json, torch, torch.multiprocessing as mp, vmmipc.torch as vt
    from _torch_host_helpers import echo_shape
    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        q, back = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=echo_shape, args=(q, back)); p.start()
        q.put(torch.zeros(0, 3))
        shape, nbytes = back.get(timeout=60); p.join(60)
        print(json.dumps({"shape": shape, "nbytes": nbytes, "info": vt.host_arena_info()}))
"""


def test_empty_tensors_take_torchs_way():
    """An empty tensor has no bytes to share: torch's reducer sends it (its
    shape kept), and the host arena is not made."""
    out = run_script(EMPTY)
    assert out["shape"] == [0, 3] and out["nbytes"] == 0
    assert out["info"]["chunks"] == 0, out


# -------------------------------------------- the failure, reproduced

MANY = """
    import json, queue, resource, sys, time, torch, torch.multiprocessing as mp, vmmipc.torch as vt
    from _torch_host_helpers import fds, keep_many
    if __name__ == "__main__":
        limit, mode, n = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
        vt.set_cpu_sharing(mode)
        ctx = mp.get_context("spawn")
        q, back = ctx.Queue(), ctx.Queue()
        # the receiver (the child) at the limit: it inherits it
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        p = ctx.Process(target=keep_many, args=(q, back, n)); p.start()
        before = fds()
        for i in range(n):
            q.put(torch.full((16,), float(i)))  # dropped here at once
        start, out = time.monotonic(), None
        while out is None:
            try:
                first, last, held = back.get(timeout=0.5)
                out = {"ok": True, "first": first, "last": last, "held": held}
            except queue.Empty:
                if not p.is_alive() or time.monotonic() - start > 120:
                    out = {"ok": False}
        out["seconds"] = time.monotonic() - start
        p.join(60)
        out.update(exitcode=p.exitcode, sender_fds=fds() - before)
        print(json.dumps(out))
"""


@moves
@pytest.mark.parametrize("limit", [1024, 64])
def test_a_receiver_keeping_1100_cpu_tensors_at_the_descriptor_limit(limit):
    """The issue's failure shape outside a DataLoader: a receiver keeps
    1100 CPU tensors sent one a put. torch's default (file_descriptor)
    gives it one descriptor per live storage and it dies; through the host
    arena every tensor arrives (bytes checked), the receiver's descriptors
    do not move after its first tensor, it holds one use per tensor, and
    the sender's do not move either."""
    ours = run_script(MANY, limit, "vmmipc", 1100, timeout=300)
    assert ours["ok"] and ours["exitcode"] == 0, ours
    assert ours["last"] == ours["first"], ours
    assert ours["held"] == 1100, ours
    assert ours["sender_fds"] <= 8, ours  # its server, lease file, one chunk: once
    torchs = run_script(MANY, limit, "torch", 1100, timeout=300)
    assert not (torchs["ok"] and torchs["exitcode"] == 0), torchs


LOADER = """
    import collections, json, os, resource, sys, torch, vmmipc, vmmipc.torch
    from torch.utils.data import DataLoader
    from _dataloader_helpers import Five
    if __name__ == "__main__":
        limit, total = int(sys.argv[1]), int(sys.argv[2])
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        loader = DataLoader(Five(total * 8), batch_size=8, num_workers=2,
                            multiprocessing_context="spawn")  # no loader_options()
        kept, first, peak, error = [], None, 0, None
        try:
            for epoch in range(2):  # new workers each epoch
                for b in loader:
                    first = first if first is not None else len(os.listdir("/proc/self/fd"))
                    kept.append(b)
                    peak = max(peak, len(os.listdir("/proc/self/fd")) - first)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        ok = all([float(t[7, 0]) for t in b] == [i % total * 8 + 7 + k for k in range(5)]
                 for i, b in enumerate(kept))
        print(json.dumps({"batches": len(kept), "ok": ok, "peak": peak, "error": error,
                          "holds": vmmipc.cache_info().holds}))
"""


@moves
def test_a_plain_dataloader_with_spawn_workers_at_64_descriptors(tmp_path):
    """A DataLoader without loader_options() whose workers are spawned:
    its batches cross through each worker's host arena (the workers run
    libvmmipc of their own), so a main process keeping every batch of two
    epochs (5 tensors each, new workers in the second) at RLIMIT_NOFILE 64
    gets them all, bytes checked, its descriptors flat after the first
    batch; torch's default dies within its first batches at 64
    (test_dataloader.py). Fork workers keep torch's way without
    loader_options() (their result queue is a fork-context one). The
    workers must install vmmipc.torch too: a spawned worker imports the
    user's script (here a file) as its __mp_main__, and so its imports."""
    out = run_script(LOADER, 64, 100, timeout=300, path=tmp_path / "loader.py")
    assert out["error"] is None and out["batches"] == 200 and out["ok"], out
    assert out["peak"] == 0, out
    assert out["holds"] == 200, out  # one use per batch: its 5 storages share one grant
