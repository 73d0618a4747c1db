#!/usr/bin/env python3
"""GPU test of vmmipc.torch: CUDA tensors in expandable segments (VMM
memory) through multiprocessing, with no pidfd_getfd.

Run from the repository root on a machine with a CUDA GPU and PyTorch,
after `make lib` (tests/gpu/run_torch.sh runs it twice: plainly and under a
seccomp filter that refuses pidfd_getfd):

    python3 tests/gpu/test_torch.py [scenario ...]

Scenarios (default: all): dtypes, tied, writes, transformer, ordering,
lifetime, repeat, legacy, mechanisms, fork, native. Every tensor is built
with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set here for this
process and its children) and checked to be VMM memory first. Data is
checked exactly: the receiver regenerates the sender's pattern and compares
every element. Prints one PASS/FAIL line per check and "N passed, M
failed"; exits non-zero if anything failed.
"""

import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time

# _gpu_helpers first: it puts this checkout's vmmipc and library on the path.
from _gpu_helpers import (Worker, driver_range, fork_refusals, guard, import_torch_expandable,
                          pattern, pidfd_getfd_refused, problems_of, require_vmm, run_problems,
                          set_expandable, settled_live, start_torch_script, summary, wait_live)

torch, TORCH_MISSING = import_torch_expandable()  # before CUDA starts, here and in children

import vmmipc  # noqa: E402  (loads nothing yet; vmmipc.torch is imported in main())

TIMEOUT = 120
MiB = 1 << 20
SLEEP_CYCLES = int(2.5e9)  # torch.cuda._sleep: about 1.5 s on the H200 (1e8 took 59 ms)

# --------------------------------------------------------------- helpers


VIEWS = {  # how the sent views are cut from a (rows, cols) base
    "contiguous": lambda b: b,
    "transposed": lambda b: b.t(),
    "strided columns": lambda b: b[:, 3:200:2],
    "storage offset": lambda b: b[5:],
    "flat slice": lambda b: b.reshape(-1)[1000:5000],
}
ROWS, COLS = 600, 700  # float32: 1.6 MiB (large pool); bfloat16, int8: small pool
DTYPES = ("float32", "bfloat16", "int8")


def base(dtype_name, seed):
    return pattern(ROWS * COLS, getattr(torch, dtype_name), seed).reshape(ROWS, COLS)


def make_model():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(d_model=64, nhead=4, dim_feedforward=128,
                                             dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)


def check_pattern(t, dtype_name, seed, view=None):
    """Problems (a list) of t against the sender's pattern: a contiguous
    tensor of t's shape, or that view of a (ROWS, COLS) base."""
    if view is None:
        want = pattern(t.numel(), getattr(torch, dtype_name), seed).reshape(t.shape)
    else:
        want = VIEWS[view](base(dtype_name, seed))
    problems = []
    if t.device.type != "cuda":
        problems.append(f"on {t.device}")
    for what, got, exp in (("dtype", t.dtype, want.dtype), ("shape", t.shape, want.shape),
                           ("stride", t.stride(), want.stride()),
                           ("storage offset", t.storage_offset(), want.storage_offset())):
        if got != exp:
            problems.append(f"{what} {got} != {exp}")
    if not problems and not torch.equal(t, want):
        problems.append(f"{int((t != want).sum())} of {t.numel()} elements differ")
    return problems


# ------------------------------------------------ run in the worker child

KEPT = {}


def w_dtypes(sent, nbytes):
    problems = []
    for dtype_name in DTYPES:
        storages = set()
        for view in VIEWS:
            t = sent[f"{dtype_name}/{view}"]
            problems += [f"{dtype_name} {view}: {p}" for p in check_pattern(t, dtype_name, 1, view)]
            storages.add(id(t.untyped_storage()))
        s = sent[f"{dtype_name}/storage"]
        if not isinstance(s, torch.UntypedStorage) or s.nbytes() != nbytes[dtype_name]:
            problems.append(f"{dtype_name}: the storage sent alone arrived as {type(s).__name__} "
                            f"of {s.nbytes()} bytes, not {nbytes[dtype_name]}")
        storages.add(id(s))
        if len(storages) != 1:
            problems.append(f"{dtype_name}: its views arrived over {len(storages)} storages, not 1")
    return {"problems": problems}


