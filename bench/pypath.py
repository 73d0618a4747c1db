"""The Python path: a buffer sent through a multiprocessing Queue into a
spawned child with vmmipc, several times, beside bench/allatonce.py.

    python3 bench/pypath.py --chunks N [--chunk-size B] [--sends S] [--host]

CUDA: the sender makes N chunks with cuMemCreate (as bench/allatonce.py
does) and registers the range once with vmmipc.share(uses=0): the anchor
that keeps the buffer's identity alive. Every send puts a new ticket of it,
vmmipc.register_again(anchor) (uses = 1), on the queue; the child imports it
with vmmipc.import_stream, checks it and closes the Mapping, which stays in
its import cache. Host (--host): a vmmipc.HostBuffer goes on the queue as
is (it keeps its own anchor; each pickle is a register_again); the child's
get() imports it.

Time is on CLOCK_MONOTONIC, which both processes share: from the sender's
first call of the send (send 1: share + register_again + put; later sends:
register_again + put; host: put) to the return of the child's import. Before
each send the sender writes a fresh byte into the buffer and the child checks
it, so a cached mapping must show the sender's latest write. Send 1 maps
anew; sends 2.. must be cache hits (the child's vmmipc.cache_info() says so,
or the row is marked failed). A thread in the sender samples the descriptor
counts of both processes from /proc/<pid>/fd about every millisecond (peaks
shorter than that can be missed). Prints one JSON object per send.
"""

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import traceback

from allatonce import Cuda, CudaBuffer, Sampler, count_fds, marker, stop_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("VMMIPC_LIBRARY", os.path.join(ROOT, "build", "libvmmipc.so"))  # children inherit it

import vmmipc  # noqa: E402 - after the path set-up above


def round_byte(send):
    return (0xA0 + send) & 0xFF


def check(read, n, size, send):
    """Reads back the chunk markers and the send's byte; "" when right."""
    for i in (0, n // 2, n - 1):
        if read(i * size) != marker(i):
            return f"chunk {i} does not hold the sender's marker"
    got = read((n - 1) * size + 1)
    if got != round_byte(send):
        return f"the mapping does not show the sender's latest write (byte {got}, want {round_byte(send)})"
    return ""


def child(q, results, n, size, host):
    try:
        cuda = None if host else Cuda()  # a context to read back with, made before any timing
        results.put(("ready", os.getpid()))
        send = 0
        while True:
            before = vmmipc.cache_info()
            item = q.get()  # host: unpickling the HostBuffer imports it
            if item is None:
                return
            send += 1
            if host:
                t1, import_ms = time.monotonic(), None
                err = check(lambda off: item[off], n, size, send)
            else:
                t = time.monotonic()
                item = vmmipc.import_stream(item)
                t1 = time.monotonic()
                import_ms = (t1 - t) * 1e3
                err = check(lambda off: cuda.read_byte(item.addr + off), n, size, send)
            after = vmmipc.cache_info()
            item.close()  # the mapping stays cached for the next send
            results.put(("done", t1, import_ms, after.hits - before.hits, after.misses - before.misses, err))
    except Exception:  # noqa: BLE001 - reported to the sender, which stops sending
        results.put(("failed", time.monotonic(), None, 0, 0, traceback.format_exc(limit=4)))


class CudaSender:
    def __init__(self, n, size):
        self.buf = CudaBuffer(n, size)
        self.n, self.size = n, size
        self.anchor = None

    def write_byte(self, off, value):
        self.buf.c.write_byte(self.buf.base + off, value)

    def send(self, q):
        """Returns the time spent registering."""
        t = time.monotonic()
        if self.anchor is None:
            self.anchor = vmmipc.share(self.buf.base, self.n * self.size, uses=0)
        ticket = vmmipc.register_again(self.anchor, uses=1)
        ms = (time.monotonic() - t) * 1e3
        q.put(ticket)
        return ms

    def close(self):
        if self.anchor is not None:
            vmmipc.unregister(self.anchor)


class HostSender:
    def __init__(self, n, size):
        self.hb = vmmipc.HostBuffer(n * size, chunk_size=size)
        for i in range(n):
            self.hb[i * size] = marker(i)

    def write_byte(self, off, value):
        self.hb[off] = value

    def send(self, q):
        q.put(self.hb)  # registering happens in the queue's feeder thread
        return None

    def close(self):
        self.hb.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--chunk-size", type=int, default=2 << 20)
    ap.add_argument("--sends", type=int, default=3)
    ap.add_argument("--host", action="store_true", help="a vmmipc.HostBuffer instead of CUDA memory (no GPU needed)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for the child at each step")
    a = ap.parse_args()
    n, size = a.chunks, a.chunk_size
    t = time.monotonic()
    sender = HostSender(n, size) if a.host else CudaSender(n, size)
    print(f"pypath: buffer of {n} x {size} bytes made in {(time.monotonic() - t) * 1e3:.0f} ms", file=sys.stderr)
    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(q, results, n, size, a.host))
    proc.start()
    msg = results.get(timeout=a.timeout)
    if msg[0] != "ready":
        raise SystemExit(f"pypath child: {msg}")
    me, them = os.getpid(), proc.pid
    row = {"approach": "python", "path": "hostbuffer+queue" if a.host else "share+queue",
           "memory": "host" if a.host else "cuda", "N": n, "chunk_size": size}
    try:
        for send in range(1, a.sends + 1):
            sender.write_byte((n - 1) * size + 1, round_byte(send))
            base = {me: count_fds(me), them: count_fds(them)}
            sampler = Sampler([me, them])
            sampler.start()
            t0 = time.monotonic()
            try:
                register_ms = sender.send(q)
                state, t1, import_ms, hits, misses, err = results.get(timeout=a.timeout)
            except Exception as e:  # noqa: BLE001
                register_ms, t1, import_ms, hits, misses = None, time.monotonic(), None, 0, 0
                state, err = "failed", f"{type(e).__name__}: {e!r}"
            sampler.stopping = True
            sampler.join()
            if not err and send == 1 and misses != 1:
                err = f"expected the first send to map anew (cache misses +{misses}, hits +{hits})"
            if not err and send > 1 and not (hits == 1 and misses == 0):
                err = f"expected a cache hit (cache hits +{hits}, misses +{misses})"
            ms = None if state == "failed" else round((t1 - t0) * 1e3, 3)
            print(json.dumps(dict(row, send=send, ok=not err, ms=ms, us_per_chunk=ms and round(ms * 1e3 / n, 3),
                                  import_ms=None if import_ms is None else round(import_ms, 3),
                                  register_ms=None if register_ms is None else round(register_ms, 3),
                                  peak_fds_sender=sampler.peak[me] - base[me],
                                  peak_fds_receiver=sampler.peak[them] - base[them],
                                  cache_hits=hits, cache_misses=misses, error=err)), flush=True)
            if state == "failed":
                break  # the child has stopped (or is silent): nothing more to measure
    finally:
        stop_child(proc, q)
        sender.close()


if __name__ == "__main__":
    main()
