"""Turns the benchmark's JSON lines into Markdown tables and a plot.

    python3 bench/plot.py RAW.jsonl [--md TABLES.md] [--png PLOT.png] [--default-window W]

Every measurement that was repeated is summarised by its median. The plot
(matplotlib, when installed) shows microseconds per chunk and peak extra
descriptors against N, one line per approach.
"""

import argparse
import json
import statistics
import sys
from collections import defaultdict


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    print(f"plot.py: skipping a malformed line: {line[:80]}", file=sys.stderr)
    return rows


def med(rows, key):
    vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    return statistics.median(vals) if vals else None


def fmt(x, digits=1):
    return "–" if x is None else f"{x:.{digits}f}"


def summarise(rows, default_window):
    """Returns {(label, N): summary} for the main approaches, main runs only."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("nofile") or r.get("variant") == "profiled" or r["approach"] == "driver_profile":
            continue  # limit and profile runs are reported apart
        a = r["approach"]
        if a == "floor":
            label = "driver floor"
        elif a == "vmmipc":
            w = r["window"] or default_window
            if w not in (1, default_window):
                continue  # the window sweep has its own table
            label = f"libvmmipc window={w}" + (" (default)" if w == default_window else "")
        else:
            label = "all-at-once (cuda.core way)"
        groups[(label, r["N"])].append(r)
    out = {}
    for (label, n), rs in groups.items():
        ok = [r for r in rs if r.get("ok")]
        if label == "driver floor":
            s = {"ms": med(ok, "floor_ms"), "sender": med(ok, "export_held_fds"), "receiver": med(ok, "held_fds")}
        else:
            # Time from the runs without a descriptor-sampling thread where
            # there are some (the sampler spins on /proc/self/fd in both
            # processes), descriptors from the sampled runs.
            sampled = [r for r in ok if r.get("variant", "") != "unsampled"]
            timed = [r for r in ok if r.get("variant") == "unsampled"] or sampled
            s = {"ms": med(timed, "ms"), "ms_sampled": med(sampled, "ms"), "timed_unsampled": timed is not sampled,
                 "sender": max((r.get("peak_fds_sender", 0) for r in sampled), default=None),
                 "receiver": max((r.get("peak_fds_receiver", 0) for r in sampled), default=None)}
        s["us"] = s["ms"] * 1e3 / n if s["ms"] is not None else None
        s["runs"], s["ok"] = len(rs), len(ok)
        s["errors"] = sorted({r.get("error", "") for r in rs if not r.get("ok")})
        out[(label, n)] = s
    return out


def order(label):
    for i, p in enumerate(["driver floor", "libvmmipc window=1", "libvmmipc window=", "all-at-once"]):
        if label.startswith(p):
            return (i, label)
    return (9, label)


def tables(rows, default_window):
    s = summarise(rows, default_window)
    ns = sorted({n for _, n in s})
    labels = sorted({lab for lab, _ in s}, key=order)
    md = []
    md.append("| approach | N | total ms | µs/chunk | × floor | peak extra fds sender | peak extra fds receiver | runs ok | ms with fd sampler running |")
    md.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in ns:
        floor = s.get(("driver floor", n), {}).get("ms")
        for lab in labels:
            x = s.get((lab, n))
            if not x:
                continue
            ratio = x["ms"] / floor if x["ms"] and floor else None
            fds_note = " (holds all N by construction)" if lab == "driver floor" else ""
            md.append(f"| {lab} | {n} | {fmt(x['ms'])} | {fmt(x['us'])} | {fmt(ratio, 2)} | "
                      f"{fmt(x['sender'], 0)}{fds_note} | {fmt(x['receiver'], 0)} | {x['ok']}/{x['runs']} | "
                      f"{fmt(x.get('ms_sampled')) if lab.startswith('libvmmipc') else ''} |")
            for e in x["errors"]:
                md.append(f"| ↳ failed: {e} | | | | | | | | |")

    # The window sweep.
    sweep, sweep_fds = defaultdict(list), defaultdict(list)
    for r in rows:
        if r["approach"] == "vmmipc" and not r.get("nofile") and r.get("ok") and r.get("variant", "") != "profiled":
            key = (r["N"], r["window"] or default_window)
            (sweep_fds if r.get("variant", "") == "" else sweep)[key].append(r)
    for key, rs in sweep_fds.items():
        sweep.setdefault(key, rs)  # time from sampled runs where no unsampled ones exist
    sweep_ns = sorted({n for n, w in sweep if len({w2 for n2, w2 in sweep if n2 == n}) > 2})
    for n in sweep_ns:
        floor = s.get(("driver floor", n), {}).get("ms")
        md += ["", f"Window sweep at N = {n} (median of the runs; window 0 in the raw output = default {default_window}):", "",
               "| window | total ms | µs/chunk | × floor | peak fds sender | peak fds receiver | runs |",
               "|---:|---:|---:|---:|---:|---:|---:|"]
        for w in sorted({w for n2, w in sweep if n2 == n}):
            rs, fs = sweep[(n, w)], sweep_fds.get((n, w), [])
            ms = med(rs, "ms")
            ps = max((r["peak_fds_sender"] for r in fs), default=None)
            pr = max((r["peak_fds_receiver"] for r in fs), default=None)
            md.append(f"| {w} | {fmt(ms)} | {fmt(ms * 1e3 / n)} | {fmt(ms / floor if floor else None, 3)} | "
                      f"{fmt(ps, 0)} | {fmt(pr, 0)} | {len(rs)} |")

    # What the floor is made of.
    fl = defaultdict(list)
    for r in rows:
        if r["approach"] == "floor" and r.get("ok"):
            fl[r["N"]].append(r)
    if fl:
        md += ["", "The driver floor in detail (µs per chunk, median; one thread, no transport):", "",
               "| N | export | import | map+release | set access (whole range) | import, sender exporting meanwhile | "
               "import-only alone → contended | export while receiver imports | export 1 thread → 8 threads | unmap+free |",
               "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for n in sorted(fl):
            rs = fl[n]
            u = lambda k: fmt(med(rs, k) * 1e3 / n if med(rs, k) is not None else None)  # noqa: E731
            md.append(f"| {n} | {u('export_ms')} | {u('import_only_ms')} | {u('map_release_ms')} | {u('set_access_ms')} | "
                      f"{u('contended_import_ms')} | {u('import_only_ms')} → {u('contended_import_only_ms')} | "
                      f"{fmt(med(rs, 'contended_export_us_per_chunk'))} | {u('export_1thread_ms')} → {u('export_8threads_ms')} | "
                      f"{u('unmap_ms')} |")

    md += profile_table(rows, default_window)

    # The limit table.
    lim = [r for r in rows if r.get("nofile")]
    if lim:
        md += ["", "Receiver limited to RLIMIT_NOFILE = 1024 (soft):", "",
               "| approach | N | result | peak extra fds receiver | what the user sees |", "|---|---:|---|---:|---|"]
        for r in sorted(lim, key=lambda r: (r["approach"], r["N"])):
            lab = "all-at-once" if r["approach"] == "allatonce" else f"libvmmipc window={r.get('window') or default_window}"
            res = "ok" if r.get("ok") else "FAILS"
            md.append(f"| {lab} | {r['N']} | {res} | {r.get('peak_fds_receiver', '–')} | {r.get('error') or '–'} |")
    return s, "\n".join(md) + "\n"


SENDER_TRANSFER_CALLS = ("cuMemExportToShareableHandle", "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2")
RECEIVER_AFTER_CALLS = ("cuMemUnmap", "cuMemAddressFree")  # vmmipc_unmap, after the timed import


def profile_table(rows, default_window):
    """Where the time of a profiled transfer goes: each process's time inside
    the driver (bench/cuda_timing_shim.c) against the receiver's wall time.
    Wall time minus the receiver's driver time is what the receiver spent
    waiting for chunks and in the transport."""
    md = []
    for k, r in enumerate(rows):
        if not (r["approach"] == "vmmipc" and r.get("variant") == "profiled" and r.get("ok")):
            continue
        recv = next((p for p in reversed(rows[:k]) if p["approach"] == "driver_profile" and "--recv-vmmipc" in p["cmdline"]), None)
        send = next((p for p in rows[k + 1:] if p["approach"] == "driver_profile" and "--recv-vmmipc" not in p["cmdline"]), None)
        if not recv or not send:
            continue
        n, wall = r["N"], r["ms"]
        rc = {c: v for c, v in recv["calls"].items() if c not in RECEIVER_AFTER_CALLS and v[0]}
        sc = {c: v for c, v in send["calls"].items() if c in SENDER_TRANSFER_CALLS and v[0]}
        r_ms, s_ms = sum(v[1] for v in rc.values()), sum(v[1] for v in sc.values())
        if not md:
            md += ["", "Where the time goes (one transfer each, libvmmipc calling the driver through "
                   "bench/cuda_timing_shim.c; µs per chunk, calls under 0.5 µs/chunk left out):", "",
                   "| window | N | receiver wall | sender in driver | receiver in driver | receiver outside the driver "
                   "(waiting for chunks, transport) | calls |",
                   "|---:|---:|---:|---:|---:|---:|---|"]
        calls = "; ".join(f"{side} {c.replace('cuMem', '').replace('_v2', '')} {v[1] * 1e3 / n:.1f}"
                          for side, d in (("sender", sc), ("receiver", rc)) for c, v in d.items() if v[1] * 1e3 / n >= 0.5)
        md.append(f"| {r['window'] or default_window} | {n} | {wall * 1e3 / n:.1f} | {s_ms * 1e3 / n:.1f} | "
                  f"{r_ms * 1e3 / n:.1f} | {(wall - r_ms) * 1e3 / n:.1f} | {calls} |")
    return md


def targets(s, default_window):
    """Checks the issue's targets; returns Markdown lines."""
    dlab = f"libvmmipc window={default_window} (default)"
    get = lambda lab, n, k="ms": (s.get((lab, n)) or {}).get(k)  # noqa: E731
    lines = []

    def check(name, ok, detail):
        mark = "met" if ok else ("MISSED" if ok is False else "not measured")
        lines.append(f"- {name}: **{mark}** ({detail})")

    d, f, a = get(dlab, 4096), get("driver floor", 4096), get("all-at-once (cuda.core way)", 4096)
    check("N=4096: libvmmipc default ≤ 1.10 × floor", None if not (d and f) else d / f <= 1.10,
          f"{fmt(d)} ms vs floor {fmt(f)} ms = {fmt(d / f if d and f else None, 3)} ×")
    check("N=4096: libvmmipc default ≤ 0.35 × all-at-once", None if not (d and a) else d / a <= 0.35,
          f"{fmt(d)} ms vs {fmt(a)} ms = {fmt(d / a if d and a else None, 3)} ×")
    u16, u512 = get(dlab, 16384, "us"), get(dlab, 512, "us")
    check("µs/chunk at N=16384 within 10% of N=512", None if not (u16 and u512) else abs(u16 / u512 - 1) <= 0.10,
          f"{fmt(u16)} vs {fmt(u512)} µs/chunk = {fmt(u16 / u512 if u16 and u512 else None, 3)} ×")
    worst = []
    for (lab, n), x in s.items():
        if lab.startswith("libvmmipc") and x["sender"] is not None:
            w = int(lab.split("=")[1].split()[0])
            if x["sender"] > w + 4 or x["receiver"] > w + 4:
                worst.append(f"{lab} N={n}: {x['sender']}/{x['receiver']}")
    check("peak extra fds ≤ window + 4 on each side at every N", not worst, "; ".join(worst) or "every libvmmipc run")
    small = [f"N={n}: {x['receiver']}" for (lab, n), x in s.items()
             if lab.startswith("all-at-once") and x["receiver"] is not None and x["receiver"] < n]
    check("all-at-once holds ≥ N in the receiver", not small, "; ".join(small) or "every N")
    return lines


