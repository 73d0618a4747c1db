"""Grants made ahead (_anchor.py): a buffer pickled again and again calls
into the library once per AHEAD pickles, not once per pickle, and nothing a
user can see changes: each pickle is still one registration of its own,
live_registrations() counts only those a pickle has named, the grants no
pickle has named end with the buffer, and a forked child never hands one
out."""

import gc
import os
import pickle
import threading
import time

import pytest

import _mp_helpers as h
import vmmipc
from vmmipc import _anchor, _register

pytestmark = pytest.mark.usefixtures("server_running")


def library_count() -> int:
    return _register.library_live_registrations()


def steady() -> tuple[int, int]:
    """live_registrations() and the library's count once neither has moved
    for 0.3 s (an earlier test's grants may still be ending)."""
    last, since = None, 0.0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        now = (vmmipc.live_registrations(), library_count())
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.3:
            break
        time.sleep(0.02)
    return last


@pytest.fixture
def calls(monkeypatch):
    """The grants each pickle made in the library: a list with one count per
    pickle() call of the test."""
    made = [0]
    real = _anchor.register_again_quiet

    def counting(*args):
        made[0] += 1
        return real(*args)
    monkeypatch.setattr(_anchor, "register_again_quiet", counting)
    per_pickle = []

    def pickle_counting(obj):
        before = made[0]
        data = pickle.dumps(obj)
        per_pickle.append(made[0] - before)
        return data
    return pickle_counting, per_pickle


def test_a_loop_of_pickles_calls_the_library_once_per_batch(calls):
    pickle_counting, per_pickle = calls
    hb = vmmipc.HostBuffer(1 << 20)
    try:
        blobs = [pickle_counting(hb) for _ in range(100)]
        assert per_pickle[0] == 0, "the first pickle takes the grant made with the buffer"
        calling = [i for i, n in enumerate(per_pickle) if n]
        # The second pickle makes a batch, and every AHEAD-th after it.
        assert calling == list(range(1, 100, _anchor.AHEAD)), \
            f"pickles that called the library: {calling} of 100"
        assert all(per_pickle[i] == _anchor.AHEAD for i in calling)
        assert len(set(blobs)) == 100, "two pickles named the same grant"
    finally:
        hb.unregister_all()
        hb.close()


def test_live_registrations_counts_only_what_pickles_named():
    base, base_library = steady()
    hb = vmmipc.HostBuffer(1 << 20)
    try:
        assert vmmipc.live_registrations() == base + 1, "the anchor alone"
        assert library_count() == base_library + 2, "the anchor and the first pickle's grant"
        for n in range(1, 41):
            pickle.dumps(hb)
            assert vmmipc.live_registrations() == base + 1 + n
        ahead = len(hb._anchor._ahead)
        assert ahead > 0
        assert library_count() == base_library + vmmipc.live_registrations() - base + ahead
        assert len(hb.pending_tickets()) == 40
        assert hb.unregister_all() == 40
        assert vmmipc.live_registrations() == base + 1
    finally:
        hb.close()
    assert vmmipc.live_registrations() == base
    assert library_count() == base_library, "grants made ahead outlived their buffer"


def test_close_ends_only_the_grants_no_pickle_named():
    _, base_library = steady()
    hb = vmmipc.HostBuffer(1 << 20)
    hb.view[0] = 7
    blobs = [pickle.dumps(hb) for _ in range(5)]
    pending = hb.pending_tickets()
    hb.close()
    assert library_count() == base_library + 5, "the five pickles' grants, nothing ahead"
    got = pickle.loads(blobs[4])
    try:
        assert got.view[0] == 7, "a pickle made before close() unpickles"
    finally:
        got.close()
    for t in pending[:4]:
        vmmipc.unregister(t)
    assert h.wait_for(lambda: library_count() == base_library)


def test_a_collected_buffer_ends_its_grants_made_ahead():
    _, base_library = steady()
    hb = vmmipc.HostBuffer(1 << 20)
    for _ in range(3):
        vmmipc.unregister(hb.grant())
    anchor = hb._anchor
    assert anchor._ahead
    del hb
    gc.collect()
    assert anchor._ahead == [] and anchor.retired
    assert library_count() == base_library


def test_grants_with_a_ttl_or_other_uses_are_made_when_asked(calls):
    pickle_counting, per_pickle = calls
    hb = vmmipc.HostBuffer(1 << 20, pickle_ttl=30)
    try:
        for _ in range(10):
            pickle_counting(hb)
        assert per_pickle == [1] * 10, "a ttl counts from the grant: none is made ahead"
        assert hb._anchor._ahead == []
    finally:
        hb.unregister_all()
        hb.close()
    hb = vmmipc.HostBuffer(1 << 20)
    try:
        ahead = list(hb._anchor._ahead)
        t = hb.grant(uses=3)
        assert hb._anchor._ahead == ahead, "a grant for 3 took one made for 1"
        vmmipc.unregister(t)
    finally:
        hb.close()


def test_a_forked_child_hands_out_no_grant_made_ahead():
    hb = vmmipc.HostBuffer(1 << 20)
    try:
        vmmipc.unregister(hb.grant())
        vmmipc.unregister(hb.grant())  # the second makes a batch ahead
        assert hb._anchor._ahead
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # no Go here: only Python, then _exit
            try:
                hb.grant()
                code = 1
            except vmmipc.VmmipcForkError:
                code = 0
            except BaseException:  # noqa: BLE001
                code = 2
            os.write(w, bytes([code]))
            os._exit(0)
        os.close(w)
        got = os.read(r, 1)
        os.close(r)
        os.waitpid(pid, 0)
        assert got == b"\x00", "the child pickled with its parent's grant (1) or failed otherwise (2)"
    finally:
        hb.close()


def test_threads_pickling_one_buffer_each_get_a_grant_of_their_own():
    _, base_library = steady()
    hb = vmmipc.HostBuffer(1 << 20)
    blobs: list[bytes] = []
    lock = threading.Lock()

    def pickles():
        mine = [pickle.dumps(hb) for _ in range(200)]
        with lock:
            blobs.extend(mine)
    threads = [threading.Thread(target=pickles) for _ in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert len(set(blobs)) == 800, "two pickles named the same grant"
        assert len(hb.pending_tickets()) == 800
        assert library_count() == base_library + 1 + 800 + len(hb._anchor._ahead)
        assert hb.unregister_all() == 800
    finally:
        hb.close()
    assert library_count() == base_library
