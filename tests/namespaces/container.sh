#!/bin/sh
# container.sh runs a command in a "container" of its own on this host, the
# one home of what the namespace tests mean by that (core/namespace_test.go,
# tests/namespaces/run_examples.sh, tests/python/test_namespaces.py,
# tests/gpu/run_namespaces.sh; new_lab.sh makes ROOT and SHARED): new PID (pid 1 is a shell; /proc of its
# own), network (loopback only), IPC and mount namespaces, in which ROOT is a
# private tmpfs with only SHARED, a directory under ROOT, bind-mounted at
# its own path, as a volume would be. The rest of the file system (programs,
# libraries, /dev) is shared, as an image and device nodes would be, and
# so is /dev/shm unless --private-shm: a multiprocessing parent and the
# child it spawns into a container share named semaphores there.
# Killing this process (it becomes unshare) kills the whole container.
# Needs root, or unprivileged user namespaces with --user.
#
#   tests/namespaces/container.sh [--user] [--keep] [--private-shm] SHARED ROOT COMMAND [ARG...]
#     --user         also a user namespace of its own (uid 0 inside is ours)
#     --keep         pid 1 outlives COMMAND, so that children it leaves live
#                    on, until the container is killed
#     --private-shm  a /dev/shm of its own, as a container has by default
set -eu
user=
shm=
run='"$@"; exit $?'
while :; do
  case $1 in
  --user) user="--user --map-root-user"; shift ;;
  --keep) run='"$@"; exec sleep 1000000'; shift ;;
  --private-shm) shm='mount -t tmpfs -o mode=1777 vmmipc-shm /dev/shm'; shift ;;
  *) break ;;
  esac
done
[ $# -ge 3 ] || { echo "usage: $0 [--user] [--keep] SHARED ROOT COMMAND [ARG...]" >&2; exit 2; }
# The shell cds into SHARED before ROOT is covered, so that it can still
# bind the real directory ("." unresolved: mount must not canonicalize it
# into the new, empty path).
# shellcheck disable=SC2086 # $user is two words or none
exec unshare --pid --net --ipc --mount --fork --mount-proc --kill-child $user sh -c '
  set -e
  cd "$1"
  mount -t tmpfs -o mode=0700 vmmipc-container "$2"
  mkdir -m 0700 "$1"
  mount --no-canonicalize --bind . "$1"
  '"$shm"'
  cd /
  shift 2
  '"$run" container "$@"
