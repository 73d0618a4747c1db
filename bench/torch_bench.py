#!/usr/bin/env python3
"""A large CUDA tensor to a spawned child, three ways, side by side in one run:

  vmmipc    expandable segments, through vmmipc.torch (no pidfd_getfd)
  torch-es  expandable segments, torch's own CUDA IPC (pidfd_getfd per chunk)
  legacy    the legacy allocator (cudaMalloc), torch's own CUDA IPC (cudaIpc)

For each way and each repetition, a fresh tensor (--gib, default 8 GiB) is
sent three times through a multiprocessing Queue to one spawned child:
"first" (nothing of it in the child yet), "second" (the same tensor again
while the child still holds the first copy) and "again" (the same tensor
after the child dropped what it had; vmmipc's import cache keeps the
mapping). CUDA contexts, libvmmipc and each way's path are warmed up before
anything is timed, with a 64 MiB tensor. The time is from put() in the
parent to the moment the child's tensor is usable (unpickled and the child's
current stream synchronized, i.e. the sender's event waited on), read on
CLOCK_MONOTONIC, which both processes share; the child then checks every
byte, untimed. For vmmipc each send also says whether the child's import
cache missed (mapped anew) or hit: a first send must miss and the others
hit, or the run counts as failed (its numbers would not mean what they say).

    python3 bench/torch_bench.py [--gib 8] [--reps 3]

Run from the repository root after `make lib`, WITHOUT the seccomp filter of
tests/gpu/no_pidfd_getfd (torch-es needs pidfd_getfd; under the filter its
rows say why they failed). Prints a table, then one JSON object per line:
each measurement, then each way's summary.
"""

import argparse
import gc
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "gpu"))
# The GPU tests' helpers: importing them puts this checkout's vmmipc and
# build/libvmmipc.so on the path (the child inherits it).
from _gpu_helpers import chunk_count, set_expandable  # noqa: E402

# Read when CUDA starts, here and in the child; "legacy" switches it off for
# its own allocations only.
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import torch  # noqa: E402

import vmmipc  # noqa: E402

WAYS = ("vmmipc", "torch-es", "legacy")
SENDS = ("first", "second", "again")
MARK_EVERY = 64 << 20  # a marker byte every 64 MiB, the rest is the seed
TIMEOUT = 300


