#!/usr/bin/env python3
"""GPU test of vmmipc.torch.sharing_pool: tensors allocated in libvmmipc's
pool (large chunks, here 64 MiB so that the tests stay small) and sent to a
spawned child through vmmipc.torch, every weight checked.

How to run it, and under the seccomp filter that refuses pidfd_getfd:
tests/gpu/run_torch.sh (TORCH_TEST=tests/gpu/test_torch_pool.py); alone,
`python3 tests/gpu/test_torch_pool.py [scenario ...]`.

Scenarios (default: all): conf, model, growth, reuse, cache, lifetime, tied,
ordering, containers, fork, release. The process runs with
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (as the other torch
tests), which torch's MemPool refuses: the pool must turn it off inside
its block and back on after it ("conf" checks both sides). Values are
checked exactly: the receiver regenerates the sender's pattern and compares
every element. A check whose setup did not come out as it needs (addresses
that do not repeat, no chunk given back) fails as "not exercised". Prints
one PASS/FAIL line per check and "N passed, M failed"; exits non-zero if
anything failed.
"""

import gc
import math
import sys
from multiprocessing.reduction import ForkingPickler

# _gpu_helpers first: it puts this checkout's vmmipc and library on the path.
from _gpu_helpers import (KEPT, cache_delta, cache_now, chunk_count, flat, fork_refusals,
                          import_torch_expandable, live_problems, pattern, problems_of,
                          require_vmm, run_cases, settled_live, spec_bytes, start_torch_script,
                          summary, value_problems, w_cache, w_drop, w_via_bulk, w_via_bytes,
                          wait_freed)
from _mp_helpers import wait_for

torch, TORCH_MISSING = import_torch_expandable()  # before CUDA starts, here and in children

import vmmipc  # noqa: E402  (loads nothing yet; vmmipc.torch is imported in main())

MiB = 1 << 20
CHUNK = 64 * MiB        # the pool's chunks in this test: growth happens at small sizes
SLEEP_CYCLES = int(2.5e9)  # torch.cuda._sleep: about 1.5 s on the H200
VIAS = ("queue", "bytes", "bulk")

# ------------------------------------------------------------- the sender


def vt():
    import vmmipc.torch
    return vmmipc.torch


