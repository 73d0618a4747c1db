#!/bin/sh
# new_lab.sh makes a directory for containers (container.sh) and prints its
# path, ROOT: short (socket paths are at most 107 bytes), with ROOT/shared,
# mode 0700, the socket directory. It first checks that a container can be
# made here; if not, it removes ROOT, says why on stderr and exits 1. The
# caller removes ROOT.
#
#   root=$(sh tests/namespaces/new_lab.sh) || skip
set -eu
here=$(dirname "$0")
root=$(mktemp -d /tmp/vmmipc-ns-XXXXXX)
mkdir -m 0700 "$root/shared"
if ! out=$(sh "$here/container.sh" "$root/shared" "$root" true 2>&1); then
  rm -rf "$root"
  echo "cannot make a container here ($here/container.sh: $out); it needs unshare and root" >&2
  exit 1
fi
echo "$root"
