"""One buffer re-sent in a loop, cut into phases: where a re-send's time goes.

    python3 bench/resend_phases.py [--way hostbuffer|sharedmemory] [--sends N] [--warm W]

The parent makes 1 GiB (a vmmipc.HostBuffer, or a multiprocessing
SharedMemory) and starts a spawned child joined by a Pipe. Each send: the
parent pickles the object (pickle.dumps: a HostBuffer's is a new grant of
its anchor), sends the bytes; the child unpickles (a HostBuffer's is an
import-cache hit vouched for by the sender's grant table after the first;
a SharedMemory's opens and maps the segment anew), closes it and answers
with its timestamps. W sends untimed, then N timed, on CLOCK_MONOTONIC,
which both processes share. Prints one JSON line: the way, the library
(VMMIPC_LIBRARY, for A/B runs) and the median and mean microseconds of each
phase: dumps, to_child (send to the child's wake-up), loads, close, ack_back
(the child's answer to the parent's wake-up), and round (their sum).
"""

import argparse
import json
import multiprocessing as mp
import os
import pickle
import statistics
import struct
import time

from gib import WAYS, gib
PHASES = ("dumps", "to_child", "loads", "close", "ack_back")


def child(conn):
    import vmmipc  # noqa: F401 - installs HostBuffer's reducer
    mono = time.monotonic_ns
    while True:
        b = conn.recv_bytes()
        woke = mono()
        if b == b"end":
            return
        x = pickle.loads(b)
        loaded = mono()
        x.close()
        conn.send_bytes(struct.pack("qqq", woke, loaded, mono()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--way", choices=WAYS, default="hostbuffer")
    ap.add_argument("--sends", type=int, default=3000)
    ap.add_argument("--warm", type=int, default=200)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=child, args=(b,))
    p.start()
    mono = time.monotonic_ns
    rows = []
    with gib(args.way) as obj:
        for i in range(args.warm + args.sends):
            start = mono()
            data = pickle.dumps(obj)
            sent = mono()
            a.send_bytes(data)
            woke, loaded, closed = struct.unpack("qqq", a.recv_bytes())
            back = mono()
            if i >= args.warm:
                rows.append((sent - start, woke - sent, loaded - woke, closed - loaded, back - closed))
        a.send_bytes(b"end")
        p.join(30)
    out = {"way": args.way, "library": os.environ.get("VMMIPC_LIBRARY", ""), "sends": args.sends}
    for name, col in zip(PHASES, zip(*rows)):
        out[name] = {"median_us": round(statistics.median(col) / 1000, 1),
                     "mean_us": round(statistics.mean(col) / 1000, 1)}
    out["round"] = {"median_us": round(sum(out[n]["median_us"] for n in PHASES), 1),
                    "mean_us": round(sum(out[n]["mean_us"] for n in PHASES), 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
