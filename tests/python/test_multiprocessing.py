"""A HostBuffer of 4096 chunks crosses multiprocessing Queue, Pipe, Pool.map
and Process(args=...) under spawn and forkserver into a child whose
RLIMIT_NOFILE is 64; every byte is checked both ways and the descriptor
counts of both processes stay within 8 of their baselines. Under fork every
use fails at once with VmmipcForkError."""

import multiprocessing as mp
import os
import pickle
import time
from multiprocessing.reduction import ForkingPickler

import pytest

import _mp_helpers as h
import conftest
import vmmipc

N_CHUNKS = 4096
CHUNK = 4096              # 16 MiB in all: 4096 descriptors cross, one at a time
FD_SLACK = 8
TIMEOUT = 60


@pytest.fixture(scope="module", autouse=True)
def warm_contexts(server_running):
    # After this process's vmmipc server, start the forkserver and the
    # resource tracker once, so per-test baselines do not count their
    # long-lived descriptors.
    for method in ("spawn", "forkserver"):
        ctx = mp.get_context(method)
        p = ctx.Process(target=h.fd_count)
        p.start()
        p.join(TIMEOUT)


@pytest.fixture
def hb():
    """Seed 1: what every child checks first (seed_in)."""
    yield from conftest.filled_host_buffer(N_CHUNKS, CHUNK, seed=1)


def check_child(r):
    assert r.get("error") is None, r.get("error")
    assert r["ok"], f"child saw wrong bytes, first bad chunk {r['first_bad_chunk']}"
    assert (r["size"], r["n_chunks"], r["nofile"]) == (N_CHUNKS * CHUNK, N_CHUNKS, h.CHILD_NOFILE)
    assert r["peak"] - r["baseline"] <= FD_SLACK, r
    assert r["after_close"] - r["baseline"] <= FD_SLACK, r


def check_parent(hb, sampler, live_before):
    sampler.stop()
    assert sampler.peak - sampler.baseline <= FD_SLACK, vars(sampler)
    assert hb.view == h.pattern(N_CHUNKS, CHUNK, seed=2), "the child's write is not visible"
    deadline = time.monotonic() + 5
    while vmmipc.live_registrations() > live_before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert vmmipc.live_registrations() == live_before, "the registration was not consumed"


def check_transfer(r, hb, sampler, live_before, p=None):
    """Both sides of one transfer: the child's report r, then the parent's
    (check_parent); p, the child Process (None for a Pool's worker), is
    joined and must have exited cleanly."""
    if p is not None:
        p.join(TIMEOUT)
    check_child(r)
    check_parent(hb, sampler, live_before)
    if p is not None:
        assert p.exitcode == 0


METHODS = ["spawn", "forkserver"]


@pytest.mark.parametrize("method", METHODS)
def test_queue(method, hb):
    ctx = mp.get_context(method)
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=h.child_queue, args=(q, results, 1, 2))
    p.start()
    live = vmmipc.live_registrations()
    sampler = h.FdSampler()
    q.put(hb)
    check_transfer(results.get(timeout=TIMEOUT), hb, sampler, live, p)


@pytest.mark.parametrize("method", METHODS)
def test_pipe(method, hb):
    ctx = mp.get_context(method)
    parent, child = ctx.Pipe()
    p = ctx.Process(target=h.child_pipe, args=(child, 1, 2))
    p.start()
    child.close()
    live = vmmipc.live_registrations()
    sampler = h.FdSampler()
    parent.send(hb)
    assert parent.poll(TIMEOUT), "no answer from the child"
    check_transfer(parent.recv(), hb, sampler, live, p)
    parent.close()


@pytest.mark.parametrize("method", METHODS)
def test_pool_map(method, hb):
    ctx = mp.get_context(method)
    with ctx.Pool(1, initializer=h.pool_init) as pool:
        live = vmmipc.live_registrations()
        sampler = h.FdSampler()
        [r] = pool.map_async(h.pool_task, [(hb, 1, 2)]).get(TIMEOUT)
        check_transfer(r, hb, sampler, live)


@pytest.mark.parametrize("method", METHODS)
def test_process_args(method, hb):
    ctx = mp.get_context(method)
    results = ctx.Queue()
    live = vmmipc.live_registrations()
    sampler = h.FdSampler()
    p = ctx.Process(target=h.child_process_args, args=(h.LimitFdsFirst(), hb, results, 1, 2))
    p.start()
    check_transfer(results.get(timeout=TIMEOUT), hb, sampler, live, p)


# -- one anchor, a registration per send, cache hits in the receiver ---------

