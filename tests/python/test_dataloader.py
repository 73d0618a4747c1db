"""torch's DataLoader with CPU batches through a vmmipc arena (issue 32,
docs/dataloader.md): the many-tensors failure case at RLIMIT_NOFILE 1024 and
64 (torch's default strategy failing, ours not), every start method with
persistent_workers both ways and pin_memory, workers and the main process
killed, torch's CPU sharing scenarios with vmmipc.torch installed, bad
input. Skipped, saying so, where torch is not installed (`make test` installs
it with VMMIPC_TEST_TORCH=1: see the Makefile)."""

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings

import pytest

import conftest
import vmmipc

pytestmark = conftest.needs_torch("the DataLoader tests")

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_PARENT = conftest.PACKAGE_PARENT


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([PACKAGE_PARENT, HERE, env.get("PYTHONPATH", "")])
    return env


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shm_files() -> set:
    """/dev/shm's files but multiprocessing's semaphores (sem.mp-*: a
    Queue's, other processes' on a shared machine)."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {f for f in os.listdir("/dev/shm") if not f.startswith("sem.")}


@pytest.fixture
def vt():
    import vmmipc.torch as vt
    return vt


def in_arena(vt, tensor) -> bool:
    a = vt.default_arena()
    return a.base <= tensor.untyped_storage().data_ptr() < a.base + a.size


def settle(vt, want_owned=0, timeout=10.0) -> dict:
    """The arena's counters once its blocks are back (workers exit a little
    after their loader goes)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        info = vt.arena_info()
        done = (info["blocks_writing"] == info["blocks_sent"] == info["blocks_held"] == 0
                and info["regions_owned"] == want_owned)
        if done or time.monotonic() > deadline:
            return info
        time.sleep(0.1)


def regions(vt, count=4) -> str:
    """The first regions' owners and slot states (generation, state), read
    from the arena's header (export/arena.c's layout): for failure messages."""
    import struct
    a = vt.default_arena()
    slots, tables = struct.unpack_from("<I", a.view, 12)[0], struct.unpack_from("<Q", a.view, 24)[0]
    out = []
    for r in range(count):
        owner, used = struct.unpack_from("<QQ", a.view, 48 + r * 64)
        words = [struct.unpack_from("<Q", a.view, tables + (r * slots + i) * 32)[0]
                 for i in range(min(used, 16))]
        out.append(f"region {r} owner {owner} used {used} {[(w >> 8, w & 0xff) for w in words]}")
    return "; ".join(out)


# ------------------------------------------------ 1. the failure case

FAILURE = textwrap.dedent(r"""
    import collections, json, os, resource, sys
    limit, mode, keep, total = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    import torch, vmmipc.torch
    from torch.utils.data import DataLoader
    from _dataloader_helpers import Five
    before = len(os.listdir("/proc/self/fd"))
    opts = vmmipc.torch.loader_options() if mode == "vmmipc" else {}
    loader = DataLoader(Five(total * 8), batch_size=8, num_workers=4, **opts)
    kept = collections.deque(maxlen=keep)
    n, start, peak, error = 0, None, 0, None
    try:
        for b in loader:
            if start is None:
                start = len(os.listdir("/proc/self/fd"))
            assert [float(t[7, 0]) for t in b] == [n * 8 + 7 + k for k in range(5)]
            kept.append(b)
            n += 1
            peak = max(peak, len(os.listdir("/proc/self/fd")) - start)
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    print(json.dumps({"batches": n, "fds_before": before, "fds_first": start,
                      "fds_above_first": peak, "error": error}))
""")


def failure_case(limit: int, mode: str, keep: int, total: int) -> dict:
    r = subprocess.run([sys.executable, "-c", FAILURE, str(limit), mode, str(keep), str(total)],
                       capture_output=True, text=True, timeout=300, env=child_env())
    assert r.stdout.strip(), r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("limit", [1024, 64])