def marks(t, seed):
    """Where the marker bytes are, and what they hold (different per seed)."""
    idx = torch.arange(0, t.numel(), MARK_EVERY, device=t.device)
    return idx, ((idx // MARK_EVERY * 7 + seed + 1) % 256).to(torch.uint8)


def fill(t, seed):
    t.fill_(seed & 0xFF)
    idx, want = marks(t, seed)
    t[idx] = want
    torch.cuda.synchronize()


def count_bad(t, seed):
    """Bytes that differ from what fill(t, seed) wrote (every byte checked)."""
    idx, want = marks(t, seed)
    plain = seed & 0xFF
    off_plain = int((t != plain).sum()) - int((t[idx] != plain).sum())  # outside the marks
    return off_plain + int((t[idx] != want).sum())


class TorchsOwn:
    """Pickles its tensor with torch's own reducer, whatever is registered."""

    def __init__(self, t):
        self.t = t

    def __reduce__(self):
        import torch.multiprocessing.reductions as reductions
        return reductions.reduce_tensor(self.t)


def child(inbox, outbox):
    torch.zeros(1, device="cuda")
    vmmipc.cache_info()  # the library is loaded before anything is timed
    outbox.put(("ready",))
    held = []
    while True:
        try:
            msg = inbox.get()  # the tensor is unpickled (imported) here
        except BaseException as e:  # noqa: BLE001
            outbox.put(("error", "".join(traceback.format_exception_only(e)).strip()))
            continue
        if msg is None:
            return
        op, seed, t = msg
        if op == "drop":
            held.clear()
            gc.collect()
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            outbox.put(("dropped",))
            continue
        torch.cuda.current_stream().synchronize()
        outbox.put(("usable", time.perf_counter(), vmmipc.cache_info().misses))
        held.append(t)
        outbox.put(("checked", count_bad(t, seed)))
        del msg, t


def make_tensor(way, nbytes, seed, vt):
    if way == "legacy":
        set_expandable(False)
    try:
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    finally:
        set_expandable(True)
    vmm = vt.is_vmm_tensor(t)
    if vmm != (way != "legacy"):
        raise RuntimeError(f"{way}: the tensor is {'' if vmm else 'not '}in VMM memory")
    fill(t, seed)
    return t


class Child:
    def __init__(self):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=child, args=(self.inbox, self.outbox))
        self.proc.start()
        self.expect("ready")
        self.misses = 0

    def expect(self, what):
        reply = self.outbox.get(timeout=TIMEOUT)
        if reply[0] == "error":
            raise RuntimeError(f"the child failed to receive: {reply[1]}")
        if reply[0] != what:
            raise RuntimeError(f"the child said {reply!r}, not {what!r}")
        return reply

    def send(self, way, t, seed):
        """Milliseconds from put() to usable in the child, the bad bytes, and
        whether the child's vmmipc import cache missed (mapped anew)."""
        payload = TorchsOwn(t) if way == "torch-es" else t
        t0 = time.perf_counter()
        self.inbox.put(("recv", seed, payload))
        _, usable, misses = self.expect("usable")
        ms = (usable - t0) * 1e3
        mapped = misses != self.misses
        self.misses = misses
        return ms, self.expect("checked")[1], mapped

    def drop(self):
        self.inbox.put(("drop", 0, None))
        self.expect("dropped")

    def stop(self):
        self.inbox.put(None)
        self.proc.join(60)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=8.0, help="tensor size in GiB (default 8)")
    ap.add_argument("--reps", type=int, default=3, help="fresh tensors per way (default 3)")
    args = ap.parse_args()
    import vmmipc.torch as vt
    nbytes = int(args.gib * (1 << 30))
    torch.zeros(1, device="cuda")
    vmmipc.live_registrations()
    print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}, libvmmipc "
          f"{vmmipc.version()}, {args.gib:g} GiB, {args.reps} repetitions", flush=True)

    results = {way: {send: [] for send in SENDS} for way in WAYS}
    errors, chunks, lines = {}, {}, []
    c = Child()
    try:
        for way in WAYS:  # warm-up, untimed
            try:
                t = make_tensor(way, 64 << 20, 1, vt)
                c.send(way, t, 1)
                c.drop()
            except Exception as e:  # noqa: BLE001 - reported in the table
                errors[way] = str(e)
            finally:
                t = None
                gc.collect()
        for rep in range(args.reps):
            for way in WAYS:
                if way in errors:
                    continue
                seed = 10 + rep
                t = make_tensor(way, nbytes, seed, vt)
                if way != "legacy":
                    chunks[way] = chunk_count(t.data_ptr(), t.untyped_storage().nbytes())
                try:
                    for send in SENDS:
                        if send == "again":
                            c.drop()
                        ms, bad, mapped = c.send(way, t, seed)
                        results[way][send].append(ms)
                        line = {"way": way, "rep": rep, "send": send, "gib": args.gib,
                                "ms": round(ms, 3), "bad_bytes": bad}
                        if way == "vmmipc":
                            line["import_cache"] = "miss" if mapped else "hit"
                            if mapped != (send == "first"):
                                errors[way] = (f"the {send} send was an import-cache "
                                               f"{line['import_cache']} (rep {rep})")
                        lines.append(line)
                        if bad:
                            errors[way] = f"{bad} bytes wrong in the child ({send}, rep {rep})"
                    c.drop()
                except Exception as e:  # noqa: BLE001
                    errors[way] = str(e)
                t = None
                gc.collect()
                torch.cuda.synchronize()
                torch.cuda.ipc_collect()  # torch's own path frees sent blocks lazily
                torch.cuda.empty_cache()
    finally:
        c.stop()

    def med(xs):
        return f"{statistics.median(xs):9.2f}" if xs else "        -"

    print()
    print(f"{'way':10} {'chunks':>6}  {'first ms':>9}  {'second ms':>9}  {'again ms':>9}   "
          "(medians; all in the JSON lines)")
    for way in WAYS:
        r = results[way]
        print(f"{way:10} {chunks.get(way, '-'):>6}  {med(r['first'])}  "
              f"{med(r['second'])}  {med(r['again'])}"
              + (f"   FAILED: {errors[way]}" if way in errors else ""))
    print()
    for line in lines:
        print(json.dumps(line))
    for way in WAYS:
        r = results[way]
        print(json.dumps({"way": way, "gib": args.gib, "reps": args.reps,
                          "chunks": chunks.get(way), "error": errors.get(way),
                          **{f"{send}_ms_median": (round(statistics.median(r[send]), 3)
                                                   if r[send] else None) for send in SENDS},
                          **{f"{send}_ms": [round(x, 3) for x in r[send]] for send in SENDS}}))
    return 1 if errors.get("vmmipc") else 0


if __name__ == "__main__":
    sys.exit(main())
