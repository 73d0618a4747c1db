#!/usr/bin/env bash
# The benchmark behind `make bench`, in one run, for N = 4096 chunks of 2 MiB
# and N = 410 chunks of 20 MiB (both about 8 GiB):
#   - the floor: the driver alone (host memory: dup + mmap), no transport;
#   - libvmmipc's first transfer at the default window, and a window sweep
#     (16, 64, 256) at N = 4096, plus any schedule variants (see below);
#   - a repeated transfer of the same registration: a cache hit, and the same
#     with the cache off (VMMIPC_IMPORT_NO_CACHE);
#   - all-at-once (every descriptor at once, as cuda.core shares VMM buffers);
#   - the Python path (vmmipc.share + Queue; host: vmmipc.HostBuffer + Queue),
#     first send and later sends of the same buffer;
#   - the host rows: 1 GiB of host memory into a spawned child through a Queue
#     as a vmmipc.HostBuffer, a multiprocessing SharedMemory and pickled bytes,
#     side by side (bench/hostrows.py), in both kinds of run;
#   - peak extra descriptors on both sides for every row; a transfer profiled
#     inside the driver (CUDA) and both approaches at RLIMIT_NOFILE = 1024.
# bench/vmmipc_bench.c, allatonce.py, pypath.py and hostrows.py say exactly
# what each row times.
#
#   bench/run.sh [--host] [--out DIR] [--schedule "LABEL VAR=VALUE ..."]...
#
# Uses the GPU when one is usable, else (or with --host) host memory (sealed
# memfd chunks, same rows). Needs build/libvmmipc.so (make lib). Prints a
# progress line per step and ends with the result table. Writes into DIR
# (default build/bench): results.md (date, commit, command, tables, console
# output, raw measurements: paste it as bench/results/<date>-<machine>.md),
# bench.png (the plot: see need_matplotlib for where matplotlib comes from),
# raw.jsonl (one JSON object per measurement), tables.md, console.txt and
# log.txt (every tool's stderr). COMMIT in the environment is recorded when
# this tree has no git metadata. BUILD, CC and PYTHON as in the Makefile.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD=${BUILD:-build}
CC=${CC:-cc}
PYTHON=${PYTHON:-python3}
OUT_DIR=$BUILD/bench
HOST=0
COMMAND="bench/run.sh $*"

# ---- Schedule variants: add library configurations to compare here. ----
# Each entry is "LABEL VAR=VALUE ...". The first transfer at N = 4096 (default
# window) runs again with those variables set in both processes, beside the
# library's default; rows carry the label ("schedule") and the report shows
# them side by side. --schedule adds one from the command line. Example, for
# a knob the library might read:
#   SCHEDULES+=("batch64 VMMIPC_SCHEDULE=batch:64")
SCHEDULES=()
# (Schedule knobs were measured on 2026-12-01 and lost or did not win:
# bench/results/2026-12-01-h200-schedules.md. Add new ones to SCHEDULES.)

while [ $# -gt 0 ]; do
  case $1 in
    --host) HOST=1 ;;
    --out) OUT_DIR=$2; shift ;;
    --schedule) SCHEDULES+=("$2"); shift ;;
    *) echo "usage: bench/run.sh [--host] [--out DIR] [--schedule \"LABEL VAR=VALUE ...\"]..." >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$OUT_DIR"
RAW=$OUT_DIR/raw.jsonl LOG=$OUT_DIR/log.txt CONSOLE=$OUT_DIR/console.txt PNG=$OUT_DIR/bench.png
: >"$RAW"; : >"$LOG"; : >"$CONSOLE"
rm -f "$PNG" "$OUT_DIR/tables.md" "$OUT_DIR/results.md"

say() { echo "bench: $*" | tee -a "$CONSOLE" "$LOG"; }

