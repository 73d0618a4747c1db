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
        results.put((info.hits, info.misses, info.holds, info.holder_sessions))
        results.close()
        results.join_thread()  # the message is out before we die
    os.kill(os.getpid(), signal.SIGKILL)
