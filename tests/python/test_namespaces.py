"""The Python quick start with its spawned child in a container of its own
(tests/namespaces/container.sh: PID, network and mount namespaces, only the
socket directory shared): multiprocessing's executable is a wrapper that
starts each child there. With VMMIPC_SOCKET_DIR the child writes into the
parent's buffer and the parent's socket files are gone after it exits;
without it, the child's error names the cause. Skipped where namespaces
cannot be made (they need root or unprivileged user namespaces)."""

import os
import shutil
import stat
import subprocess
import sys
import tempfile

import pytest

import conftest

CONTAINER = os.path.join(conftest.ROOT, "tests", "namespaces", "container.sh")
NEW_LAB = os.path.join(conftest.ROOT, "tests", "namespaces", "new_lab.sh")
QUICKSTART = os.path.join(conftest.ROOT, "examples", "python", "quickstart.py")

# Runs the quick start unchanged, with multiprocessing starting every child
# through the wrapper.
DRIVER = """
import multiprocessing, runpy, sys
multiprocessing.set_executable(sys.argv[1])
runpy.run_path(sys.argv[2], run_name="__main__")
"""


@pytest.fixture
def lab():
    made = subprocess.run(["sh", NEW_LAB], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(made.stderr.strip())
    root = made.stdout.strip()
    shared = os.path.join(root, "shared")
    # The wrapper lives outside root, which each container covers.
    fd, wrapper = tempfile.mkstemp(prefix="vmmipc-ns-python-")
    with os.fdopen(fd, "w") as f:
        f.write(f'#!/bin/sh\nexec sh "{CONTAINER}" "{shared}" "{root}" "{sys.executable}" "$@"\n')
    os.chmod(wrapper, stat.S_IRWXU)
    yield shared, wrapper
    os.unlink(wrapper)
    shutil.rmtree(root)


def run_quickstart(wrapper, socket_dir=None):
    env = {k: v for k, v in os.environ.items() if k != "VMMIPC_SOCKET_DIR"}
    env["PYTHONPATH"] = conftest.PYTHON_DIR
    if socket_dir:
        env["VMMIPC_SOCKET_DIR"] = socket_dir
    return subprocess.run([sys.executable, "-c", DRIVER, wrapper, QUICKSTART], env=env,
                          capture_output=True, text=True, timeout=120)


def test_quickstart_child_in_another_container(lab):
    shared, wrapper = lab
    r = run_quickstart(wrapper, shared)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "b'HELLO'", (r.stdout, r.stderr)
    assert os.listdir(shared) == [], "the parent's socket files outlived it"


def test_quickstart_without_socket_dir_names_the_cause(lab):
    _, wrapper = lab
    r = run_quickstart(wrapper)
    assert "b'HELLO'" not in r.stdout
    assert "abstract sockets do not cross network namespaces; set VMMIPC_SOCKET_DIR" in r.stderr, r.stderr
