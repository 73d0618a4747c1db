"""Each unpickled HostBuffer spends its pickle's use before unpickling
returns, and holds nothing (issue 31): a HostBuffer's memfd is its own and
its pages live as long as any mapping of them, so no hold (vmmipc.h
"Holds") is asked for, neither by its registration nor by its receivers.
A cache hit is confirmed by the exporter, on a connection that proves the
whole ticket, before it returns: a changed byte is refused and an ended
grant raises NotFoundError, as for a new receiver; and a receiver killed
right after unpickling (SIGKILL, Pool.terminate) leaves nothing pending.

On 860d711 a hit spent its use with one message on a kept holder
connection and returned without the answer: a receiver killed right after
could leave grants live for ever (the exporter stopped reading that
connection when an answer could not be delivered), 2 runs in 25 of the
Pool test below, and the hit test here."""

import multiprocessing as mp
import os
import pickle
import signal
import time
from multiprocessing.reduction import ForkingPickler

import pytest

import _hostbuffer_helpers as hh
import _mp_helpers as h
import vmmipc
from vmmipc import _reductions

TIMEOUT = 30
pytestmark = pytest.mark.usefixtures("server_running")


def marked_buffer(size=16 << 20, chunk_size=1 << 20):
    hb = vmmipc.HostBuffer(size, chunk_size=chunk_size)
    hb.view[0], hb.view[-1] = 1, 2
    return hb


def rebuilt_counting(hb, *fields):
    """A new grant of hb, unpickled here: the grant, the HostBuffer and how
    much each of the cache_info `fields` grew meanwhile."""
    before = vmmipc.cache_info()
    t = hb.grant()
    got = _reductions.rebuild_host_buffer(t, hb.chunk_size)
    after = vmmipc.cache_info()
    return t, got, tuple(getattr(after, f) - getattr(before, f) for f in fields)


def settled(live: int, timeout: float = 6) -> int:
    """Registrations live beyond `live` once they stop ending (timeout s).
    One made before `live` was read may end meanwhile (an earlier test's
    killed receiver: the sender spends its last table hits from its spend
    log within 250 ms), which leaves none beyond."""
    h.wait_for(lambda: vmmipc.live_registrations() <= live, timeout=timeout)
    return max(0, vmmipc.live_registrations() - live)


def test_a_hostbuffer_asks_for_no_hold():
    """Neither the registration nor the receiver holds: the receiver keeps
    no connection to the sender (holder_sessions 0) and holds nothing."""
    live = vmmipc.live_registrations()
    hb = marked_buffer()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=hh.unpickle_all_and_die,
                    args=([bytes(ForkingPickler.dumps(hb)) for _ in range(3)], results))
    p.start()
    hits, misses, holds, sessions, _ = results.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    hb.close()
    assert (hits, misses) == (2, 1)
    assert (holds, sessions) == (0, 0), f"the receiver holds {holds} uses on {sessions} connections"
    assert vmmipc.holds() == 0
    # The killed child's last hits are spent from its spend log.
    assert settled(live) == 0, "grants left pending by the killed receiver"


def test_a_hit_has_spent_its_use_when_unpickling_returns():
    """64 pickles unpickled back to back (a map, then hits) by a child that
    dies by SIGKILL right after: every grant ends, spent by the hits'
    confirmations or, where the child died before they ran, by the sender
    from the child's spend log (vmmipc.h, vmmipc_import)."""
    ctx = mp.get_context("spawn")
    for _ in range(5):
        live = vmmipc.live_registrations()
        hb = marked_buffer()
        blobs = [bytes(ForkingPickler.dumps(hb)) for _ in range(64)]
        p = ctx.Process(target=hh.unpickle_all_and_die, args=(blobs,))
        p.start()
        p.join(TIMEOUT)
        assert p.exitcode == -signal.SIGKILL, f"the child unpickled them all and died: {p.exitcode}"
        hb.close()
        left = settled(live)
        assert left == 0, f"{left} of 64 grants still live after their receiver died"


def test_a_hit_is_vouched_by_the_senders_table():
    """A pickle of a buffer mapped here is a hit that the sender's grant
    table vouches for (no round trip), and its use is spent right after."""
    hb = marked_buffer()
    first = _reductions.rebuild_host_buffer(hb.grant(), hb.chunk_size)
    try:
        t, second, grew = rebuilt_counting(hb, "hits", "table_hits")
        assert grew == (1, 1)
        assert bytes(second[:1]) == bytes(first[:1])
        second.close()
        assert t.wait(5), "the table hit's use was not spent"
    finally:
        first.close()
        hb.close()


def test_a_hit_on_an_ended_grant_raises_not_found():
    hb = marked_buffer()
    first = _reductions.rebuild_host_buffer(hb.grant(), hb.chunk_size)  # mapped: hits from now on
    try:
        for end in ("unregistered", "expired"):
            t = hb.grant(ttl=0.05) if end == "expired" else hb.grant()
            if end == "unregistered":
                vmmipc.unregister(t)
            else:
                time.sleep(0.2)
            before = vmmipc.cache_info()
            with pytest.raises(vmmipc.NotFoundError):
                _reductions.rebuild_host_buffer(t, hb.chunk_size)
            after = vmmipc.cache_info()
            assert after.hits == before.hits, f"{end}: the hit was counted"
    finally:
        first.close()
        hb.close()


