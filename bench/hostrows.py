"""The host rows: the same host memory into a spawned child three ways, side
by side in one run: a vmmipc.HostBuffer, a
multiprocessing.shared_memory.SharedMemory, and the bytes pickled, each put
on a multiprocessing Queue (start method "spawn").

    python3 bench/hostrows.py [--size B] [--chunk-size B] [--sends S]
                              [--bytes-sends K] [--nofile L]

For each way the sender makes --size bytes (default 1 GiB; HostBuffer
chunks of --chunk-size, default 2 MiB) with markers at the start, the middle
and the end, starts one child and sends S times (default 40; pickled bytes
K times, default 1: each takes seconds). Every way's first sends are slower,
a HostBuffer's for about eight, while the processes' code paths warm up, so
the medians of sends 2-40 are mostly a warm child's. Before each send it
writes a fresh byte at the end (pickled bytes: a fresh bytes object, made
before the clock starts); the child checks it and the markers, reading 4
pages either way.

Time is on CLOCK_MONOTONIC, which both processes share: from the sender's
put() to the return of the child's get() (unpickling done: the child holds
the memory, mapped or copied). The child's reads of the markers come after
and are not timed, for every way alike. Send 1 of a HostBuffer maps anew;
its later sends are import-cache hits (the child tells them apart by the
address they come at, and its vmmipc.cache_info() counters, read once at
the end, must agree). Every SharedMemory send opens and maps the segment anew
(it keeps nothing between sends). A thread in the sender samples the
descriptor counts of both processes from /proc/<pid>/fd about every
millisecond. The children run at a soft RLIMIT_NOFILE of L (default 64).
Prints one JSON object per send (approach "hostrows"; path "hostbuffer",
"sharedmemory" or "bytes"), and at the end, on stderr, each way's median
over sends 2-S with a HostBuffer's ratios to SharedMemory's.
"""

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
import traceback
from multiprocessing import shared_memory

from allatonce import Sampler, count_fds, stop_child

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("VMMIPC_LIBRARY", os.path.join(ROOT, "build", "libvmmipc.so"))  # children inherit it

import vmmipc  # noqa: E402 - after the path set-up above

MARKS = (0x5A, 0xA5, 0x3C)