def plot(s, png, chunk_size):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed; no plot", file=sys.stderr)
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for lab in sorted({lab for lab, _ in s}, key=order):
        pts = sorted((n, x) for (l2, n), x in s.items() if l2 == lab and x["us"] is not None)
        if not pts:
            continue
        ns = [n for n, _ in pts]
        ax1.plot(ns, [x["us"] for _, x in pts], marker="o", label=lab)
        ax2.plot(ns, [max(x["sender"] or 0, x["receiver"] or 0) for _, x in pts], marker="o", label=lab)
    ax1.set(xscale="log", xlabel=f"chunks N ({chunk_size // 1024} KiB each)" if chunk_size < 1 << 20 else f"chunks N ({chunk_size >> 20} MiB each)", ylabel="µs per chunk", title="time per chunk (lower is better)")
    ax1.set_ylim(bottom=0)
    ax2.set(xscale="log", yscale="log", xlabel="chunks N", ylabel="peak extra fds (max of both sides)",
            title="descriptors held at once")
    for ax in (ax1, ax2):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("raw")
    ap.add_argument("--md")
    ap.add_argument("--png")
    ap.add_argument("--default-window", type=int, default=16)
    a = ap.parse_args()
    rows = load(a.raw)
    s, md = tables(rows, a.default_window)
    md += "\nTargets (issue 5):\n\n" + "\n".join(targets(s, a.default_window)) + "\n"
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    print(md)
    if a.png:
        plot(s, a.png, next((r["chunk_size"] for r in rows if "chunk_size" in r), 2 << 20))


if __name__ == "__main__":
    main()
