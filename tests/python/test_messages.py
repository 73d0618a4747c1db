"""What vmmipc tells a Python caller, in the Python API's terms: errors name
the Python call (Ticket.info, not vmmipc_ticket_decode) and its arguments
(timeout= in seconds, not timeout_ms); a library that exists but does not
load says why first; running out of descriptors is OutOfDescriptorsError
wherever it happens; pending_tickets() lists only grants still live."""

import ctypes
import glob
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import conftest
import vmmipc
from vmmipc import _errors, _lib

PAGE = 4096
pytestmark = pytest.mark.usefixtures("server_running")


def run_child(code: str, **env) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR)
    for k, v in env.items():
        if v is None:
            e.pop(k, None)
        else:
            e[k] = v
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                          capture_output=True, text=True, timeout=60)


# -- loading -------------------------------------------------------------------

def test_a_library_that_does_not_load_says_why_first(tmp_path):
    """Under an address-space limit dlopen fails ("failed to map segment");
    that is the error, not "cannot find libvmmipc.so" with the cause
    somewhere in a list of places that have no library."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(conftest.PYTHON_DIR, "vmmipc"), site / "vmmipc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    library = site / "vmmipc" / "libvmmipc.so"
    shutil.copy(conftest.LIBRARY, library)
    r = run_child("""
        import resource, vmmipc
        def vm_size():
            for line in open("/proc/self/status"):
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
        # 1 MiB more than now: Python goes on, a 3 MiB library cannot be mapped
        resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (1 << 20), resource.RLIM_INFINITY))
        try:
            vmmipc.version()
        except vmmipc.LibraryNotFoundError as e:
            print(e)
    """, PYTHONPATH=str(site), VMMIPC_LIBRARY=None)
    assert r.returncode == 0, r.stderr
    message = r.stdout.strip()
    assert message.startswith(f"cannot load {library}: failed to map segment"), message
    assert "RLIMIT_AS" in message, "it says what to do"


def test_an_unloadable_library_named_by_the_variable_says_why(tmp_path):
    bad = tmp_path / "libvmmipc.so"
    bad.write_text("not an ELF file\n" * 100)
    r = run_child("""
        import vmmipc
        try:
            vmmipc.version()
        except vmmipc.LibraryNotFoundError as e:
            print(e)
    """, VMMIPC_LIBRARY=str(bad))
    message = r.stdout.strip()
    assert message.startswith(f"cannot load {bad} (from VMMIPC_LIBRARY): invalid ELF header"), \
        message
    assert "point VMMIPC_LIBRARY at a libvmmipc.so that loads" in message


# -- descriptors -----------------------------------------------------------------

def test_memfd_out_of_descriptors_is_out_of_descriptors_error():
    r = run_child("""
        import errno, os, resource, vmmipc
        vmmipc.version()                      # loaded, with its server's descriptors
        lowest_free = os.dup(0); os.close(lowest_free)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # none left
        try:
            vmmipc.HostBuffer(4096)
        except vmmipc.OutOfDescriptorsError as e:
            print("OutOfDescriptorsError", isinstance(e, OSError), e.errno == errno.EMFILE)
            print(e)
        except OSError as e:
            print("plain", type(e).__name__, e)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("after:", vmmipc.HostBuffer(4096).size)
    """)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "OutOfDescriptorsError True True", r.stdout
    assert lines[1].startswith("HostBuffer: cannot create the HostBuffer's memfd: Too many open "
                               "files: "), lines[1]
    assert "RLIMIT_NOFILE" in lines[1] and "[VMMIPC_ENFILE]" in lines[1]
    assert lines[2] == "after: 4096", "raising the limit again is all it takes"


# -- Python names, not C names ------------------------------------------------------

def test_errors_name_the_python_call():
    with pytest.raises(vmmipc.InvalidError) as e:
        vmmipc.Ticket(bytes(256)).info()
    assert e.value.function == "Ticket.info" and str(e.value).startswith("Ticket.info: "), e.value
    with pytest.raises(vmmipc.InvalidError) as e:
        vmmipc.unregister(bytes(256))
    assert str(e.value).startswith("vmmipc.unregister: "), e.value
    with pytest.raises(TypeError, match=r"^vmmipc\.import_stream: ticket must be"):
        vmmipc.import_stream("abc")
    with pytest.raises(TypeError, match=r"^vmmipc\.wait: timeout must be a number of seconds"):
        vmmipc.wait(bytes(256), timeout="1")
    with pytest.raises(vmmipc.InvalidError) as e:
        vmmipc.import_stream(bytes(256), timeout=-1)
    assert e.value.function == "vmmipc.import_stream" and "timeout=-1 seconds" in str(e.value)


def all_stopped(pid: int) -> bool:
    states = []
    for stat in glob.glob(f"/proc/{pid}/task/*/stat"):
        try:
            states.append(open(stat).read().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass  # a thread that just ended
    return bool(states) and all(s in ("T", "t") for s in states)


def test_a_silent_exporter_says_to_pass_a_larger_timeout():
    """The library says "raise timeout_ms"; a Python caller passed
    timeout= in seconds, and is told so."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, vmmipc\nhb = vmmipc.HostBuffer(4096)\n"
         "sys.stdout.buffer.write(hb.grant()); sys.stdout.flush(); sys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        env=dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR))
    try:
        ticket = child.stdout.read(256)
        os.kill(child.pid, signal.SIGSTOP)  # connected to, never answers
        while not all_stopped(child.pid):  # kill() returns before every thread has stopped
            time.sleep(0.01)
        with pytest.raises(vmmipc.VmmipcIOError) as e:
            vmmipc.import_stream(ticket, timeout=0.5, cache=False)
    finally:
        os.kill(child.pid, signal.SIGCONT)
        child.stdin.close()
        child.wait(30)
    msg = str(e.value)
    assert msg.startswith("vmmipc.import_stream: "), msg
    assert "pass a larger timeout=" in msg and "timeout_ms" not in msg, msg


