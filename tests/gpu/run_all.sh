#!/usr/bin/env bash
# Runs every GPU suite on a CUDA machine, one after the other, each under its
# own time limit, and writes each one's output to LOGDIR/<suite>.log:
#
#   tests/gpu/run_all.sh LOGDIR [SUITE...]
#
# Suites: cuda (run.sh), fault (run_fault.sh), peer (run_peer.sh), python
# (test_python_cuda.py), pytest (tests/python on this host), torch
# (run_torch.sh), torch-model (run_torch.sh with test_torch_model.py), torch-mp
# (run_torch.sh with test_torch_mp.py), torch-pool (run_torch.sh with test_torch_pool.py),
# examples (examples/cuda/run.sh; needs the prefix that
# `make test-install` leaves, carried in build/), torch-example
# (examples/python/torch_state_dict.py), torch-sync (examples/python/torch_weight_sync.py),
# torch-pool-example (examples/python/torch_sharing_pool.py).
# Default: all of them.
# Needs build/libvmmipc.so (the GPU machine has no Go: build it elsewhere
# and carry build/). Prints one line per suite and exits non-zero if any
# failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
logdir=${1:?usage: tests/gpu/run_all.sh LOGDIR [SUITE...]}
shift
mkdir -p "$logdir"
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(cuda fault peer python pytest torch torch-model torch-mp torch-pool examples torch-example torch-sync torch-pool-example)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}

run() { # name limit command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$logdir/$name.log" 2>&1
  local rc=$?
  local verdict=PASS
  [ $rc -eq 0 ] || verdict="FAIL (exit $rc)"
  echo "$verdict $name in $((SECONDS - t0)) s: $(grep -E 'passed|failed' "$logdir/$name.log" | tail -1)"
  [ $rc -eq 0 ]
}

failed=0
for s in "${suites[@]}"; do
  case $s in
    cuda) run cuda 240 sh tests/gpu/run.sh ;;
    fault) run fault 180 sh tests/gpu/run_fault.sh ;;
    peer) run peer 60 sh tests/gpu/run_peer.sh ;;
    python) run python 240 python3 tests/gpu/test_python_cuda.py ;;
    pytest) run pytest 420 python3 -m pytest -q -p no:cacheprovider tests/python ;;
    torch) run torch 300 sh tests/gpu/run_torch.sh ;;
    torch-model) run torch-model 540 env TORCH_TEST=tests/gpu/test_torch_model.py sh tests/gpu/run_torch.sh ;;
    torch-mp) run torch-mp 1800 env TORCH_TEST=tests/gpu/test_torch_mp.py sh tests/gpu/run_torch.sh ;;
    torch-pool) run torch-pool 540 env TORCH_TEST=tests/gpu/test_torch_pool.py sh tests/gpu/run_torch.sh ;;
    examples) run examples 60 bash examples/cuda/run.sh ;;
    torch-example) run torch-example 120 python3 examples/python/torch_state_dict.py ;;
    torch-sync) run torch-sync 180 python3 examples/python/torch_weight_sync.py ;;
    torch-pool-example) run torch-pool-example 120 python3 examples/python/torch_sharing_pool.py ;;
    *) echo "unknown suite $s"; false ;;
  esac || failed=$((failed + 1))
done
echo "run_all: ${#suites[@]} suite(s), $failed failed"
[ $failed -eq 0 ]
