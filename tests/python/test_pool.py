"""The pool made for sharing (include/vmmipc.h, "Pools") where no GPU is
needed: its C API's refusals and its behaviour without a CUDA driver, the
torch hooks' NULL-with-a-reason, vmmipc_pool_info's layout, and
vmmipc.torch.sharing_pool's errors without torch or without a GPU (with a
stand-in torch). The pool's bookkeeping is unit tested in Go
(core/pool_test.go); the GPU paths in tests/gpu/test_torch_pool.py."""

import ctypes
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

import conftest
from vmmipc import _lib

NO_DRIVER = "/nonexistent/libcuda.so.1"


def run_python(code, **env):
    """code in a fresh Python with this checkout's vmmipc and library, and
    env; VMMIPC_LIBCUDA is read by the library when it loads the driver, so
    it must be set before the process starts."""
    e = dict(os.environ, PYTHONPATH=conftest.PYTHON_DIR, **env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_pool_calls_without_a_driver():
    out = run_python("""
        import ctypes
        import vmmipc
        from vmmipc import _lib
        lib = _lib.lib()
        pool = ctypes.c_void_p()
        for fn, args in (("vmmipc_pool_create", (0, 0, 0, ctypes.byref(pool))),
                         ("vmmipc_torch_pool", (0, 64 << 20, ctypes.byref(pool)))):
            try:
                _lib.call(fn, *args)
                print(fn, "no error")
            except vmmipc.CudaError as e:
                print(fn, "CudaError", e)
        print("pool", pool.value)
        alloc = lib.vmmipc_torch_alloc
        alloc.restype, alloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        print("torch_alloc", alloc(2 << 20, 0, None), _lib.last_error())
        free = lib.vmmipc_torch_free
        free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        free(0x7f0000000000, 2 << 20, 0, None)
        print("torch_free", _lib.last_error())
    """, VMMIPC_LIBCUDA=NO_DRIVER)
    lines = dict(line.split(" ", 1) for line in out.splitlines())
    for fn in ("vmmipc_pool_create", "vmmipc_torch_pool"):
        assert lines[fn].startswith("CudaError") and NO_DRIVER in lines[fn], lines[fn]
    assert lines["pool"] == "None"  # nothing handed out
    # The hook cannot raise: NULL, and the reason in this thread's last error.
    assert lines["torch_alloc"].startswith("None ") and NO_DRIVER in lines["torch_alloc"], lines
    # Freeing into a device that has no torch pool: nothing made, the reason kept.
    assert "device 0 has no torch pool" in lines["torch_free"], lines


def test_pool_calls_refuse_bad_arguments():
    lib = _lib.lib()
    pool = ctypes.c_void_p()
    for fn, args, status, says in (
            ("vmmipc_pool_create", (0, 0, 0, None), -1, "pool_out is NULL"),
            ("vmmipc_torch_pool", (0, 0, None), -1, "pool_out is NULL"),
            ("vmmipc_pool_create", (-1, 0, 0, ctypes.byref(pool)), -1, "not a CUDA device ordinal"),
            ("vmmipc_pool_alloc", (None, 512, ctypes.byref(ctypes.c_uint64())), -2, "NULL, stale or destroyed"),
            ("vmmipc_pool_alloc", (0x1234, 512, ctypes.byref(ctypes.c_uint64())), -2, "pool handle 0x1234"),
            ("vmmipc_pool_free", (0x1234, 0x7f0000000000), -2, "NULL, stale or destroyed"),
            ("vmmipc_pool_trim", (0x1234, 0, None), -2, "NULL, stale or destroyed"),
            ("vmmipc_pool_get_info", (0x1234, ctypes.byref(_lib.vmmipc_pool_info()), 8), -2,
             "NULL, stale or destroyed"),
            ("vmmipc_pool_destroy", (None,), -2, "NULL, stale or destroyed")):
        rc = getattr(lib, fn)(*args)
        assert rc == status, (fn, rc, _lib.last_error())
        assert says in _lib.last_error(), (fn, _lib.last_error())
    assert pool.value is None
    released = ctypes.c_uint64(99)
    assert lib.vmmipc_pool_trim(None, 0, ctypes.byref(released)) == -2
    assert released.value == 0  # stored also on failure


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to read the header")
def test_pool_info_layout_matches_header(tmp_path):
    names = [f[0] for f in _lib.vmmipc_pool_info._fields_]
    lines = ['printf("size %zu\\n", sizeof(vmmipc_pool_info));']
    lines += [f'printf("{n} %zu %zu\\n", offsetof(vmmipc_pool_info, {n}), '
              f'sizeof(((vmmipc_pool_info *)0)->{n}));' for n in names]
    src = tmp_path / "layout.c"
    src.write_text("#include <stdio.h>\n#include <stddef.h>\n#include \"vmmipc.h\"\n"
                   "int main(void) {\n" + "\n".join(lines) + "\nreturn 0; }\n")
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-Wall", "-Werror", "-I", os.path.join(conftest.ROOT, "include"),
                    str(src), "-o", str(exe)], check=True)
    got = dict(line.split(" ", 1) for line in
               subprocess.run([str(exe)], capture_output=True, text=True).stdout.splitlines())
    assert int(got["size"]) == ctypes.sizeof(_lib.vmmipc_pool_info)
    for n in names:
        field = getattr(_lib.vmmipc_pool_info, n)
        assert got[n] == f"{field.offset} {field.size}", n


