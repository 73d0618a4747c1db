"""What the Python GPU scripts share (test_python_cuda.py, test_torch.py and
test_torch_model.py here; bench/torch_bench.py and bench/torch_model_bench.py):
the checkout's vmmipc and build/libvmmipc.so on the path, one PASS/FAIL line
per check and the closing "N passed, M failed", the guard every child
answers through, the check that children made by fork() are refused, and
for the torch scripts: the worker child that runs the functions it is sent
and what runs in it for test_torch_model.py and test_torch_pool.py (tensors
that arrive as bytes on its pipe, what it keeps between checks, its import
cache's counters), the exact value pattern, and the probes (VMM or not,
chunk counts, live registrations, whether pidfd_getfd is refused).

Import it before vmmipc: it sets the paths up. It also puts tests/python on
the path, for the descriptor tools of _mp_helpers (fd_count, FdSampler,
limit_fds). Nothing here needs CUDA or torch until it is called.
"""

import ctypes
import errno
import gc
import math
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


def run_problems(name, fn):
    """One check: fn() returns (problems, detail); it passes when problems
    is empty, and the line says them all when it is not."""
    def verdict():
        problems, detail = fn()
        return not problems, "; ".join(problems) if problems else detail
    run_case(name, verdict)


def problems_of(r):
    """The problems a child reported in r (what guard() sent back)."""
    if "error" in r:
        return ["child failed:\n" + r["error"]]
    return r.get("problems", [])


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

def import_torch_expandable():
    """(torch, None), or (None, why) without torch, with expandable segments
    on for this process and its children (they inherit the environment):
    PyTorch reads the setting when CUDA starts, so this comes first."""
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        import torch
    except ImportError as e:  # the script says SKIP
        return None, str(e)
    return torch, None


def no_torch_gpu(torch, torch_missing):
    """Why a torch GPU script cannot run here (say it with skip_all), or
    None: import_torch_expandable()'s result and a usable GPU."""
    if torch is None:
        return f"PyTorch is not installed ({torch_missing})"
    if not torch.cuda.is_available():
        return "no usable GPU (torch.cuda.is_available() is False)"
    return None


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


def pattern(numel, dtype, seed, device="cuda"):
    """Values in [-125, 125], exact in float32, bfloat16 and int8, different
    for every seed and (mod 251) every index."""
    import torch
    i = torch.arange(numel, device=device, dtype=torch.int64)
    v = (i * 2654435761 + seed * 40503) % 251 - 125
    return v.to(torch.float32).to(dtype) if dtype.is_floating_point else v.to(dtype)


# A spec is a list of (name, shape, dtype name, seed): what a torch script's
# sender fills (pattern) and its receiver checks (value_problems), plus the
# number of in-place updates since.


