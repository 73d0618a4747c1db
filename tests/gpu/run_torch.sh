#!/bin/sh
# Runs a vmmipc.torch GPU test twice: plainly, then under
# tests/gpu/no_pidfd_getfd, a seccomp filter that refuses pidfd_getfd with
# EPERM as a container without CAP_SYS_PTRACE does. The test is
# tests/gpu/test_torch.py, or $TORCH_TEST (tests/gpu/test_torch_model.py:
# models, the bulk API, a killed sender; tests/gpu/test_torch_mp.py: the CUDA
# scenarios of PyTorch's own test_multiprocessing.py, send-delete-reuse,
# receivers that die, send_many timed next to torch's own path;
# tests/gpu/test_torch_pool.py: vmmipc.torch.sharing_pool). For
# test_torch.py the second run
# also shows torch's own expandable-segment sharing failing ("pidfd_getfd:
# Operation not permitted"). Needs a CUDA GPU, PyTorch, gcc and
# build/libvmmipc.so (`make lib`). Run from the repository root; arguments
# pick scenarios (default: all). Exits non-zero if either run failed.
#
#   sh tests/gpu/run_torch.sh [scenario...]
#   TORCH_TEST=tests/gpu/test_torch_model.py sh tests/gpu/run_torch.sh [scenario...]
#   TORCH_TEST=tests/gpu/test_torch_pool.py sh tests/gpu/run_torch.sh [scenario...]
#   TORCH_TEST=tests/gpu/test_torch_mp.py sh tests/gpu/run_torch.sh [scenario...]
set -u
PYTHON=${PYTHON:-python3}
TEST=${TORCH_TEST:-tests/gpu/test_torch.py}
sh tests/gpu/no_pidfd_getfd.sh true || exit 1 # builds the filter; fails early without gcc
export PYTHONUNBUFFERED=1

echo "== run 1 of 2: plain"
"$PYTHON" "$TEST" "$@"
plain=$?
echo "== run 2 of 2: under no_pidfd_getfd (pidfd_getfd refused with EPERM)"
VMMIPC_TEST_EXPECT_NO_PIDFD_GETFD=1 sh tests/gpu/no_pidfd_getfd.sh "$PYTHON" "$TEST" "$@"
filtered=$?
echo "run_torch ($TEST): plain exit $plain, under the filter exit $filtered"
[ "$plain" -eq 0 ] && [ "$filtered" -eq 0 ]
