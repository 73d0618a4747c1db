#!/usr/bin/env bash
# The C host examples across containers (tests/namespaces/container.sh):
# host_sender in one, host_receiver in another, the ticket through a pipe
# between them, the socket in a directory only the two share. Then the same
# with the receiver also in a user namespace of its own. After each run the
# socket directory must be empty: the sender's exit() removed its socket and
# lock. Exits 77 (skipped) where namespaces cannot be made.
#
#   tests/namespaces/run_examples.sh [BUILD_DIR]   (default build; needs
#   BUILD_DIR/libvmmipc.so and BUILD_DIR/include/vmmipc.h: `make lib`)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=$(cd "${1:-build}" && pwd)
[ -f "$build/libvmmipc.so" ] || { echo "namespaces: no $build/libvmmipc.so: run make lib" >&2; exit 2; }
container=tests/namespaces/container.sh
bins=$build/tests/namespaces
mkdir -p "$bins"
for role in sender receiver; do
  "${CC:-cc}" -Wall -Wextra -Werror -o "$bins/host_$role" "examples/host/$role.c" \
    -I"$build/include" -L"$build" -lvmmipc -Wl,-rpath,"$build"
done
root=$(sh tests/namespaces/new_lab.sh) || { echo "namespaces: skipped (see above)"; exit 77; }
trap 'rm -rf "$root"' EXIT
shared=$root/shared

for receiver_opts in "" "--user"; do
  echo "namespaces: host_sender in one container | host_receiver in another${receiver_opts:+ (with its own user namespace)}"
  # shellcheck disable=SC2086 # the option is one word or none
  VMMIPC_SOCKET_DIR=$shared sh "$container" "$shared" "$root" "$bins/host_sender" |
    sh "$container" $receiver_opts "$shared" "$root" "$bins/host_receiver" | tee "$root/out"
  grep -q ' 0 wrong$' "$root/out" || { echo "namespaces: the receiver did not verify every byte" >&2; exit 1; }
  left=$(ls -A "$shared")
  [ -z "$left" ] || { echo "namespaces: the sender left $left in the socket directory" >&2; exit 1; }
done
echo "namespaces: the host examples work across containers; nothing left in the socket directory"