def flat(name, nbytes, dtype_name, seed):
    """A spec's 1-D entry of nbytes, float32 or bfloat16."""
    return (name, (nbytes // (4 if dtype_name == "float32" else 2),), dtype_name, seed)


def spec_bytes(spec):
    """The bytes of a spec of float32 and bfloat16 entries."""
    return sum(math.prod(shape) * (4 if d == "float32" else 2) for _, shape, d, _ in spec)


def value_problems(named, spec, add=0):
    """Problems of the received tensors (a dict, or a list of (name,
    tensor) pairs) against the spec's pattern + add."""
    import torch
    got = dict(named.items() if isinstance(named, dict) else named)
    problems = []
    for name, shape, dtype_name, seed in spec:
        t = got.get(name)
        if t is None:
            problems.append(f"{name}: missing (received {sorted(got)[:5]}...)")
            continue
        want = (pattern(math.prod(shape), getattr(torch, dtype_name), seed) + add).reshape(shape)
        if t.device.type != "cuda" or t.dtype != want.dtype or t.shape != want.shape:
            problems.append(f"{name}: {t.dtype} {tuple(t.shape)} on {t.device}, not "
                            f"{want.dtype} {tuple(want.shape)} on cuda")
        elif not torch.equal(t, want):
            problems.append(f"{name}: {int((t != want).sum())} of {t.numel()} elements differ "
                            f"(want the pattern + {add})")
    return problems


def require_vmm(*tensors):
    """Raise unless every tensor lies in CUDA VMM memory (expandable
    segments): a check that ran over cudaMalloc memory tested nothing."""
    import vmmipc.torch as vt
    for t in tensors:
        if not vt.is_vmm_tensor(t):
            raise RuntimeError(f"a {t.dtype} tensor of {t.untyped_storage().nbytes()} bytes is not "
                               "in VMM memory: are expandable segments on?")


def chunk_count(ptr, nbytes):
    """Allocations (chunks) under the covering range of [ptr, ptr + nbytes):
    what vmmipc moves one by one; their size is the range's size over it."""
    import vmmipc
    rng = vmmipc.cuda_query_range(ptr, nbytes)
    ticket = vmmipc.share(rng.base, rng.size, uses=1)
    try:
        return ticket.info().chunk_count
    finally:
        vmmipc.unregister(ticket)


def driver_range(ptr):
    """cuMemGetAddressRange(ptr): (base, size), or the error's name
    (CUDA_ERROR_NOT_FOUND once nothing is mapped there)."""
    from cuda.bindings import driver
    err, base_, size = driver.cuMemGetAddressRange(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        return err.name
    return int(base_), int(size)


def is_vmm_memory(ptr):
    """Whether ptr lies in CUDA VMM memory (cuMemCreate: expandable
    segments) rather than cudaMalloc memory, asked of the driver alone
    (cuMemRetainAllocationHandle fails on cudaMalloc memory with
    CUDA_ERROR_INVALID_VALUE), so a process that must not load libvmmipc
    can ask too."""
    from cuda.bindings import driver
    err, handle = driver.cuMemRetainAllocationHandle(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        return False
    driver.cuMemRelease(handle)  # the retain took a reference
    return True


def pidfd_getfd_refused():
    """Whether this process runs under a filter refusing pidfd_getfd
    (tests/gpu/no_pidfd_getfd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(438, -1, 0, 0)  # x86-64 pidfd_getfd on a bad pidfd
    return ctypes.get_errno() == errno.EPERM


def pidfd_filter_state():
    """Whether pidfd_getfd is refused here; None (with a FAIL recorded) when
    run_torch.sh asked for a run under the filter
    (VMMIPC_TEST_EXPECT_NO_PIDFD_GETFD=1) and it is not in force."""
    filtered = pidfd_getfd_refused()
    if os.environ.get("VMMIPC_TEST_EXPECT_NO_PIDFD_GETFD") == "1" and not filtered:
        record("setup", False, "run_torch.sh asked for a run under no_pidfd_getfd, but "
               "pidfd_getfd is allowed here: the seccomp filter is not in force")
        return None
    return filtered


def start_torch_script(torch, torch_missing, needs, extra=""):
    """The start of a torch script's main(): None when it goes on, CUDA and
    the library loaded and the log's first line printed (torch_run_banner);
    else the exit status main() returns at once: SKIP all without torch or a
    usable GPU (import_torch_expandable's result: torch, torch_missing), a
    FAIL ("setup") when needs(), the script's check that this checkout has
    what it tests, raises ImportError or AttributeError, or when
    run_torch.sh's filter is not in force."""
    why = no_torch_gpu(torch, torch_missing)
    if why:
        return skip_all(why)
    try:
        needs()
    except (ImportError, AttributeError) as e:
        record("setup", False, f"this checkout lacks what the script tests ({e}): merge main "
               "and run make lib")
        return summary()
    import vmmipc
    torch.zeros(1, device="cuda")
    vmmipc.live_registrations()  # load the library before anything is measured
    return summary() if torch_run_banner(torch, extra) is None else None


def torch_run_banner(torch, extra=""):
    """Whether pidfd_getfd is refused here (pidfd_filter_state), said on the
    line that opens a torch script's log with torch's version and the GPU
    (and extra); None, with a FAIL recorded, when run_torch.sh asked for
    the filter and it is not in force: the script ends there."""
    filtered = pidfd_filter_state()
    if filtered is not None:
        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, pidfd_getfd "
              f"{'REFUSED (seccomp filter)' if filtered else 'allowed'}{extra}", flush=True)
    return filtered


def settled_live():
    """This process's live registrations once the tensors of earlier checks
    are freed and their anchors have ended (a reaper thread ends them)."""
    import vmmipc
    gc.collect()
    n, deadline = vmmipc.live_registrations(), time.monotonic() + 5
    while time.monotonic() < deadline:
        time.sleep(0.1)
        m = vmmipc.live_registrations()
        if m == n:
            return n
        n = m
    return n


def wait_live(n, timeout=15.0):
    """Wait until this process has n live registrations; the count."""
    import vmmipc
    deadline = time.monotonic() + timeout
    while vmmipc.live_registrations() != n and time.monotonic() < deadline:
        time.sleep(0.02)
    return vmmipc.live_registrations()


def live_problems(live, what="after both sides dropped the tensors"):
    """[] once this process is back to live registrations (within 15 s),
    else the problem."""
    after = wait_live(live)
    return [] if after == live else [f"{after - live} registrations still live in the sender "
                                     f"{what}"]


# ------------------------------------------------------- the worker child

WORKER_TIMEOUT = 120


def worker(inbox, outbox, pipe):
    """A spawned child that runs the (function, args) messages it gets and
    answers each through guard(); tensors arrive pickled in the args. The
    functions are sent as objects: a spawned child's __main__ is the
    parent's script, so its functions are found there. pipe: the child's end
    of a Pipe, for the functions that take bytes (PIPE)."""
    global PIPE
    PIPE = pipe
    import torch
    import vmmipc
    torch.zeros(1, device="cuda")
    vmmipc.cache_info()  # the library is loaded before the first message
    outbox.put("ready")
    while True:
        try:
            msg = inbox.get(timeout=WORKER_TIMEOUT)
        except BaseException as e:  # noqa: BLE001 - unpickling failed
            outbox.put({"error": "".join(traceback.format_exception(e))[-2500:]})
            continue
        if msg is None:
            return
        fn, args = msg
        outbox.put(guard(fn, *args))
        del msg, args
        gc.collect()


PIPE = None  # in a worker: its end of the Worker's pipe


class Worker:
    """The parent's side of worker(): call(fn, *args) runs fn(*args) in the
    child and returns its answer; send_bytes puts bytes on the pipe."""

    def __init__(self, method="spawn"):
        import multiprocessing as mp
        ctx = mp.get_context(method)
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.pipe, child_end = ctx.Pipe()
        self.proc = ctx.Process(target=worker, args=(self.inbox, self.outbox, child_end))
        self.proc.start()
        child_end.close()
        if self.outbox.get(timeout=WORKER_TIMEOUT) != "ready":
            raise RuntimeError("the worker did not start")

    def put(self, fn, *args):
        self.inbox.put((fn, args))

    def answer(self, timeout=WORKER_TIMEOUT):
        return self.outbox.get(timeout=timeout)

    def call(self, fn, *args):
        self.put(fn, *args)
        return self.answer()

    def call_with_bytes(self, via_fn, blob, *args):
        """Run via_fn(*args) in the child, which reads blob from the pipe
        (w_via_bytes, w_via_bulk): the call first (the child then waits on
        the pipe), then the bytes: a blob larger than the pipe's buffer
        would block us otherwise."""
        self.put(via_fn, *args)
        self.send_bytes(blob)
        return self.answer()

    def send_bytes(self, blob):
        """Bytes for a function already put() (it reads them from PIPE): a
        blob larger than the pipe's buffer blocks until it does."""
        self.pipe.send_bytes(blob)

    def stop(self):
        self.inbox.put(None)
        self.proc.join(WORKER_TIMEOUT)
        if self.proc.is_alive():
            self.proc.kill()


def run_cases(cases, vias):
    """Run the (title, check, per_via) cases in one spawned Worker w:
    check(w, via) for each of vias where per_via, else check(w); a
    PASS/FAIL line each (run_problems)."""
    w = Worker("spawn")
    try:
        for title, fn, per_via in cases:
            for via in vias if per_via else (None,):
                run_problems(f"{title} [{via}]" if via else title,
                             lambda: fn(w, via) if via else fn(w))
    finally:
        w.stop()


# ------------------------------------------- run in the worker, torch scripts

KEPT = {}  # in a worker: what a check keeps for a later one, by key


def pipe_bytes():
    """In a worker: the next bytes on its pipe (Worker.send_bytes)."""
    if not PIPE.poll(WORKER_TIMEOUT):
        raise TimeoutError("no bytes arrived on the pipe")
    return PIPE.recv_bytes()


def w_via_bytes(fn, *args):
    """fn(the pipe's bytes through ForkingPickler.loads, *args)."""
    from multiprocessing.reduction import ForkingPickler
    return fn(ForkingPickler.loads(pipe_bytes()), *args)


def w_via_bulk(fn, *args):
    """fn(the pipe's bytes through vmmipc.torch.open_tensors, *args)."""
    import vmmipc.torch as vt
    return fn(vt.open_tensors(pipe_bytes()), *args)


def cache_now():
    """This process's vmmipc.cache_info(), as a dict (it crosses the queue)."""
    import vmmipc
    return vmmipc.cache_info()._asdict()


def w_cache():
    return {"problems": [], "cache": cache_now()}


def w_drop(key):
    """Let go of what KEPT[key] holds; the cache's state after."""
    import torch
    KEPT.pop(key, None)
    gc.collect()
    torch.cuda.synchronize()
    return {"problems": [], "cache": cache_now()}


def cache_delta(before, after):
    """Imports and mapped bytes between two cache_now() dicts."""
    mapped = (after["referenced_bytes"] + after["unreferenced_bytes"]
              - before["referenced_bytes"] - before["unreferenced_bytes"])
    return after["misses"] - before["misses"], mapped


def wait_freed(allocated, timeout=15.0):
    """Wait until this process's allocated CUDA bytes are back to at most
    allocated (a sent storage is kept until its receiver has it)."""
    import torch
    from _mp_helpers import wait_for
    return wait_for(lambda: torch.cuda.memory_allocated() <= allocated, timeout)
