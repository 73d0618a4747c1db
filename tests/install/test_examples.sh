#!/usr/bin/env bash
# Builds every example against the libvmmipc installed in PREFIX, the way a
# user would: through find_package(vmmipc) (examples/CMakeLists.txt) and
# through pkg-config, with -Wall -Wextra -Werror, and runs the host pair of
# each build. Nothing is on LD_LIBRARY_PATH: each program must find
# PREFIX's libvmmipc.so by itself (CMake's RUNPATH; vmmipc.pc's -Wl,-rpath).
# The CUDA pair is built when cuda.h is found and run only on a GPU machine,
# by examples/cuda/run.sh.
#
#   tests/install/test_examples.sh PREFIX WORKDIR
set -euo pipefail
[ $# = 2 ] || { echo "usage: $0 PREFIX WORKDIR" >&2; exit 2; }
prefix=$(cd "$1" && pwd)
work=$2
cd "$(dirname "$0")/../.."
rm -rf "$work"
mkdir -p "$work"
unset LD_LIBRARY_PATH
CC=${CC:-cc}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
library=
for candidate in "$prefix"/lib*/libvmmipc.so; do [ -f "$candidate" ] && library=$candidate && break; done
[ -n "$library" ] || { echo "examples: no lib*/libvmmipc.so under $prefix: not an installed libvmmipc" >&2; exit 2; }
libdir=$(dirname "$library")

# run_host_pair NAME DIR: host_sender | host_receiver, after checking that
# both load the installed library.
run_host_pair() {
  local name=$1 dir=$2 program loads
  for program in "$dir/host_sender" "$dir/host_receiver"; do
    loads=$(ldd "$program")
    if ! grep -qF "libvmmipc.so => $libdir/libvmmipc.so" <<<"$loads"; then
      echo "examples: $program does not load $libdir/libvmmipc.so:" >&2
      echo "$loads" >&2
      exit 1
    fi
  done
  echo "examples: running the host pair built with $name: host_sender | host_receiver"
  "$dir/host_sender" | "$dir/host_receiver"
}

# Through CMake. Its configure log is kept; the lines about the examples
# (the CUDA pair built or skipped, and why) are shown.
cmake -S examples -B "$work/cmake" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_FLAGS=-Werror \
  >"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
grep '^-- examples:' "$work/cmake.log" | sed 's/^-- /CMake: /'
cmake --build "$work/cmake" >>"$work/cmake.log" 2>&1 || { cat "$work/cmake.log"; exit 1; }
run_host_pair CMake "$work/cmake"

# Through pkg-config, as the README says.
pc_flags=$(PKG_CONFIG_PATH="$libdir/pkgconfig" pkg-config --cflags --libs vmmipc)
read -r -a pc <<<"$pc_flags"
mkdir -p "$work/pkg-config"
for role in sender receiver; do
  "$CC" -Wall -Wextra -Werror -o "$work/pkg-config/host_$role" "examples/host/$role.c" "${pc[@]}"
done
if [ -f "$CUDA_HOME/include/cuda.h" ]; then
  for role in sender receiver; do
    "$CC" -Wall -Wextra -Werror -o "$work/pkg-config/cuda_$role" "examples/cuda/$role.c" "${pc[@]}" \
      -I"$CUDA_HOME/include" -L"$CUDA_HOME/lib64" -L"$CUDA_HOME/lib64/stubs" -lcuda
  done
  echo "pkg-config: built the CUDA pair; examples/cuda/run.sh runs it on a GPU machine"
else
  echo "pkg-config: skipping the CUDA pair: no $CUDA_HOME/include/cuda.h (set CUDA_HOME);" \
    "examples/cuda/run.sh builds and runs it on a GPU machine"
fi
run_host_pair pkg-config "$work/pkg-config"
echo "examples: every host pair passed"
