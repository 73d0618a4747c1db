#!/usr/bin/env python3
"""GPU test of vmmipc.torch on models: state dicts of many tensors that lie
side by side in torch's expandable segments, sent again and again, through
four transports (the "vias"):

  queue   a spawn Queue (the pickle goes through ForkingPickler.dump)
  bytes   ForkingPickler bytes over a Pipe, loaded with ForkingPickler.loads
          (SGLang's MultiprocessingSerializer)
  bulk    vmmipc.torch.share_tensors -> bytes over a Pipe -> open_tensors
  reduce  vLLM's pattern: (rebuild, args) = vmmipc.torch.reduce_tensor(t)
          for each tensor inside vmmipc.torch.batch(tensors), the handles
          sent with plain pickle over a Pipe, rebuild(*args) in the child

How to run it, and under the seccomp filter that refuses pidfd_getfd:
tests/gpu/run_torch.sh (TORCH_TEST=tests/gpu/test_torch_model.py); alone,
`python3 tests/gpu/test_torch_model.py [scenario ...]`.

Scenarios (default: all): cache, growth, across, pools, tied, keep, kill,
bytes, bulk, imports, transformer. Tensors are allocated on a stream of
their own where the layout matters: torch gives each stream its own
expandable segment, so the test knows where they lie and says when the
allocator did not lay them out as the case needs ("not exercised" fails the
check: it would have tested nothing). Values are checked exactly: the
receiver regenerates the sender's pattern (plus the number of in-place
updates since) and compares every element. The receiver's imports and
mapped bytes come from its vmmipc.cache_info() (imports = misses). Prints
one PASS/FAIL line per check and "N passed, M failed"; exits non-zero if
anything failed.
"""

import contextlib
import gc
import importlib
import io
import math
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler

# _gpu_helpers first: it puts this checkout's vmmipc and library on the path.
from _gpu_helpers import (KEPT, cache_delta, cache_now, chunk_count, driver_range, flat,
                          import_torch_expandable, live_problems, pattern, pipe_bytes, problems_of,
                          require_vmm, run_cases, run_problems, settled_live, spec_bytes,
                          start_torch_script, summary, value_problems, w_cache, w_drop, w_via_bulk,
                          w_via_bytes, wait_freed)
from _mp_helpers import settled_fd_count, wait_for

torch, TORCH_MISSING = import_torch_expandable()  # before CUDA starts, here and in children

import vmmipc  # noqa: E402  (loads nothing yet; vmmipc.torch is imported in main())

TIMEOUT = 120
MiB = 1 << 20
LARGE_CHUNK = 20 * MiB  # expandable segments map the large pool (> 1 MiB) in 20 MiB chunks,
SMALL_CHUNK = 2 * MiB   # the small pool (<= 1 MiB) in 2 MiB ones
VIAS = ("queue", "bytes", "bulk", "reduce")
MAX_MODEL_IMPORTS = 4   # a model built at once on one stream lies in 2 runs (large and small pool)
KILL_BOUND_S = 60       # the receiver's error must come within this after the sender died

# --------------------------------------------------------------- specs
# (name, shape, dtype name, seed) entries: _gpu_helpers' flat, value_problems


