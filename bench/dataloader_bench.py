"""DataLoader CPU batches, side by side in one run (issue 32):

  torch_fd    torch's default: file_descriptor sharing strategy
  torch_fs    torch's file_system strategy (files in /dev/shm)
  shm_new     a new multiprocessing.shared_memory segment per batch
  shm_ring    four reused shared_memory segments per worker (no return path:
              the physical anchor, not a safe loader)
  vmmipc      DataLoader(..., **vmmipc.torch.loader_options())
  memcpy      one process copying the batch into a reused buffer (the floor)

Each batch is one float32 tensor (64 x 3 x 224 x 224 = 38.5 MB, or 4 KiB with
--small); 2 workers, fork; the main process touches (reads one float per 4 KiB
page) or sums each batch; rounds interleave the modes; medians of batches/s.
Also: the main process's descriptors (max over the run minus before the
first batch) and the many-tensors failure case (5 tensors of 16 floats per
sample, batch 8, 4 workers, the main keeping its last 1100 batches) at
RLIMIT_NOFILE 1024 and 64, each in a process of its own.

    python bench/dataloader_bench.py [--rounds 3] [--batches 60] [--small-batches 2000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import vmmipc.torch  # noqa: E402

BIG = (3, 224, 224)
SMALL = (16,)
BATCH = 64


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Samples(Dataset):
    def __init__(self, n: int, shape):
        self.n, self.x = n, torch.rand(shape)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.x


# ------------------------------------------------------ shared_memory ways

class ShmNew:
    """collate_fn: a new segment per batch; the main unlinks it."""

    def __call__(self, batch):
        from multiprocessing import resource_tracker, shared_memory
        t = torch.stack(batch)
        shm = shared_memory.SharedMemory(create=True, size=t.numel() * 4)
        resource_tracker.unregister(shm._name, "shared_memory")  # the main unlinks it
        torch.frombuffer(shm.buf, dtype=torch.float32).copy_(t.view(-1))
        name, shape = shm.name, tuple(t.shape)
        shm.close()
        return ("new", name, shape)


class ShmRing:
    """collate_fn: four reused segments per worker, stacked into in place."""
    ring: list = []
    i = 0

    def __call__(self, batch):
        from multiprocessing import resource_tracker, shared_memory
        shape = (len(batch),) + tuple(batch[0].shape)
        n = 4 * int(torch.tensor(shape).prod())
        if not ShmRing.ring:
            for _ in range(4):
                s = shared_memory.SharedMemory(create=True, size=n)
                resource_tracker.unregister(s._name, "shared_memory")  # the main unlinks
                ShmRing.ring.append(s)
        s = ShmRing.ring[ShmRing.i % 4]
        ShmRing.i += 1
        torch.stack(batch, out=torch.frombuffer(s.buf, dtype=torch.float32).view(shape))
        return ("ring", s.name, shape)


_attached: dict = {}


def shm_tensor(item):
    from multiprocessing import shared_memory
    kind, name, shape = item
    if kind == "ring":
        s = _attached.get(name)
        if s is None:
            s = _attached[name] = shared_memory.SharedMemory(name=name)
        return torch.frombuffer(s.buf, dtype=torch.float32).view(shape), None
    s = shared_memory.SharedMemory(name=name)
    return torch.frombuffer(s.buf, dtype=torch.float32).view(shape), s


def shm_cleanup():
    for s in _attached.values():
        s.close()
        s.unlink()
    _attached.clear()


# ------------------------------------------------------------------ runs

def consume(t, op):
    if op == "touch":
        return float(t.view(-1)[::1024].sum())
    return float(t.sum())


WARM = 8  # batches before the clock starts: every way's first blocks or segments fault in


def run_loader(mode: str, op: str, shape, batches: int) -> tuple[float, int]:
    """batches/s over `batches` batches (after WARM), and the main's
    descriptors at most above where they were after the first batch."""
    opts = {}
    if mode in ("torch_fd", "torch_fs"):
        torch.multiprocessing.set_sharing_strategy(
            "file_descriptor" if mode == "torch_fd" else "file_system")
    elif mode == "shm_new":
        opts["collate_fn"] = ShmNew()
    elif mode == "shm_ring":
        opts["collate_fn"] = ShmRing()
    elif mode == "vmmipc":
        opts.update(vmmipc.torch.loader_options())
    loader = DataLoader(Samples((batches + WARM) * BATCH, shape), batch_size=BATCH,
                        num_workers=2, **opts)
    start_fds = None
    it = iter(loader)
    peak = 0
    t0 = None
    for i, b in enumerate(it):
        if mode.startswith("shm"):
            b, seg = shm_tensor(b)
        else:
            seg = None
        consume(b, op)
        del b
        if seg is not None:
            seg.close()
            seg.unlink()
        if start_fds is None:
            start_fds = fds()
        peak = max(peak, fds() - start_fds)
        if i == WARM - 1:
            t0 = time.perf_counter()
    n = i - (WARM - 1)
    rate = n / (time.perf_counter() - t0)
    del it
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    shm_cleanup()
    return rate, peak


def run_memcpy(op: str, shape, batches: int) -> tuple[float, int]:
    src = torch.rand((BATCH,) + tuple(shape))
    dst = torch.empty_like(src)
    dst.copy_(src)
    t0 = time.perf_counter()
    for _ in range(batches):
        dst.copy_(src)
        consume(dst, op)
    return batches / (time.perf_counter() - t0), 0


MODES = ["torch_fd", "torch_fs", "shm_new", "shm_ring", "vmmipc", "memcpy"]


def table(shape, batches: int, rounds: int) -> dict:
    results = {(m, op): [] for m in MODES for op in ("touch", "sum")}
    peaks = {m: 0 for m in MODES}
    for r in range(rounds):
        for op in ("touch", "sum"):
            for m in MODES:
                if m == "memcpy":
                    rate, peak = run_memcpy(op, shape, batches)
                else:
                    rate, peak = run_loader(m, op, shape, batches)
                results[(m, op)].append(rate)
                peaks[m] = max(peaks[m], peak)
                print(f"  round {r + 1} {op:5s} {m:9s} {rate:8.1f} batches/s  "
                      f"main fds +{peak}", flush=True)
    out = {}
    for m in MODES:
        row = {op: statistics.median(results[(m, op)]) for op in ("touch", "sum")}
        row["fds"] = peaks[m]
        out[m] = row
    return out


def print_table(title: str, out: dict) -> None:
    fd = out["torch_fd"]
    print(f"\n{title}: medians, batches/s (x torch_fd)")
    print(f"{'mode':10s} {'touch':>16s} {'sum':>16s} {'main fds (max above start)':>28s}")
    for m, row in out.items():
        print(f"{m:10s} {row['touch']:8.1f} ({row['touch'] / fd['touch']:5.2f}x) "
              f"{row['sum']:8.1f} ({row['sum'] / fd['sum']:5.2f}x) {row['fds']:>28d}")


# ---------------------------------------------------- the failure case

FAILURE = r"""
import os, resource, sys, collections, json
limit = int(sys.argv[1]); mode = sys.argv[2]; keep = int(sys.argv[3]); total = int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
sys.path.insert(0, sys.argv[5])
import torch, vmmipc.torch
from torch.utils.data import DataLoader, Dataset
class Five(Dataset):
    def __len__(self): return total * 8
    def __getitem__(self, i): return tuple(torch.full((16,), float(i + k)) for k in range(5))
