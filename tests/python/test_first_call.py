"""The first call of vmmipc in a fresh process: it loads the package's own
libvmmipc.so without starting a process (ctypes.util.find_library runs
ldconfig and a compiler: it is the last resort, asked only when nothing
else loads), and costs about what the dlopen itself costs.

Run as a script for the numbers alone:
    python3 tests/python/test_first_call.py [runs]
(bench/results/2026-12-01-first-call.md records them)."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import conftest

# Every audit event by which Python starts or becomes another process.
SPAWN_EVENTS = ("subprocess.Popen", "os.posix_spawn", "os.fork", "os.forkpty", "os.exec",
                "os.spawn", "os.system", "os.startfile", "pty.spawn")

CHILD = textwrap.dedent("""
    import sys
    started = []
    def hook(event, args):
        if event.startswith({events!r}):
            started.append((event, repr(args)[:200]))
    sys.addaudithook(hook)
    import vmmipc
    vmmipc.version()                        # the first call: loads the library
    vmmipc.HostBuffer(4096).close()         # and one that starts the server
    print("started:", started)
    print("loaded:", [l.split()[-1] for l in open("/proc/self/maps") if "libvmmipc" in l][0])
""")


def installed_copy(tmp_path):
    """The package as `pip install ./python` lays it out: libvmmipc.so inside."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(conftest.PYTHON_DIR, "vmmipc"), site / "vmmipc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(conftest.LIBRARY, site / "vmmipc" / "libvmmipc.so")
    return site


def child_env(site, **more):
    env = dict(os.environ, PYTHONPATH=str(site), **more)
    env.pop("VMMIPC_LIBRARY", None)  # the package's own library, found as installed
    return env


def test_loading_starts_no_process(tmp_path):
    site = installed_copy(tmp_path)
    code = CHILD.format(events=SPAWN_EVENTS)
    r = subprocess.run([sys.executable, "-c", code], env=child_env(site), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "started: []" in r.stdout, f"loading vmmipc started a process: {r.stdout}"
    assert f"loaded: {site / 'vmmipc' / 'libvmmipc.so'}" in r.stdout, r.stdout


def test_find_library_is_still_the_last_resort(tmp_path):
    """A library that only the system's tools know of is still found: with
    none in the package or its usual places, find_library is asked (here a
    stand-in for it, since this machine has no installed libvmmipc)."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(conftest.PYTHON_DIR, "vmmipc"), site / "vmmipc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    code = textwrap.dedent(f"""
        import ctypes.util, vmmipc
        from vmmipc import _lib
        asked = []
        def find_library(name):
            asked.append(name)
            return {conftest.LIBRARY!r}
        ctypes.util.find_library = find_library
        found = [p for p in _lib.candidate_paths() if "/" in p and __import__("os").path.exists(p)]
        if found:
            print("skip: an installed libvmmipc.so", found)
        else:
            vmmipc.version()
            print("asked:", asked, "loaded:", _lib.lib() is not None)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=child_env(site), cwd=str(tmp_path),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    if r.stdout.startswith("skip:"):
        pytest.skip(r.stdout.strip())
    assert r.stdout.strip() == "asked: ['vmmipc'] loaded: True", r.stdout


def test_exit_hooks_run_without_multiprocessing(tmp_path):
    """A process that never imports multiprocessing gets its exit hooks
    (registrations with Python callbacks ended while Python is whole) from
    atexit, in exitpriority order; importing multiprocessing for them was
    most of the first call's cost."""
    code = textwrap.dedent("""
        import os, sys
        import vmmipc
        from vmmipc import _lib
        def export(i):
            return os.memfd_create("x")
        vmmipc.register([4096], export, release=lambda: print("released", flush=True))
        _lib.at_exit(lambda: print("hook -50", flush=True), -50)
        _lib.at_exit(lambda: print("hook -200", flush=True), -200)
        print("multiprocessing imported:", "multiprocessing" in sys.modules, flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR))
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == ["multiprocessing imported: False", "hook -50", "released",
                                     "hook -200"], r.stdout


# -- how long the first call takes, against a bare dlopen -----------------------

TIME_FIRST_CALL = textwrap.dedent("""
    import time
    import vmmipc
    t0 = time.perf_counter()
    vmmipc.version()
    t1 = time.perf_counter()
    vmmipc.HostBuffer(4096).close()
    t2 = time.perf_counter()
    print(t1 - t0, t2 - t1)
""")

TIME_DLOPEN = textwrap.dedent("""
    import ctypes, sys, time
    t0 = time.perf_counter()
    ctypes.CDLL(sys.argv[1])
    print(time.perf_counter() - t0)
""")

TIME_IMPORT = textwrap.dedent("""
    import time
    t0 = time.perf_counter()
    import vmmipc
    print(time.perf_counter() - t0)
""")


def measure(site, runs: int) -> dict:
    """Fresh processes, interleaved (the machine's load falls on both
    alike); the least of `runs` of each, in seconds."""
    env = child_env(site)
    library = str(site / "vmmipc" / "libvmmipc.so")
    out = {"first call (version)": [], "first HostBuffer": [], "bare dlopen": [],
           "import vmmipc": []}
    for _ in range(runs):
        first = subprocess.run([sys.executable, "-c", TIME_FIRST_CALL], env=env,
                               capture_output=True, text=True, timeout=60, check=True)
        a, b = map(float, first.stdout.split())
        out["first call (version)"].append(a)
        out["first HostBuffer"].append(b)
        bare = subprocess.run([sys.executable, "-c", TIME_DLOPEN, library], env=env,
                              capture_output=True, text=True, timeout=60, check=True)
        out["bare dlopen"].append(float(bare.stdout))
        imp = subprocess.run([sys.executable, "-c", TIME_IMPORT], env=env,
                             capture_output=True, text=True, timeout=60, check=True)
        out["import vmmipc"].append(float(imp.stdout))
    return {k: min(v) for k, v in out.items()}


def report(best: dict) -> str:
    ratio = best["first call (version)"] / best["bare dlopen"]
    lines = [f"{k:22s} {v * 1e3:7.2f} ms" for k, v in best.items()]
    return "\n".join(lines + [f"first call / bare dlopen: {ratio:.2f}x"])


def test_first_call_costs_about_a_dlopen(tmp_path):
    """The target: the first call (which loads the library) within 3x a bare
    ctypes.CDLL of the same file. It was 10x and more: find_library's
    subprocesses and importing multiprocessing for the exit hooks."""
    best = measure(installed_copy(tmp_path), runs=7)
    print("\n" + report(best))
    assert best["first call (version)"] <= 3 * best["bare dlopen"], report(best)


if __name__ == "__main__":
    import tempfile
    import pathlib
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    with tempfile.TemporaryDirectory() as d:
        print(report(measure(installed_copy(pathlib.Path(d)), runs)))
