"""What the Python GPU scripts share (test_python_cuda.py and test_torch.py
here; bench/torch_bench.py takes set_expandable): the checkout's vmmipc and
build/libvmmipc.so on the path, one PASS/FAIL line per check and the
closing "N passed, M failed", the guard every child answers through, and
the check that children made by fork() are refused.

Import it before vmmipc: it sets the paths up. It also puts tests/python on
the path, for the descriptor tools of _mp_helpers (fd_count, FdSampler,
limit_fds). Nothing here needs CUDA or torch until it is called.
"""

import os
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
for _path in (os.path.join(ROOT, "tests", "python"), os.path.join(ROOT, "python")):
    if _path not in sys.path:
        sys.path.insert(0, _path)
# Children (spawn, forkserver) inherit it: every process loads this build.
os.environ.setdefault("VMMIPC_LIBRARY", os.path.join(ROOT, "build", "libvmmipc.so"))

# ---------------------------------------------------------------- the checks

results = []


def record(name, ok, detail=""):
    results.append(ok)
    print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def run_case(name, fn):
    """One check: fn() returns (ok, detail); an exception fails the check
    with its traceback. The line ends with the time it took."""
    t0 = time.monotonic()
    try:
        ok, detail = fn()
    except BaseException as e:  # noqa: BLE001 - reported as the check's failure
        ok, detail = False, "".join(traceback.format_exception(e))[-2500:]
    record(name, ok, f"{detail} ({time.monotonic() - t0:.1f} s)".lstrip())


def summary():
    """Print "N passed, M failed"; the exit status (1 if anything failed)."""
    passed = sum(results)
    failed = len(results) - passed
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


def skip_all(reason):
    """Nothing can run here (no GPU, a package missing): say why; exit 0."""
    print(f"SKIP all: {reason}")
    return summary()


# ------------------------------------------------------------ in the children

def guard(fn, *args):
    """fn(*args) in a child, or {"error": its traceback's tail}: the parent
    must always hear back, never wait forever."""
    try:
        return fn(*args)
    except BaseException as e:  # noqa: BLE001 - sent to the parent instead
        return {"error": "".join(traceback.format_exception(e))[-2500:]}


def fork_refusals(buf, live):
    """Problems of sending buf to children made by fork(): a Queue's child
    and a Pool's task must both be refused at once, with nothing registered
    (live: this process's live registrations before)."""
    import multiprocessing as mp
    import vmmipc
    ctx = mp.get_context("fork")
    q, res = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=fork_child_queue, args=(q, res))
    p.start()
    q.put(buf)
    got = res.get(timeout=60)
    p.join(60)
    problems = []
    if not got.startswith("VmmipcForkError"):
        problems.append(f"queue: the forked child got {got!r}")
    with ctx.Pool(1) as pool:
        try:
            pool.map_async(fork_pool_task, [buf]).get(60)
            problems.append("pool: no error")
        except vmmipc.VmmipcForkError:
            pass
    if vmmipc.live_registrations() != live:
        problems.append("something was registered for a forked child")
    return problems


def fork_child_queue(q, res):
    """A child made by fork(): getting the buffer must fail at once."""
    import vmmipc
    try:
        q.get(timeout=60)  # the parent waits as long for the answer
        res.put("no error")
    except vmmipc.VmmipcForkError as e:
        res.put(f"VmmipcForkError: {e}")
    except BaseException as e:  # noqa: BLE001
        res.put(repr(e))


def fork_pool_task(buf):
    return "unreachable: the parent must refuse to send this"


# ------------------------------------------------------------------- torch

def set_expandable(on):
    """Switch PyTorch's caching allocator to expandable segments (VMM memory)
    or back to cudaMalloc, for the tensors allocated from now on."""
    import torch
    setting = f"expandable_segments:{'True' if on else 'False'}"
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)
