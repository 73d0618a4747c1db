#!/bin/sh
# Builds and runs the cross-device / UUID test (vmmipc_peer_test.c). Needs a
# CUDA GPU (two for the peer-access part), its headers (CUDA_HOME) and
# build/libvmmipc.so. Run from the repository root. Prints PASS/FAIL lines
# and "N passed, M failed" (counted here: they come from the receivers'
# processes as well as the test's own); exits non-zero on a FAIL line or if
# the test itself failed.
set -eu
sh tests/gpu/build.sh vmmipc_peer_test
status=0
out=$(build/tests/vmmipc_peer_test) || status=$?
echo "$out"
echo "exit $status"
p=$(echo "$out" | grep -c '^PASS' || true)
f=$(echo "$out" | grep -c '^FAIL' || true)
echo "$p passed, $f failed"
[ "$f" -eq 0 ] && [ "$status" -eq 0 ]
