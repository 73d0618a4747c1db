#!/bin/sh
# Builds and runs the CUDA fault-injection test (vmmipc_fault_test.c). Needs a
# CUDA GPU, its headers (CUDA_HOME) and build/libvmmipc.so. Run from the
# repository root. Prints PASS/FAIL lines and "N passed, M failed".
set -eu
sh tests/gpu/build.sh vmmipc_fault_test
exec build/tests/vmmipc_fault_test
