"""Holds (vmmipc.h, "Holds"): a grant registered with hold=True keeps what
its sender lends until every receiver that holds it has let go or died.
(A HostBuffer holds nothing: its ends are test_hostbuffer_uses.py's.)

A CPU stand-in for vmmipc.torch's lifetime rule: there, what the sender
lends is a sent tensor's storage, kept from torch's allocator while a
receiver holds it; here it is a release callback that must not run."""

import fcntl
import multiprocessing as mp
import os
import signal
import sys
import threading

import pytest

import _hold_helpers as hh
import _mp_helpers as h
import vmmipc

TIMEOUT = 30
SIZE = 1 << 20


@pytest.fixture
def anchor():
    """An anchor (uses 0) over a sealed memfd whose first bytes are known."""
    fd = os.memfd_create("test-holds", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    os.pwrite(fd, b"HOLD", 0)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    t = vmmipc.register_host_file(fd, SIZE, SIZE, uses=0)
    os.close(fd)
    yield t
    vmmipc.unregister(t)


def held_grant(anchor):
    """A hold=True grant of the anchor and the event its release sets."""
    released = threading.Event()
    return vmmipc.register_again(anchor, uses=1, hold=True, release=released.set), released


def start_holder(ctx, ticket, holds=1):
    """A child that imports ticket asking to hold it, and then holds
    `holds` uses (0: the grant was made without hold)."""
    results, commands = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=hh.holding_child, args=(bytes(ticket), results, commands))
    p.start()
    r = results.get(timeout=TIMEOUT)
    assert r[0] == "held", r
    assert r[2] == b"HOLD" and r[3] == holds, r
    return p, results, commands


def expect_kept(released, what):
    assert not released.wait(0.3), f"{what}: the sender's grant was released while a receiver holds it"


@pytest.mark.parametrize("end", ["release", "exit", "SIGTERM", "SIGKILL"])
def test_a_hold_keeps_the_sender_until_the_receiver_lets_go(anchor, end):
    ctx = mp.get_context("spawn")
    holds = vmmipc.holds()
    grant, released = held_grant(anchor)
    p, results, commands = start_holder(ctx, grant)
    expect_kept(released, "after the receiver imported")
    assert vmmipc.holds() == holds + 1
    if end == "release":
        commands.put("release")
        assert results.get(timeout=TIMEOUT) == ("released", 0)
    elif end == "exit":
        commands.put("exit")
    else:
        os.kill(p.pid, getattr(signal, end))
    assert released.wait(5), f"the sender's grant was still held 5 s after the receiver's {end}"
    assert h.wait_for(lambda: vmmipc.holds() == holds), vmmipc.holds()
    if end == "release":
        commands.put("exit")
    p.join(TIMEOUT)


def test_no_receiver_lets_go_of_what_another_holds(anchor):
    ctx = mp.get_context("spawn")
    victim_grant, victim_released = held_grant(anchor)
    other_grant, other_released = held_grant(anchor)
    victim, vres, vcmd = start_holder(ctx, victim_grant)
    other, ores, ocmd = start_holder(ctx, other_grant)
    ocmd.put(("release-other", bytes(victim_grant)))
    what, msg = ores.get(timeout=TIMEOUT)
    assert what == "release-other" and "holds no use" in msg, msg
    ocmd.put("exit")
    assert other_released.wait(5)
    expect_kept(victim_released, "after another receiver tried to let go of it and ended")
    vcmd.put("release")
    assert vres.get(timeout=TIMEOUT)[0] == "released"
    assert victim_released.wait(5)
    vcmd.put("exit")
    for p in (victim, other):
        p.join(TIMEOUT)


def test_a_grant_without_hold_is_released_when_used(anchor):
    ctx = mp.get_context("spawn")
    released = threading.Event()
    grant = vmmipc.register_again(anchor, uses=1, release=released.set)
    p, _, commands = start_holder(ctx, grant, holds=0)  # nothing held: the sender did not ask
    assert released.wait(5)
    commands.put("exit")
    p.join(TIMEOUT)