def test_many_tensors_torch_fails_and_the_arena_runs_to_the_end(limit):
    """The issue's failure: 5 tensors of 16 floats per sample, batch 8, 4
    workers, fork, the main keeping its last batches. torch's default
    (file_descriptor) holds one descriptor per live storage and fails; the
    arena holds none per batch: every batch arrives, and the main stays at
    most 8 descriptors above where it stood at its first batch."""
    keep, total = 240, 260  # 5 x 240 live storages > 1024
    torch_run = failure_case(limit, "torch_fd", keep, total)
    assert torch_run["batches"] < total and torch_run["error"], torch_run
    assert any(w in torch_run["error"] for w in (
        "Too many open files", "received 0 items of ancdata", "unable to open shared memory",
        "exited unexpectedly")), torch_run
    ours = failure_case(limit, "vmmipc", keep, total)
    assert ours["error"] is None and ours["batches"] == total, ours
    assert ours["fds_above_first"] <= 8, ours


# ------------------------------------ 2. start methods, epochs, pin_memory


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_every_start_method_and_epoch_verified(vt, method, persistent):
    import torch
    from torch.utils.data import DataLoader
    from _dataloader_helpers import Mixed, check_mixed
    shm_before = shm_files()
    loader = DataLoader(Mixed(48), batch_size=8, num_workers=2, multiprocessing_context=method,
                        persistent_workers=persistent, pin_memory=True,
                        **vt.loader_options())
    # With CUDA, pin_memory=True copies every batch into page-locked memory (torch's pin thread
    # does so whatever the sharing strategy), and the arena blocks go back once copied; without
    # it, pin_memory does nothing and the batch stays where it arrived, in the arena.
    pinned = torch.cuda.is_available()
    kept = []
    with warnings.catch_warnings():
        # CPU-only torch: pin_memory=True warns that no accelerator is found and does nothing
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        for epoch in range(2):
            for j, b in enumerate(loader):
                check_mixed(b, j * 8, 8)
                for t in (b["x"], b["idx"], b["nested"]["y"], b["np"]):
                    if pinned:
                        assert t.is_pinned() and not in_arena(vt, t)
                    else:
                        assert in_arena(vt, t), "the batch did not come through the arena"
                kept.append(b)
            assert len(kept) == 6 * (epoch + 1)
    x = kept[0]["x"]
    x.add_(1)  # writable, in place: in the main process's own mapping (or the pinned copy)
    assert float(x[0, 0, 0]) == 1.0
    assert not x.is_shared()  # torch's is_shared asks for its own shm allocators: not ours
    if pinned:  # every block goes back once the pin thread has copied it
        deadline = time.monotonic() + 10
        while vt.arena_info()["blocks_held"] and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.05)
        info = vt.arena_info()
        assert info["blocks_held"] == 0, info
    else:
        info = vt.arena_info()
        # x, idx, w, nested.y, the two tags and np: 7 blocks a batch (the empty one is torch's)
        assert info["blocks_held"] == 12 * 7 and info["live_bytes"] > 0, info
    del kept, b, x, t
    del loader
    info = settle(vt)
    assert info["blocks_writing"] == info["blocks_sent"] == info["blocks_held"] == 0, info
    assert info["regions_owned"] == 0, info
    assert shm_files() - shm_before == set()


def test_empty_batches_take_torchs_way(vt):
    import torch
    from torch.utils.data import DataLoader
    loader = DataLoader([torch.zeros(0)] * 8, batch_size=4, num_workers=1, **vt.loader_options())
    got = list(loader)
    assert [tuple(b.shape) for b in got] == [(4, 0), (4, 0)]


def test_views_of_one_storage_arrive_as_one_storage(vt):
    """torch's preserve-sharing, for a worker's batch: a custom collate's
    two views of one storage arrive as views of one arena block."""
    from torch.utils.data import DataLoader
    import torch
    from _dataloader_helpers import views_collate
    loader = DataLoader([torch.full((4,), float(i)) for i in range(8)], batch_size=4,
                        num_workers=1, **vt.loader_options(views_collate))
    for x, tail, pid in loader:
        assert pid != os.getpid() and in_arena(vt, x)
        assert x.untyped_storage().data_ptr() == tail.untyped_storage().data_ptr()
        tail[0].fill_(-1)
        assert float(x[1, 0]) == -1.0
    del x, tail, loader
    settle(vt)