def test_a_hit_refuses_every_changed_byte():
    """Each of the ticket's 256 bytes changed (two ways) while this process
    has the buffer mapped: every one is refused, none maps."""
    hb = marked_buffer(4 << 20)
    first = _reductions.rebuild_host_buffer(hb.grant(), hb.chunk_size)
    t = bytes(hb.grant(uses=0))  # unlimited: ended below, or the buffer would live on
    try:
        accepted = []
        for i in range(len(t)):
            for flip in (0x01, 0x80):
                bad = bytearray(t)
                bad[i] ^= flip
                try:
                    got = _reductions.rebuild_host_buffer(bytes(bad), hb.chunk_size)
                except (vmmipc.VmmipcError, ValueError):
                    continue
                got.close()
                accepted.append((i, flip))
        assert accepted == [], f"changed tickets accepted: {accepted[:10]} ({len(accepted)})"
    finally:
        vmmipc.unregister(t)
        first.close()
        hb.close()


def test_pool_workers_terminated_leave_nothing_pending():
    """Ten buffers, each sent to a pool's workers 16 times (cache hits
    after the first), the pool terminated (Pool.__exit__: SIGTERM), the
    buffer closed: every registration ends within a few seconds."""
    ctx = mp.get_context("spawn")
    live = vmmipc.live_registrations()
    for _ in range(10):
        hb = marked_buffer()
        with ctx.Pool(4) as pool:
            assert pool.map(hh.touch, [hb] * 16, chunksize=1) == [3] * 16
        hb.close()
    left = settled(live)
    assert left == 0, f"{left} registrations still live 6 s after the pools ended"


def test_receivers_killed_after_cache_hits_leave_nothing_pending():
    """As above with SIGKILL (a Pool cannot be terminated after its workers
    were SIGKILLed: one may die holding its task queue's lock), so plain
    processes reading a Queue: each gets the buffer 16 times, says so, and
    is killed."""
    ctx = mp.get_context("spawn")
    live = vmmipc.live_registrations()
    for _ in range(5):
        hb = marked_buffer()
        q, done = ctx.Queue(), ctx.Queue()
        procs = [ctx.Process(target=hh.read_many, args=(q, done, 16)) for _ in range(4)]
        for p in procs:
            p.start()
        for _ in range(16 * len(procs)):
            q.put(hb)
        assert sorted(done.get(timeout=TIMEOUT) for _ in procs) == [3 * 16] * len(procs)
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)
            p.join(TIMEOUT)
        hb.close()
        q.close()
        done.close()
    left = settled(live)
    assert left == 0, f"{left} registrations still live 6 s after the receivers died"


def test_a_receiver_killed_after_table_imports_leaves_nothing_pending():
    """A child unpickles one pickle each of 33 new buffers (the first
    brings the sender's table, the others are mapped from the memfds it
    names) and dies by SIGKILL at once: every grant ends, spent by the
    imports' confirmations or, where the child died first, by the sender
    from its spend log."""
    ctx = mp.get_context("spawn")
    live = vmmipc.live_registrations()
    hbs = [marked_buffer(1 << 20, 1 << 20) for _ in range(33)]
    try:
        results = ctx.Queue()
        p = ctx.Process(target=hh.unpickle_all_and_die,
                        args=([bytes(ForkingPickler.dumps(hb)) for hb in hbs], results))
        p.start()
        hits, misses, _, _, imports = results.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
        assert p.exitcode == -signal.SIGKILL, f"the child ended with {p.exitcode}"
        assert (hits, misses, imports) == (0, 33, 32), (hits, misses, imports)
    finally:
        for hb in hbs:
            hb.close()
    left = settled(live)
    assert left == 0, f"{left} grants still live after their receiver died"


def test_a_sender_that_forked_and_died_gives_no_table_hit():
    """A sender forks (a fork-based Pool or DataLoader would) and is killed;
    its child lives on with every descriptor it inherited, the grant
    table's and the listening socket's included, and the dead sender stays
    a zombie until its parent (this test) reaps it. A pickle of the dead
    sender's buffer, mapped here already, is refused at once (a zombie has
    exited; without that, the connection the child's socket accepts would
    wait out the whole timeout), not a hit; the child maps no table
    (MADV_DONTFORK)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    p = ctx.Process(target=hh.grant_fork_and_wait, args=(results, 2))
    p.start()
    child = None
    try:
        blobs = results.get(timeout=TIMEOUT)
        first = pickle.loads(blobs[0])  # maps it, and brings the sender's table
        child, child_maps = results.get(timeout=TIMEOUT)
        assert child_maps == "none", "the sender's forked child maps its grant table"
        os.kill(p.pid, signal.SIGKILL)
        assert h.wait_for(lambda: zombie(p.pid), timeout=TIMEOUT), "the killed sender is not a zombie"
        before = vmmipc.cache_info()
        start = time.monotonic()
        with pytest.raises(vmmipc.VmmipcError) as refused:
            pickle.loads(blobs[1])
        took = time.monotonic() - start
        assert took < 5, f"the refusal took {took:.1f} s: {refused.value}"
        assert vmmipc.cache_info().table_hits == before.table_hits
        first.close()
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        if p.is_alive():
            p.kill()
        p.join(TIMEOUT)


def zombie(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_new_buffer_is_mapped_from_the_senders_table():
    """Once a receiver has the sender's grant table (its first import from
    that sender brings it), a pickle of a new HostBuffer of that sender is
    mapped from the memfd the table names, with no round trip: the right
    bytes, and its use spent just after (vmmipc.h, vmmipc_import_stream)."""
    first_hb = marked_buffer()
    first = _reductions.rebuild_host_buffer(first_hb.grant(), first_hb.chunk_size)
    hb = marked_buffer(4 << 20)
    hb.view[100] = 0x5A
    try:
        t, got, grew = rebuilt_counting(hb, "misses", "table_imports")
        assert grew == (1, 1)
        assert (got[0], got[100], got[len(got) - 1]) == (1, 0x5A, 2)
        got.close()
        assert t.wait(5), "the table import's use was not spent"
    finally:
        first.close()
        first_hb.close()
        hb.close()
