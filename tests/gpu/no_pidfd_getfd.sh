#!/bin/sh
# Runs a command under tests/gpu/no_pidfd_getfd (pidfd_getfd refused with
# EPERM, as in a container without CAP_SYS_PTRACE), building
# build/tests/no_pidfd_getfd first when it is missing or older than its
# source. Run from the repository root; needs gcc. run_torch.sh and
# bench/torch_model_bench.py run their filtered processes through it.
#
#   sh tests/gpu/no_pidfd_getfd.sh COMMAND [ARG...]
set -eu
bin=build/tests/no_pidfd_getfd
src=tests/gpu/no_pidfd_getfd.c
if [ ! -x "$bin" ] || [ "$src" -nt "$bin" ]; then
  mkdir -p build/tests
  gcc -O2 -Wall -Wextra -o "$bin.$$" "$src"
  mv "$bin.$$" "$bin" # whole or not at all, should two runs build at once
fi
exec "$bin" "$@"