opts = vmmipc.torch.loader_options() if mode == "vmmipc" else {}
loader = DataLoader(Five(), batch_size=8, num_workers=4, **opts)
kept = collections.deque(maxlen=keep)
n = 0; start = None; peak = 0; error = None
try:
    for b in loader:
        if start is None: start = len(os.listdir("/proc/self/fd"))
        assert float(b[4][7, 0]) == float(n * 8 + 7 + 4)
        kept.append(b); n += 1
        peak = max(peak, len(os.listdir("/proc/self/fd")) - start)
except Exception as e:
    error = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
print(json.dumps({"batches": n, "of": total, "fds_above_start": peak, "error": error}))
"""


def failure_case(keep: int, total: int) -> None:
    print(f"\nmany-tensors failure case: 5 tensors of 16 floats per sample, batch 8, 4 workers, "
          f"fork, the main keeping its last {keep} batches, {total} batches")
    py = os.path.join(os.path.dirname(HERE), "python")
    for limit in (1024, 64):
        for mode in ("torch_fd", "vmmipc"):
            r = subprocess.run([sys.executable, "-c", FAILURE, str(limit), mode, str(keep),
                                str(total), py], capture_output=True, text=True, timeout=600)
            line = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else r.stderr[-300:]
            print(f"  RLIMIT_NOFILE {limit:4d} {mode:8s} {line}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--small-batches", type=int, default=2000)
    ap.add_argument("--keep", type=int, default=1100)
    ap.add_argument("--total", type=int, default=1300)
    a = ap.parse_args()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, python {sys.version.split()[0]}")
    print(f"\n38.5 MB batches (64 x 3 x 224 x 224 float32), {a.batches} batches per run:")
    big = table(BIG, a.batches, a.rounds)
    print(f"\n4 KiB batches (64 x 16 float32), {a.small_batches} batches per run:")
    small = table(SMALL, a.small_batches, a.rounds)
    print_table("38.5 MB batches", big)
    print_table("4 KiB batches", small)
    failure_case(a.keep, a.total)
    print("\n" + json.dumps({"big": big, "small": small}))


if __name__ == "__main__":
    main()
