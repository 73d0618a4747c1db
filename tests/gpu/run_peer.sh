#!/bin/sh
# Builds and runs the cross-device / UUID test (vmmipc_peer_test.c). Needs a
# CUDA GPU (two for the peer-access part), its headers (CUDA_HOME) and
# build/libvmmipc.so. Prints PASS/FAIL lines and "N passed, M failed".
set -eu
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p build/tests
gcc -O2 -Wall -Wextra -std=gnu11 -I"$CUDA_HOME/include" -Ibuild/include \
  tests/gpu/vmmipc_peer_test.c -o build/tests/vmmipc_peer_test \
  -Lbuild -lvmmipc -Wl,-rpath,"$(pwd)/build" -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcuda
out=$(build/tests/vmmipc_peer_test; echo "exit $?")
echo "$out"
p=$(echo "$out" | grep -c '^PASS' || true)
f=$(echo "$out" | grep -c '^FAIL' || true)
echo "$p passed, $f failed"
[ "$f" -eq 0 ]
