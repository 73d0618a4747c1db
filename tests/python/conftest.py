"""Shared setup for the Python tests: use the checkout's python/ package and
build/libvmmipc.so, and skip everything, with the reason, when the library
has not been built."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIBRARY = os.path.join(ROOT, "build", "libvmmipc.so")
PYTHON_DIR = os.path.join(ROOT, "python")

if PYTHON_DIR not in sys.path:
    sys.path.insert(0, PYTHON_DIR)
if os.path.exists(LIBRARY):
    # Children (spawn, forkserver) inherit it: every process loads this build.
    os.environ.setdefault("VMMIPC_LIBRARY", LIBRARY)

SKIP_REASON = f"{LIBRARY} is missing: run `make lib` first"


def pytest_collection_modifyitems(config, items):
    if os.path.exists(LIBRARY):
        return
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


def pytest_report_header(config):
    state = "found" if os.path.exists(LIBRARY) else "MISSING (tests/python will skip)"
    return f"libvmmipc: {LIBRARY} {state}"
