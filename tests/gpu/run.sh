#!/bin/sh
# Builds and runs the GPU test of the CUDA backend (vmmipc_gpu_test.c). Needs
# a CUDA GPU, its driver, the CUDA headers (CUDA_HOME, default
# /usr/local/cuda) and build/libvmmipc.so (`make lib`). Run from the
# repository root; arguments pick scenarios (default: all). Prints PASS/FAIL
# lines and "N passed, M failed".
set -eu
sh tests/gpu/build.sh vmmipc_gpu_test
exec build/tests/vmmipc_gpu_test "$@"
