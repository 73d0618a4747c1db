#!/bin/sh
# Builds the GPU test program tests/gpu/NAME.c into build/tests/NAME, linked
# against build/libvmmipc.so (`make lib`) and the CUDA driver:
#
#   sh tests/gpu/build.sh NAME
#
# Needs gcc and the CUDA headers (CUDA_HOME, default /usr/local/cuda). Run
# from the repository root; run.sh, run_fault.sh and run_peer.sh use it.
set -eu
name=${1:?usage: tests/gpu/build.sh NAME (builds tests/gpu/NAME.c)}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
mkdir -p build/tests
# -lcuda resolves against the driver's libcuda.so.1 at run time (the stub
# only satisfies the linker); libvmmipc's dlopen of libcuda.so.1 then finds
# the same, already loaded, driver.
gcc -O3 -g -Wall -Wextra -std=gnu11 -pthread \
  -I"$CUDA_HOME/include" -Ibuild/include \
  "tests/gpu/$name.c" -o "build/tests/$name" \
  -Lbuild -lvmmipc -Wl,-rpath,"$(pwd)/build" \
  -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcuda
