"""Turns the benchmark's JSON lines into the result tables and the plot.

    python3 bench/plot.py RAW.jsonl [--md TABLES.md] [--console] [--png PLOT.png]
                          [--default-window W]

RAW.jsonl holds what bench/vmmipc_bench.c, bench/allatonce.py,
bench/pypath.py and bench/hostrows.py printed. Times are medians over the runs that had no
descriptor sampler running (where there are some), peak descriptors the
largest seen in the sampled runs. --md writes Markdown tables (for
results.md), --console prints a plain-text table, --png draws the plot
(needs matplotlib).
"""

import argparse
import json
import statistics
import sys
import textwrap
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


def fmt(x, digits=1):
    if x is None:
        return "–"
    if isinstance(x, float) and digits and abs(x) < 10 ** -digits * 5 and x != 0:
        return f"{x:.2g}"  # a cache hit of 0.04 ms must not read as 0.0
    return f"{x:.{digits}f}"


def size_name(b):
    return f"{b >> 20} MiB" if b >= 1 << 20 and b % (1 << 20) == 0 else f"{b >> 10} KiB"


def config_name(n, chunk):
    total = n * chunk
    return f"N = {n} × {size_name(chunk)} ({total / (1 << 30):.1f} GiB)"


class Row:
    """One line of the main table: what it measures and its runs."""

    def __init__(self, key, label, kind):
        self.key, self.label, self.kind = key, label, kind
        self.runs = []

    def _timed(self):
        ok = [r for r in self.runs if r.get("ok")]
        unsampled = [r for r in ok if r.get("sampled") is False]
        return unsampled or ok

    def times(self):
        k = "floor_ms" if self.kind == "floor" else "ms"
        return [r[k] for r in self._timed() if isinstance(r.get(k), (int, float))]

    @property
    def ms(self):
        t = self.times()
        return statistics.median(t) if t else None

    def fds(self, side):
        if self.kind == "floor":
            vals = [r.get("export_held_fds" if side == "sender" else "held_fds") for r in self.runs if r.get("ok")]
        else:
            vals = [r.get(f"peak_fds_{side}") for r in self.runs if r.get("ok") and r.get("sampled") is not False]
        vals = [v for v in vals if isinstance(v, int)]
        return max(vals) if vals else None

    @property
    def ok(self):
        return sum(1 for r in self.runs if r.get("ok"))

    @property
    def errors(self):
        return sorted({r.get("error") or "failed without a message" for r in self.runs if not r.get("ok")})


def classify(r, host, default_window):
    """(sort key, key, label, kind) of a raw row in the main table, or None
    for rows reported apart (profile, limit runs) or not at all (round 0 of
    a repeated session: a first transfer, which the first-transfer rows
    cover)."""
    a = r.get("approach")
    if r.get("nofile") or r.get("profiled") or a == "driver_profile":
        return None
    sched = r.get("schedule", "")
    in_sched = f", schedule {sched}" if sched else ""
    if a == "floor":
        return ((0,), "floor", "floor (dup + mmap, no transport)" if host else "floor (driver only, no transport)",
                "floor")
    if a == "first":
        w = r.get("window") or 0
        wl = f"window {w}" if w else f"window {default_window} (default)"
        # Schedules stay in the order bench/run.sh ran them (the sort is stable).
        return ((1, sched != "", w != 0, w), f"first/{sched}/{w}", f"first transfer, {wl}{in_sched}", "first")
    if a == "repeated":
        if r.get("round", 0) == 0:
            return None
        if r.get("cache"):
            return ((2, sched), f"hit/{sched}", f"repeated transfer, cache hit{in_sched}", "hit")
        return ((3, sched), f"nocache/{sched}", f"repeated transfer, cache off{in_sched}", "nocache")
    if a == "allatonce":
        return ((4,), "allatonce", "all-at-once (DupFd)" if host else "all-at-once (DupFd, cuda.core's way)", "allatonce")
    if a == "hostrows":
        way = HOST_WAYS.get(r.get("path"))
        if way is None:
            return None
        order, name = way
        if r.get("send") == 1:
            return ((8, order), f"host/{r['path']}/{bool(r.get('again'))}/cold",
                    f"{name} + Queue, first send (fresh child{', the same buffer after' if r.get('again') else ''})",
                    "hostrow")
        what = ("the same buffer again" + (" (import-cache hit)" if r["path"] == "hostbuffer" else "")
                if r.get("again") else "a new buffer each send")
        return ((7, bool(r.get("again")), order), f"host/{r['path']}/{bool(r.get('again'))}",
                f"{name} + Queue, {what}", "hostrow")
    if a == "python":
        what = "HostBuffer" if r.get("path") == "hostbuffer+queue" else "share"
        if r.get("send") == 1:
            return ((5,), "py1", f"Python {what} + Queue, first send", "python")
        return ((6,), "py2", f"Python {what} + Queue, later sends (cache hit)", "pyhit")
    return None


