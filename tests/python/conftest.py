"""Shared setup for the Python tests: use the checkout's python/ package and
its build/libvmmipc.so (or $VMMIPC_LIBRARY, to test another build).

Without a library the run FAILS at once (exit status 4) with the command
that builds it: a suite that skips everything would pass in a fresh clone
and prove nothing. No test here needs a GPU (tests/gpu/ has those)."""

import importlib.util
import mmap
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

import vmmipc  # noqa: E402  (after the path set-up; importing loads nothing)
from _mp_helpers import pattern  # noqa: E402

PAGE = mmap.PAGESIZE

# The directory that holds the vmmipc package under test: a child process
# run as a script gets it on PYTHONPATH.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(vmmipc.__file__)))

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def needs_torch(these: str):
    """The skip marker of tests that need torch's CPU build; these names them
    in the reason."""
    return pytest.mark.skipif(
        not HAVE_TORCH, reason=f"PyTorch is not installed for this Python; {these} need its CPU "
        "build (pip install torch), which `make test VMMIPC_TEST_TORCH=1` (.ci/run) installs "
        "into build/torch-venv")

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


# -- fixtures and fixture makers shared by the test modules -------------------

@pytest.fixture(scope="module")
def server_running():
    """This process's server (its listening socket) and receiver, started
    once per module that asks for them, so that per-test descriptor
    baselines do not count them."""
    b = vmmipc.HostBuffer(PAGE)
    vmmipc.import_stream(b.grant(), cache=False).close()
    b.close()


def filled_host_buffer(n_chunks: int, chunk_size: int, seed: int):
    """For a fixture (`yield from` it): a HostBuffer of n_chunks chunks that
    holds pattern(n_chunks, chunk_size, seed); afterwards every share of it
    ends and it is closed."""
    b = vmmipc.HostBuffer(n_chunks * chunk_size, chunk_size=chunk_size)
    b.view[:] = pattern(n_chunks, chunk_size, seed)
    yield b
    b.unregister_all()
    b.close()


@pytest.fixture
def hb():
    """A HostBuffer of 16 one-page chunks (pattern seed 7)."""
    yield from filled_host_buffer(16, PAGE, seed=7)
