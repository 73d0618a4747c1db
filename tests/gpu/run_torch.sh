#!/bin/sh
# Runs the vmmipc.torch GPU test (tests/gpu/test_torch.py) twice: plainly,
# then under tests/gpu/no_pidfd_getfd, a seccomp filter that refuses
# pidfd_getfd with EPERM as a container without CAP_SYS_PTRACE does. The
# second run also shows torch's own expandable-segment sharing failing
# ("pidfd_getfd: Operation not permitted"). Needs a CUDA GPU, PyTorch, gcc
# and build/libvmmipc.so (`make lib`). Run from the repository root;
# arguments pick scenarios (default: all). Exits non-zero if either run
# failed.
set -u
PYTHON=${PYTHON:-python3}
out=build/tests
mkdir -p "$out"
gcc -O2 -Wall -Wextra -o "$out/no_pidfd_getfd" tests/gpu/no_pidfd_getfd.c || exit 1
export PYTHONUNBUFFERED=1

echo "== run 1 of 2: plain"
"$PYTHON" tests/gpu/test_torch.py "$@"
plain=$?
echo "== run 2 of 2: under no_pidfd_getfd (pidfd_getfd refused with EPERM)"
VMMIPC_TEST_EXPECT_NO_PIDFD_GETFD=1 "$out/no_pidfd_getfd" "$PYTHON" tests/gpu/test_torch.py "$@"
filtered=$?
echo "run_torch: plain exit $plain, under the filter exit $filtered"
[ "$plain" -eq 0 ] && [ "$filtered" -eq 0 ]