def test_torch_hooks_have_torchs_signatures():
    """The header declares the hooks as torch's pluggable allocator calls
    them (CUDAPluggableAllocator: void*(size_t, int, cudaStream_t) and
    void(void*, size_t, int, cudaStream_t)); both are exported."""
    header = open(os.path.join(conftest.ROOT, "include", "vmmipc.h")).read()
    assert "void *vmmipc_torch_alloc(size_t size, int device, void *stream);" in header
    assert "void vmmipc_torch_free(void *ptr, size_t size, int device, void *stream);" in header
    lib = _lib.lib()
    assert hasattr(lib, "vmmipc_torch_alloc") and hasattr(lib, "vmmipc_torch_free")


def test_sharing_pool_without_torch_says_what_is_missing():
    out = run_python("""
        import sys
        sys.modules["torch"] = None  # as if PyTorch were not installed
        import vmmipc.torch as vt
        try:
            with vt.sharing_pool():
                print("entered")
        except ImportError as e:
            print("ImportError", e)
        print("release", end=" ")
        try:
            vt.release_sharing_pool()
        except ImportError as e:
            print("ImportError", e)
    """)
    assert "entered" not in out
    assert "ImportError vmmipc.torch needs PyTorch (pip install torch)" in out, out
    assert "release ImportError vmmipc.torch needs PyTorch" in out, out


STAND_IN_TORCH = """
    import sys, types
    torch = types.ModuleType("torch")
    torch.multiprocessing = types.ModuleType("torch.multiprocessing")
    torch.multiprocessing.reductions = types.ModuleType("torch.multiprocessing.reductions")
    memory = types.SimpleNamespace(get_allocator_backend=lambda: {backend!r},
                                   CUDAPluggableAllocator=object)
    torch.cuda = types.SimpleNamespace(is_available=lambda: {gpu}, memory=memory, MemPool=object,
                                       use_mem_pool=None, current_device=lambda: 0)
    torch.device = type("device", (), {{}})
    for name in ("torch", "torch.multiprocessing", "torch.multiprocessing.reductions"):
        sys.modules[name] = eval(name)
    from vmmipc import _torch_pool
    def enter(**kw):
        try:
            with _torch_pool.sharing_pool(**kw):
                return "entered"
        except Exception as e:
            return f"{{type(e).__name__}} {{e}}"
"""


@pytest.mark.parametrize("gpu,backend,want", [
    (False, "native", "RuntimeError vmmipc.torch.sharing_pool needs a CUDA GPU, and torch sees none"),
    (True, "cudaMallocAsync", "RuntimeError vmmipc.torch.sharing_pool needs PyTorch's native caching "
                              "allocator, and this process uses 'cudaMallocAsync'"),
])
def test_sharing_pool_refuses_what_cannot_work(gpu, backend, want):
    out = run_python(STAND_IN_TORCH.format(gpu=gpu, backend=backend) + """
    print(enter())
    print(enter(chunk_size=1.5))
    print(enter(chunk_size=0))
    import vmmipc
    print("live", vmmipc.live_registrations(), "pools", len(_torch_pool.sharing_pools()))
    """)
    lines = out.splitlines()
    assert lines[0].startswith(want), lines
    assert lines[1].startswith("TypeError vmmipc.torch.sharing_pool: chunk_size must be an integer"), lines
    assert lines[2].startswith("InvalidError vmmipc.torch.sharing_pool: chunk_size=0 is out of range"), lines
    assert lines[3] == "live 0 pools 0", lines  # nothing made


def test_torch_is_pointed_at_the_loaded_library_by_its_absolute_path(tmp_path):
    """torch opens the library again by path (CUDAPluggableAllocator):
    it must be the very file this process loaded, even when that was
    loaded by a relative path and the working directory changed since."""
    lib = os.path.abspath(conftest.LIBRARY)
    out = run_python(f"""
        import os
        from vmmipc import _lib, _torch_pool
        os.chdir({os.path.dirname(lib)!r})
        _lib.lib()
        os.chdir({str(tmp_path)!r})
        print(_torch_pool._library_path())
    """, VMMIPC_LIBRARY=os.path.join(".", os.path.basename(lib)))
    assert os.path.isabs(out.strip()) and os.path.samefile(out.strip(), lib), out
