#!/usr/bin/env python3
"""CPU tensors through a multiprocessing Queue, one process to another
(docs/dataloader.md, "CPU tensors between any processes"): N sends of a new
1 MiB float32 tensor (filled in the sender) to a spawned child, which checks
one value of each and drops it; vmmipc.torch's host arena against torch's
own file_descriptor strategy, in one run, rounds interleaved. Prints the
child's sends per second from its first get to its last (medians over the
rounds) and the child's descriptors after the last.

    python3 bench/cpu_queue_bench.py [N] [ROUNDS] [MiB]   (default 1000 3 1)
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))


def child(q, r, mode):
    import vmmipc.torch as vt
    vt.set_cpu_sharing(mode)
    n, t0 = 0, None
    while (t := q.get()) is not None:
        if t0 is None:
            t0 = time.perf_counter()
        assert float(t[-1]) == float(n), (n, float(t[-1]))
        del t
        n += 1
    r.put((n, time.perf_counter() - t0, len(os.listdir("/proc/self/fd"))))


def one_round(mode: str, n: int, numel: int) -> tuple[float, int]:
    import torch
    import torch.multiprocessing as mp
    import vmmipc.torch as vt
    vt.set_cpu_sharing(mode)
    mp.set_sharing_strategy("file_descriptor")
    ctx = mp.get_context("spawn")
    q, r = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, r, mode))
    p.start()
    for i in range(n):
        t = torch.empty(numel)
        t.fill_(float(i))
        q.put(t)
        del t
    q.put(None)
    got, seconds, fds = r.get(timeout=600)
    p.join(60)
    assert got == n
    return got / seconds, fds


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    mib = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
    numel = int(mib * (1 << 20)) // 4
    rates: dict = {"vmmipc": [], "torch": []}
    fds: dict = {}
    for _ in range(rounds):
        for mode in ("torch", "vmmipc"):
            rate, fds[mode] = one_round(mode, n, numel)
            rates[mode].append(rate)
    for mode in ("torch", "vmmipc"):
        label = "vmmipc.torch host arena" if mode == "vmmipc" else "torch file_descriptor"
        print(f"{label:26s} {statistics.median(rates[mode]):8.0f} sends/s  "
              f"(rounds: {', '.join(f'{x:.0f}' for x in rates[mode])}; child fds at the end: "
              f"{fds[mode]})")
    ratio = statistics.median(rates["vmmipc"]) / statistics.median(rates["torch"])
    print(f"ratio vmmipc/torch: {ratio:.2f}x  ({n} sends of {mib:g} MiB, {rounds} rounds, "
          "interleaved)")


if __name__ == "__main__":
    main()