@pytest.mark.parametrize("method", METHODS)
def test_repeated_sends_hit_the_receivers_cache(method):
    sends = 5
    b = vmmipc.HostBuffer(64 * CHUNK, chunk_size=CHUNK)
    b.view[:] = h.pattern(64, CHUNK, seed=4)
    live = vmmipc.live_registrations()
    ctx = mp.get_context(method)
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=h.child_repeated, args=(q, results, sends, 4))
    p.start()
    for _ in range(sends):
        q.put(b)  # each pickle: register_again of the anchor
    r = results.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert r.get("error") is None, r["error"]
    assert r["ok"], "the child saw wrong bytes"
    info = vmmipc.CacheInfo(*r["cache"])
    assert (info.misses, info.hits) == (1, sends - 1), info
    assert len(set(r["addrs"])) == 1, "a cache hit maps at the same address"
    assert b.wait(10) and b.pending_tickets() == []
    assert vmmipc.live_registrations() == live  # only the anchor is left
    b.close()
    close_queues(q, results)


def close_queues(*queues):
    # Now, not at some later garbage collection: their pipes would move the
    # descriptor baselines of the tests that follow.
    for q in queues:
        q.close()
        q.join_thread()


@pytest.mark.parametrize("method", METHODS)
def test_exit_waits_for_background_confirmations(method):
    """A receiver that queues confirmations (confirm_later: what unpickling a
    HostBuffer it has mapped already does) and exits at once still spends
    every use: its exit waits for them, so the sender's grants end instead
    of staying pending."""
    grants = 200
    b = vmmipc.HostBuffer(4 * CHUNK, chunk_size=CHUNK)
    tickets = [b.grant() for _ in range(grants)]
    ctx = mp.get_context(method)
    results = ctx.Queue()
    p = ctx.Process(target=h.child_confirm_later_and_exit, args=(tickets, results))
    p.start()
    r = results.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert r.get("error") is None, r["error"]
    assert p.exitcode == 0
    assert b.wait(10), (f"{len(b.pending_tickets())} of {grants} grants still pending after the "
                        f"receiver exited ({r['pending']} were pending when it returned)")
    b.close()
    close_queues(results)


# -- a pickle that fails in the Queue's feeder thread -------------------------

@pytest.mark.parametrize("what", ["closed", "imported"])
def test_feeder_thread_error_reaches_the_receiver(what):
    b = vmmipc.HostBuffer(4 * CHUNK, chunk_size=CHUNK)
    if what == "closed":
        b.close()
        bad, expect = b, ("ValueError", "closed")
    else:
        bad, expect = pickle.loads(pickle.dumps(b)), ("TypeError", "imported")
        assert b.wait(5)  # that pickle's registration has ended (on the server's thread)
    live = vmmipc.live_registrations()
    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=h.child_get_error, args=(q, results))
    p.start()
    t0 = time.monotonic()
    q.put(bad)
    r = results.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    assert (r["type"], expect[1] in r["message"]) == (expect[0], True), r
    assert any(f"pid {os.getpid()}" in n for n in r["notes"]), r["notes"]
    assert time.monotonic() - t0 < 20, "the receiver waited instead of raising"
    assert vmmipc.live_registrations() == live
    if what == "imported":
        bad.close()
        b.close()
    close_queues(q, results)


# -- pickled and never unpickled ----------------------------------------------

def _wait_live(n, timeout=5.0):
    deadline = time.monotonic() + timeout
    while vmmipc.live_registrations() != n and time.monotonic() < deadline:
        time.sleep(0.01)
    return vmmipc.live_registrations()


@pytest.mark.parametrize("how", ["ttl", "unregister"])
def test_never_unpickled_is_released(how):
    live, fds = vmmipc.live_registrations(), h.settled_fd_count()
    hb = vmmipc.HostBuffer(N_CHUNKS * CHUNK, chunk_size=CHUNK)
    # The anchor: one registration, and one duplicate of the memfd in the
    # library next to the HostBuffer's own (and, before Python 3.13, the one
    # the mmap module keeps).
    assert (vmmipc.live_registrations(), h.fd_count()) == (live + 1, fds + 2 + h.MMAP_DUP)
    if how == "ttl":
        hb.pickle_ttl = 0.3
    # bytes(): the buffer dumps() returns is a memoryview of a BytesIO, which
    # Python 3.12.0-3.12.1 crash on when a reference cycle holds it at a
    # garbage collection (CPython gh-111211), as the raises() below makes.
    data = bytes(ForkingPickler.dumps(hb))  # registers again; opens nothing
    assert (vmmipc.live_registrations(), h.fd_count()) == (live + 2, fds + 2 + h.MMAP_DUP)
    [ticket] = hb.pending_tickets()
    hb.close()  # ends the anchor, closes its own memfd
    # The pending registration still holds the library's duplicate, and only that.
    assert (vmmipc.live_registrations(), h.fd_count()) == (live + 1, fds + 1)
    if how == "unregister":
        vmmipc.unregister(ticket)
    assert _wait_live(live) == live
    assert h.fd_count() == fds, "the memfd was not closed when the registration ended"
    with pytest.raises(vmmipc.NotFoundError) as e:
        pickle.loads(data)
    assert ("expired" if how == "ttl" else "unregistered") in e.value.message


