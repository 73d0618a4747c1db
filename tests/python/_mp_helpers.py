"""Helpers of the tests in this directory: descriptor counts, the byte
pattern, waiting for a condition, and the code that runs in the child
processes of test_multiprocessing.py (kept apart from the test modules so
children import only this and vmmipc)."""

import os
import resource
import struct
import sys
import threading
import time

import vmmipc

CHILD_NOFILE = 64
# Descriptors mmap.mmap keeps of its own (a dup of the file) before Python
# 3.13, where HostBuffer passes trackfd=False.
MMAP_DUP = 1 if sys.version_info < (3, 13) else 0


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_table() -> dict:
    """This process's descriptors and what each refers to (for messages)."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the directory's own descriptor, gone already
    return out


def fd_changes(before: dict) -> str:
    """What differs between fd_table() now and before, for a failed check."""
    now = fd_table()
    gone = {fd: t for fd, t in before.items() if now.get(fd) != t}
    new = {fd: t for fd, t in now.items() if before.get(fd) != t}
    return f"descriptors opened since: {new or 'none'}; closed since: {gone or 'none'}"


def settled_fd_count(timeout: float = 2.0) -> int:
    """fd_count() once earlier tests' leftovers are gone: objects in cycles
    collected (Queues hold pipes), no unreferenced mapping left in the
    import cache (while there is one, the cache asks its exporter about it
    every 250 ms over a short-lived socket), and the count unchanged over 3
    samples (a server closes its end of a finished stream on its own
    thread)."""
    import gc
    import vmmipc
    from vmmipc import _lib
    gc.collect()
    deadline = time.monotonic() + timeout
    while _lib.loaded() and vmmipc.cache_info().unreferenced_bytes and time.monotonic() < deadline:
        time.sleep(0.02)
    seen = [fd_count()]
    while time.monotonic() < deadline and (len(seen) < 3 or len(set(seen[-3:])) > 1):
        time.sleep(0.02)
        seen.append(fd_count())
    return seen[-1]


def wait_for(pred, timeout: float = 5.0) -> bool:
    """Whether pred() holds within timeout seconds (asked every 10 ms)."""
    deadline = time.monotonic() + timeout
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)
    return pred()


def pattern(n_chunks: int, chunk_size: int, seed: int) -> bytes:
    """Different in every chunk and for every seed (8-byte words: chunk index,
    seed), so a chunk mapped at the wrong offset is caught."""
    return b"".join(struct.pack("<II", i, seed) * (chunk_size // 8) for i in range(n_chunks))


class FdSampler:
    """Samples this process's descriptor count in a thread; peak is the
    highest count seen (the library works with the GIL released)."""

    def __init__(self):
        self.baseline = fd_count()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, fd_count())
            time.sleep(0.0005)

    def stop(self) -> "FdSampler":
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, fd_count())
        return self


def limit_fds(n: int = CHILD_NOFILE) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))


# -- Pool: the initializer runs before the worker unpickles any task --------

_sampler = None


def pool_init():
    global _sampler
    limit_fds()
    _sampler = FdSampler()


class LimitFdsFirst:
    """Put first in Process(args=...): unpickling it (before the buffer that
    follows it) lowers RLIMIT_NOFILE and starts the fd sampler, so the limit
    already holds while the HostBuffer is imported."""

    def __reduce__(self):
        return (_limit_and_sample, ())


def _limit_and_sample():
    pool_init()
    return None


def take_sampler() -> FdSampler:
    global _sampler
    s, _sampler = _sampler, None
    return s.stop()


# -- the work every child does ------------------------------------------------

def verify_and_write(hb, seed_in: int, seed_out: int) -> dict:
    """Check every byte against the parent's pattern, then overwrite the
    whole buffer with the seed_out pattern for the parent to check."""
    n, cs = hb.n_chunks, hb.chunk_size
    view = hb.view
    ok = view == pattern(n, cs, seed_in)
    bad = -1
    if not ok:
        want = pattern(n, cs, seed_in)
        bad = next(i for i in range(n) if view[i * cs:(i + 1) * cs] != want[i * cs:(i + 1) * cs])
    view[:] = pattern(n, cs, seed_out)
    return {"ok": ok, "first_bad_chunk": bad, "size": hb.size, "n_chunks": n,
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0]}


def _report(hb, sampler, seed_in, seed_out):
    after_import = fd_count()
    r = verify_and_write(hb, seed_in, seed_out)
    hb.close()
    r.update(baseline=sampler.baseline, peak=sampler.peak, after_import=after_import,
             after_close=fd_count(), pid=os.getpid())
    return r


def child_queue(q, results, seed_in, seed_out):
    limit_fds()
    sampler = FdSampler()
    try:
        hb = q.get(timeout=60)  # unpickling (the import) happens here
        sampler.stop()
        results.put(_report(hb, sampler, seed_in, seed_out))
    except BaseException as e:  # report, never leave the parent waiting
        results.put({"error": repr(e)})


def child_pipe(conn, seed_in, seed_out):
    limit_fds()
    sampler = FdSampler()
    try:
        if not conn.poll(60):
            raise TimeoutError("nothing arrived on the pipe")
        hb = conn.recv()
        sampler.stop()
        conn.send(_report(hb, sampler, seed_in, seed_out))
    except BaseException as e:
        conn.send({"error": repr(e)})


def child_process_args(_limit, hb, results, seed_in, seed_out):
    try:
        sampler = take_sampler()  # started while unpickling _limit, before hb
        results.put(_report(hb, sampler, seed_in, seed_out))
    except BaseException as e:
        results.put({"error": repr(e)})


def pool_task(args):
    hb, seed_in, seed_out = args
    return _report(hb, take_sampler(), seed_in, seed_out)


# -- fork: every use must fail at once ---------------------------------------

def _fork_outcome(fn):
    try:
        fn()
        return {"error": None}
    except vmmipc.VmmipcForkError as e:
        return {"error": "VmmipcForkError", "status": e.status, "message": str(e)}
    except BaseException as e:
        return {"error": repr(e)}


def fork_child_queue(q, results):
    results.put(_fork_outcome(lambda: q.get(timeout=30)))


def fork_child_pipe(conn, results):
    def get():
        if not conn.poll(30):
            raise TimeoutError("nothing arrived on the pipe")
        conn.recv()
    results.put(_fork_outcome(get))


def fork_child_process_args(hb, results):
    import ctypes
    import pickle
    out = _fork_outcome(lambda: pickle.dumps(hb))
    # The C library refuses on its own too (bypassing the Python check).
    n = ctypes.c_uint64()
    out["c_status"] = vmmipc._lib._lib.vmmipc_live_registrations(ctypes.byref(n))
    results.put(out)


def fork_pool_task(hb):
    return "unreachable: the parent must refuse to send this"


# -- the import cache across repeated sends ----------------------------------

def child_repeated(q, results, n, seed):
    """Receive the same HostBuffer n times; report where each was mapped and
    the cache's counters."""
    import ctypes
    try:
        addrs, ok = [], True
        for _ in range(n):
            hb = q.get(timeout=60)
            anchor = ctypes.c_char.from_buffer(hb.view)
            addrs.append(ctypes.addressof(anchor))
            del anchor
            ok = ok and hb.view == pattern(hb.n_chunks, hb.chunk_size, seed)
            hb.close()
        results.put({"addrs": addrs, "ok": ok, "cache": tuple(vmmipc.cache_info())})
    except BaseException as e:
        results.put({"error": repr(e)})