[ -f "$BUILD/libvmmipc.so" ] || { echo "bench: $BUILD/libvmmipc.so is missing: run make lib first" >&2; exit 1; }
BENCH=$BUILD/vmmipc_bench
if [ ! -x "$BENCH" ] || [ "$BENCH" -ot bench/vmmipc_bench.c ] || [ "$BENCH" -ot tests/c/cuda_dlopen.h ] ||
  [ "$BENCH" -ot tests/c/testutil.h ] || [ "$BENCH" -ot "$BUILD/libvmmipc.so" ]; then
  $CC -O2 -Wall -o "$BENCH" bench/vmmipc_bench.c -I"$BUILD/include" -L"$BUILD" -lvmmipc -lpthread -ldl -lm \
    -Wl,-rpath,'$ORIGIN'
fi
export VMMIPC_LIBRARY=$PWD/$BUILD/libvmmipc.so # for the Python tools and their children

if [ $HOST = 0 ] && "$BENCH" --probe; then
  MEM=--cuda PYMEM=
  say "CUDA run: a GPU is usable here"
else
  MEM=--host PYMEM=--host
  say "host-memory run ($([ $HOST = 1 ] && echo "--host" || echo "no usable GPU here")): sealed memfd chunks" \
    "stand in for GPU memory; the CUDA-only rows (driver profile) are left out"