def model_spec(seed, layers=20, dtype_name="float32"):
    """A transformer's state dict in miniature: per layer four 1.5 MiB
    attention matrices, three 4 MiB MLP matrices (large pool) and two 4 KiB
    norms (small pool), then embedding, head and final norm: 183 tensors
    for 20 layers, about 376 MiB, the shapes mixed as a real model's are."""
    spec = [flat("embed", 8 * MiB, dtype_name, seed)]
    for i in range(layers):
        for j, (part, nbytes) in enumerate((("q", 3 * MiB // 2), ("k", 3 * MiB // 2),
                                            ("v", 3 * MiB // 2), ("o", 3 * MiB // 2),
                                            ("gate", 4 * MiB), ("up", 4 * MiB),
                                            ("down", 4 * MiB), ("norm1", 4096),
                                            ("norm2", 4096))):
            spec.append(flat(f"layer{i}.{part}", nbytes, dtype_name, seed + 1 + 9 * i + j))
    spec += [flat("norm", 4096, dtype_name, seed + 999),
             flat("head", 8 * MiB, dtype_name, seed + 998)]
    return spec


def build(spec, streams):
    """The spec's tensors, allocated in order on streams (one stream for
    all, or one per entry), then filled on the default stream, whose
    temporaries stay out of those streams' segments. Checked to be VMM."""
    if not isinstance(streams, list):
        streams = [streams] * len(spec)
    out = {}
    for (name, shape, dtype_name, _), stream in zip(spec, streams):
        with torch.cuda.stream(stream):
            out[name] = torch.empty(shape, dtype=getattr(torch, dtype_name), device="cuda")
    for name, shape, dtype_name, seed in spec:
        out[name].copy_(pattern(math.prod(shape), out[name].dtype, seed).reshape(shape))
    torch.cuda.synchronize()
    require_vmm(*out.values())
    return out


def add_all(named, value=1):
    """The in-place update of a training step, then synchronized (the
    Queue's feeder pickles on the default stream)."""
    with torch.no_grad():
        for t in named.values():
            t.add_(value)
    torch.cuda.synchronize()


def mapped_bound(nbytes, imports):
    """The issue's target: mapped <= 1.05 x the bytes, plus a chunk a run."""
    return int(1.05 * nbytes) + imports * LARGE_CHUNK

# ------------------------------------------------------------ transports


def dumps_sglang(obj):
    """SGLang's MultiprocessingSerializer.serialize."""
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)
    return buf.getvalue()


def deliver(w, via, named, fn, *args):
    """Send named (a dict, or a list of (name, tensor) pairs) to the worker
    through via; the worker runs fn(what it received, *args)."""
    if via == "queue":
        return w.call(fn, named, *args)
    if via == "bytes":
        blob = ForkingPickler.dumps(named)
        return w.call_with_bytes(w_via_bytes, blob, fn, *args)
    import vmmipc.torch as vt
    if via == "reduce":
        return w.call_with_bytes(w_via_reduce, pickle.dumps(reduced(named)), fn, *args)
    blob = vt.share_tensors(named)
    if not isinstance(blob, bytes):
        return {"problems": [f"share_tensors returned {type(blob).__name__}, not bytes"]}
    return w.call_with_bytes(w_via_bulk, blob, fn, *args)


def reduced(named, batched=True):
    """vLLM's handles: (name, (rebuild, args)) for each tensor, the same
    structure as named; batched: all in one vmmipc.torch.batch (one grant
    a run), else one reduce_tensor alone per tensor (one grant each)."""
    import vmmipc.torch as vt
    items = list(named.items()) if isinstance(named, dict) else list(named)
    with vt.batch([t for _, t in items]) if batched else contextlib.nullcontext():
        handles = [(name, vt.reduce_tensor(t)) for name, t in items]
    return dict(handles) if isinstance(named, dict) else handles


# ------------------------------------------------ run in the worker child

def w_via_reduce(fn, *args):
    handles = pickle.loads(pipe_bytes())
    items = handles.items() if isinstance(handles, dict) else handles
    rebuilt = [(name, rebuild(*rargs)) for name, (rebuild, rargs) in items]
    return fn(dict(rebuilt) if isinstance(handles, dict) else rebuilt, *args)


def w_check(named, spec, add=0, keep=None):
    """Check the values; keep them under keep (if given). The answer
    carries the cache's state while the tensors are held."""
    torch.cuda.current_stream().synchronize()
    if keep is not None:
        KEPT[keep] = named
    return {"problems": value_problems(named, spec, add), "cache": cache_now(),
            "kind": type(named).__name__, "names": [n for n, _ in
                                                    (named.items() if isinstance(named, dict)
                                                     else named)]}


def w_check_kept(key, spec, add=0):
    return {"problems": value_problems(KEPT[key], spec, add)}


def w_same_memory(named, key, spec, add, value):
    """The tensors named also in KEPT[key] are the same memory: a write
    through the new one shows through the kept one (and the sender, which
    checks after). Says whether they are the same storage object too."""
    problems = value_problems(named, spec, add)
    kept = KEPT[key]
    common = [n for n in named if n in kept]
    same_object = 0
    for n in common:
        named[n].view(-1)[0] = value
        torch.cuda.synchronize()
        if float(kept[n].view(-1)[0]) != value:
            problems.append(f"{n}: a write through the later send is not seen through the kept one")
        same_object += named[n].untyped_storage() is kept[n].untyped_storage()
    return {"problems": problems, "common": len(common), "same_object": same_object,
            "cache": cache_now()}


def w_tied(named, key=None):
    """Every tensor of named views one storage: one storage object in the
    child, and a write through one is seen through all. With key: the
    same storage as KEPT[key]'s (a later pickle)."""
    tensors = list(dict(named).values())
    problems = []
    storages = {id(t.untyped_storage()) for t in tensors}
    if key is None:
        if len(storages) != 1:
            problems.append(f"{len(tensors)} views of one storage arrived over {len(storages)} "
                            "storages")
        base = named["w"]
        base[7, 3] = 1234.0
        torch.cuda.synchronize()
        if float(named["t"][3, 7]) != 1234.0 or float(named["row"][3]) != 1234.0:
            problems.append("a write through one view is not seen through the others")
        if "head" in named and named["head"].untyped_storage() is not base.untyped_storage():
            problems.append("the tied weight arrived as a storage of its own")
        KEPT["tied"] = named
    else:
        first = KEPT.pop(key)["w"]
        if tensors[0].untyped_storage() is not first.untyped_storage():
            problems.append("a view sent in a later pickle arrived over another storage")
        if not torch.equal(tensors[0], first[10:]):
            problems.append("the later view shows other values than the kept base")
    return {"problems": problems}


def w_resend(named, spec, k):
    """Send k of the repeated-send path: values are the pattern + k; from
    the second send on, the same storages as the first send's."""
    problems = value_problems(named, spec, k)
    if k == 0:
        KEPT["resend"] = named
    else:
        kept = KEPT["resend"]
        other = [n for n in named if named[n].untyped_storage() is not kept[n].untyped_storage()]
        if other:
            problems.append(f"{len(other)} tensors (e.g. {other[0]}) arrived over other storages "
                            "than the first send's")
        problems += [f"kept: {p}" for p in value_problems(kept, spec, k)]
    return {"problems": problems, "cache": cache_now()}


def w_llama(named, config, ids):
    """Load a received Llama state dict into a model built here, as an
    inference engine would (assign: the received tensors become the
    parameters), and run it."""
    from transformers import LlamaForCausalLM
    sd = dict(named)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(sd, assign=True)
    model.eval()
    problems = [f"parameter {name} is not the received tensor"
                for name, p in model.named_parameters()
                if p.data_ptr() != sd[name].data_ptr()]
    tied_names = ("model.embed_tokens.weight", "lm_head.weight")
    if (config.tie_word_embeddings and all(n in sd for n in tied_names)
            and sd[tied_names[0]].untyped_storage() is not sd[tied_names[1]].untyped_storage()):
        problems.append("the tied embedding and head arrived as two storages")
    with torch.no_grad():
        logits = model(ids.cuda()).logits
    torch.cuda.synchronize()
    return {"problems": problems, "logits": logits.cpu(), "cache": cache_now()}


# ------------------------------------------------------------ the checks


def reallocation(w, via):
    """Send, drop, empty_cache, reallocate at the same addresses with other
    contents, send again: the receiver sees the new contents, never stale
    data. Once with the receiver keeping the old tensors (their memory
    stays alive in the receiver and must still show the old values), once
    with the receiver having dropped them (its import cache may still hold
    the old mapping)."""
    stream = torch.cuda.Stream()
    problems, notes = [], []
    for round_, receiver_keeps in enumerate((True, False)):
        old_spec = [flat(f"w{i}", 24 * MiB, "float32", 100 + 10 * round_ + i) for i in range(6)]
        new_spec = [(n, s, d, seed + 1000) for n, s, d, seed in old_spec]
        # A tensor kept at the start of the stream's segment keeps the segment
        # (torch frees a wholly unmapped expandable segment, whose address
        # range then goes): the freed chunks after it are unmapped and
        # mapped anew at the same addresses.
        with torch.cuda.stream(stream):
            keeper = torch.empty(LARGE_CHUNK, dtype=torch.uint8, device="cuda")
        start = torch.cuda.memory_allocated()
        sd = build(old_spec, stream)
        ptrs = [t.data_ptr() for t in sd.values()]
        problems += problems_of(deliver(w, via, sd, w_check, old_spec, 0,
                                        "old" if receiver_keeps else None))
        del sd
        gc.collect()
        if receiver_keeps:
            # torch's rule: what the receiver holds stays out of the
            # sender's allocator, whatever the sender does with its own.
            if wait_freed(start, timeout=1.0):
                problems.append("the sender's tensors were freed while the receiver keeps them")
            with torch.cuda.stream(stream):
                other = build(new_spec, stream)  # same sizes: must land elsewhere
            torch.cuda.synchronize()
            problems += [f"kept old tensors: {p}" for p in
                         problems_of(w.call(w_check_kept, "old", old_spec, 0))]
            w.call(w_drop, "old")
            del other
            gc.collect()
        if not wait_freed(start):
            problems.append("the sender's tensors were not freed within 15 s of the receiver "
                            "letting go of them")
        reserved = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        released = reserved - torch.cuda.memory_reserved()
        sd = build(new_spec, stream)
        same = sum(p == t.data_ptr() for p, t in zip(ptrs, sd.values()))
        notes.append(f"{'kept' if receiver_keeps else 'dropped'}: {same}/{len(ptrs)} addresses "
                     f"repeated, {released // MiB} MiB given back by empty_cache")
        if same != len(ptrs) or released < spec_bytes(old_spec):
            problems.append(f"not exercised: {same} of {len(ptrs)} addresses repeated and "
                            f"empty_cache gave back {released // MiB} MiB (want all, and at "
                            f"least {spec_bytes(old_spec) // MiB} MiB)")
        problems += [f"new contents: {p}" for p in
                     problems_of(deliver(w, via, sd, w_check, new_spec, 0))]
        del sd, keeper
        gc.collect()
    return problems, "; ".join(notes)


def growth(w, via):
    """Send a state dict, allocate more tensors that extend the segment
    with new chunks, send old + new together."""
    stream = torch.cuda.Stream()
    old_spec = [flat(f"a{i}", LARGE_CHUNK, "float32", 200 + i) for i in range(5)]  # 5 whole chunks
    new_spec = [flat(f"b{i}", LARGE_CHUNK, "float32", 210 + i) for i in range(2)]
    old = build(old_spec, stream)
    problems = problems_of(deliver(w, via, old, w_check, old_spec, 0, "growth"))
    new = build(new_spec, stream)
    old_end = old["a4"].data_ptr() + LARGE_CHUNK
    geometry = (f"old tensors at +0..+{(old_end - old['a0'].data_ptr()) // MiB} MiB, new at "
                f"+{(new['b0'].data_ptr() - old['a0'].data_ptr()) // MiB} MiB")
    if new["b0"].data_ptr() != old_end:
        problems.append(f"not exercised: the new tensors do not extend the old ones ({geometry})")
    both = {**old, **new}
    r = deliver(w, via, both, w_same_memory, "growth", old_spec + new_spec, 0, 4321.0)
    problems += problems_of(r)
    if not problems and float(old["a0"][0]) != 4321.0:
        problems.append("the receiver's write did not reach the sender's tensor")
    w.call(w_drop, "growth")
    return problems, (f"{geometry}; {r.get('same_object')}/{r.get('common')} old tensors "
                      "arrived as the same storage object as in the first send")


def across(w, via):
    """A tensor across two runs: A's tensors end inside a chunk; B starts in
    A's last chunk and extends into chunks mapped after A was sent."""
    stream = torch.cuda.Stream()
    a_spec = [flat(f"a{i}", 30 * MiB, "float32", 300 + i) for i in range(3)]  # 90 MiB in 100
    b_spec = [flat("b", 30 * MiB, "float32", 310)]
    a = build(a_spec, stream)
    run_end = vmmipc.cuda_query_range(a["a2"].data_ptr(), 30 * MiB)
    run_end = run_end.base + run_end.size
    problems = problems_of(deliver(w, via, a, w_check, a_spec, 0, "across"))
    b = build(b_spec, stream)
    b_start, b_end = b["b"].data_ptr(), b["b"].data_ptr() + 30 * MiB
    a_end = a["a2"].data_ptr() + 30 * MiB
    geometry = (f"A ends {(run_end - a_end) // MiB} MiB before its last chunk's end; B starts "
                f"{(b_start - a_end) // MiB} MiB after A and ends "
                f"{(b_end - run_end) // MiB} MiB past that chunk")
    if not (b_start < run_end < b_end):
        problems.append(f"not exercised: B does not start in A's last chunk and go on past it "
                        f"({geometry})")
    r = deliver(w, via, {**a, **b}, w_same_memory, "across", a_spec + b_spec, 0, 99.0)
    problems += problems_of(r)
    w.call(w_drop, "across")
    return problems, geometry


def pools(w, via):
    """Small-pool (<= 1 MiB, 2 MiB chunks) and large-pool (20 MiB chunks)
    tensors, interleaved, in one state dict."""
    stream = torch.cuda.Stream()
    spec = []
    for i in range(8):
        spec.append(flat(f"small{i}", (4 + 60 * i) * 1024, "bfloat16", 400 + i))
        spec.append(flat(f"large{i}", (2 + 3 * i) * MiB, "float32", 420 + i))
    sd = build(spec, stream)
    problems = []
    for name, want in (("small3", SMALL_CHUNK), ("large3", LARGE_CHUNK)):
        t = sd[name]
        rng = vmmipc.cuda_query_range(t.data_ptr(), t.untyped_storage().nbytes())
        size = rng.size // chunk_count(rng.base, rng.size)
        if size != want:
            problems.append(f"not exercised: {name} lies in {size // 1024} KiB chunks, not "
                            f"{want // MiB} MiB ones")
    before = w.call(w_cache)["cache"]
    r = deliver(w, via, sd, w_check, spec, 0)
    problems += problems_of(r)
    imports, mapped = cache_delta(before, r.get("cache", before))
    return problems, (f"{len(spec)} tensors, {spec_bytes(spec) // 1024} KiB: {imports} imports, "
                      f"{mapped // MiB} MiB mapped")


def tied(w, via):
    """Views of one storage and a tied weight arrive as one storage; a view
    sent in a later pickle arrives over the same storage (not in bulk:
    each blob stands alone)."""
    w_ = pattern(1000 * 256, torch.float32, 2).reshape(1000, 256)
    require_vmm(w_)
    named = {"w": w_, "head": w_.detach(), "t": w_.t(), "row": w_[7], "tail": w_[500:]}
    problems = problems_of(deliver(w, via, named, w_tied))
    if via == "bulk":
        w.call(w_drop, "tied")
        return problems, "views and a tied weight in one blob share one storage"
    problems += problems_of(deliver(w, via, {"later": w_[10:]}, w_tied, "tied"))
    return problems, "views, a tied weight and a view sent later share one storage"


def keep_after_sender_drops(w, via):
    """The receiver keeps a model's tensors after the sender dropped its
    own and gave the memory back (empty_cache), and after other tensors
    took that memory: its values stay right."""
    live = settled_live()
    stream = torch.cuda.Stream()
    spec = model_spec(500, layers=6)
    start = torch.cuda.memory_allocated()
    sd = build(spec, stream)
    if via == "queue":
        w.put(w_check, sd, spec, 0, "keep")
        del sd  # right after put(): the pickle keeps the storages until received
        gc.collect()
        problems = problems_of(w.answer())
    else:
        problems = problems_of(deliver(w, via, sd, w_check, spec, 0, "keep"))
        del sd
        gc.collect()
    if wait_freed(start, timeout=1.0):
        problems.append("the sender's tensors were freed while the receiver keeps them")
    torch.cuda.empty_cache()
    with torch.cuda.stream(stream):
        other = torch.full((spec_bytes(spec) // 4 + MiB,), -1.0, device="cuda")
    torch.cuda.synchronize()
    problems += problems_of(w.call(w_check_kept, "keep", spec, 0))
    del other
    w.call(w_drop, "keep")
    if not wait_freed(start):
        problems.append("the sender's tensors were not freed within 15 s of the receiver "
                        "dropping them")
    problems += live_problems(live)
    return problems, (f"{len(spec)} tensors kept right after the sender dropped, emptied its "
                      "cache and reused the memory; the sender's registrations ended")


def killed_sender(conn, runs, run_bytes):
    """The sender of the kill check: one tensor per stream (each its own
    segment, so its own run); sends the spec, the pickle of the first half
    and the pickle of all, then waits to be killed."""
    def run():
        import vmmipc.torch  # noqa: F401  (the reducers)
        torch.zeros(1, device="cuda")
        spec = [flat(f"r{i}", run_bytes, "float32", 600 + i) for i in range(runs)]
        tensors = build(spec, [torch.cuda.Stream() for _ in spec])
        half = {n: tensors[n] for n, *_ in spec[:runs // 2]}
        conn.send(spec)
        conn.send_bytes(ForkingPickler.dumps(half))
        conn.send_bytes(ForkingPickler.dumps(tensors))
        conn.recv()  # its server goes on serving until the test kills it
    try:
        run()
    except BaseException:  # noqa: BLE001 - the parent must hear why
        conn.send(("error", traceback.format_exc()[-2500:]))


def gpu_free():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def kill_mid_sync(vt):
    """This process receives from a spawned sender: the first half of its
    runs, then a pickle of all of them, during whose loading the sender is
    stopped (SIGSTOP: loading must wait on it) and killed (SIGKILL). The
    loading must fail with a vmmipc error within KILL_BOUND_S; this process
    goes on; the first half's tensors stay right; once dropped, nothing is
    left: no descriptor, no cached mapping, the addresses unmapped, and
    the GPU memory of both sides back to the driver."""
    import multiprocessing as mp
    from multiprocessing import resource_tracker
    runs, run_bytes = 16, 512 * MiB
    ctx = mp.get_context("spawn")
    resource_tracker.ensure_running()  # spawn starts it once, with a descriptor of its own
    free0, fds0, cache0 = gpu_free(), settled_fd_count(), vmmipc.cache_info()
    conn, child_end = ctx.Pipe()
    proc = ctx.Process(target=killed_sender, args=(child_end, runs, run_bytes))
    proc.start()
    child_end.close()
    problems, detail = [], ""
    try:
        if not conn.poll(TIMEOUT):
            return ["the sender sent nothing"], ""
        spec = conn.recv()
        if isinstance(spec, tuple):
            return [f"the sender failed:\n{spec[1]}"], ""
        half_blob, all_blob = conn.recv_bytes(), conn.recv_bytes()
        first = ForkingPickler.loads(half_blob)
        torch.cuda.current_stream().synchronize()
        problems += [f"first half: {p}" for p in value_problems(first, spec[:runs // 2])]
        ptrs = [t.data_ptr() for t in first.values()]
        os.kill(proc.pid, signal.SIGSTOP)
        outcome = {}

        def load_all():
            try:
                outcome["value"] = ForkingPickler.loads(all_blob)
            except BaseException as e:  # noqa: BLE001 - the check looks at it
                outcome["error"] = e
            outcome["end"] = time.monotonic()
        loader = threading.Thread(target=load_all, daemon=True)
        loader.start()
        loader.join(1.0)
        waiting = loader.is_alive()
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        proc.join(TIMEOUT)
        loader.join(KILL_BOUND_S)
        if loader.is_alive():
            return problems + [f"loading did not end within {KILL_BOUND_S} s of the sender's "
                               "death"], ""
        after_kill = outcome["end"] - t_kill
        if not waiting:
            problems.append("not exercised: loading ended while the sender was stopped "
                            f"({outcome.get('error') or 'no error'})")
        err = outcome.pop("error", None)
        if not isinstance(err, vmmipc.VmmipcError):
            problems.append(f"loading after the sender died gave {err!r}, not a vmmipc error"
                            + (" (it returned tensors)" if "value" in outcome else ""))
        detail = (f"{runs} runs of {run_bytes // MiB} MiB; the load "
                  f"{'waited' if waiting else 'did NOT wait'} on the stopped sender; "
                  f"{after_kill:.2f} s after SIGKILL it failed: {type(err).__name__}: "
                  f"{str(err)[:300]}")
        outcome.clear()  # whatever it built is freed here
        del err
        gc.collect()
        problems += [f"first half after the kill: {p}" for p in
                     value_problems(first, spec[:runs // 2])]
        del first
        gc.collect()
        torch.cuda.synchronize()
        if not wait_for(lambda: (vmmipc.cache_info().entries == cache0.entries
                                 and vmmipc.cache_info().referenced_bytes
                                 == cache0.referenced_bytes), 15):
            problems.append(f"mappings left in the import cache: {vmmipc.cache_info()} "
                            f"(before: {cache0})")
        mapped = [p for p in ptrs if driver_range(p) != "CUDA_ERROR_NOT_FOUND"]
        if mapped:
            problems.append(f"{len(mapped)} of the first half's addresses are still mapped")
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT)
        proc.close()  # its sentinel descriptor
        conn.close()
    fds = settled_fd_count()
    if fds != fds0:
        problems.append(f"{fds - fds0} more descriptors than before the sender started")
    if not wait_for(lambda: gpu_free() >= free0 - 256 * MiB, 15):
        problems.append(f"{(free0 - gpu_free()) // MiB} MiB of GPU memory not given back to "
                        "the driver (the killed sender's memory is freed once no one holds it)")
    return problems, detail


def resend_bytes(w):
    """The repeated-send path under ForkingPickler bytes: a send, then 5
    re-sends after in-place updates; values checked each time, the later
    sends over the first send's storages and with no import."""
    live = settled_live()
    stream = torch.cuda.Stream()
    spec = model_spec(700, layers=4) + model_spec(800, layers=2, dtype_name="bfloat16")[1:-2]
    spec = [(f"{i}.{n}", s, d, seed) for i, (n, s, d, seed) in enumerate(spec)]
    sd = build(spec, stream)
    problems, misses, times = [], [], []
    for k in range(6):
        if k:
            add_all(sd)
        t0 = time.monotonic()
        blob = dumps_sglang(sd) if k % 2 else ForkingPickler.dumps(sd)
        r = w.call_with_bytes(w_via_bytes, blob, w_resend, spec, k)
        times.append((time.monotonic() - t0) * 1e3)
        problems += [f"send {k}: {p}" for p in problems_of(r)]
        misses.append(r.get("cache", {}).get("misses"))
    if None not in misses and misses[-1] != misses[0]:
        problems.append(f"the re-sends imported anew ({misses[-1] - misses[0]} imports after "
                        "the first send)")
    w.call(w_drop, "resend")
    del sd
    gc.collect()
    problems += live_problems(live)
    return problems, (f"{len(spec)} tensors; round trips {', '.join(f'{t:.1f}' for t in times)} "
                      "ms (pickle, pipe, loads, check)")


def bulk(w):
    """share_tensors/open_tensors with a dict and with a list of pairs
    (names and order kept; the list opened with device=0), and vLLM's
    pattern with reduce_tensor called alone for each tensor (no batch: a
    grant each): values right; once the receiver drops them, its mappings
    are unreferenced."""
    stream = torch.cuda.Stream()
    spec = model_spec(900, layers=3)
    sd = build(spec, stream)
    problems = []
    before = w.call(w_cache)["cache"]
    r = deliver(w, "bulk", sd, w_check, spec, 0)
    problems += [f"dict: {p}" for p in problems_of(r)]
    if r.get("kind") not in (None, "dict"):
        problems.append(f"a dict was shared, a {r['kind']} opened")
    pairs = list(reversed(list(sd.items())))
    import vmmipc.torch as vt
    r = w.call_with_bytes(w_open_list, vt.share_tensors(pairs), spec)
    problems += [f"list: {p}" for p in problems_of(r)]
    if r.get("names") is not None and r["names"] != [n for n, _ in pairs]:
        problems.append("the list of pairs came back in another order or with other names")
    r = w.call_with_bytes(w_via_reduce, pickle.dumps(reduced(sd, batched=False)), w_check, spec)
    problems += [f"reduce_tensor one by one: {p}" for p in problems_of(r)]
    after = w.call(w_cache)["cache"]
    if after["referenced_bytes"] != before["referenced_bytes"]:
        problems.append(f"{after['referenced_bytes'] - before['referenced_bytes']} bytes still "
                        "referenced in the receiver after it dropped the tensors")
    return problems, (f"{len(spec)} tensors as a dict and as a list of pairs, and through "
                      "reduce_tensor one by one")


def w_open_list(spec):
    import vmmipc.torch as vt
    got = vt.open_tensors(pipe_bytes(), device=0)
    problems = [] if isinstance(got, list) else [f"a list was shared, a {type(got).__name__} "
                                                 "opened"]
    r = w_check(got, spec)
    r["problems"] = problems + r["problems"]
    return r


def imports(w, via):
    """A model's state dict built at once on one stream is a handful of
    imports in the receiver (one a run), not one a tensor; and its mapped
    bytes stay within 1.05 x the state dict's bytes plus a chunk a run."""
    stream = torch.cuda.Stream()
    spec = model_spec(1000)
    sd = build(spec, stream)
    before = w.call(w_cache)["cache"]
    r = deliver(w, via, sd, w_check, spec, 0)
    problems = problems_of(r)
    n, mapped = cache_delta(before, r.get("cache", before))
    nbytes = spec_bytes(spec)
    if not 1 <= n <= MAX_MODEL_IMPORTS:
        problems.append(f"{n} imports for {len(spec)} tensors (want 1..{MAX_MODEL_IMPORTS}: one "
                        "a run)")
    if mapped > mapped_bound(nbytes, n):
        problems.append(f"{mapped / MiB:.1f} MiB mapped for {nbytes / MiB:.1f} MiB of tensors "
                        f"(bound {mapped_bound(nbytes, n) / MiB:.1f} MiB)")
    return problems, (f"{len(spec)} tensors: {n} imports, {mapped / MiB:.1f} MiB mapped for "
                      f"{nbytes / MiB:.1f} MiB")


def transformer(w, via):
    """A real small transformer (transformers' Llama, tied embeddings): the
    child loads the state dict and its logits equal the sender's exactly.
    Through bulk it goes as a list of pairs."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, vocab_size=2048,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).cuda().eval()
    ids = torch.randint(0, config.vocab_size, (2, 24), device="cuda")
    with torch.no_grad():
        want = model(ids).logits.cpu()
    sd = model.state_dict()
    require_vmm(*sd.values())
    r = deliver(w, via, sd if via != "bulk" else list(sd.items()), w_llama, config, ids.cpu())
    problems = problems_of(r)
    if problems:
        return problems, ""
    diff = float((r["logits"] - want).abs().max())
    if not torch.equal(r["logits"], want):
        problems.append(f"the child's logits differ from the sender's by up to {diff:.3g}")
    return problems, f"{len(sd)} tensors; logits equal (max difference {diff:.3g})"


def main(argv):
    status = start_torch_script(torch, TORCH_MISSING,
                                lambda: importlib.import_module("vmmipc.torch"))
    if status is not None:
        return status
    import vmmipc.torch as vt
    try:
        import transformers  # noqa: F401
        have_transformers = True
    except ImportError as e:
        have_transformers = False
        print(f"SKIP transformer: transformers is not installed ({e})", flush=True)
    only = set(argv)

    def want(name):
        return not only or name in only

    # scenario: (title, check, whether it runs once per via)
    cases = {
        "cache": ("empty_cache() and reallocation at the same addresses between sends",
                  reallocation, True),
        "growth": ("segment growth between sends, old and new sent together", growth, True),
        "across": ("a tensor across two runs", across, True),
        "pools": ("small-pool and large-pool tensors in one state dict", pools, True),
        "tied": ("views and tied weights arrive as one storage", tied, True),
        "keep": ("the receiver keeps a model after the sender dropped and reused it",
                 keep_after_sender_drops, True),
        "imports": ("a model built at once: one import a run, mapped bytes bounded", imports,
                    True),
        "transformer": ("a small Llama's state dict: the same logits in the child", transformer,
                        True),
        "bytes": ("ForkingPickler bytes over a Pipe: a send and 5 re-sends after in-place updates",
                  resend_bytes, False),
        "bulk": ("share_tensors/open_tensors with a dict and a list of pairs; reduce_tensor one "
                 "by one", bulk, False),
    }
    chosen = [case for name, case in cases.items()
              if want(name) and (name != "transformer" or have_transformers)]
    if chosen:
        run_cases(chosen, VIAS)
    if want("kill"):
        run_problems("the sender killed mid-sync: a clear error, nothing leaks, the receiver "
                     "goes on", lambda: kill_mid_sync(vt))
    return summary()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