def test_a_region_too_small_falls_back_to_torch_with_a_warning(vt):
    """A batch larger than a region (or no region left): torch's own
    shared memory for it, warned about in the worker, never silently."""
    import torch
    from torch.utils.data import DataLoader
    small = vt.Arena(regions=1, slots=8, region_bytes=4096)
    loader = DataLoader([torch.full((1024,), float(i)) for i in range(8)], batch_size=4,
                        num_workers=1, **vt.loader_options(arena=small))
    r = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import torch, vmmipc.torch
        from torch.utils.data import DataLoader
        small = vmmipc.torch.Arena(regions=1, slots=8, region_bytes=4096)
        loader = DataLoader([torch.full((1024,), float(i)) for i in range(8)], batch_size=4,
                            num_workers=1, **vmmipc.torch.loader_options(arena=small))
        got = [b[:, 0].tolist() for b in loader]
        assert got == [[0., 1., 2., 3.], [4., 5., 6., 7.]], got
        print("ok", small.info()["blocks_free"])
    """)], capture_output=True, text=True, timeout=120, env=child_env())
    assert r.returncode == 0 and "ok 0" in r.stdout, r.stderr[-2000:]
    assert "no room in the arena for 16384 bytes" in r.stderr and "torch's own" in r.stderr
    del loader, small


# ------------------------------------------------------------ 3. kills


def test_a_worker_killed_mid_epoch_gets_torchs_error_and_leaves_nothing(vt):
    import torch
    from torch.utils.data import DataLoader
    from _dataloader_helpers import Slow
    loader = DataLoader(Slow(), batch_size=4, num_workers=2, **vt.loader_options())
    it = iter(loader)
    kept = [next(it) for _ in range(4)]
    os.kill(it._workers[0].pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"DataLoader worker \(pid"):
        for b in it:
            kept.append(b)
            del b  # a batch left bound here would be held (seen under load)
    assert time.monotonic() - t0 < 30
    # torch may hold a batch it received out of order (its reorder buffer)
    assert vt.arena_info()["blocks_held"] >= len(kept)
    pids = [w.pid for w in it._workers]
    del kept, it, loader
    info = settle(vt)
    why = f"{info}; workers {pids}; {regions(vt)} (state 3: held by this process)"
    assert info["blocks_writing"] == info["blocks_sent"] == info["blocks_held"] == 0, why
    assert info["live_bytes"] == 0 and info["regions_owned"] == 0, why


MAIN = textwrap.dedent(r"""
    import json, os, sys, time
    import torch, vmmipc.torch
    from torch.utils.data import DataLoader
    from _dataloader_helpers import Slow
    loader = DataLoader(Slow(), batch_size=4, num_workers=2, persistent_workers=True,
                        **vmmipc.torch.loader_options())
    it = iter(loader)
    kept = [next(it) for _ in range(3)]
    arena = vmmipc.torch.default_arena()
    print(json.dumps({"workers": [w.pid for w in it._workers],
                      "inode": os.fstat(arena.fd).st_ino}), flush=True)
    time.sleep(120)
""")


def holders_of(inode: int) -> list:
    """Processes with the arena's memfd open or mapped."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if "vmmipc-arena" in link and os.stat(f"/proc/{pid}/fd/{fd}").st_ino == inode:
                    found.append((pid, "fd"))
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    parts = line.split()
                    if len(parts) >= 6 and "vmmipc-arena" in line and int(parts[4]) == inode:
                        found.append((pid, "map"))
                        break
        except OSError:
            continue
    return found


def test_the_main_process_killed_leaves_nothing():
    """SIGKILL of the main process: its workers exit (torch's watchdog),
    and then no process has the memfd open or mapped (its memory is gone),
    and nothing was ever named in /dev/shm."""
    shm_before = shm_files()
    p = subprocess.Popen([sys.executable, "-c", MAIN], stdout=subprocess.PIPE, text=True,
                         env=child_env())
    try:
        state = json.loads(p.stdout.readline())
        assert len(holders_of(state["inode"])) >= 3  # the main and its two workers
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        deadline = time.monotonic() + 30  # torch's workers look for their parent every 5 s
        while time.monotonic() < deadline and holders_of(state["inode"]):
            time.sleep(0.5)
        assert holders_of(state["inode"]) == []
        for pid in state["workers"]:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split(
                ") ")[1][0] in "ZX"
        assert shm_files() - shm_before == set()
    finally:
        p.kill()
        p.wait()


# ---------------------------------- 4. torch's CPU scenarios, bad input

