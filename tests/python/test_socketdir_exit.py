"""An exporter in VMMIPC_SOCKET_DIR removes its socket and lock at exit()
in the directory it made them in, wherever the path leads by then:
export/abi.c removes them through a descriptor of the directory the server
checked when it started, never through the path. A symlink re-pointed
meanwhile at a directory holding files of the same names leaves those
files alone (core/socketdir_repoint_test.go plays another uid; this plays
only the re-pointing, which needs no root)."""

import os
import subprocess
import sys
import tempfile

import conftest

# Registers a host buffer, prints the names of its files, waits for the test
# to re-point the path, then exits: exit() runs the library's handler.
EXPORTER = """
import os, sys
import vmmipc
hb = vmmipc.HostBuffer(4096)
hb.grant()
print(" ".join(sorted(os.listdir(sys.argv[1]))), flush=True)
sys.stdin.readline()
"""


def test_exit_removes_its_files_where_it_made_them():
    with tempfile.TemporaryDirectory(prefix="vmmipc-") as root:  # short: a socket path has 107 bytes
        private, elsewhere = os.path.join(root, "private"), os.path.join(root, "elsewhere")
        os.mkdir(private, 0o700)
        os.mkdir(elsewhere, 0o700)
        link = os.path.join(root, "link")
        os.symlink(private, link)
        env = dict(os.environ, VMMIPC_SOCKET_DIR=link, PYTHONPATH=conftest.PYTHON_DIR)
        p = subprocess.Popen([sys.executable, "-c", EXPORTER, private], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            names = p.stdout.readline().split()
            assert [n.rsplit(".", 1)[1] for n in names] == ["lock", "sock"], (names, p.stderr.read() if not names else "")
            for n in names:
                with open(os.path.join(elsewhere, n), "w") as f:
                    f.write("theirs")
            os.unlink(link)
            os.symlink(elsewhere, link)
            _, err = p.communicate("exit\n", timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        assert p.returncode == 0, err[-2000:]
        assert os.listdir(private) == [], "the exporter's exit() left its own files"
        for n in names:
            with open(os.path.join(elsewhere, n)) as f:
                assert f.read() == "theirs", f"the exporter's exit() removed {n} in the directory the path leads to now"


# Tries to register with the socket directory the test set, and prints the
# exception's class, status and message.
REFUSED = """
import vmmipc
try:
    vmmipc.HostBuffer(4096).grant()
    print("registered")
except vmmipc.VmmipcError as e:
    print(type(e).__name__, e.status_name, e)
"""


def test_unsafe_or_missing_socket_dir_is_a_config_error():
    """A socket directory others may write (mode 0777, no sticky bit) or one
    that is missing is the caller's configuration: ConfigError
    (VMMIPC_ECONFIG) naming VMMIPC_SOCKET_DIR and what to change, not an I/O
    error (VmmipcIOError) that a caller might retry."""
    with tempfile.TemporaryDirectory(prefix="vmmipc-") as root:
        open_dir = os.path.join(root, "open")
        os.mkdir(open_dir)
        os.chmod(open_dir, 0o777)
        cases = {open_dir: "is writable by other users (mode 0777) and has no sticky bit",
                 os.path.join(root, "missing"): "no such directory"}
        for path, want in cases.items():
            env = dict(os.environ, VMMIPC_SOCKET_DIR=path, PYTHONPATH=conftest.PYTHON_DIR)
            r = subprocess.run([sys.executable, "-c", REFUSED], env=env, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 0, r.stderr[-2000:]
            out = r.stdout.strip()
            assert out.startswith("ConfigError VMMIPC_ECONFIG "), out
            assert "VMMIPC_SOCKET_DIR" in out and want in out, out
