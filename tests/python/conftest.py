"""Shared setup for the Python tests: use the checkout's python/ package and
its build/libvmmipc.so (or $VMMIPC_LIBRARY, to test another build).

Without a library the run FAILS at once (exit status 4) with the command
that builds it: a suite that skips everything would pass in a fresh clone
and prove nothing. No test here needs a GPU (tests/gpu/ has those)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD_LIBRARY = os.path.join(ROOT, "build", "libvmmipc.so")
PYTHON_DIR = os.path.join(ROOT, "python")
HERE = os.path.dirname(os.path.abspath(__file__))

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)
# Children (spawn, forkserver) inherit it: every process loads this build.
LIBRARY = os.environ.setdefault("VMMIPC_LIBRARY", BUILD_LIBRARY)

MISSING_MESSAGE = (
    f"tests/python need libvmmipc.so, and {LIBRARY} does not exist. Build it first: "
    "`make lib` (needs Go; see README.md), then run `python3 -m pytest tests/python` again "
    "(or `make test-python`, which builds it). To test another build, set VMMIPC_LIBRARY "
    "to its path.")


def pytest_collection_modifyitems(config, items):
    # After collection, so that this holds however pytest was started (this
    # directory, one file, or the repository root).
    if not os.path.exists(LIBRARY) and any(str(i.fspath).startswith(HERE) for i in items):
        pytest.exit(MISSING_MESSAGE, returncode=pytest.ExitCode.USAGE_ERROR)


def pytest_report_header(config):
    state = "found" if os.path.exists(LIBRARY) else "MISSING: the run will fail"
    return f"libvmmipc: {LIBRARY} {state}"