def w_tied_first(sent):
    KEPT["tied"] = sent
    w, head, row = sent["embed"], sent["head"], sent["row"]
    problems = []
    if not (w.untyped_storage() is head.untyped_storage() is row.untyped_storage()):
        problems.append("embed, head and row do not share one storage")
    if not torch.equal(head, w.t()) or not torch.equal(row, w[7]):
        problems.append("the views do not show the base's values")
    head[3, 7] = 1234.0  # w[7, 3] through the transposed view
    if float(w[7, 3]) != 1234.0 or float(row[3]) != 1234.0:
        problems.append("a write through one view is not seen through the others")
    sd = sent["module"]
    if sd["0.weight"].untyped_storage() is not sd["1.weight"].untyped_storage():
        problems.append("the state_dict's tied weights arrived as two storages")
    return {"problems": problems}


def w_tied_second(later):
    first = KEPT.pop("tied")
    problems = []
    if later.untyped_storage() is not first["embed"].untyped_storage():
        problems.append("a view sent in a second pickle arrived over another storage")
    if not torch.equal(later, first["embed"][10:]):
        problems.append("the second pickle's view shows other values")
    return {"problems": problems}


def w_keep(name, t, dtype_name, seed, fill=None):
    """Check t against the pattern, keep it, then (if fill) write fill and
    synchronize, for the sender to see."""
    KEPT[name] = t
    problems = check_pattern(t, dtype_name, seed)
    if fill is not None:
        t.fill_(fill)
        torch.cuda.synchronize()
    return {"problems": problems}


def w_check_kept(name, dtype_name=None, seed=None, value=None):
    t = KEPT.pop(name)
    if value is not None:
        bad = int((t != value).sum())
        return {"problems": [f"{bad} elements are not {value}"] if bad else []}
    return {"problems": check_pattern(t, dtype_name, seed)}


def w_transformer(sd, x):
    problems = []
    with torch.device("meta"):
        model = make_model()
    model.load_state_dict(sd, assign=True)  # the received tensors become the parameters
    model.eval()
    for name, p in model.named_parameters():
        if p.device.type != "cuda" or p.data_ptr() != sd[name].data_ptr():
            problems.append(f"parameter {name} is not the received tensor")
    with torch.no_grad():
        out = model(x)
    return {"problems": problems, "out": out.cpu()}


def w_ordering(t, value):
    t0 = time.monotonic()
    waiting = not torch.cuda.current_stream().query()  # the event is not done yet
    bad = int((t != value).sum())
    return {"problems": [f"{bad} of {t.numel()} elements were read before the sender's "
                         f"kernel wrote them"] if bad else [],
            "waiting": waiting, "waited_s": time.monotonic() - t0}


def w_repeat(name, t):
    info = vmmipc.cache_info()
    if name not in KEPT:
        KEPT[name] = (t, info)
        return {"problems": check_pattern(t, "float32", 4)}
    first, before = KEPT.pop(name)
    problems = []
    if t.untyped_storage() is not first.untyped_storage():
        problems.append("the second send arrived over another storage")
    # The run is still mapped here: no import at all, the grant is
    # confirmed in the background (the sender's registrations tell).
    if info.misses != before.misses:
        problems.append(f"the second send imported again (misses {before.misses}->"
                        f"{info.misses})")
    return {"problems": problems}


# ------------------------------------------------------ other children


def child_receiver_lifetime(q, res):
    def run():
        torch.zeros(1, device="cuda")
        vmmipc.set_cache_limit(0)  # the last reference unmaps at once
        t = q.get(timeout=TIMEOUT)
        problems = check_pattern(t, "float32", 5)
        view = t[1000:]
        ptr, view_ptr = t.data_ptr(), view.data_ptr()
        held, nbytes = vmmipc.cache_info(), t.untyped_storage().nbytes()
        del t
        gc.collect()
        with_view = driver_range(view_ptr), vmmipc.cache_info()
        del view
        gc.collect()
        after = driver_range(ptr), vmmipc.cache_info()
        if held.referenced_bytes < nbytes:
            problems.append(f"while held: cache_info {held}")
        if isinstance(with_view[0], str) or with_view[1].referenced_bytes != held.referenced_bytes:
            problems.append(f"the base was dropped but a view lives, and the mapping went "
                            f"({with_view})")
        if after[0] != "CUDA_ERROR_NOT_FOUND":
            problems.append(f"after the last view died the range is still mapped: "
                            f"cuMemGetAddressRange gave {after[0]}")
        if after[1].entries or after[1].referenced_bytes or after[1].unreferenced_bytes:
            problems.append(f"after the last view died: cache_info {after[1]}")
        from vmmipc import _torch_received
        if _torch_received.received_storages():
            problems.append(f"{_torch_received.received_storages()} received storages still known")
        return {"problems": problems}
    res.put(guard(run))