# The host rows' ways (bench/hostrows.py): table order and name.
HOST_WAYS = {"hostbuffer": (0, "vmmipc.HostBuffer"), "sharedmemory": (1, "SharedMemory"),
             "bytes": (2, "pickled bytes")}


def host_target(by_config):
    """The host rows' target, in words: HostBuffer <= 1.5 x SharedMemory at
    1 GiB, a new buffer each send and the same one again (warm sends)."""
    lines = []
    for (n, chunk), rs in by_config.items():
        by_key = {r.key: r for r in rs}
        for again, what in ((False, "a new buffer each send"), (True, "the same buffer again")):
            hb, shm = by_key.get(f"host/hostbuffer/{again}"), by_key.get(f"host/sharedmemory/{again}")
            if not (hb and shm and hb.ms and shm.ms):
                continue
            x = hb.ms / shm.ms
            fds = max(v for v in (hb.fds("sender"), hb.fds("receiver"), 0) if v is not None)
            lines.append(f"{config_name(n, chunk)}, {what}: HostBuffer <= 1.5 x SharedMemory: "
                         f"{'met' if x <= 1.5 else 'missed'} ({x:.2f} x: {fmt(hb.ms, 3)} ms against "
                         f"{fmt(shm.ms, 3)} ms; HostBuffer peak extra fds {fds})")
    return lines


def row_notes(host):
    """What each row of the main table measures, in words."""
    floor = ("floor: the sender dups the memfd N times, the N descriptors are handed over untimed, the receiver "
             "mmaps each into one reserved range; floor = both timed parts, no transport") if host else \
        ("floor: the sender exports all N chunks (cuMemExportToShareableHandle) in one thread, the N descriptors "
         "are handed over untimed, the receiver imports, maps and releases each and sets access once; floor = "
         "both timed parts, no transport")
    return [
        floor,
        "first transfer: a fresh receiver process's vmmipc_import_stream, from call to return (registration before)",
        "repeated transfer, cache hit: the receiver imported this buffer before and unmapped it (it stays cached); "
        "the sender keeps an anchor registration (uses = 0) and sends a new vmmipc_register_again ticket; the time "
        "of the next vmmipc_import_stream (every later import, checked to be a cache hit)",
        "repeated transfer, cache off: the same with VMMIPC_IMPORT_NO_CACHE: every import maps anew "
        "(the second and later imports of one receiver process)",
        "all-at-once: every descriptor exported up front and passed through a multiprocessing Queue as DupFd, "
        "the receiver maps all (bench/allatonce.py); from the first export to the last mapping",
        ("Python: a vmmipc.HostBuffer put on a multiprocessing Queue to a spawned child" if host else
         "Python: vmmipc.share (once, uses = 0) and vmmipc.register_again per send, the ticket put on a "
         "multiprocessing Queue to a spawned child, vmmipc.import_stream there") +
        "; from the sender's call to the child's import return (bench/pypath.py)",
        "host rows: 1 GiB into a spawned child through a multiprocessing Queue (bench/hostrows.py), from the "
        "sender's put() to the return of the child's get() (unpickled: mapped, or copied); a vmmipc.HostBuffer "
        "(2 MiB chunks), a multiprocessing.shared_memory.SharedMemory, or the bytes pickled; a new object each "
        "send, or the same one every send; first sends (a fresh child) apart; children at RLIMIT_NOFILE 64",
        "ms: median of the timed runs (no descriptor sampler running); fds: the most extra descriptors a sampler "
        "saw in either process during the transfer (the floor and all-at-once hold all N by construction; the "
        "Python rows are sampled about every millisecond)",
    ]