def child_confirm_later_and_exit(tickets, results):
    """Queue a background confirmation of each ticket, say how many are
    still pending, and return at once (the process then exits)."""
    try:
        for t in tickets:
            vmmipc.confirm(t, later=True)
        results.put({"pending": vmmipc.cache_info().confirms_pending})
    except BaseException as e:
        results.put({"error": repr(e)})


# -- a reducer that fails in the Queue's feeder thread -----------------------

def child_get_error(q, results):
    try:
        q.get(timeout=30)
        results.put({"type": None})
    except BaseException as e:
        results.put({"type": type(e).__name__, "message": str(e),
                     "notes": list(getattr(e, "__notes__", []))})


def buffer_child(q, results):
    """test_buffer's receiver: reads what the sender wrote through the
    buffer protocol and writes back through it."""
    try:
        hb = q.get()
        v = memoryview(hb)
        results.put(("ok", bytes(v[100:105]), len(hb)))
        v[200:205] = b"WORLD"
        v.release()
        q.get()
        hb.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        results.put(("failed", repr(e), 0))


def child_put_and_exit(q):
    """An exporter that puts a HostBuffer on the queue and exits at once."""
    hb = vmmipc.HostBuffer(4096)
    hb[0] = 42
    q.put(hb)


def child_share_then_exit_hook(q, go):
    """An exporter that shares a HostBuffer, runs vmmipc's exit hooks (what
    its exit would run) and stays until told to go."""
    from vmmipc import _lib
    hb = vmmipc.HostBuffer(4096)
    t = hb.grant()
    _lib._run_exit_hooks()
    q.put(bytes(t))
    go.get(timeout=60)