SHARING = textwrap.dedent(r"""
    import sys, torch, torch.multiprocessing as mp, vmmipc.torch
    from _dataloader_helpers import fill_views
    if __name__ == "__main__":
        mp.set_sharing_strategy(sys.argv[1])
        vmmipc.torch.set_cpu_sharing("torch")  # the default is test_torch_host.py's
        ctx = mp.get_context("spawn")
        x = torch.zeros(4, 3)
        q, done = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=fill_views, args=(q, done)); p.start()
        q.put([x, x[:, 1]]); done.wait(60); p.join(60)
        assert x[:, 0].tolist() == [1.0] * 4 and x[:, 1].tolist() == [2.0] * 4, x
        assert x.is_shared()
        print("ok")
""")


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_cpu_tensors_keep_torchs_sharing_when_chosen(strategy):
    """torch's fd_sharing / fs_sharing under torch's own strategies, with
    vmmipc.torch installed in every process and set_cpu_sharing("torch"):
    a child fills [x, x[:, 1]] in place and the parent sees both."""
    r = subprocess.run([sys.executable, "-c", SHARING, strategy], capture_output=True,
                       text=True, timeout=120, env=child_env())
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


POOL = textwrap.dedent(r"""
    import torch, torch.multiprocessing as mp, vmmipc.torch
    from _dataloader_helpers import doubled, fill_inherited
    if __name__ == "__main__":
        vmmipc.torch.set_cpu_sharing("torch")  # the default is test_torch_host.py's
        with mp.get_context("spawn").Pool(2, vmmipc.torch.set_cpu_sharing, ("torch",)) as pool:
            got = pool.map(doubled, [torch.full((3,), float(i)) for i in range(6)])
        assert [t.tolist() for t in got] == [[2.0 * i] * 3 for i in range(6)], got
        t = torch.zeros(5, 5).share_memory_()  # torch's inherit_tensor, fork
        p = mp.get_context("fork").Process(target=fill_inherited, args=(t, 7.0))
        p.start(); p.join(60)
        assert p.exitcode == 0 and t.eq(7).all(), t
        print("ok")
""")


def test_pools_and_inherited_tensors_keep_torchs_way_when_chosen():
    """torch's pool cases and inherit_tensor, with vmmipc.torch installed in
    every process and set_cpu_sharing("torch"): torch's own sharing."""
    r = subprocess.run([sys.executable, "-c", POOL], capture_output=True, text=True,
                       timeout=120, env=child_env())
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


@pytest.fixture
def writer(vt):
    """This process as a writer of a small arena, for the reducers, undone
    after."""
    from vmmipc import _torch_arena
    arena = vt.Arena(regions=2, slots=16, region_bytes=1 << 20)
    _torch_arena.start_writing(arena)
    try:
        yield arena
    finally:
        _torch_arena.start_writing(None)


def test_a_non_leaf_tensor_is_refused_in_torchs_words(writer):
    import torch
    from vmmipc import _torch_reductions
    x = torch.ones(3, requires_grad=True) * 2
    with pytest.raises(RuntimeError, match="Cowardly refusing to serialize non-leaf tensor"):
        _torch_reductions.reduce_tensor(x)


def test_a_block_round_trips_in_one_process_and_is_freed_at_its_last_view(writer):
    import torch
    from multiprocessing.reduction import ForkingPickler
    x = torch.arange(6.0).view(2, 3)
    data = bytes(ForkingPickler.dumps([x, x[:, 1]]))
    a, col = ForkingPickler.loads(data)  # this process owns the arena: it receives
    assert a.untyped_storage().data_ptr() == col.untyped_storage().data_ptr()
    assert writer.base <= a.data_ptr() < writer.base + writer.size
    assert a.tolist() == x.tolist() and col.tolist() == [1.0, 4.0]
    assert writer.info()["blocks_held"] == 1
    with pytest.raises(vmmipc.NotFoundError, match="received already"):  # loaded again, block freed
        del a, col
        gc.collect()
        ForkingPickler.loads(data)
    assert writer.info()["blocks_held"] == 0


def test_damaged_and_foreign_blocks_get_clear_errors(writer):
    from vmmipc import _torch_arena
    with pytest.raises(vmmipc.InvalidError, match="out of range"):
        _torch_arena.rebuild_storage(writer.id, 7, 0, 1, 16)
    with pytest.raises(vmmipc.NotFoundError, match="gone|free"):
        _torch_arena.rebuild_storage(writer.id, 0, 3, 99, 16)
    with pytest.raises(vmmipc.NotFoundError, match="does not own arena"):
        _torch_arena.rebuild_storage("0123456789abcdef", 0, 0, 1, 16)


