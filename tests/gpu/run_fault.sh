#!/bin/sh
# Builds and runs the CUDA fault-injection test (vmmipc_fault_test.c). Needs a
# CUDA GPU, its headers (CUDA_HOME) and build/libvmmipc.so.
set -eu
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p build/tests
gcc -O2 -Wall -Wextra -std=gnu11 -I"$CUDA_HOME/include" -Ibuild/include \
  tests/gpu/vmmipc_fault_test.c -o build/tests/vmmipc_fault_test \
  -Lbuild -lvmmipc -Wl,-rpath,"$(pwd)/build" -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcuda
exec build/tests/vmmipc_fault_test
