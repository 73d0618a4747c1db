"""One buffer re-sent to several receivers in a loop: what the sender pays
per send when many processes hit the same buffer.

    python3 bench/fanout_resend.py [--receivers K] [--rounds N] [--way hostbuffer|sharedmemory]

The parent makes 1 GiB (a vmmipc.HostBuffer, or a multiprocessing
SharedMemory) and starts K spawned children, each joined by a Pipe. Each
round it pickles the object once per child (a HostBuffer's pickle is a new
grant of its anchor: one use each), sends each child its pickle and waits
for all K answers; each child unpickles (after its first, an import-cache
hit vouched for by the sender's grant table), closes it and answers. After
50 untimed rounds, N rounds are timed. Prints one JSON line: sends per
second (K per round), the CPU microseconds per send of the parent and of
all children together over the timed rounds (getrusage; a child's spent
after it answered its last send, such as its last spends, counts too), and
the library (VMMIPC_LIBRARY).
"""

import argparse
import json
import multiprocessing as mp
import os
import pickle
import resource
import time

from gib import WAYS, gib


def child(conn):
    import vmmipc  # noqa: F401 - installs HostBuffer's reducer
    while True:
        b = conn.recv_bytes()
        if b in (b"mark", b"end"):
            r = resource.getrusage(resource.RUSAGE_SELF)
            conn.send((r.ru_utime, r.ru_stime))
            if b == b"end":
                return
            continue
        pickle.loads(b).close()
        conn.send_bytes(b"k")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--receivers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=500)
    ap.add_argument("--way", choices=WAYS, default="hostbuffer")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    for _ in range(args.receivers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=child, args=(b,))
        p.start()
        pipes.append(a)
        procs.append(p)
    with gib(args.way) as obj:
        def one_round():
            for a in pipes:
                a.send_bytes(pickle.dumps(obj))
            for a in pipes:
                a.recv_bytes()

        for _ in range(50):
            one_round()
        marks = []
        for a in pipes:
            a.send_bytes(b"mark")
            marks.append(sum(a.recv()))
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for _ in range(args.rounds):
            one_round()
        elapsed = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        child_cpu = 0.0
        for a, mark in zip(pipes, marks):
            a.send_bytes(b"end")
            child_cpu += sum(a.recv()) - mark
        for p in procs:
            p.join(30)
    sends = args.rounds * args.receivers
    print(json.dumps({
        "way": args.way, "library": os.environ.get("VMMIPC_LIBRARY", ""),
        "receivers": args.receivers, "sends": sends,
        "sends_per_s": round(sends / elapsed),
        "parent_cpu_us_per_send": round(((r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)) / sends * 1e6, 1),
        "children_cpu_us_per_send": round(child_cpu / sends * 1e6, 1),
    }))


if __name__ == "__main__":
    main()