def child_queue(q, res):
    torch.zeros(1, device="cuda")
    res.put(guard(lambda: {"problems": check_pattern(*q.get(timeout=TIMEOUT))}))


def child_pipe(conn):
    torch.zeros(1, device="cuda")

    def run():
        if not conn.poll(TIMEOUT):
            raise TimeoutError("nothing arrived on the pipe")
        return {"problems": check_pattern(*conn.recv())}
    conn.send(guard(run))


def child_process_args(t, dtype_name, seed, res):
    res.put(guard(lambda: {"problems": check_pattern(t, dtype_name, seed)}))


def pool_task(t, dtype_name, seed):
    return guard(lambda: {"problems": check_pattern(t, dtype_name, seed)})


def native_child(q, res):
    torch.zeros(1, device="cuda")
    try:
        t = q.get(timeout=TIMEOUT)
        res.put({"problems": check_pattern(t, "float32", 9)})
    except BaseException as e:  # noqa: BLE001
        res.put({"failed": repr(e)[:500]})


def native_sender():
    """Torch's own sharing of an expandable-segment tensor (vmmipc.torch is
    not imported in this process); prints one JSON line."""
    import torch.multiprocessing as tmp
    ctx = tmp.get_context("spawn")
    q, res = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=native_child, args=(q, res))
    p.start()
    t = base("float32", 9)
    q.put(t)
    r = res.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    print(json.dumps(r), flush=True)


# ------------------------------------------------------------ the checks

def dtypes_and_views(vt, w):
    sent, nbytes = {}, {}
    for dtype_name in DTYPES:
        b = base(dtype_name, 1)
        require_vmm(b)
        for view, cut in VIEWS.items():
            sent[f"{dtype_name}/{view}"] = cut(b)
        sent[f"{dtype_name}/storage"] = b.untyped_storage()
        nbytes[dtype_name] = b.untyped_storage().nbytes()
    r = w.call(w_dtypes, sent, nbytes)
    return problems_of(r), f"{len(sent)} tensors and storages in one pickle"


def tied(vt, w):
    emb = torch.nn.Embedding(100, 32).cuda()
    head = torch.nn.Linear(32, 100, bias=False).cuda()
    head.weight = emb.weight
    w_ = pattern(1000 * 256, torch.float32, 2).reshape(1000, 256)
    require_vmm(w_, emb.weight)
    sent = {"embed": w_, "head": w_.t(), "row": w_[7],
            "module": torch.nn.Sequential(emb, head).state_dict()}
    problems = problems_of(w.call(w_tied_first, sent))
    problems += problems_of(w.call(w_tied_second, w_[10:]))
    return problems, "views, tied weights, and a view sent later share one storage"


def writes(vt, w):
    t = pattern(16 * MiB, torch.float32, 8)
    require_vmm(t)
    problems = problems_of(w.call(w_keep, "writes", t, "float32", 8, 2.0))
    torch.cuda.synchronize()
    bad = int((t != 2).sum())
    if bad:
        problems.append(f"the sender sees {bad} elements not written by the receiver")
    t.fill_(3)
    torch.cuda.synchronize()
    problems += problems_of(w.call(w_check_kept, "writes", None, None, 3.0))
    return problems, "receiver's writes seen by the sender and the sender's by the receiver"


def transformer(vt, w):
    model = make_model().cuda().eval()
    torch.manual_seed(1)
    x = torch.randn(4, 16, 64, device="cuda")
    with torch.no_grad():
        want = model(x).cpu()
    sd = model.state_dict()
    require_vmm(x, *sd.values())
    r = w.call(w_transformer, sd, x)
    problems = problems_of(r)
    if problems:
        return problems, ""
    diff = float((r["out"] - want).abs().max())
    if not torch.allclose(r["out"], want, rtol=1e-5, atol=1e-5):
        problems.append(f"the child's output differs from the parent's by up to {diff:.3g}")
    return problems, f"{len(sd)} tensors; outputs differ by at most {diff:.3g}"