def main_rows(rows, host, default_window):
    """{(N, chunk_size): [Row, ...]} in table order."""
    by_config = defaultdict(dict)
    for r in rows:
        c = classify(r, host, default_window)
        if c is None or "N" not in r:
            continue
        order, key, label, kind = c
        cfg = by_config[(r["N"], r["chunk_size"])]
        if key not in cfg:
            cfg[key] = (order, Row(key, label, kind))
        cfg[key][1].runs.append(r)
    return {cfg: [row for _, row in sorted(d.values(), key=lambda x: x[0])]
            for cfg, d in sorted(by_config.items(), key=lambda kv: -kv[0][0])}


def floor_ms(rows_of_config):
    return next((r.ms for r in rows_of_config if r.kind == "floor"), None)


def spread(row):
    t = row.times()
    return f"{fmt(min(t))}–{fmt(max(t))}" if len(t) > 1 else ""


def table_lines(rows_of_config, n):
    """(header, [cells]) of one configuration's main table."""
    floor = floor_ms(rows_of_config)
    head = ["row", "ms", "range ms", "µs/chunk", "× floor", "fds sender/receiver", "runs ok"]
    body = []
    for row in rows_of_config:
        ms = row.ms
        fds = f"{fmt(row.fds('sender'), 0)} / {fmt(row.fds('receiver'), 0)}"
        digits = 3 if row.kind in ("hit", "pyhit", "hostrow") else 1
        body.append([row.label, fmt(ms, digits), spread(row), fmt(ms * 1e3 / n if ms is not None else None, 2 if digits == 3 else 1),
                     fmt(ms / floor if ms is not None and floor else None, 3 if digits == 3 else 2), fds,
                     f"{row.ok}/{len(row.runs)}"])
        for e in row.errors:
            body.append(["  ↳ failed: " + e.strip().splitlines()[-1][:300], "", "", "", "", "", ""])
    return head, body


def markdown_table(head, body):
    out = ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    out += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in body]
    return out


