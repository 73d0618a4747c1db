#!/usr/bin/env bash
# The first-transfer schedule experiment, side by side in one run: the
# driver floor, then a fresh receiver's first transfer under each schedule
# (overlap at several windows; VMMIPC_SCHEDULE=turns:B, where the two sides
# take turns in batches of B chunks), at N = 4096 x 2 MiB and N = 410 x 20 MiB.
#
#   bench/schedules.sh [REPEAT]      (default 7 timed runs per row)
#
# Needs build/libvmmipc.so; CUDA when a GPU is usable, else host memory.
# Prints one JSON line per run, then a table of medians (ms and x floor).
set -euo pipefail
cd "$(dirname "$0")/.."
REPEAT=${1:-7}
BUILD=${BUILD:-build}
CC=${CC:-cc}
BENCH=$BUILD/vmmipc_bench
$CC -O2 -Wall -o "$BENCH" bench/vmmipc_bench.c -I"$BUILD/include" -L"$BUILD" -lvmmipc -lpthread -ldl -lm \
  -Wl,-rpath,'$ORIGIN'
MEM=--host
"$BENCH" --probe >/dev/null 2>&1 && MEM=--cuda
RAW=$(mktemp)
run() { # label env... -- args...
  local label=$1
  shift
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" VMMIPC_BENCH_SCHEDULE="$label" "$BENCH" $MEM "$@" | tee -a "$RAW"
}
for cfg in 4096:$((2 << 20)) 410:$((20 << 20)); do
  n=${cfg%%:*} size=${cfg##*:}
  c=(--chunks "$n" --chunk-size "$size")
  run floor -- "${c[@]}" --floor --repeat 3
  run overlap -- "${c[@]}" --first 16,64 --repeat "$REPEAT" --fd-runs 0
  for b in 256 1024 "$n"; do
    run "turns:$b" VMMIPC_SCHEDULE=turns:$b -- "${c[@]}" --first 16 --repeat "$REPEAT" --fd-runs 1
  done
done
python3 - "$RAW" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for n in sorted({r["N"] for r in rows}, reverse=True):
    rs = [r for r in rows if r["N"] == n]
    floor = statistics.median(r["floor_ms"] for r in rs if r["approach"] == "floor")
    print(f"\nN = {n} x {rs[0]['chunk_size'] >> 20} MiB: floor {floor:.1f} ms (median of 3)")
    groups = {}
    for r in rs:
        if r["approach"] == "first" and r.get("ok") and not r.get("sampled"):
            groups.setdefault((r["schedule"], r["window"]), []).append(r["ms"])
    for (sched, w), ms in sorted(groups.items()):
        med = statistics.median(ms)
        print(f"  {sched:>12} window {w:>4}: {med:7.1f} ms  ({min(ms):.1f}-{max(ms):.1f}, {len(ms)} runs)  {med / floor:.2f} x floor")
    for r in rs:
        if r["approach"] == "first" and r.get("sampled"):
            print(f"  {r['schedule']:>12} peak fds sender/receiver: {r.get('peak_fds_sender')}/{r.get('peak_fds_receiver')}")
PY