# -- vmmipc.torch's receiver: which grant keeps each storage -----------------

class _Storage:
    """A stand-in for a received torch storage (only its lifetime matters)."""


def test_torch_receiver_holds_each_ticket_while_a_storage_needs_it(monkeypatch):
    import gc

    from vmmipc import _torch_received
    released = []
    monkeypatch.setattr(_torch_received, "release", released.append)
    holds = _torch_received.Holds()
    a, b = _Storage(), _Storage()
    holds.attach(a, "g1")  # one pickle of a and b
    holds.attach(b, "g1")
    holds.attach(a, "g1")  # another view of a in the same pickle
    assert released == [] and holds.held() == 1
    holds.attach(a, "g2")  # a sent again: g2 takes over a, g1 still keeps b
    assert released == [] and holds.held() == 2
    del b
    gc.collect()
    assert released == ["g1"], "the last storage g1 kept died: g1 is let go of"
    c = _Storage()
    holds.attach(c, "g3")
    holds.attach(a, "g3")  # a and c sent together: g2 kept only a
    assert released == ["g1", "g2"] and holds.held() == 1
    del a
    gc.collect()
    assert released == ["g1", "g2"], "g3 still keeps c"
    del c
    gc.collect()
    assert released == ["g1", "g2", "g3"] and holds.held() == 0


def test_torch_receiver_ignores_a_release_that_finds_nothing(monkeypatch):
    import gc

    from vmmipc import _torch_received

    def gone(ticket):
        raise vmmipc.NotFoundError("holds no use", vmmipc.ENOENT, "vmmipc.release")
    monkeypatch.setattr(_torch_received, "release", gone)
    # What a finalizer raises is not raised here: Python hands it to
    # sys.unraisablehook (pytest only warns of it).
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    holds = _torch_received.Holds()
    s = _Storage()
    holds.attach(s, "old-sender's ticket")
    del s
    gc.collect()  # a finalizer: it must not raise
    assert holds.held() == 0
    assert not unraisable, f"the finalizer raised {unraisable[0].exc_value!r}"


def test_torch_receiver_storage_dying_in_a_collection_inside_attach_does_not_deadlock():
    """weakref finalizers run wherever a collection starts, also inside
    Holds.attach while it holds its lock (allocating a cell there can start
    one): a received storage that only a reference cycle kept (a module, a
    traceback) dies there and must not wait for that lock. In a child: a
    deadlocked thread would hold the collector's threshold at 1 here."""
    import subprocess
    import sys
    code = (
        "import gc, threading\n"
        "from vmmipc import _torch_received\n"
        "_torch_received.release = lambda t: None\n"
        "class S: pass\n"
        "holds = _torch_received.Holds()\n"
        "def work():\n"
        "    gc.set_threshold(1)  # a collection at (nearly) every allocation\n"
        "    for i in range(2000):\n"
        "        s = S(); s.me = s  # a storage only a cycle keeps\n"
        "        holds.attach(s, ('cyclic', i))\n"
        "        del s\n"
        "        keep = S()\n"
        "        holds.attach(keep, ('kept', i))\n"
        "    del keep\n"
        "t = threading.Thread(target=work, daemon=True)\n"
        "t.start()\n"
        "t.join(20)\n"
        "if t.is_alive():\n"
        "    print('deadlocked')\n"
        "else:\n"
        "    gc.set_threshold(700, 10, 10)\n"
        "    gc.collect()\n"
        "    done = threading.Event()\n"
        "    _torch_received.reaper.submit(done.set)  # what the finalizers handed it\n"
        "    done.wait(20)\n"
        "    print('ok' if holds.held() == 0 else f'{holds.held()} tickets still held')\n")
    parent = os.path.dirname(os.path.dirname(os.path.abspath(vmmipc.__file__)))
    env = dict(os.environ, PYTHONPATH=parent)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.strip() == "ok", r.stdout + r.stderr