def text_table(head, body):
    cells_only = [cells for cells in body if not cells[0].startswith("  ↳")]  # failure lines run on unaligned
    widths = [max([len(h)] + [len(cells[i]) for cells in cells_only]) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    out = [line(head), "  ".join("-" * w for w in widths)]
    for cells in body:
        out.append(cells[0] if cells[0].startswith("  ↳") else line(cells))
    return out


def sweep_table(rows, default_window):
    """Every first-transfer configuration (schedule × window) at the N with the
    most of them: the schedule variants of bench/run.sh side by side."""
    groups = defaultdict(list)
    for r in rows:
        if r.get("approach") == "first" and not r.get("nofile") and not r.get("profiled"):
            groups[(r["N"], r["chunk_size"])].append(r)
    if not groups:
        return []
    (n, chunk), rs = max(groups.items(), key=lambda kv: len({(r.get("schedule", ""), r.get("window")) for r in kv[1]}))
    confs = sorted({(r.get("schedule", ""), r.get("window") or 0) for r in rs}, key=lambda c: (c[0], c[1] or default_window))
    if len({sched for sched, _ in confs}) < 2:
        return []  # windows alone: the main table has them
    floors = [r["floor_ms"] for r in rows if r.get("approach") == "floor" and r.get("N") == n
              and r.get("chunk_size") == chunk and r.get("ok")]
    floor = statistics.median(floors) if floors else None
    md = ["", f"First transfer by schedule and window, {config_name(n, chunk)} (window 0 in the raw output is "
          f"the default, {default_window}):", "",
          "| schedule | window | ms (median) | range | × floor | peak extra fds sender / receiver | timed runs |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for sched, w in confs:
        row = Row("", "", "first")
        row.runs = [r for r in rs if r.get("schedule", "") == sched and (r.get("window") or 0) == w]
        ms = row.ms
        md.append(f"| {sched or 'library default'} | {w or f'{default_window} (default)'} | {fmt(ms)} | {spread(row)} | "
                  f"{fmt(ms / floor if ms and floor else None, 3)} | {fmt(row.fds('sender'), 0)} / "
                  f"{fmt(row.fds('receiver'), 0)} | {len(row.times())} |")
    return md


def floor_detail(rows, host):
    fl = defaultdict(list)
    for r in rows:
        if r.get("approach") == "floor" and r.get("ok"):
            fl[(r["N"], r["chunk_size"])].append(r)
    if not fl:
        return []
    md = ["", "The floor in detail (µs per chunk, median; one thread, no transport):", ""]
    if host:
        md += ["| configuration | dup | fstat | mmap | unmap |", "|---|---:|---:|---:|---:|"]
    else:
        md += ["| configuration | export | import | map+release | set access (whole range) | import, sender exporting "
               "meanwhile | export while receiver imports | export 1 thread → 8 threads | unmap+free |",
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (n, chunk), rs in sorted(fl.items(), key=lambda kv: -kv[0][0]):
        def u(k):
            v = [r[k] for r in rs if isinstance(r.get(k), (int, float))]
            return fmt(statistics.median(v) * 1e3 / n) if v else "–"
        contended = fmt(statistics.median(r["contended_export_us_per_chunk"] for r in rs))
        if host:
            md.append(f"| {config_name(n, chunk)} | {u('export_ms')} | {u('import_only_ms')} | {u('map_release_ms')} | "
                      f"{u('unmap_ms')} |")
        else:
            md.append(f"| {config_name(n, chunk)} | {u('export_ms')} | {u('import_only_ms')} | {u('map_release_ms')} | "
                      f"{u('set_access_ms')} | {u('contended_import_ms')} | {contended} | "
                      f"{u('export_1thread_ms')} → {u('export_8threads_ms')} | {u('unmap_ms')} |")
    return md


SENDER_TRANSFER_CALLS = ("cuMemExportToShareableHandle", "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2")
RECEIVER_AFTER_CALLS = ("cuMemUnmap", "cuMemAddressFree")  # vmmipc_unmap, after the timed import


def profile_table(rows, default_window):
    """Where the time of a profiled transfer goes: each process's time inside
    the driver (bench/cuda_timing_shim.c) against the receiver's wall time.
    The shim prints at process exit, so both processes' lines follow the
    transfer's row: the receiver's first (it exits at the end of its
    session), the sender's when the bench exits."""
    md = []
    for k, r in enumerate(rows):
        if not (r.get("approach") == "first" and r.get("profiled") and r.get("ok")):
            continue
        recv = next((p for p in rows[k + 1:] if p.get("approach") == "driver_profile"
                     and "--recv-imports" in p["cmdline"]), None)
        send = next((p for p in rows[k + 1:] if p.get("approach") == "driver_profile"
                     and "--recv-imports" not in p["cmdline"]), None)
        if not recv or not send:
            continue
        n, wall = r["N"], r["ms"]
        rc = {c: v for c, v in recv["calls"].items() if c not in RECEIVER_AFTER_CALLS and v[0]}
        sc = {c: v for c, v in send["calls"].items() if c in SENDER_TRANSFER_CALLS and v[0]}
        r_ms, s_ms = sum(v[1] for v in rc.values()), sum(v[1] for v in sc.values())
        if not md:
            md += ["", "Where the time goes (one first transfer, libvmmipc calling the driver through "
                   "bench/cuda_timing_shim.c; µs per chunk, calls under 0.5 µs/chunk left out):", "",
                   "| configuration | window | receiver wall | sender in driver | receiver in driver | receiver outside "
                   "the driver (waiting for chunks, transport) | calls |",
                   "|---|---:|---:|---:|---:|---:|---|"]
        calls = "; ".join(f"{side} {c.replace('cuMem', '').replace('_v2', '')} {v[1] * 1e3 / n:.1f}"
                          for side, d in (("sender", sc), ("receiver", rc)) for c, v in d.items() if v[1] * 1e3 / n >= 0.5)
        md.append(f"| {config_name(n, r['chunk_size'])} | {r['window'] or default_window} | {wall * 1e3 / n:.1f} | "
                  f"{s_ms * 1e3 / n:.1f} | {r_ms * 1e3 / n:.1f} | {(wall - r_ms) * 1e3 / n:.1f} | {calls} |")
    return md


def python_detail(rows):
    """Each send of the Python path: where its time goes."""
    py = [r for r in rows if r.get("approach") == "python"]
    if not py:
        return []
    md = ["", "The Python path, send by send (end to end: the sender's call to the child's import return; "
          "the child's vmmipc.import_stream alone, CUDA only; the sender's registering, CUDA only):", "",
          "| configuration | send | end to end ms | child's import ms | sender's share / register_again ms | "
          "fds sender / receiver | cache | result |", "|---|---:|---:|---:|---:|---:|---|---|"]
    for r in py:
        cache = "hit" if r.get("cache_hits") else "miss" if r.get("cache_misses") else "–"
        res = "ok" if r.get("ok") else "FAILED: " + (r.get("error") or "").strip().splitlines()[-1][:200]
        md.append(f"| {config_name(r['N'], r['chunk_size'])} | {r['send']} | {fmt(r.get('ms'), 3)} | "
                  f"{fmt(r.get('import_ms'), 3)} | {fmt(r.get('register_ms'), 3)} | "
                  f"{fmt(r.get('peak_fds_sender'), 0)} / {fmt(r.get('peak_fds_receiver'), 0)} | {cache} | {res} |")
    return md


def limit_table(rows, default_window):
    lim = [r for r in rows if r.get("nofile") and r.get("approach") in ("first", "allatonce")]
    if not lim:
        return []
    md = ["", f"Receiver at RLIMIT_NOFILE = {lim[0]['nofile']} (soft):", "",
          "| approach | configuration | result | peak extra fds receiver | what the user sees |", "|---|---|---|---:|---|"]
    for r in lim:
        lab = "all-at-once" if r["approach"] == "allatonce" else f"libvmmipc first transfer, window {r.get('window') or default_window}"
        md.append(f"| {lab} | {config_name(r['N'], r['chunk_size'])} | {'ok' if r.get('ok') else 'FAILS'} | "
                  f"{fmt(r.get('peak_fds_receiver'), 0)} | {(r.get('error') or '–').strip().splitlines()[-1]} |")
    return md


def targets(by_config, default_window):
    """The GPU targets, in words. Returns plain lines."""
    lines = []
    for (n, chunk), rs in by_config.items():
        name = config_name(n, chunk)
        default = next((r for r in rs if r.key == "first//0"), None)  # the library's default schedule and window
        hit = next((r for r in rs if r.key == "hit/"), None)
        floor = floor_ms(rs)
        if hit and hit.ms is not None:
            lines.append(f"{name}: repeated transfer (cache hit) <= 1 ms: {'met' if hit.ms <= 1 else 'missed'} "
                         f"({fmt(hit.ms, 3)} ms)")
        else:
            lines.append(f"{name}: repeated transfer (cache hit) <= 1 ms: not measured")
        if default and default.ms is not None and floor:
            x = default.ms / floor
            lines.append(f"{name}: first transfer <= 1.10 × floor: {'met' if x <= 1.10 else 'missed'} "
                         f"({x:.2f} ×: {fmt(default.ms)} ms against {fmt(floor)} ms)")
        else:
            lines.append(f"{name}: first transfer <= 1.10 × floor: not measured")
    worst, seen, largest = [], 0, {"sender": 0, "receiver": 0}
    for (n, chunk), rs in by_config.items():
        for r in rs:
            if r.kind not in ("first", "hit", "nocache"):
                continue
            w = int(r.key.rsplit("/", 1)[1]) if r.kind == "first" else 0
            bound = (w or default_window) + 4
            for side in ("sender", "receiver"):
                v = r.fds(side)
                if v is None:
                    continue
                seen += 1
                largest[side] = max(largest[side], v)
                if v > bound:
                    worst.append(f"{r.label} at N = {n}: {side} {v} > {bound}")
    if not seen:
        lines.append("peak extra fds <= window + 4 on either side: not measured")
    else:
        lines.append("peak extra fds <= window + 4 on either side: " +
                     (f"met (every libvmmipc row measured from C; at most {largest['sender']} in the sender, "
                      f"{largest['receiver']} in the receiver)" if not worst else "missed (" + "; ".join(worst) + ")"))
    return lines


HOST_NOTE = ("These are host-memory figures (memfd chunks, no usable GPU here). The targets — repeated transfer "
             "≤ 1 ms, first transfer ≤ 1.10 × floor, peak extra fds ≤ window + 4 — apply to the GPU run (CUDA VMM "
             "memory); they are not checked here.")


def report(rows, default_window):
    """(markdown, console text)."""
    host = all(r.get("memory", "host") == "host" for r in rows if r.get("approach") != "driver_profile")
    by_config = main_rows(rows, host, default_window)
    md, txt = [], []
    for (n, chunk), rs in by_config.items():
        head, body = table_lines(rs, n)
        md += ["", f"### {config_name(n, chunk)}", ""] + markdown_table(head, body)
        txt += ["", config_name(n, chunk)] + text_table(head, body)
    md += ["", "What each row measures:", ""] + [f"- {x}" for x in row_notes(host)]
    txt += ["", "What each row measures:"] + [textwrap.fill(x, 110, initial_indent="  - ", subsequent_indent="    ")
                                              for x in row_notes(host)]
    md += sweep_table(rows, default_window) + floor_detail(rows, host) + profile_table(rows, default_window) \
        + python_detail(rows) + limit_table(rows, default_window)
    ht = host_target(by_config)
    if ht:
        md += ["", "Host rows (target HostBuffer <= 1.5 x SharedMemory at 1 GiB, warm sends):", ""] + \
            [f"- {x}" for x in ht]
        txt += ["", "Host rows (target HostBuffer <= 1.5 x SharedMemory at 1 GiB, warm sends):"] + \
            [f"  {x}" for x in ht]
    if host:
        md += ["", HOST_NOTE]
        txt += ["", textwrap.fill(HOST_NOTE, 110)]
    else:
        t = targets(by_config, default_window)
        md += ["", "Targets (H200, one run):", ""] + [f"- {x}" for x in t]
        txt += ["", "Targets (H200, one run):"] + [f"  {x}" for x in t]
    return "\n".join(md).lstrip("\n") + "\n", "\n".join(txt).lstrip("\n") + "\n", by_config, host


def plot(by_config, host, png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py: matplotlib is not installed; no plot", file=sys.stderr)
        return False
    labels = []
    for rs in by_config.values():
        for r in rs:
            if r.label not in labels:
                labels.append(r.label)
    # Constrained layout leaves room for the figure's title above the panels'
    # titles (tight_layout set the two on top of each other).
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.45 * len(labels) * len(by_config) + 1.8), sharey=True,
                                   layout="constrained")
    height = 0.8 / max(1, len(by_config))
    for k, ((n, chunk), rs) in enumerate(by_config.items()):
        by_label = {r.label: r for r in rs}
        ys = [i + k * height for i, lab in enumerate(labels) if lab in by_label]
        rows = [by_label[lab] for lab in labels if lab in by_label]
        ms = [r.ms for r in rows]
        fds = [None if r.fds("sender") is None and r.fds("receiver") is None
               else max(r.fds("sender") or 0, r.fds("receiver") or 0) for r in rows]
        name = f"N = {n} × {size_name(chunk)}"
        ax1.barh(ys, [v or 0 for v in ms], height, label=name)
        ax2.barh(ys, [v or 0 for v in fds], height, label=name)
        for y, v in zip(ys, ms):  # a row without a value failed: say so on the bar's place
            ax1.text(v or 1e-3, y, " failed" if v is None else f" {v:.3g}" if v < 100 else f" {v:.0f}",
                     va="center", fontsize=7)
        for y, v in zip(ys, fds):
            ax2.text(max(v or 0, 0.5), y, " failed" if v is None else f" {v}", va="center", fontsize=7)
    ax1.set_yticks([i + 0.4 - height / 2 for i in range(len(labels))], labels, fontsize=8)
    ax1.invert_yaxis()
    ax1.set(xscale="log", xlabel="milliseconds (median; log scale)", title="time (lower is better)")
    ax2.set(xscale="symlog", xlabel="peak extra descriptors, larger of the two sides (symlog)",
            title="descriptors held at once")
    for ax in (ax1, ax2):
        ax.grid(True, axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("libvmmipc benchmark, " + ("host memory (memfd chunks; the GPU targets do not apply)" if host
                                            else "CUDA VMM memory"))
    fig.savefig(png, dpi=110)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("raw")
    ap.add_argument("--md", help="write the Markdown tables here")
    ap.add_argument("--console", action="store_true", help="print the plain-text table")
    ap.add_argument("--png", help="draw the plot here (needs matplotlib)")
    ap.add_argument("--default-window", type=int, default=16)
    a = ap.parse_args()
    rows = load(a.raw)
    if not rows:
        sys.exit(f"plot.py: {a.raw} holds no measurements")
    md, txt, by_config, host = report(rows, a.default_window)
    if a.md:
        with open(a.md, "w") as f:
            f.write(md)
    if a.console:
        print(txt, end="")
    if a.png and not plot(by_config, host, a.png):
        sys.exit(2)


if __name__ == "__main__":
    main()
