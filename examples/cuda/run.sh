#!/usr/bin/env bash
# Builds the CUDA examples against an installed libvmmipc and runs them on
# this machine's GPU, once per build: cuda_sender | cuda_receiver, and
# big_chunks_sender | big_chunks_receiver (a pool of 1 GiB chunks, a
# sub-range shared).
#
#   examples/cuda/run.sh [PREFIX]
#
# PREFIX is an installed libvmmipc (lib/, include/, lib/cmake/vmmipc,
# lib/pkgconfig/vmmipc.pc); default build/install-test/prefix, which
# `make test-install` (part of `make test`) leaves. On a GPU machine without
# Go, carry that directory from a machine that built it. Needs cuda.h
# (CUDA_HOME, default /usr/local/cuda), the CUDA driver and a GPU. Builds
# through pkg-config and through CMake (find_package), each when the tool is
# installed, with -Wall -Wextra -Werror; with neither, through plain flags.
# Run from the repository root. Prints one PASS or FAIL line per build and
# "N passed, M failed".
set -euo pipefail
cd "$(dirname "$0")/../.."
prefix=$(cd "${1:-build/install-test/prefix}" 2>/dev/null && pwd) || {
  echo "run.sh: no installed libvmmipc at ${1:-build/install-test/prefix}: run make test-install first" >&2
  exit 2
}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
CC=${CC:-cc}
[ -f "$CUDA_HOME/include/cuda.h" ] || { echo "run.sh: no $CUDA_HOME/include/cuda.h: set CUDA_HOME" >&2; exit 2; }
library=
for candidate in "$prefix"/lib*/libvmmipc.so; do [ -f "$candidate" ] && library=$candidate && break; done
[ -n "$library" ] || { echo "run.sh: no lib*/libvmmipc.so under $prefix: not an installed libvmmipc" >&2; exit 2; }
libdir=$(dirname "$library")
out=build/examples-cuda
rm -rf "$out"
mkdir -p "$out"
# The ticket's pipe carries no status: pipefail makes either side's failure count.
passed=0 failed=0
run_pair() { # run_pair NAME DIR: each sender | receiver pair
  local pair
  for pair in cuda big_chunks; do
    if "$2/${pair}_sender" | "$2/${pair}_receiver"; then
      echo "PASS $pair example, built with $1"; passed=$((passed + 1))
    else
      echo "FAIL $pair example, built with $1"; failed=$((failed + 1))
    fi
  done
}
# At run time the loader finds the driver's libcuda.so.1; the stub only links.
cuda_flags=(-I"$CUDA_HOME/include" -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcuda)
build_flat() { # build_flat NAME DIR FLAGS...: the programs with these vmmipc flags
  local name=$1 dir=$2
  shift 2
  mkdir -p "$dir"
  for role in sender receiver; do
    "$CC" -std=gnu11 -Wall -Wextra -Werror -o "$dir/cuda_$role" "examples/cuda/$role.c" "$@" "${cuda_flags[@]}"
    "$CC" -std=gnu11 -Wall -Wextra -Werror -o "$dir/big_chunks_$role" "examples/cuda/big_chunks_$role.c" \
      "$@" "${cuda_flags[@]}"
  done
  run_pair "$name" "$dir"
}
built=0
if command -v pkg-config >/dev/null; then
  # The prefix may have moved since it was installed: point pkg-config at it.
  pc_flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --define-variable=prefix="$prefix" --cflags --libs vmmipc)
  read -r -a pc <<<"$pc_flags"
  build_flat pkg-config "$out/pkg-config" "${pc[@]}"
  built=1
fi
if command -v cmake >/dev/null; then
  CUDA_HOME=$CUDA_HOME cmake -S examples -B "$out/cmake" -DCMAKE_PREFIX_PATH="$prefix" \
    -DVMMIPC_EXAMPLES_CUDA=ON -DCMAKE_C_FLAGS=-Werror >"$out/cmake.log" || { cat "$out/cmake.log"; exit 1; }
  cmake --build "$out/cmake" >>"$out/cmake.log" || { cat "$out/cmake.log"; exit 1; }
  run_pair CMake "$out/cmake"
  built=1
fi
if [ $built = 0 ]; then
  echo "run.sh: neither pkg-config nor cmake here: building with plain flags"
  build_flat "plain flags" "$out/plain" -I"$prefix/include" -L"$libdir" -Wl,-rpath,"$libdir" -lvmmipc
fi
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
