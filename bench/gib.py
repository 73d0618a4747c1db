"""The 1 GiB buffer of the re-send benchmarks (resend_phases.py,
fanout_resend.py, backlog_hits.py): a vmmipc.HostBuffer, or what users
would pick instead, a multiprocessing SharedMemory; closed (and the
SharedMemory unlinked) when done."""

import contextlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))

SIZE = 1 << 30
WAYS = ("hostbuffer", "sharedmemory")


@contextlib.contextmanager
def gib(way):
    if way == "hostbuffer":
        import vmmipc
        obj = vmmipc.HostBuffer(SIZE)
    else:
        from multiprocessing import shared_memory
        obj = shared_memory.SharedMemory(create=True, size=SIZE)
    try:
        yield obj
    finally:
        obj.close()
        if way == "sharedmemory":
            obj.unlink()