def library_messages() -> list[str]:
    """Every message text of the Go code (format strings as written)."""
    texts = []
    for path in glob.glob(os.path.join(conftest.ROOT, "*", "*.go")):
        if path.endswith("_test.go"):
            continue
        with open(path) as f:
            texts += re.findall(r'"((?:[^"\\\n]|\\.)*)"', f.read())
    return texts


def test_every_library_message_reads_in_python_terms():
    """What python_message leaves of each message of the library: none of
    the C API's words that the Python API spells otherwise."""
    c_words = re.compile(r"timeout_ms|ttl_ms|VMMIPC_(DEVICE|MEMORY|IMPORT)_[A-Z_]+|\bvmmipc_[a-z_]+")
    # Messages about a NULL or short vmmipc_options struct are C-only: the
    # Python package always passes one it filled with vmmipc_options_init.
    texts = [t for t in library_messages() if c_words.search(t) and "vmmipc_options " not in t
             and "vmmipc_options o;" not in t]
    assert len(texts) > 20, "the scan found the library's messages"
    left = {t: _errors.python_message(t) for t in texts}
    bad = {t: p for t, p in left.items() if re.search(
        r"timeout_ms|ttl_ms|VMMIPC_(DEVICE|MEMORY|IMPORT)_|\bvmmipc_(?!fn\b)[a-z_]+\b", p)}
    assert not bad, bad
    assert _errors.python_message("x: raise timeout_ms if it is just slow") == \
        "x: pass a larger timeout= if it is just slow"
    assert _errors.python_message("pass VMMIPC_DEVICE_HOST, not device 3") == \
        "pass vmmipc.DEVICE_HOST, not device 3"


# -- pending_tickets ---------------------------------------------------------------

def _import_and_exit(ticket):
    vmmipc.import_stream(ticket, cache=False).close()


def test_pending_tickets_lists_only_grants_still_live(hb):
    """While this thread keeps the GIL (no library thread could call back
    into Python), a grant that a receiver has used up is not listed:
    pending_tickets() asks the library."""
    used, kept = hb.grant(), hb.grant()
    live_now = ctypes.PyDLL(None, handle=_lib.lib()._handle).vmmipc_live_registrations  # keeps the GIL
    count = ctypes.c_uint64()
    live_now(ctypes.byref(count))
    before = count.value
    p = mp.get_context("spawn").Process(target=_import_and_exit, args=(used,))
    p.start()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000)  # no other thread gets the GIL unless this one waits
    try:
        deadline = time.monotonic() + 60
        while count.value == before and time.monotonic() < deadline:
            live_now(ctypes.byref(count))  # spins, holding the GIL
        ended = count.value == before - 1
        pending = hb.pending_tickets()
    finally:
        sys.setswitchinterval(interval)
    p.join(30)
    assert ended, "the receiver did not use its grant within 60 s"
    assert pending == [kept], "a grant that has ended is listed"
    assert hb.wait(0.1) is False and hb.pending_tickets() == [kept]
    vmmipc.unregister(kept)
    assert hb.wait(5) and hb.pending_tickets() == []


def test_pickles_call_nothing_back_and_their_list_stays_bounded(hb):
    """A HostBuffer's grant keeps and holds nothing, so it is registered
    without a release callback (a library thread taking the GIL for every
    pickle cost the sender more than the grant); the buffer's list of them
    is pruned by asking the library, so it stays near the live ones however
    many pickles come and go, and pending_tickets() and wait() are as before."""
    from vmmipc import _register
    callbacks = len(_register._records)
    live = [hb.grant() for _ in range(100)]
    assert len(_register._records) == callbacks, "a pickle registered a Python callback"
    assert hb.pending_tickets() == live, "not every live grant is listed, in order"
    for _ in range(2000):
        vmmipc.unregister(hb.grant())  # ended at once, as a receiver's use ends it
    listed = len(hb._anchor._quiet)
    assert listed <= 2 * len(live) + 64, f"{listed} grants listed for {len(live)} live ones"
    assert hb.pending_tickets() == live
    for t in live[:-1]:
        vmmipc.unregister(t)
    assert hb.pending_tickets() == live[-1:] and hb.wait(0) is False
    vmmipc.unregister(live[-1])
    assert hb.wait(5) and hb.pending_tickets() == []
