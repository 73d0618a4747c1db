#!/usr/bin/env bash
# Moves GPU memory from one container into another on this host
# (tests/namespaces/container.sh: own PID, network, IPC and mount
# namespaces, only the socket directory shared; /dev, and so the GPU's
# device nodes, shared), and writes a log:
#   1. a CUDA VMM buffer: examples/cuda's cuda_sender in one container,
#      cuda_receiver in another (it maps the buffer onto the same GPU and
#      checks every byte on the GPU), the ticket through a pipe;
#   2. a vmmipc.torch state dict: examples/python/torch_state_dict.py, its
#      spawned child in another container (multiprocessing's executable is a
#      wrapper that starts it there; the two share /dev/shm, where
#      multiprocessing keeps its semaphores); the child's output must match;
#   3. a vmmipc.torch state dict between two containers that share nothing
#      but the socket directory, a pipe and the GPU (each with a /dev/shm of
#      its own, as pods have): tests/gpu/torch_namespaces.py, share_tensors
#      in one, open_tensors in the other;
#   then the same three under tests/gpu/no_pidfd_getfd.sh (pidfd_getfd
#   refused, as a container's default seccomp profile does).
# The CUDA pair runs with a private /dev/shm too.
# After each, the socket directory must be empty (the sender's exit removed
# its files). Needs root (or unprivileged user namespaces), unshare, a CUDA
# GPU, gcc and the CUDA headers (CUDA_HOME, default /usr/local/cuda), torch
# for 2 and 4, and build/libvmmipc.so and build/include/vmmipc.h (`make lib`
# where Go is; carry build/). Run from the repository root:
#
#   bash tests/gpu/run_namespaces.sh [LOG]   (default bench/results/<date>-gpu-namespaces.log)
#
# Prints one PASS/FAIL/SKIP line per case and "N passed, M failed, K
# skipped"; exits non-zero if any failed.
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${1:-bench/results/$(date -u +%F)-gpu-namespaces.log}
mkdir -p "$(dirname "$log")"
exec > >(tee "$log") 2>&1
PYTHON=${PYTHON:-python3}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
container=tests/namespaces/container.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}

echo "run_namespaces: $(date -u +%FT%TZ) on $(hostname), commit $(git rev-parse HEAD 2>/dev/null || echo unknown)"
echo "kernel $(uname -r); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"
"$PYTHON" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>/dev/null || echo "torch: not importable"

passed=0 failed=0 skipped=0
verdict() { # verdict NAME RC: counts and prints one line
  if [ "$2" = 0 ]; then echo "PASS $1"; passed=$((passed + 1)); else echo "FAIL $1 (exit $2)"; failed=$((failed + 1)); fi
}
skip() { echo "SKIP $1: $2"; skipped=$((skipped + 1)); }

[ -f build/libvmmipc.so ] || { echo "run_namespaces: no build/libvmmipc.so: build it with make lib (Go) and carry build/"; exit 2; }
root=$(sh tests/namespaces/new_lab.sh) || exit 2
trap 'rm -rf "$root"' EXIT
shared=$root/shared

bins=$PWD/build/tests/namespaces
mkdir -p "$bins"
sh tests/gpu/no_pidfd_getfd.sh true || exit 1 # builds the filter; fails early without gcc
cuda_ok=1
if [ ! -f "$CUDA_HOME/include/cuda.h" ]; then
  cuda_ok=0 why="no $CUDA_HOME/include/cuda.h (set CUDA_HOME)"
else
  for role in sender receiver; do
    gcc -std=gnu11 -O2 -Wall -Wextra -Werror -o "$bins/cuda_$role" "examples/cuda/$role.c" \
      -Ibuild/include -Lbuild -lvmmipc -Wl,-rpath,"$PWD/build" \
      -I"$CUDA_HOME/include" -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcuda || exit 1
  done
fi

# empty_after NAME: the socket directory must be empty after a case.
empty_after() {
  local left
  left=$(ls -A "$shared")
  [ -z "$left" ] || { echo "$1: left in the socket directory: $left"; rm -f "$shared"/*; return 1; }
}

# cuda_pair [FILTER]: sender and receiver each in a container of its own.
cuda_pair() {
  VMMIPC_SOCKET_DIR=$shared "$@" sh "$container" --private-shm "$shared" "$root" "$bins/cuda_sender" |
    "$@" sh "$container" --private-shm "$shared" "$root" "$bins/cuda_receiver" && empty_after "cuda pair"
}

# torch_pods [FILTER]: share_tensors in one container, open_tensors in
# another, the bytes through a pipe, "done" back through a fifo.
torch_pods() {
  local done=$root.done
  rm -f "$done" && mkfifo "$done"
  VMMIPC_SOCKET_DIR=$shared timeout 300 "$@" sh "$container" --private-shm "$shared" "$root" \
    "$PYTHON" "$PWD/tests/gpu/torch_namespaces.py" send "$done" |
    timeout 300 "$@" sh "$container" --private-shm "$shared" "$root" \
      "$PYTHON" "$PWD/tests/gpu/torch_namespaces.py" receive "$done"
  local rc=$?
  rm -f "$done"
  [ $rc = 0 ] && empty_after "torch between containers"
}

# The torch example unchanged, every spawned child started in a container.
wrapper=$root.python
printf '#!/bin/sh\nexec sh "%s" "%s" "%s" "%s" "$@"\n' "$PWD/$container" "$shared" "$root" "$(command -v "$PYTHON")" >"$wrapper"
chmod 0700 "$wrapper"
trap 'rm -rf "$root" "$wrapper" "$root.done"' EXIT
driver='import multiprocessing, runpy, sys
multiprocessing.set_executable(sys.argv[1])
runpy.run_path(sys.argv[2], run_name="__main__")'
torch_example() { # torch_example [FILTER]
  VMMIPC_SOCKET_DIR=$shared timeout 300 "$@" "$PYTHON" -c "$driver" "$wrapper" "$PWD/examples/python/torch_state_dict.py" &&
    empty_after "torch example"
}

torch_ok=1
"$PYTHON" -c 'import torch; assert torch.cuda.is_available()' 2>/dev/null || torch_ok=0
for filter in "" "sh tests/gpu/no_pidfd_getfd.sh"; do
  under=${filter:+, under no_pidfd_getfd}
  if [ $cuda_ok = 1 ]; then
    echo "== CUDA buffer, container to container$under"
    cuda_pair $filter
    verdict "CUDA buffer, container to container$under" $?
  else
    skip "CUDA buffer$under" "$why"
  fi
  if [ $torch_ok = 1 ]; then
    echo "== vmmipc.torch state dict, into a spawned child's container$under"
    torch_example $filter
    verdict "vmmipc.torch state dict, into another container$under" $?
    echo "== vmmipc.torch share_tensors/open_tensors, between two containers with their own /dev/shm$under"
    torch_pods $filter
    verdict "vmmipc.torch share_tensors/open_tensors between containers$under" $?
  else
    skip "vmmipc.torch state dict$under" "torch with CUDA is not importable by $PYTHON"
    skip "vmmipc.torch share_tensors/open_tensors$under" "torch with CUDA is not importable by $PYTHON"
  fi
done
echo "run_namespaces: $passed passed, $failed failed, $skipped skipped; log in $log"
[ "$failed" = 0 ]
