#!/bin/sh
# Builds and runs the GPU test of the CUDA backend. Needs a CUDA GPU, its
# driver, the CUDA headers (CUDA_HOME, default /usr/local/cuda) and
# build/libvmmipc.so (`make lib`). Run from the repository root; arguments
# pick scenarios (default: all). Prints PASS/FAIL lines and "N passed, M failed".
set -eu
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
out=build/tests
mkdir -p "$out"
# -lcuda resolves against the driver's libcuda.so.1 at run time (the stub
# only satisfies the linker); libvmmipc's dlopen of libcuda.so.1 then finds
# the same, already loaded, driver.
gcc -O3 -g -Wall -Wextra -std=gnu11 -pthread \
  -I"$CUDA_HOME/include" -Ibuild/include \
  tests/gpu/vmmipc_gpu_test.c -o "$out/vmmipc_gpu_test" \
  -Lbuild -lvmmipc -Wl,-rpath,"$(pwd)/build" \
  -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcuda
exec "$out/vmmipc_gpu_test" "$@"