def ordering(vt, w):
    t = torch.zeros(64 * MiB, device="cuda")  # 256 MiB
    require_vmm(t)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # a long kernel, then the write, both still queued
    t.fill_(7.0)
    r = w.call(w_ordering, t, 7.0)
    problems = problems_of(r)
    detail = ""
    if not problems:
        detail = (f"the receiver's stream was {'still' if r['waiting'] else 'no longer'} waiting "
                  f"when the tensor was returned; its first read took {r['waited_s']:.2f} s")
    torch.cuda.synchronize()
    return problems, detail


def sender_lifetime(vt, w):
    """torch.multiprocessing's rule: the receiver keeps the tensor; the
    sender drops its own right after put(), empties its cache and allocates
    the same size again: the receiver's values stay right, the sender keeps
    the memory (its anchor lives) until the receiver lets go, then not."""
    problems = []
    live = settled_live()
    t = pattern(64 * MiB, torch.float32, 3)  # 256 MiB
    require_vmm(t)
    w.put(w_keep, "lifetime", t, "float32", 3)
    del t  # the sender lets go right after put()
    gc.collect()
    problems += problems_of(w.answer())
    if wait_live(live, timeout=1.0) == live:
        problems.append("the sender let go of the tensor while the receiver holds it")
    torch.cuda.empty_cache()  # nothing of the held tensor may go back
    other = torch.full((64 * MiB,), -1.0, device="cuda")  # the same size, asked for again
    torch.cuda.synchronize()
    problems += problems_of(w.call(w_check_kept, "lifetime", "float32", 3))  # and dropped there
    after = wait_live(live)
    if after != live:
        problems.append(f"{after - live} registrations of the dropped tensor still live after "
                        "the receiver dropped it too")
    del other
    return problems, ("the sender dropped its tensor after put(), emptied its cache and "
                      "allocated again; the receiver's data stayed right; the anchor ended once "
                      "the receiver dropped it")


def receiver_lifetime(vt):
    ctx = mp.get_context("spawn")
    q, res = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_receiver_lifetime, args=(q, res))
    p.start()
    t = pattern(64 * MiB, torch.float32, 5)
    require_vmm(t)
    q.put(t)
    r = res.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    return problems_of(r), ("the mapping stayed while a view lived and was gone "
                            "(CUDA_ERROR_NOT_FOUND, empty cache) after the last one died")


def repeat(vt, w):
    live = settled_live()
    t = pattern(64 * MiB, torch.float32, 4)
    require_vmm(t)
    times = []
    problems = []
    for _ in range(2):
        t0 = time.perf_counter()
        problems += problems_of(w.call(w_repeat, "repeat", t))
        times.append((time.perf_counter() - t0) * 1e3)
    if wait_live(live + 1) != live + 1:
        problems.append(f"{vmmipc.live_registrations() - live} live registrations after two "
                        "sends of one tensor, not 1 (its anchor)")
    del t
    gc.collect()
    if wait_live(live) != live:
        problems.append("the anchor outlived the tensor")
    return problems, (f"one anchor; second send over the same storage, no import, its grant "
                      f"confirmed; "
                      f"round trips {times[0]:.1f} ms then {times[1]:.1f} ms (256 MiB)")


def legacy_and_cpu(vt, w):
    set_expandable(False)
    try:
        t = base("float32", 6)
    finally:
        set_expandable(True)
    problems = []
    if vt.is_vmm_tensor(t):
        problems.append("a tensor made with expandable segments off is VMM memory")
    problems += problems_of(w.call(w_check_pattern, t, "float32", 6))
    c = base("int8", 7).cpu()
    problems += problems_of(w.call(w_check_cpu, c))
    # The caching allocator would hand the freed cudaMalloc block to the
    # next tensor of that size, expandable segments or not: give it back.
    del t
    gc.collect()
    torch.cuda.empty_cache()
    return problems, ("cudaMalloc tensors went through torch's own reducer, CPU tensors through "
                      "the host arena (vmmipc.torch's default)")


def w_check_pattern(t, dtype_name, seed):
    return {"problems": check_pattern(t, dtype_name, seed)}


def w_check_cpu(c):
    want = base("int8", 7).cpu()
    return {"problems": [] if c.device.type == "cpu" and torch.equal(c, want)
            else ["the CPU tensor arrived wrong"]}


