#!/usr/bin/env bash
# Runs the whole benchmark: for each N, the driver floor, libvmmipc with
# window 1, the default window (and a window sweep at N = 4096), the
# all-at-once reproduction, and the limit runs with the receiver at
# RLIMIT_NOFILE = 1024; then tables and a plot.
#
#   bench/run.sh [--host] [--out DIR (build/bench)] [--ns "64 512 4096 16384"]
#
# Uses the GPU when one is usable, else (or with --host) the host-memory
# variant: memfd chunks of 64 KiB, same processes and same measurements, no
# CUDA. Needs build/libvmmipc.so (make lib). Writes DIR/raw.jsonl (one JSON
# object per measurement), DIR/log.txt, DIR/tables.md, DIR/results.md and,
# when matplotlib is installed, DIR/plot.png. COMMIT in the environment is
# recorded when this tree has no git metadata.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
CC=${CC:-cc}
PYTHON=${PYTHON:-python3}
OUT_DIR=${BUILD}/bench
NS="64 512 4096 16384"
HOST=0
while [ $# -gt 0 ]; do
  case $1 in
    --host) HOST=1 ;;
    --out) OUT_DIR=$2; shift ;;
    --ns) NS=$2; shift ;;
    *) echo "usage: bench/run.sh [--host] [--out DIR] [--ns \"64 512 4096 16384\"]" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT_DIR"
RAW=$OUT_DIR/raw.jsonl LOG=$OUT_DIR/log.txt
: >"$RAW"; : >"$LOG"

[ -f "$BUILD/libvmmipc.so" ] || { echo "bench: $BUILD/libvmmipc.so is missing: run make lib first" >&2; exit 1; }
BENCH=$BUILD/vmmipc_bench
if [ ! -x "$BENCH" ] || [ bench/vmmipc_bench.c -nt "$BENCH" ] || [ tests/c/cuda_dlopen.h -nt "$BENCH" ]; then
  $CC -O2 -Wall -o "$BENCH" bench/vmmipc_bench.c -I"$BUILD/include" -L"$BUILD" -lvmmipc -lpthread -ldl \
    -Wl,-rpath,'$ORIGIN'
fi

MEM=--cuda PYMEM=
if [ $HOST = 1 ] || ! "$BENCH" --probe; then
  echo "bench: no usable GPU here (or --host): running the host-memory variant (memfd chunks of 64 KiB);" \
    "the CUDA measurements are skipped" | tee -a "$LOG"
  MEM=--host PYMEM=--host
fi
DEFAULT_WINDOW=$(sed -n 's/^const DefaultWindow = \([0-9]*\).*/\1/p' core/stream.go)

note() { echo "bench: $*" | tee -a "$LOG" >&2; }
bench() { note "vmmipc_bench $*"; "$BENCH" $MEM "$@" >>"$RAW" 2>>"$LOG" || note "vmmipc_bench $* failed (status $?)"; }
allatonce() {
  note "allatonce.py $*"
  PYTHONUNBUFFERED=1 $PYTHON bench/allatonce.py $PYMEM "$@" >>"$RAW" 2>>"$LOG" || note "allatonce.py $* failed (status $?)"
}

START=$(date +%s)
for n in $NS; do
  windows=1,0 repeat=3
  [ "$n" = 4096 ] && windows=1,0,2,4,8,32,64
  [ "$n" -ge 16384 ] && repeat=2
  # With the descriptor samplers (peak fds), then without them (time: the
  # samplers spin on /proc/self/fd in both processes).
  bench --chunks "$n" --windows "$windows" --repeat $repeat
  VMMIPC_BENCH_NO_SAMPLER=1 bench --chunks "$n" --no-floor --windows "$windows" --repeat $repeat
  allatonce --chunks "$n"
done
# Where the time goes: libvmmipc calls the driver through a timing shim.
if [ "$MEM" = --cuda ]; then
  $CC -O2 -Wall -shared -fPIC -o "$BUILD/libcuda_timing.so" bench/cuda_timing_shim.c -ldl -lpthread
  for w in 0 1; do
    VMMIPC_LIBCUDA=$PWD/$BUILD/libcuda_timing.so VMMIPC_BENCH_NO_SAMPLER=1 bench --chunks 4096 --no-floor --windows $w
  done
fi
# The limit table: the receiver at the common default RLIMIT_NOFILE of 1024.
largest=${NS##* }
bench --chunks "$largest" --no-floor --windows 0 --nofile 1024
for n in $NS; do
  if [ "$n" -ge 512 ] && [ "$n" -le 4096 ]; then allatonce --chunks "$n" --nofile 1024; fi
done
note "measurements took $(( $(date +%s) - START )) s"

if command -v go >/dev/null 2>&1; then
  note "go test -bench HostImport ./core"
  go test -run '^$' -bench HostImport -benchmem -count=1 ./core 2>&1 | tee "$OUT_DIR/go_bench.txt" >>"$LOG" || true
fi

$PYTHON bench/plot.py "$RAW" --md "$OUT_DIR/tables.md" --png "$OUT_DIR/plot.png" --default-window "$DEFAULT_WINDOW" \
  >/dev/null 2>>"$LOG" || note "plot.py failed (see $LOG)"

if commit=$(git rev-parse --verify -q HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain 2>/dev/null)" ] || commit="$commit dirty"
else
  commit=${COMMIT:-unknown}
fi
{
  echo "# libvmmipc benchmark, $(date -u +%Y-%m-%d) ($([ "$MEM" = --cuda ] && echo CUDA || echo host memory))"
  echo
  echo "- commit: $commit"
  echo "- command: bench/run.sh $([ $HOST = 1 ] && echo --host) --ns \"$NS\""
  echo "- machine: $(uname -srm); $(nproc) CPUs; RLIMIT_NOFILE $(ulimit -Sn)/$(ulimit -Hn)"
  if [ "$MEM" = --cuda ] && command -v nvidia-smi >/dev/null 2>&1; then
    echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  fi
  echo "- default window: $DEFAULT_WINDOW"
  echo
  cat "$OUT_DIR/tables.md" 2>/dev/null || true
  echo
  echo "## Raw output"
  echo
  echo '```'
  cat "$RAW"
  echo '```'
  if [ -f "$OUT_DIR/go_bench.txt" ]; then
    echo; echo "## Go host-path benchmark"; echo; echo '```'; cat "$OUT_DIR/go_bench.txt"; echo '```'
  fi
} >"$OUT_DIR/results.md"
note "wrote $OUT_DIR/results.md"
