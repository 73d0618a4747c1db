"""Code that runs in the child processes of test_hostbuffer_uses.py (kept
apart from the test module so children import only this and vmmipc)."""

import os
import pickle
import signal
import time

import vmmipc


def touch(hb) -> int:
    """A Pool task: read the buffer this worker was sent."""
    return hb[0] + hb[len(hb) - 1]


def read_many(q, done, n: int) -> None:
    """Take the buffer n times from q (a cache hit after the first), say
    the sum of what was read, then wait to be killed."""
    total = 0
    for _ in range(n):
        total += touch(q.get())
    done.put(total)
    time.sleep(3600)


def unpickle_all_and_die(blobs, results=None) -> None:
    """Unpickle every blob (the first maps, the others are cache hits) as
    fast as it can, say what the cache and the holds say (with a results
    queue), and die by SIGKILL at once: what the exporter has not been told
    by then is lost. A blob that does not unpickle ends the process with
    status 1 instead."""
    for b in blobs:
        hb = pickle.loads(b)
        if touch(hb) != 3:
            os._exit(1)
        hb.close()
    if results is not None:
        info = vmmipc.cache_info()
        results.put((info.hits, info.misses, info.holds, info.holder_sessions, info.table_imports))
        results.close()
        results.join_thread()  # the message is out before we die
    os.kill(os.getpid(), signal.SIGKILL)


def grant_fork_and_wait(results, n: int) -> None:
    """A sender that forks: make a buffer, put n pickles of it on results,
    fork a child that only sleeps, at most a minute (it inherits every
    descriptor: the grant table's too, but no mapping of it), put the
    child's pid and whether the child maps the table, then wait to be
    killed."""
    from multiprocessing.reduction import ForkingPickler
    hb = vmmipc.HostBuffer(4 << 20, chunk_size=1 << 20)
    hb.view[0], hb.view[-1] = 1, 2
    results.put([bytes(ForkingPickler.dumps(hb)) for _ in range(n)])
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # no call into the library here: its runtime did not come along
        os.close(r)
        with open("/proc/self/maps") as f:
            maps = f.read()
        os.write(w, b"mapped" if "vmmipc-grants" in maps else b"none")
        time.sleep(60)  # outlives its parent; the test kills it, or it goes by itself
        os._exit(0)
    os.close(w)
    results.put((pid, os.read(r, 16).decode()))
    time.sleep(3600)