def transfer(vt, mechanism, method, ctx=None):
    ctx = ctx or mp.get_context(method)
    live = settled_live()
    seed = 10
    t = base("float32", seed)
    require_vmm(t)
    if mechanism == "queue":
        q, res = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child_queue, args=(q, res))
        p.start()
        q.put((t, "float32", seed))
        r = res.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
    elif mechanism == "pipe":
        a, b = ctx.Pipe()
        p = ctx.Process(target=child_pipe, args=(b,))
        p.start()
        b.close()
        a.send((t, "float32", seed))
        if not a.poll(TIMEOUT):
            return ["no answer from the child"], ""
        r = a.recv()
        p.join(TIMEOUT)
    elif mechanism == "pool":
        with ctx.Pool(1) as pool:
            r = pool.apply(pool_task, (t, "float32", seed))
    else:
        res = ctx.Queue()
        p = ctx.Process(target=child_process_args, args=(t, "float32", seed, res))
        p.start()
        r = res.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
    problems = problems_of(r)
    del t
    gc.collect()
    if wait_live(live) != live:
        problems.append(f"{vmmipc.live_registrations() - live} registrations outlived the "
                        "transfer and the tensor")
    return problems, ""


def fork_refused(vt):
    t = base("float32", 11)
    require_vmm(t)
    return fork_refusals(t, settled_live()), "queue and pool refused at once, nothing registered"


def native(vt):
    refused = pidfd_getfd_refused()
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--native-sender"],
                       capture_output=True, text=True, timeout=TIMEOUT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return [f"the native sender failed (exit {r.returncode}): {r.stderr[-1500:]}"], ""
    got = json.loads(lines[-1])
    if refused:
        failed = got.get("failed", "")
        if "pidfd_getfd: Operation not permitted" not in failed:
            return [f"under the filter torch's own sharing did not fail as expected: {got}"], ""
        return [], f"under the filter torch's own sharing fails: {failed}"
    if "failed" in got or got.get("problems"):
        return [f"without the filter torch's own sharing failed: {got}"], ""
    return [], "without the filter torch's own expandable-segment sharing works"


def needs():
    """What this script needs of the checkout: vmmipc.torch, installed, and
    the vmmipc 0.2 Python API."""
    import vmmipc.torch as vt
    vt.install()
    for name in ("cuda_query_range", "register_again", "cache_info", "set_cache_limit"):
        getattr(vmmipc, name)


def main(argv):
    status = start_torch_script(torch, TORCH_MISSING, needs)
    if status is not None:
        return status
    import vmmipc.torch as vt
    only = set(argv)
    filtered = pidfd_getfd_refused()  # start_torch_script said so, and checked it

    def want(name):
        return not only or name in only

    in_worker = [("dtypes", "dtypes float32/bfloat16/int8, contiguous and strided views, "
                  "storage offsets, a storage alone", dtypes_and_views),
                 ("tied", "tied weights and views within and across pickles", tied),
                 ("writes", "writes visible both ways", writes),
                 ("transformer", "TransformerEncoder state_dict: same forward output in the "
                  "child", transformer),
                 ("ordering", "stream ordering: a long kernel writing just before put()",
                  ordering),
                 ("lifetime", "sender drops its tensor right after put()", sender_lifetime),
                 ("repeat", "second send of one tensor: same anchor, import-cache hit", repeat),
                 ("legacy", "cudaMalloc tensors keep torch's reducer; CPU tensors arrive", legacy_and_cpu)]
    chosen = [case for case in in_worker if want(case[0])]
    if chosen:
        w = Worker("spawn")
        try:
            for _, title, fn in chosen:
                run_problems(title, lambda: fn(vt, w))
        finally:
            w.stop()
    if want("lifetime"):
        run_problems("receiver drops its tensor: the mapping is gone",
                     lambda: receiver_lifetime(vt))
    if want("mechanisms"):
        for method in ("spawn", "forkserver"):
            for mech in ("queue", "pipe", "pool", "process"):
                run_problems(f"{mech} under {method}", lambda: transfer(vt, mech, method))
        import torch.multiprocessing as tmp
        run_problems("torch.multiprocessing queue under spawn",
                     lambda: transfer(vt, "queue", "spawn", tmp.get_context("spawn")))
    if want("fork"):
        run_problems("fork start method fails at once with VmmipcForkError",
                     lambda: fork_refused(vt))
    if want("native"):
        run_problems("torch's own expandable-segment sharing "
                     f"({'fails under the filter' if filtered else 'works without the filter'})",
                     lambda: native(vt))
    return summary()


if __name__ == "__main__":
    if sys.argv[1:] == ["--native-sender"]:
        native_sender()
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