def marks_at(size):
    return (0, size // 2, size - 2)


def fresh(send):
    return (0xB0 + send) & 0xFF


def check(view, size, send):
    """Reads back the markers and the send's byte; "" when right."""
    for off, want in zip(marks_at(size), MARKS):
        if view[off] != want:
            return f"byte {off} is {view[off]}, not the sender's marker {want}"
    if view[size - 1] != fresh(send):
        return f"the last byte is {view[size - 1]}, not this send's {fresh(send)}: not the sender's latest write"
    return ""


def child(way, q, results, size, nofile):
    try:
        if nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        start = vmmipc.cache_info() if way == "hostbuffer" else None  # loads the library first
        results.put(("ready", os.getpid()))
        send, last = 0, None
        while True:
            item = q.get()
            t1 = time.monotonic()
            if item is None:
                if way == "hostbuffer":
                    end = vmmipc.cache_info()
                    results.put(("counted", end.hits - start.hits, end.misses - start.misses))
                return
            send += 1
            hits = misses = 0
            if way == "hostbuffer":
                # A hit comes at the address of the mapping it hits, a new
                # mapping elsewhere (the last send's is still mapped, in the
                # cache): no call into the library a send, which SharedMemory's
                # child does not make either. The cache's counters, read once
                # at the end, must say the same (run_way).
                addr = ctypes.addressof(item)
                hits, misses = (1, 0) if addr == last else (0, 1)
                last = addr
                err = check(item.view, size, send)
                item.close()  # the mapping stays cached for the next send
            elif way == "sharedmemory":
                err = check(item.buf, size, send)
                item.close()
            else:
                err = check(item, size, send)
            del item
            results.put(("done", t1, err, hits, misses))
    except Exception:  # noqa: BLE001 - reported to the sender, which stops sending
        results.put(("failed", time.monotonic(), traceback.format_exc(limit=4), 0, 0))


class Way:
    """The sender's side of one way: item(send) is what to put on the queue
    for that send, made (or reused, when again) before the clock starts."""

    def __init__(self, way, size, chunk, again):
        self.way, self.size, self.chunk, self.again = way, size, chunk, again
        self.obj = self.view = None
        self.old = []  # objects of earlier sends, closed at the end

    def make(self):
        t = time.monotonic()
        if self.obj is not None:
            self.old.append(self.obj)
        if self.way == "hostbuffer":
            self.obj = vmmipc.HostBuffer(self.size, chunk_size=self.chunk)
            self.view = self.obj.view
        elif self.way == "sharedmemory":
            self.obj = shared_memory.SharedMemory(create=True, size=self.size)
            self.view = self.obj.buf
        else:
            self.view = bytearray(self.size)
        for off, m in zip(marks_at(self.size), MARKS):
            self.view[off] = m
        print(f"hostrows: {self.way}: {self.size} bytes made in {(time.monotonic() - t) * 1e3:.0f} ms",
              file=sys.stderr)

    def item(self, send):
        if self.view is None or not self.again:
            self.make()
        self.view[self.size - 1] = fresh(send)
        return bytes(self.view) if self.way == "bytes" else self.obj

    def close(self):
        self.view = None
        for obj in self.old + [self.obj]:
            if self.way == "sharedmemory":
                obj.close()
                obj.unlink()
            elif self.way == "hostbuffer":
                obj.close()


def run_way(way, again, a):
    chunk = a.chunk_size
    sends = a.bytes_sends if way == "bytes" else a.sends
    row = {"approach": "hostrows", "path": way, "again": again, "memory": "host", "N": -(-a.size // chunk),
           "chunk_size": chunk, "size": a.size, "nofile": None, "child_nofile": a.nofile}
    w = Way(way, a.size, chunk, again)
    times = []  # ms of the sends after the first, where they went right
    counted = [0, 0]  # hits and misses the child saw
    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=child, args=(way, q, results, a.size, a.nofile))
    proc.start()
    try:
        msg = results.get(timeout=a.timeout)
        if msg[0] != "ready":
            raise SystemExit(f"hostrows child ({way}): {msg}")
        me, them = os.getpid(), proc.pid
        for send in range(1, sends + 1):
            item = w.item(send)
            base = {me: count_fds(me), them: count_fds(them)}
            sampler = Sampler([me, them])
            sampler.start()
            t0 = time.monotonic()
            try:
                q.put(item)
                state, t1, err, hits, misses = results.get(timeout=a.timeout)
            except Exception as e:  # noqa: BLE001
                state, t1, err, hits, misses = "failed", time.monotonic(), f"{type(e).__name__}: {e!r}", 0, 0
            sampler.stopping = True
            sampler.join()
            del item
            if way == "hostbuffer" and not err:
                if (send == 1 or not again) and misses != 1:
                    err = f"expected a new buffer to be mapped anew (cache misses +{misses}, hits +{hits})"
                elif send > 1 and again and not (hits == 1 and misses == 0):
                    err = f"expected a cache hit (cache hits +{hits}, misses +{misses})"
            ms = None if state == "failed" else round((t1 - t0) * 1e3, 3)
            print(json.dumps(dict(row, send=send, ok=not err, ms=ms,
                                  peak_fds_sender=sampler.peak[me] - base[me],
                                  peak_fds_receiver=sampler.peak[them] - base[them],
                                  cache_hits=hits, cache_misses=misses, error=err)), flush=True)
            if state == "failed":
                break
            counted[0] += hits
            counted[1] += misses
            if send > 1 and not err:
                times.append(ms)
        else:
            if way == "hostbuffer":
                q.put(None)
                msg = results.get(timeout=a.timeout)
                if msg != ("counted", *counted):
                    raise SystemExit(f"hostrows child ({way}): the import cache counted {msg}, "
                                     f"the sends' addresses (hits, misses) {tuple(counted)}")
    finally:
        stop_child(proc, q)
        w.close()
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=int, default=1 << 30)
    ap.add_argument("--chunk-size", type=int, default=2 << 20)
    ap.add_argument("--sends", type=int, default=40)
    ap.add_argument("--bytes-sends", type=int, default=1)
    ap.add_argument("--nofile", type=int, default=64, help="the children's soft RLIMIT_NOFILE (0: leave it)")
    ap.add_argument("--ways", default="hostbuffer,sharedmemory,hostbuffer-again,sharedmemory-again,bytes",
                    help="WAY (a new object each send) or WAY-again (the same object every send)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds to wait for a child at each step")
    a = ap.parse_args()
    medians = {}
    for way in a.ways.split(","):
        times = run_way(way.removesuffix("-again"), way.endswith("-again"), a)
        if times:
            medians[way] = statistics.median(times)
    summarize(medians, a.sends)


def summarize(medians, sends):
    """One line on stderr: each way's median over sends 2-S, and a
    HostBuffer's against SharedMemory's of the same kind (new, again)."""
    if not medians:
        return
    parts = [f"{way} {ms:.3f} ms" for way, ms in medians.items()]
    for kind in ("", "-again"):
        hb, sm = medians.get("hostbuffer" + kind), medians.get("sharedmemory" + kind)
        if hb and sm:
            parts.append(f"hostbuffer{kind} / sharedmemory{kind} {hb / sm:.2f}x")
    print(f"hostrows: medians of sends 2-{sends}: " + ", ".join(parts), file=sys.stderr)


if __name__ == "__main__":
    main()
