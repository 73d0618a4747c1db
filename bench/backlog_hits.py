"""A backlog of pickles of one buffer, unpickled at once: what a receiver's
hits cost when the sender grants nothing meanwhile.

    python3 bench/backlog_hits.py [--way hostbuffer|sharedmemory] [--pickles N]

The parent makes 1 GiB (a vmmipc.HostBuffer, or a multiprocessing
SharedMemory), pickles it N + 1 times (each HostBuffer pickle is a grant of
its anchor) and sends the list to a spawned child in one message, then
waits. The child unpickles and closes the first (a HostBuffer's maps it),
then times each of the N others: unpickling (a HostBuffer's is an
import-cache hit) and closing. The sender grants nothing while they are
unpickled, so it spends none of the hits' uses from the child's spend log
(its harvest runs when it grants): the child's confirmer spends them on
sessions, and a hit that finds its spend log full asks the sender itself.
Prints one JSON line: the way, N, the median, mean, 95th percentile and
largest microseconds of an unpickling, the hits vouched by the sender's
table and the others (HostBuffer), and the total.
"""

import argparse
import json
import multiprocessing as mp
import pickle
import statistics
import time

from gib import WAYS, gib


def child(way, conn):
    import vmmipc
    datas = conn.recv()
    x = pickle.loads(datas[0])
    x.close()
    times, table = [], 0
    for d in datas[1:]:
        before = vmmipc.cache_info().table_hits if way == "hostbuffer" else 0
        t = time.perf_counter_ns()
        x = pickle.loads(d)
        times.append((time.perf_counter_ns() - t) / 1000)
        if way == "hostbuffer":
            table += vmmipc.cache_info().table_hits > before
        x.close()
    conn.send((times, table))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--way", choices=WAYS, default="hostbuffer")
    ap.add_argument("--pickles", type=int, default=3000)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    with gib(args.way) as obj:
        p = ctx.Process(target=child, args=(args.way, b))
        p.start()
        a.send([pickle.dumps(obj) for _ in range(args.pickles + 1)])
        times, table = a.recv()
        p.join(60)
    q = statistics.quantiles(times, n=20)
    print(json.dumps({"way": args.way, "pickles": args.pickles,
                      "median_us": round(statistics.median(times), 1),
                      "mean_us": round(statistics.mean(times), 1), "p95_us": round(q[-1], 1),
                      "max_us": round(max(times), 1), "table_hits": table,
                      "other": len(times) - table if args.way == "hostbuffer" else None,
                      "total_ms": round(sum(times) / 1000, 1)}))


if __name__ == "__main__":
    main()
