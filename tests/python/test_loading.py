"""Finding and loading libvmmipc.so, and failing fast without it: a missing
or unloadable library raises before any child process is started (the
README quick start exits non-zero within seconds), an installed package
never looks into a checkout it is not in, a library that lacks part of the
contract is named as such, and the test suite itself fails, saying how to
build the library, when there is none."""

import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import conftest

README = os.path.join(conftest.PYTHON_DIR, "README.md")


def python_readme_quick_start() -> str:
    """The first Python block under "## Quick start" in python/README.md."""
    with open(README) as f:
        text = f.read()
    section = text[text.index("## Quick start"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def readme_quick_start() -> str:
    """README.md's Python quick start (an excerpt of this example)."""
    with open(os.path.join(conftest.ROOT, "examples", "python", "quickstart.py")) as f:
        return f.read()


QUICK_STARTS = {"python/README.md": python_readme_quick_start, "README.md": readme_quick_start}


def run(args, timeout, cwd=None, **env):
    e = dict(os.environ, **env)
    for k, v in env.items():
        if v is None:
            del e[k]
    t0 = time.monotonic()
    r = subprocess.run(args, env=e, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    return r, time.monotonic() - t0


@pytest.mark.parametrize("readme", QUICK_STARTS)
def test_quick_start_works(tmp_path, readme):
    script = tmp_path / "quick_start.py"
    script.write_text(QUICK_STARTS[readme]())
    r, _ = run([sys.executable, str(script)], 60, PYTHONPATH=conftest.PYTHON_DIR)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "b'HELLO'"


@pytest.mark.parametrize("readme", QUICK_STARTS)
def test_quick_start_fails_fast_without_a_loadable_library(tmp_path, readme):
    not_a_library = tmp_path / "libvmmipc.so"
    not_a_library.write_text("this is not an ELF file\n" * 100)  # > an ELF header
    script = tmp_path / "quick_start.py"
    script.write_text(QUICK_STARTS[readme]())
    r, elapsed = run([sys.executable, str(script)], 30, PYTHONPATH=conftest.PYTHON_DIR,
                     VMMIPC_LIBRARY=str(not_a_library))
    assert r.returncode != 0 and elapsed < 10, (r.returncode, elapsed)
    assert "LibraryNotFoundError" in r.stderr and str(not_a_library) in r.stderr
    assert "invalid ELF header" in r.stderr
    # it failed in the parent, at HostBuffer(...), before any child was started
    assert "HostBuffer" in r.stderr and "p.start()" not in r.stderr


def test_feeder_thread_failure_reaches_the_receiver_without_a_library(tmp_path):
    """vmmipc.cuda_core-style: a reducer that first loads the library inside
    a Queue's feeder thread. The receiver's get() raises the sender's error
    instead of waiting forever."""
    code = textwrap.dedent("""
        import multiprocessing as mp, sys
        import vmmipc
        from vmmipc import _mp, _reductions

        class NeedsLibrary:
            pass

        def reduce(obj):
            return _mp.guarded_reduce("NeedsLibrary", lambda: (int, (vmmipc.live_registrations(),)))

        def child(q, out):
            try:
                q.get(timeout=20)
                out.put("no error")
            except vmmipc.LibraryNotFoundError as e:
                out.put("LibraryNotFoundError: " + str(e) + " | " + " ".join(getattr(e, "__notes__", [])))
            except BaseException as e:
                out.put("other: " + repr(e))

        if __name__ == "__main__":
            _reductions.init_reductions(_reductions.Reductions(forking=((NeedsLibrary, reduce),)))
            ctx = mp.get_context("spawn")
            q, out = ctx.Queue(), ctx.Queue()
            p = ctx.Process(target=child, args=(q, out))
            p.start()
            q.put(NeedsLibrary())
            print(out.get(timeout=30))
            p.join(30)
    """)
    script = tmp_path / "feeder.py"
    script.write_text(code)
    r, elapsed = run([sys.executable, str(script)], 60, PYTHONPATH=conftest.PYTHON_DIR,
                     VMMIPC_LIBRARY="/nonexistent/libvmmipc.so")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("LibraryNotFoundError: "), r.stdout
    assert "/nonexistent/libvmmipc.so" in r.stdout and "sending process" in r.stdout
    assert "pickling a NeedsLibrary" in r.stderr  # and the sender logged it
    assert elapsed < 20


def installed_copy(tmp_path, with_library):
    """The package copied into a fresh site directory, as pip would place it."""
    site = tmp_path / "site"
    shutil.copytree(os.path.join(conftest.PYTHON_DIR, "vmmipc"), site / "vmmipc",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    if with_library:
        shutil.copy(conftest.LIBRARY, site / "vmmipc" / "libvmmipc.so")
    return site


def test_installed_package_loads_the_library_next_to_it(tmp_path):
    site = installed_copy(tmp_path, with_library=True)
    r, _ = run([sys.executable, "-c", "import vmmipc; vmmipc.version(); "
                "print([l.split()[-1] for l in open('/proc/self/maps') if 'libvmmipc' in l][0])"],
               30, cwd=str(tmp_path), PYTHONPATH=str(site), VMMIPC_LIBRARY=None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(site / "vmmipc" / "libvmmipc.so")


def test_installed_package_without_library_says_what_it_tried(tmp_path):
    site = installed_copy(tmp_path, with_library=False)
    code = ("import vmmipc\nfrom vmmipc import _lib\n"
            "print(repr(_lib.candidate_paths()))\n"
            "try:\n    vmmipc.HostBuffer(4096)\nexcept vmmipc.LibraryNotFoundError as e:\n"
            "    print(e)\n")
    r, _ = run([sys.executable, "-c", code], 30, cwd=str(tmp_path), PYTHONPATH=str(site),
               VMMIPC_LIBRARY=None)
    assert r.returncode == 0, r.stderr
    paths, message = r.stdout.split("\n", 1)
    found = [p for p in eval(paths) if os.sep in p and os.path.exists(p)]
    if found:
        pytest.skip(f"this machine has an installed libvmmipc.so: {found}")
    assert not any(conftest.ROOT in p for p in eval(paths)), "looked into a checkout it is not in"
    assert str(site / "vmmipc" / "libvmmipc.so") + " (does not exist)" in message
    assert "/usr/local/lib/libvmmipc.so (does not exist)" in message
    for fix in ("make lib", "pip install ./python", "make install", "VMMIPC_LIBRARY"):
        assert fix in message, fix


def test_library_in_another_package_path_directory_is_found(tmp_path):
    """An editable install (scikit-build-core) imports the source package and
    adds the directory its build installed into to the package's __path__:
    the library there is found (tests/install/test_editable.sh does it for
    real)."""
    site = installed_copy(tmp_path, with_library=False)
    built = tmp_path / "built" / "vmmipc"
    built.mkdir(parents=True)
    shutil.copy(conftest.LIBRARY, built / "libvmmipc.so")
    r, _ = run([sys.executable, "-c", f"import vmmipc; vmmipc.__path__.append({str(built)!r}); "
                "vmmipc.version(); "
                "print([l.split()[-1] for l in open('/proc/self/maps') if 'libvmmipc' in l][0])"],
               30, cwd=str(tmp_path), PYTHONPATH=str(site), VMMIPC_LIBRARY=None)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(built / "libvmmipc.so")


def test_checkout_package_finds_the_build():
    from vmmipc import _lib
    env = os.environ.pop("VMMIPC_LIBRARY")
    try:
        assert os.path.join(conftest.ROOT, "build", "libvmmipc.so") in _lib.candidate_paths()
    finally:
        os.environ["VMMIPC_LIBRARY"] = env


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build a stand-in")
def test_library_without_the_whole_contract_is_named(tmp_path):
    src = tmp_path / "old.c"
    src.write_text('const char *vmmipc_version(void) { return "0.1.0"; }\n'
                   'int vmmipc_options_init(void *o, unsigned long n) { return 0; }\n')
    lib = tmp_path / "libvmmipc.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    r, _ = run([sys.executable, "-c", "import vmmipc; vmmipc.live_registrations()"], 30,
               PYTHONPATH=conftest.PYTHON_DIR, VMMIPC_LIBRARY=str(lib))
    assert r.returncode != 0
    assert "LibraryNotFoundError" in r.stderr and "libvmmipc 0.1.0 without" in r.stderr
    assert "vmmipc_register_again" in r.stderr and "vmmipc_options_init," not in r.stderr


def test_suite_fails_without_the_library_and_says_how_to_build_it():
    r, _ = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                os.path.join(conftest.HERE, "test_architecture.py")], 60,
               cwd=conftest.ROOT, VMMIPC_LIBRARY="/nonexistent/libvmmipc.so")
    out = r.stdout + r.stderr
    assert r.returncode == 4, out  # pytest's usage error: not "passed", not "skipped"
    assert "/nonexistent/libvmmipc.so does not exist" in out and "make lib" in out
