"""A receiver that holds a HostBuffer's descriptor cannot seal it (issue 27
item 2): every receiver gets a read-write descriptor of the owner's memfd,
and before, one could add F_SEAL_FUTURE_WRITE (or, once the owner had
closed, F_SEAL_WRITE) and F_SEAL_SEAL, after which every later receiver was
refused ("mmap: operation not permitted"), although registrations already
pickled are promised to stay fetchable (python/README.md)."""

import fcntl
import mmap
import os
import pickle
import subprocess
import sys

import pytest

import conftest
import vmmipc
from vmmipc import _memfd

PAGE = mmap.PAGESIZE
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)  # Linux 5.1
pytestmark = pytest.mark.usefixtures("server_running")

# The hostile receiver: pulls the first chunk of the ticket in argv[1] (hex),
# keeps its descriptor, closes the stream (which gives the use back) and tries
# each seal; prints what each attempt got.
RECEIVER = f"""
import errno, fcntl, sys
import vmmipc
with vmmipc.open(bytes.fromhex(sys.argv[1])) as s:
    fd = next(s).detach()
got = []
for bits in ({F_SEAL_FUTURE_WRITE} | fcntl.F_SEAL_SEAL, fcntl.F_SEAL_WRITE, {F_SEAL_FUTURE_WRITE},
             fcntl.F_SEAL_SEAL):
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, bits)
        got.append("added")
    except OSError as e:
        got.append(errno.errorcode[e.errno])
print(" ".join(got))
"""


def test_a_hostbuffers_memfd_takes_no_more_seals():
    fd = _memfd.sealed_memfd("vmmipc-test", 4 * PAGE)
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        want = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
        assert seals == want, f"seals {seals:#x}, want {want:#x}"
    finally:
        os.close(fd)


def test_a_receiver_cannot_seal_a_hostbuffer():
    hb = vmmipc.HostBuffer(4 * PAGE, chunk_size=PAGE)
    hb[:] = bytes(range(256)) * (4 * PAGE // 256)
    blob = pickle.dumps(hb)  # pickled before the attack: must stay fetchable
    t = hb.grant(uses=0)  # unlimited: each attack pulls it
    env = dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR)

    def attack(when):
        r = subprocess.run([sys.executable, "-c", RECEIVER, t.hex()], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.split() == ["EPERM"] * 4, f"{when}: the receiver's seals got {r.stdout!r}"

    attack("while the owner has it mapped")
    hb.close()  # no writable mapping is left: F_SEAL_WRITE would be allowed
    attack("after the owner closed")
    got = pickle.loads(blob)
    try:
        assert bytes(got) == bytes(range(256)) * (4 * PAGE // 256)
    finally:
        got.close()
    vmmipc.unregister(t)


# Registering a memfd that fails leaves its seals as they were (issue 31
# item 9): F_SEAL_SEAL is the call's last step. Each case runs in a process
# of its own (a server that could not start, a descriptor table that is
# full): makes a memfd sealed against shrinking only, registers it, prints
# the status's name and the seals before and after.
SEALS_ON_FAILURE = """
import fcntl, os, resource, sys
import vmmipc
def memfd():
    fd = os.memfd_create("vmmipc-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, 4096)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
    return fd
fd = memfd()
if sys.argv[1] == "full":
    keep = vmmipc.register_host_file(memfd(), 4096, 4096, uses=0)  # the server runs
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
before = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
try:
    vmmipc.register_host_file(fd, 4096, 4096)
    got = "OK"
except vmmipc.VmmipcError as e:
    got = type(e).__name__
print(got, before, fcntl.fcntl(fd, fcntl.F_GET_SEALS))
"""


@pytest.mark.parametrize("case, env, error", [
    ("no socket directory", {"VMMIPC_SOCKET_DIR": "/nonexistent/vmmipc-sockets"}, "ConfigError"),
    ("full", {}, "OutOfDescriptorsError"),
])
def test_a_failed_registration_leaves_the_seals(case, env, error):
    r = subprocess.run([sys.executable, "-c", SEALS_ON_FAILURE, case],
                       env=dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR, **env),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    got, before, after = r.stdout.split()
    assert got == error, f"{case}: registering got {got}, want {error}"
    assert int(after) == int(before) == fcntl.F_SEAL_SHRINK, \
        f"{case}: seals {int(before):#x} before the failed registration, {int(after):#x} after"