def model_spec(seed, layers=12):
    """A state dict in miniature: per layer four 1.5 MiB and three 4 MiB
    matrices and two 4 KiB norms (torch puts those in its small pool's
    2 MiB segments), embedding and head: about 290 MiB, 5 chunks."""
    spec = [flat("embed", 8 * MiB, "float32", seed)]
    for i in range(layers):
        for j, (part, nbytes) in enumerate((("q", 3 * MiB // 2), ("k", 3 * MiB // 2),
                                            ("v", 3 * MiB // 2), ("o", 3 * MiB // 2),
                                            ("gate", 4 * MiB), ("up", 4 * MiB), ("down", 4 * MiB),
                                            ("norm1", 4096), ("norm2", 4096))):
            spec.append(flat(f"l{i}.{part}", nbytes, "bfloat16" if j % 2 else "float32",
                             seed + 1 + 9 * i + j))
    return spec + [flat("head", 8 * MiB, "float32", seed + 999)]


def build(spec, add=0):
    """The spec's tensors, allocated in the sharing pool, filled outside it
    (the pattern's temporaries stay out of the pool)."""
    with vt().sharing_pool(CHUNK):
        out = {name: torch.empty(shape, dtype=getattr(torch, d), device="cuda")
               for name, shape, d, _ in spec}
    for name, shape, d, seed in spec:
        out[name].copy_((pattern(math.prod(shape), out[name].dtype, seed) + add).reshape(shape))
    torch.cuda.synchronize()
    require_vmm(*out.values())
    return out


def pool_info():
    """The sharing pool's vmmipc_pool_info (made on first use)."""
    pool = vt().sharing_pools().get(torch.cuda.current_device())
    if pool is None:
        with vt().sharing_pool(CHUNK) as pool:
            pass
    return pool.info()


def fresh_pool():
    """Everything of earlier checks freed and the pool's memory given back,
    so that a check's tensors lie from the pool's base on: torch lays the
    same allocations out the same way in a new MemPool."""
    gc.collect()
    torch.cuda.synchronize()
    settled_live()  # anchors of earlier sends ended: their storages are free
    vt().release_sharing_pool()


def in_pool(*tensors):
    """Problems of tensors that do not lie in the sharing pool's range."""
    i = pool_info()
    return [f"a tensor at {t.data_ptr():#x} lies outside the pool [{i.base:#x}, +{i.reserved_bytes})"
            for t in tensors if not i.base <= t.data_ptr() < i.base + i.reserved_bytes]


def chunk_size_of(t):
    """The size of the allocations under t (its covering range over their
    count): CHUNK in the pool, 20 or 2 MiB in torch's expandable segments."""
    rng = vmmipc.cuda_query_range(t.data_ptr(), t.untyped_storage().nbytes())
    return rng.size // chunk_count(rng.base, rng.size)


def deliver(w, via, named, fn, *args):
    """Send named to the worker through via; it runs fn(received, *args)."""
    if via == "queue":
        return w.call(fn, named, *args)
    if via == "bytes":
        return w.call_with_bytes(w_via_bytes, ForkingPickler.dumps(named), fn, *args)
    return w.call_with_bytes(w_via_bulk, vt().share_tensors(named), fn, *args)

# ------------------------------------------------ run in the worker child


def w_check(named, spec, add=0, keep=None):
    torch.cuda.current_stream().synchronize()
    if keep is not None:
        KEPT[keep] = named
    return {"problems": value_problems(dict(named), spec, add), "cache": cache_now()}


def w_check_kept(key, spec, add=0):
    torch.cuda.synchronize()
    return {"problems": value_problems(KEPT[key], spec, add)}


def w_write_through(named, spec, key, name, value):
    """Values right; the tensors named also in KEPT[key] are the same
    memory (a write through the new one is seen through the kept one);
    then write value into named[name] for the sender to see."""
    problems = value_problems(named, spec)
    kept = KEPT.pop(key)
    for n in kept:
        named[n].view(-1)[0] = -7.0
        torch.cuda.synchronize()
        if float(kept[n].view(-1)[0]) != -7.0:
            problems.append(f"{n}: a write through the later send is not seen through the kept one")
        named[n].view(-1)[0] = kept_first(n, spec)
    named[name].view(-1)[1] = value
    torch.cuda.synchronize()
    return {"problems": problems}


def kept_first(name, spec):
    for n, shape, d, seed in spec:
        if n == name:
            return float(pattern(math.prod(shape), getattr(torch, d), seed)[0])
    raise KeyError(name)


def w_tied(named):
    problems = []
    if len({id(t.untyped_storage()) for t in named.values()}) != 1:
        problems.append("views and a tied weight arrived over more than one storage")
    named["w"][7, 3] = 1234.0
    torch.cuda.synchronize()
    if float(named["t"][3, 7]) != 1234.0 or float(named["row"][3]) != 1234.0 \
            or float(named["head"][7, 3]) != 1234.0:
        problems.append("a write through one view is not seen through the others")
    want = pattern(1000 * 256, torch.float32, 2).reshape(1000, 256)
    want[7, 3] = 1234.0
    if not torch.equal(named["tail"], want[500:]):
        problems.append("the storage-offset view shows other values")
    return {"problems": problems}


def w_all_equal(t, value):
    torch.cuda.current_stream().synchronize()
    wrong = int((t != value).sum())
    return {"problems": [f"{wrong} of {t.numel()} elements are not {value}: the receiver did not "
                         "wait for the sender's kernel"] if wrong else []}


def w_containers(got, spec):
    problems = []
    try:
        a, (b, inner) = got["list"][0], got["list"][1]
        tensors = {"a": a, "b": b, "c": inner["c"], "d": got["tuple"][0]}
        if not isinstance(got["tuple"], tuple) or not isinstance(got["list"], list):
            problems.append(f"containers changed type: {type(got['list'])}, {type(got['tuple'])}")
    except (KeyError, IndexError, TypeError) as e:
        return {"problems": [f"the structure did not survive: {e!r}"]}
    if got.get("plain") != {"n": 3, "s": "x"}:
        problems.append(f"plain values changed: {got.get('plain')}")
    return {"problems": problems + value_problems(tensors, spec)}

# ------------------------------------------------------------ the checks


def conf(w):
    """The pool works under expandable_segments:True (torch's MemPool alone
    refuses it) and the rest of the program keeps it: outside the block
    tensors are in expandable segments before and after, inside they are in
    CHUNK-byte pool chunks."""
    problems = []
    before = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    with vt().sharing_pool(CHUNK) as pool:
        inside = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    after = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    require_vmm(before, inside, after)
    sizes = [chunk_size_of(t) for t in (before, inside, after)]
    if sizes[1] != CHUNK:
        problems.append(f"inside the block: {sizes[1] // MiB} MiB chunks, want {CHUNK // MiB}")
    for what, size in (("before", sizes[0]), ("after", sizes[2])):
        if size == CHUNK or size > 20 * MiB:
            problems.append(f"{what} the block: {size // MiB} MiB chunks, not torch's expandable "
                            "segments (2 or 20 MiB)")
    problems += in_pool(inside)
    if pool.chunk_size != CHUNK or pool.info().device != torch.cuda.current_device():
        problems.append(f"the pool says {pool!r}")
    spec = [("inside", (8 * MiB,), "uint8", 0)]
    inside.copy_(pattern(8 * MiB, torch.uint8, 0))
    torch.cuda.synchronize()
    problems += problems_of(w.call(w_check, {"inside": inside}, spec))
    return problems, f"chunks: before {sizes[0] // MiB} MiB, inside {sizes[1] // MiB} MiB, " \
                     f"after {sizes[2] // MiB} MiB"


def model(w, via):
    """A model's state dict built in the pool arrives whole, every weight
    checked, as one or two imports, its mapped bytes within the pool's."""
    spec = model_spec(100)
    sd = build(spec)
    problems = in_pool(*sd.values())
    before = w.call(w_cache)["cache"]
    r = deliver(w, via, sd, w_check, spec)
    problems += problems_of(r)
    n, mapped = cache_delta(before, r.get("cache", before))
    info = pool_info()
    if not 1 <= n <= 2:
        problems.append(f"{n} imports for {len(spec)} tensors in {info.mapped_bytes // CHUNK} "
                        "chunks (want 1 or 2: one a run)")
    if mapped > info.mapped_bytes:
        problems.append(f"the receiver mapped {mapped // MiB} MiB, more than the pool's "
                        f"{info.mapped_bytes // MiB} MiB")
    chunks = chunk_count(*vmmipc.cuda_query_range(sd["embed"].data_ptr(), 1)[:2])
    return problems, (f"{len(spec)} tensors, {spec_bytes(spec) // MiB} MiB: {n} import(s), "
                      f"{mapped // MiB} MiB mapped, {info.mapped_bytes // CHUNK} pool chunks "
                      f"({chunks} under the embedding)")


def growth(w, via):
    """Growth past one chunk: tensors of 40 MiB span chunk boundaries and
    map new chunks right after the old ones; old and new sent together are
    the same memory as the first send's."""
    old_spec = [flat(f"a{i}", 40 * MiB, "float32", 200 + i) for i in range(3)]
    new_spec = [flat(f"b{i}", 40 * MiB, "float32", 210 + i) for i in range(2)]
    fresh_pool()
    mapped0 = pool_info().chunks_mapped
    old = build(old_spec)
    problems = problems_of(deliver(w, via, old, w_check, old_spec, 0, "growth"))
    new = build(new_spec)
    mapped1 = pool_info().chunks_mapped
    ptrs = [t.data_ptr() for t in list(old.values()) + list(new.values())]
    if any(b - a != 40 * MiB for a, b in zip(ptrs, ptrs[1:])):
        problems.append(f"not exercised: the 40 MiB tensors are not side by side: {ptrs}")
    if mapped1 - mapped0 < 2:
        problems.append(f"not exercised: {mapped1 - mapped0} new chunks for 200 MiB of tensors")
    r = deliver(w, via, {**old, **new}, w_write_through, old_spec + new_spec, "growth", "b1", 4321.0)
    problems += problems_of(r)
    torch.cuda.synchronize()
    if not problems and float(new["b1"][1]) != 4321.0:
        problems.append("the receiver's write did not reach the sender's tensor")
    return problems, f"{mapped1 - mapped0} chunks mapped for {len(ptrs)} tensors of 40 MiB"


def reuse(w):
    """Freed tensors' memory is reused by torch inside the pool: the same
    addresses come back and no chunk is mapped for them; the new values
    arrive."""
    spec = [flat(f"r{i}", 16 * MiB, "float32", 300 + i) for i in range(4)]
    first = build(spec)
    ptrs = sorted(t.data_ptr() for t in first.values())
    del first
    gc.collect()
    torch.cuda.synchronize()
    mapped = pool_info().chunks_mapped
    again = build(spec, add=1)
    problems = []
    if sorted(t.data_ptr() for t in again.values()) != ptrs:
        problems.append("not exercised: the reallocated tensors are at other addresses")
    if pool_info().chunks_mapped != mapped:
        problems.append(f"{pool_info().chunks_mapped - mapped} chunks mapped for a reallocation")
    problems += problems_of(w.call(w_check, again, spec, 1))
    return problems, f"{len(spec)} tensors reallocated at their addresses, no chunk mapped"


def cache(w, via):
    """Send; the receiver drops the tensors (its import cache may keep the
    mapping); the sender drops its own and gives the pool's memory back
    (release_sharing_pool, torch.cuda.empty_cache); new tensors come at the
    same addresses in new chunks; sending them shows the new values, never
    the old chunks' stale ones."""
    live = settled_live()
    old_spec = [flat(f"w{i}", 24 * MiB, "float32", 400 + i) for i in range(6)]
    new_spec = [(n, c, d, seed + 1000) for n, c, d, seed in old_spec]
    fresh_pool()
    start = torch.cuda.memory_allocated()
    sd = build(old_spec)
    ptrs = [t.data_ptr() for t in sd.values()]
    problems = problems_of(deliver(w, via, sd, w_check, old_spec))
    del sd
    gc.collect()
    if not wait_freed(start):
        problems.append("the sender's tensors were not freed within 15 s of the receiver having them")
    gone0 = pool_info().chunks_released
    released = vt().release_sharing_pool()
    torch.cuda.empty_cache()
    gone = pool_info().chunks_released - gone0
    sd = build(new_spec)
    same = sum(p == t.data_ptr() for p, t in zip(ptrs, sd.values()))
    if same != len(ptrs) or gone == 0:
        problems.append(f"not exercised: {same} of {len(ptrs)} addresses repeated, {gone} chunks "
                        f"given back ({released // MiB} MiB)")
    problems += [f"new contents: {p}" for p in problems_of(deliver(w, via, sd, w_check, new_spec))]
    del sd
    gc.collect()
    problems += live_problems(live)
    return problems, f"{same}/{len(ptrs)} addresses repeated over {gone} chunks given back and mapped anew"


def lifetime(w, via):
    """The lifetime rule: send, the receiver keeps the tensors, the sender
    deletes its own and allocates again in the pool (other values): the
    receiver still reads the old values."""
    old_spec = [flat(f"k{i}", 12 * MiB, "float32", 500 + i) for i in range(4)]
    sd = build(old_spec)
    problems = problems_of(deliver(w, via, sd, w_check, old_spec, 0, "lifetime"))
    del sd
    gc.collect()
    torch.cuda.synchronize()
    other = build([(n, c, d, seed + 77) for n, c, d, seed in old_spec], add=3)
    problems += [f"kept: {p}" for p in problems_of(w.call(w_check_kept, "lifetime", old_spec))]
    w.call(w_drop, "lifetime")
    del other
    return problems, "the receiver's tensors kept their values after the sender freed and reallocated"


def tied(w, via):
    """Views and a tied weight of a pool tensor arrive as one storage."""
    with vt().sharing_pool(CHUNK):
        base = torch.empty(1000, 256, device="cuda")
    base.copy_(pattern(1000 * 256, torch.float32, 2).reshape(1000, 256))
    torch.cuda.synchronize()
    named = {"w": base, "head": base.detach(), "t": base.t(), "row": base[7], "tail": base[500:]}
    return problems_of(deliver(w, via, named, w_tied)), "views and a tied weight share one storage"


def ordering(w):
    """The receiver waits for the sender's kernel: a long kernel, then a
    fill, queued on the current stream right before put(), unsynchronized."""
    with vt().sharing_pool(CHUNK):
        t = torch.zeros(16 * MiB // 4, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(7.0)
    return problems_of(w.call(w_all_equal, t, 7.0)), "the fill behind a 1.5 s kernel arrived"


def containers(w):
    """Tensors in nested dicts, lists and tuples, beside plain values."""
    spec = [flat(c, 2 * MiB, "float32", 600 + i) for i, c in enumerate("abcd")]
    t = build(spec)
    got = {"list": [t["a"], (t["b"], {"c": t["c"]})], "tuple": (t["d"],), "plain": {"n": 3, "s": "x"}}
    return problems_of(w.call(w_containers, got, spec)), "dict, list, tuple nesting kept"


def fork(w):
    """A child made by fork() is refused, nothing registered for it."""
    with vt().sharing_pool(CHUNK):
        t = torch.ones(MiB, device="cuda")
    torch.cuda.synchronize()
    return fork_refusals(t, settled_live()), "a forked Queue child and Pool task refused"


def release(w):
    """Once nothing lives in the pool, release_sharing_pool gives every
    chunk back to the driver: the pool maps nothing and the GPU's free
    memory grows by what it held."""
    build([flat("x", 100 * MiB, "float32", 700)])  # freed at once: cached by torch in the pool
    gc.collect()
    torch.cuda.synchronize()
    settled_live()
    held = pool_info().mapped_bytes
    free0 = torch.cuda.mem_get_info()[0]
    released = vt().release_sharing_pool()
    info = pool_info()
    problems = []
    if held < 100 * MiB:
        problems.append(f"not exercised: the pool held {held // MiB} MiB")
    if info.mapped_bytes != 0 or info.allocations != 0:
        problems.append(f"still mapped: {info}")
    # Registrations of earlier sends may hold chunks a little longer.
    grown = wait_for(lambda: torch.cuda.mem_get_info()[0] - free0 >= held - CHUNK, 15)
    free1 = torch.cuda.mem_get_info()[0]
    if released < held or not grown:
        problems.append(f"released {released // MiB} MiB of {held // MiB}; the GPU's free memory "
                        f"grew by {(free1 - free0) // MiB} MiB")
    return problems, f"{released // MiB} MiB given back; free memory +{(free1 - free0) // MiB} MiB"


def main(argv):
    status = start_torch_script(torch, TORCH_MISSING, lambda: vt().sharing_pool,
                                f", pool chunks {CHUNK // MiB} MiB")
    if status is not None:
        return status
    only = set(argv)
    # scenario: (title, check, whether it runs once per via)
    cases = {
        "conf": ("expandable segments on for the program, off in the block: the pool works",
                 conf, False),
        "model": ("a model built in the pool: every weight, one or two imports", model, True),
        "growth": ("growth past one chunk, old and new sent together", growth, True),
        "reuse": ("freeing and reuse inside the pool", reuse, False),
        "cache": ("release_sharing_pool + empty_cache, reallocation: never stale", cache, True),
        "lifetime": ("send, delete, allocate again: the receiver reads the old values", lifetime,
                     True),
        "tied": ("views and tied weights arrive as one storage", tied, True),
        "ordering": ("stream ordering: a long kernel right before put()", ordering, False),
        "containers": ("tensors in nested containers", containers, False),
        "fork": ("fork start method refused", fork, False),
        "release": ("release_sharing_pool gives every chunk back", release, False),
    }
    run_cases([case for name, case in cases.items() if not only or name in only], VIAS)
    return summary()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