# -- fork: fail at once, never hang ------------------------------------------

@pytest.fixture
def fork_ctx():
    vmmipc.live_registrations()  # the library is loaded before the fork
    return mp.get_context("fork")


def check_fork_error(r):
    assert r["error"] == "VmmipcForkError", r
    assert r["status"] == vmmipc.EFORK
    assert "spawn" in r["message"] and "fork" in r["message"]


def test_fork_queue_refused(fork_ctx, hb):
    live = vmmipc.live_registrations()
    q, results = fork_ctx.Queue(), fork_ctx.Queue()
    p = fork_ctx.Process(target=h.fork_child_queue, args=(q, results))
    p.start()
    q.put(hb)
    check_fork_error(results.get(timeout=TIMEOUT))
    p.join(TIMEOUT)
    assert vmmipc.live_registrations() == live, "a pickle bound for a forked child registered"


def test_fork_pool_refused(fork_ctx, hb):
    live = vmmipc.live_registrations()
    with fork_ctx.Pool(1) as pool:
        with pytest.raises(vmmipc.VmmipcForkError, match="fork-context pool"):
            pool.map_async(h.fork_pool_task, [hb]).get(TIMEOUT)
    assert vmmipc.live_registrations() == live


def test_fork_pipe_child_fails(fork_ctx, hb):
    results = fork_ctx.Queue()
    parent, child = fork_ctx.Pipe()
    p = fork_ctx.Process(target=h.fork_child_pipe, args=(child, results))
    p.start()
    parent.send(hb)  # a Pipe has no context: this registers, the child refuses
    check_fork_error(results.get(timeout=TIMEOUT))
    p.join(TIMEOUT)
    assert hb.unregister_all() == 1


def test_fork_process_args(fork_ctx, hb):
    results = fork_ctx.Queue()
    p = fork_ctx.Process(target=h.fork_child_process_args, args=(hb, results))
    p.start()
    r = results.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    check_fork_error(r)
    assert r["c_status"] == vmmipc.EFORK


# -- a forkserver that preloads vmmipc stays free of the Go runtime ----------

PRELOAD_SCRIPT = """
import multiprocessing as mp, os, sys
import vmmipc, _mp_helpers as h
from multiprocessing import forkserver

if __name__ == "__main__":
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["vmmipc", "_mp_helpers"])
    hb = vmmipc.HostBuffer(64 * 4096, chunk_size=4096)
    hb.view[:] = h.pattern(64, 4096, seed=1)
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=h.child_queue, args=(q, results, 1, 2))
    p.start()
    q.put(hb)
    r = results.get(timeout=60)
    p.join(60)
    assert r.get("error") is None and r["ok"], r
    assert hb.view == h.pattern(64, 4096, seed=2)
    maps = open(f"/proc/{forkserver._forkserver._forkserver_pid}/maps").read()
    assert "libvmmipc" not in maps, "the forkserver loaded libvmmipc"
    print("ok")
"""


def test_forkserver_preloading_vmmipc_does_not_load_the_library(tmp_path):
    import os
    import subprocess
    import sys
    import conftest
    script = tmp_path / "preload.py"
    script.write_text(PRELOAD_SCRIPT)
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([conftest.PYTHON_DIR, here]))
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_receiver_hears_that_the_exporter_is_exiting():
    """vmmipc's exit hooks end the process's shares (so no release callback
    runs in a finalizing interpreter, and a HostBuffer's grant, which has
    none, ends alike): a receiver then hears that the exporter is exiting,
    not that someone unregistered what it was sent."""
    ctx = mp.get_context("spawn")
    q, go = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=h.child_share_then_exit_hook, args=(q, go))
    p.start()
    try:
        t = vmmipc.Ticket(q.get(timeout=60))
        with pytest.raises(vmmipc.NotFoundError) as e:
            vmmipc.import_stream(t)
        assert f"has ended: its exporter (pid {p.pid}) is exiting" in str(e.value), str(e.value)
    finally:
        go.put(None)
        p.join(timeout=30)


def test_receiver_of_an_exporter_that_exits():
    """The exporter puts a HostBuffer and returns. The receiver may get it
    (the exporter was still there) or hear that it is exiting or exited,
    never that somebody unregistered what it was sent."""
    ctx = mp.get_context("spawn")
    for _ in range(3):
        q = ctx.Queue()
        p = ctx.Process(target=h.child_put_and_exit, args=(q,))
        p.start()
        try:
            b = q.get(timeout=60)
            assert b[0] == 42
            b.close()
        except (vmmipc.NotFoundError, vmmipc.VmmipcIOError) as e:
            msg = str(e)
            assert "unregistered by its owner" not in msg, msg
            assert "is exiting" in msg or "exited" in msg, msg
        p.join(timeout=30)
