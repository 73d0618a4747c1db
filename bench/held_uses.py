#!/usr/bin/env python3
"""Held uses one by one, the shape of a loop of one-tensor sends (torch's
send_many) on host memory: the parent grants an anchor (hold, uses=1) N
times; a spawned child imports each grant with hold=True (import-cache hits
after the first), unmaps it and releases it at once. Prints the child's
time per use.

    python3 bench/held_uses.py [N]      (default 2000)
"""
import fcntl
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
import vmmipc  # noqa: E402


def child(q, r):
    n, t0 = 0, None
    while (t := q.get()) is not None:
        if t0 is None:
            t0 = time.perf_counter()
        m = vmmipc.import_stream(t, hold=True)
        m.close()
        vmmipc.release(t)
        n += 1
    r.put((n, time.perf_counter() - t0))


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    fd = os.memfd_create("held-uses", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 1 << 20)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    anchor = vmmipc.register_host_file(fd, 1 << 20, 1 << 20, uses=0)
    os.close(fd)
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, r))
    p.start()
    for _ in range(n):
        q.put(bytes(vmmipc.register_again(anchor, uses=1, hold=True)))
    q.put(None)
    done, took = r.get()
    p.join()
    print(f"{done} held uses in {took:.2f} s: {1e6 * took / done:.0f} us each "
          f"(import hold=True, unmap, release); the sender holds {vmmipc.holds()} now")


if __name__ == "__main__":
    main()