fi
# The library's default window: what window 0 means in the rows.
DEFAULT_WINDOW=$(sed -n 's/^const DefaultWindow = \([0-9]*\).*/\1/p' core/*.go | head -1)
if [ -z "$DEFAULT_WINDOW" ]; then
  DEFAULT_WINDOW=$(sed -n "s/.*the library's choice, \([0-9]*\).*/\1/p" include/vmmipc.h | head -1)
fi
DEFAULT_WINDOW=${DEFAULT_WINDOW:-16}

# ---- What runs: one step per tool invocation. ----
STEP_LABELS=() STEP_CMDS=()
step() { STEP_LABELS+=("$1"); STEP_CMDS+=("$2"); }
mib() { echo "$(( $1 >> 20 )) MiB"; }

CONFIGS="4096:$((2 << 20)) 410:$((20 << 20))"
SWEEP=""
for w in 16 64 256; do [ "$w" = "$DEFAULT_WINDOW" ] || SWEEP="$SWEEP${SWEEP:+,}$w"; done
for cfg in $CONFIGS; do
  n=${cfg%%:*} size=${cfg##*:}
  at="N = $n x $(mib "$size")"
  c="--chunks $n --chunk-size $size"
  step "floor, $at: 3 runs" "bench $c --floor --repeat 3"
  step "libvmmipc first transfer, $at, default window ($DEFAULT_WINDOW): 5 timed runs + 1 counting fds" \
    "bench $c --first 0 --repeat 5 --fd-runs 1"
  if [ "$n" = 4096 ]; then
    step "libvmmipc first transfer, $at, windows $SWEEP: 3 timed runs + 1 counting fds each" \
      "bench $c --first $SWEEP --repeat 3 --fd-runs 1"
    for s in "${SCHEDULES[@]}"; do
      label=${s%% *} vars=${s#"${s%% *}"}
      step "libvmmipc first transfer, $at, schedule $label (${vars# }): 5 timed runs + 1 counting fds" \
        "VMMIPC_BENCH_SCHEDULE=$label $vars bench $c --first 0 --repeat 5 --fd-runs 1"
    done
  fi
  step "libvmmipc repeated transfer, cache hit, $at: 1 + 5 imports, twice (timed; counting fds)" \
    "bench $c --repeated cache --rounds 5 --repeat 1 --fd-runs 1"
  step "libvmmipc repeated transfer, cache off, $at: 1 + 2 imports, twice (timed; counting fds)" \
    "bench $c --repeated nocache --rounds 2 --repeat 1 --fd-runs 1"
  for k in 1 2; do
    step "all-at-once, $at: run $k of 2" "allatonce $c"
  done
  step "Python path ($([ "$MEM" = --cuda ] && echo vmmipc.share || echo vmmipc.HostBuffer) + Queue), $at: 3 sends" \
    "pypath $c --sends 3"
done
if [ "$MEM" = --cuda ]; then
  step "where the time goes: one first transfer, N = 4096 x 2 MiB, through the driver timing shim" \
    "profile --chunks 4096 --chunk-size $((2 << 20)) --first 0 --repeat 1 --fd-runs 0"
fi
step "host rows, 1 GiB into a spawned child through a Queue: HostBuffer, SharedMemory, pickled bytes (children at RLIMIT_NOFILE 64)" \
  "hostrows --size $((1 << 30)) --chunk-size $((2 << 20)) --sends 11"
step "receiver at RLIMIT_NOFILE 1024, N = 4096 x 2 MiB: libvmmipc" \
  "bench --chunks 4096 --chunk-size $((2 << 20)) --first 0 --repeat 0 --fd-runs 1 --nofile 1024"
step "receiver at RLIMIT_NOFILE 1024, N = 4096 x 2 MiB: all-at-once" \
  "allatonce --chunks 4096 --chunk-size $((2 << 20)) --nofile 1024"
step "matplotlib for the plot" "need_matplotlib"
step "tables and plot" "report"

# ---- The tools. Each appends its JSON lines to RAW and its stderr to LOG. ----
bench() { "$BENCH" $MEM "$@" >>"$RAW"; }
allatonce() { PYTHONUNBUFFERED=1 $PYTHON bench/allatonce.py $PYMEM "$@" >>"$RAW"; }
pypath() { PYTHONUNBUFFERED=1 $PYTHON bench/pypath.py $PYMEM "$@" >>"$RAW"; }
hostrows() { PYTHONUNBUFFERED=1 $PYTHON bench/hostrows.py "$@" >>"$RAW"; }
profile() {
  $CC -O2 -Wall -shared -fPIC -o "$BUILD/libcuda_timing.so" bench/cuda_timing_shim.c -ldl -lpthread &&
    VMMIPC_LIBCUDA=$PWD/$BUILD/libcuda_timing.so bench "$@"
}
# The plot needs matplotlib: PYTHON's own if it has one; else the one in
# BUILD/bench-venv, a virtual environment made (once, kept for later runs)
# and filled from PyPI for the plot alone, so PYTHON itself never changes.
# VMMIPC_BENCH_NO_INSTALL=1 installs nothing: no plot without matplotlib.
PLOT_WHY="" PLOT_PYTHON=$PYTHON PLOT_VENV=$BUILD/bench-venv
need_matplotlib() {
  if $PYTHON -c 'import matplotlib' 2>/dev/null; then return 0; fi
  if "$PLOT_VENV/bin/python" -c 'import matplotlib' 2>/dev/null; then
    PLOT_PYTHON=$PLOT_VENV/bin/python
    say "matplotlib: from $PLOT_VENV"
    return 0
  fi
  if [ -n "${VMMIPC_BENCH_NO_INSTALL:-}" ]; then
    PLOT_WHY="matplotlib is not installed (VMMIPC_BENCH_NO_INSTALL is set, so nothing was installed)"
    return 0
  fi
  local install="$PYTHON -m venv $PLOT_VENV && $PLOT_VENV/bin/python -m pip install --quiet matplotlib"
  say "matplotlib is missing; installing it for the plot into $PLOT_VENV (not into $PYTHON): $install"
  if eval "$install" >>"$LOG" 2>&1 && "$PLOT_VENV/bin/python" -c 'import matplotlib' 2>/dev/null; then
    PLOT_PYTHON=$PLOT_VENV/bin/python
    say "matplotlib installed in $PLOT_VENV"
  else
    PLOT_WHY="matplotlib is not installed, and '$install' failed ($(tail -1 "$LOG"))"
  fi
}
report() {
  $PLOT_PYTHON bench/plot.py "$RAW" --md "$OUT_DIR/tables.md" --default-window "$DEFAULT_WINDOW" \
    $([ -z "$PLOT_WHY" ] && echo --png "$PNG")
}

# ---- Run. ----
hard=$(ulimit -Hn)
if [ "$hard" != unlimited ] && [ "$hard" -lt 9300 ]; then
  say "note: the hard RLIMIT_NOFILE is $hard; the floor and all-at-once hold every descriptor at once" \
    "(all-at-once about 2 N + 1024 in the sender) and may fail at N = 4096 here"
fi
START=$(date +%s)
total=${#STEP_LABELS[@]} failed=0
for i in "${!STEP_LABELS[@]}"; do
  say "[$((i + 1))/$total, $(( $(date +%s) - START )) s] ${STEP_LABELS[$i]}"
  echo "+ ${STEP_CMDS[$i]}" >>"$LOG"
  err=$OUT_DIR/.step.err
  if eval "${STEP_CMDS[$i]}" 2>"$err"; then
    cat "$err" >>"$LOG"
  else
    status=$? failed=$((failed + 1))
    cat "$err" >>"$LOG"
    say "  step $((i + 1)) failed (status $status): $(grep -v '^\s*$' "$err" | tail -1 || true) (all of it in $LOG)"
  fi
  rm -f "$err"
done
ELAPSED=$(( $(date +%s) - START ))
say "done in $ELAPSED s$([ $failed = 0 ] || echo ", $failed step(s) failed")"

# ---- The result table on the console, and results.md. ----
echo | tee -a "$CONSOLE"
$PYTHON bench/plot.py "$RAW" --console --default-window "$DEFAULT_WINDOW" 2>>"$LOG" | tee -a "$CONSOLE" ||
  say "could not make the table (see $LOG)"
echo | tee -a "$CONSOLE"
if [ -f "$PNG" ]; then
  say "plot: $PNG"
else
  say "no plot: ${PLOT_WHY:-bench/plot.py failed (see $LOG)}." \
    "Install matplotlib (pip install matplotlib, or apt-get install python3-matplotlib) and run:" \
    "$PYTHON bench/plot.py $RAW --png $PNG"
fi

if commit=$(git rev-parse --verify -q HEAD 2>/dev/null); then
  [ -z "$(git status --porcelain 2>/dev/null)" ] || commit="$commit (working tree has uncommitted changes)"
else
  commit=${COMMIT:-unknown (no git metadata here; set COMMIT to record it)}
fi
{
  echo "# libvmmipc benchmark, $(date -u +%Y-%m-%d) ($([ "$MEM" = --cuda ] && echo "CUDA" || echo "host memory"))"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC') ($ELAPSED s of measurements)"
  echo "- commit: $commit"
  echo "- command: \`$COMMAND\`"
  echo "- machine: $(uname -srm); $(nproc) CPUs; RLIMIT_NOFILE $(ulimit -Sn)/$(ulimit -Hn); $($PYTHON -V 2>&1)"
  if [ "$MEM" = --cuda ] && command -v nvidia-smi >/dev/null 2>&1; then
    echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | head -1)"
  fi
  echo "- libvmmipc default window: $DEFAULT_WINDOW"
  [ -f "$PNG" ] && printf '\n![time and descriptors per approach](bench.png)\n'
  echo
  echo "## Results"
  echo
  cat "$OUT_DIR/tables.md" 2>/dev/null || echo "(no tables: bench/plot.py failed, see the log below)"
  echo
  echo "## Console output"
  echo
  echo '```'
  cat "$CONSOLE"
  echo '```'
  echo
  echo "## Raw measurements (raw.jsonl)"
  echo
  echo '```'
  cat "$RAW"
  echo '```'
  echo
  echo "## Log (every tool's stderr)"
  echo
  echo '```'
  cat "$LOG"
  echo '```'
} >"$OUT_DIR/results.md"
say "wrote $OUT_DIR/results.md (to record this run: copy it to bench/results/<date>-<machine>.md," \
  "and bench.png beside it under the same name, .png, changing the image link)"