def test_a_block_sent_by_a_worker_that_died_is_refused(vt):
    """A writer sends a block and dies before the main receives it: its
    region is taken over (reaped), and the block's pickle gets a clear error."""
    from vmmipc import _torch_arena
    arena = vt.Arena(regions=2, slots=16, region_bytes=1 << 20)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # no Go here: the arena calls are plain C
        try:
            import torch
            _torch_arena.start_writing(arena)
            args = _torch_arena.storage_args(torch.ones(4).untyped_storage())
            os.write(w, json.dumps(args).encode())
        finally:
            os._exit(0)  # no clean exit: the region is not given back
    os.close(w)
    args = json.loads(os.read(r, 4096))
    os.close(r)
    os.waitpid(pid, 0)
    assert arena.info()["takeovers"] == 1  # info() reaps the dead writer's region
    with pytest.raises(vmmipc.NotFoundError, match="taken over"):
        _torch_arena.rebuild_storage(*args)
    assert arena.info()["blocks_sent"] == 0


def test_the_arena_calls_check_what_they_are_given(vt):
    import ctypes
    from vmmipc import _lib
    a = vt.Arena(regions=1, slots=4, region_bytes=1 << 16)
    with pytest.raises(vmmipc.InvalidError, match="formatted already"):
        _lib.call_fork_safe("vmmipc_arena_format", a.base, a.size, 1, 4, 1 << 16)
    with pytest.raises(vmmipc.InvalidError, match="not an arena of this size"):
        a.__class__.info.__wrapped__ if False else _lib.call_fork_safe(
            "vmmipc_arena_get_info", a.base, a.size - 4096, None, 0)
    blocks = [a.alloc(1000) for _ in range(4)]
    assert a.alloc(1000) is None  # 4 slots: no room, the caller falls back
    assert len({b[3] for b in blocks}) == 4 and all(b[3] % 64 == 0 for b in blocks)
    assert a.drop(blocks[1]) and not a.drop(blocks[1])  # dropped once
    again = a.alloc(900)  # the freed block again, a new generation
    assert again[:2] == blocks[1][:2] and again[3] == blocks[1][3] and again[2] > blocks[1][2]
    with pytest.raises(vmmipc.NotFoundError):
        a.send(blocks[1])  # its old generation
    with pytest.raises(TypeError, match="process being started"):
        import pickle
        pickle.dumps(a)
    assert ctypes.sizeof(_lib.vmmipc_arena_block) == 32


ADDRESS_SPACE = textwrap.dedent(r"""
    import os, resource, vmmipc
    from vmmipc import _lib
    from vmmipc._arena import Arena
    _lib.lib("test")  # the Go runtime starts before the limit
    fds = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, resource.RLIM_INFINITY))
    try:
        Arena()  # 32 regions of 4 GiB of address space
        print("mapped")
    except vmmipc.VmmipcMemoryError as e:
        print("refused", len(os.listdir("/proc/self/fd")) - fds, e)
    small = Arena(regions=2, region_bytes=64 << 20)
    print("small", small.size)
""")


def test_an_arena_larger_than_the_address_space_is_a_clear_error():
    """The default arena is 128 GiB of address space: under an RLIMIT_AS
    that cannot hold it, Arena() raises VmmipcMemoryError saying what to
    make instead, not mmap's bare OSError, and keeps no descriptor; a
    smaller arena maps."""
    out = subprocess.run([sys.executable, "-c", ADDRESS_SPACE], capture_output=True, text=True,
                         env=child_env(), timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("refused 0 ") and "RLIMIT_AS" in lines[0], lines
    assert "loader_options(arena=" in lines[0] and "GiB" in lines[0], lines
    assert lines[1].startswith("small "), lines


def test_the_documented_example_runs():
    # docs/dataloader.md's one line is an excerpt of this example: it must run.
    example = os.path.join(conftest.ROOT, "examples", "python", "torch_dataloader.py")
    r = subprocess.run([sys.executable, example], capture_output=True, text=True, timeout=300,
                       env=child_env())
    assert r.returncode == 0, r.stderr[-3000:]
    assert "every batch's values checked" in r.stdout, r.stdout
