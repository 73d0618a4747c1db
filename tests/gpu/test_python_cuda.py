#!/usr/bin/env python3
"""GPU test of the Python shim with cuda.core VirtualMemoryResource buffers.

Run from the repository root on a machine with a CUDA GPU, cuda.core (1.2,
VirtualMemoryResource), cuda.bindings, CuPy and torch (the array-protocol
scenario), after `make lib`:

    python3 tests/gpu/test_python_cuda.py [scenario ...]

Buffers: "chunked", 4096 allocations of 2 MiB (8 GiB) mapped contiguously and
owned by a VirtualMemoryResource; "grown", a VirtualMemoryResource buffer
grown with modify_allocation (several allocations of different sizes). Each
crosses multiprocessing Queue, Pipe, Pool.map and Process(args=...) under
spawn and forkserver into a child whose RLIMIT_NOFILE is 64; the child checks
every word on the GPU (CuPy), writes a new pattern, and the parent checks it.
Descriptor counts of both processes must stay within 8 of their baselines.
Also: the sender frees its buffer right after pickling; the fork start method
fails at once with VmmipcForkError; a CUDA Mapping is read and written through
__cuda_array_interface__ (CuPy, torch.as_tensor) and __dlpack__ (CuPy,
torch.from_dlpack), and the received cuda.core Buffer through its own
__dlpack__; repeated sends of one Buffer are one anchor registration and
cache hits in the receiver (same address); cuda_query_range finds allocation
boundaries and refuses cudaMalloc memory.

Prints one PASS/FAIL/SKIP line per check and "N passed, M failed".
"""

import multiprocessing as mp
import os
import resource
import sys
import time
import traceback

# _gpu_helpers first: it puts this checkout's vmmipc and library on the path.
from _gpu_helpers import fork_refusals, guard, record, run_case, skip_all, summary
from _mp_helpers import CHILD_NOFILE, FdSampler, fd_count, limit_fds
import vmmipc  # loads nothing yet

CHUNK = 2 << 20
N_CHUNKS = 4096
FD_SLACK = 8
TIMEOUT = 300
BLOCK_WORDS = 64 << 20  # verify 256 MiB at a time

# ---------------------------------------------------------------- helpers


def cuda_setup(device=0):
    """Make the device current for cuda.core and CuPy (their descriptors are
    opened here, before any baseline is taken)."""
    from cuda.core import Device
    import cupy as cp
    Device(device).set_current()
    cp.cuda.Device(device).use()
    cp.zeros(1).sum()  # CuPy's own context and modules


_kernel = None


def _fill_kernel():
    global _kernel
    if _kernel is None:
        import cupy as cp
        _kernel = cp.ElementwiseKernel(
            "uint64 base, uint32 seed", "uint32 y",
            "unsigned long long k = base + i;"
            "y = (unsigned int)(k * 2654435761ull) ^ (unsigned int)(k >> 32) ^ seed;",
            "vmmipc_fill")
    return _kernel


def words(buf):
    """A CuPy uint32 array over a cuda.core Buffer (no copy)."""
    import cupy as cp
    mem = cp.cuda.UnownedMemory(int(buf.handle), buf.size, buf, device_id=buf.device_id)
    return cp.ndarray((buf.size // 4,), dtype=cp.uint32, memptr=cp.cuda.MemoryPointer(mem, 0))


def fill(buf, seed):
    import cupy as cp
    w = words(buf)
    _fill_kernel()(cp.uint64(0), cp.uint32(seed), w)
    cp.cuda.runtime.deviceSynchronize()


def count_bad(buf, seed):
    """Words of a cuda.core Buffer that differ from the seed pattern."""
    return count_bad_words(words(buf), seed)


def count_bad_words(w, seed):
    """Words of a CuPy uint32 array that differ from the seed pattern
    (checked block by block)."""
    import cupy as cp
    scratch = cp.empty(min(BLOCK_WORDS, w.size), dtype=cp.uint32)
    bad = 0
    for start in range(0, w.size, BLOCK_WORDS):
        part = w[start:start + BLOCK_WORDS]
        expect = scratch[:part.size]
        _fill_kernel()(cp.uint64(start), cp.uint32(seed), expect)
        bad += int(cp.count_nonzero(part != expect))
    return bad


# ------------------------------------------------------------ the buffers


def vmm_resource(device=0):
    from cuda.core import VirtualMemoryResource, VirtualMemoryResourceOptions
    return VirtualMemoryResource(device, VirtualMemoryResourceOptions(handle_type="posix_fd"))


def _ok(res):
    from cuda.bindings import driver as d
    err = res[0]
    if err != d.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"CUDA driver call failed: {err}")
    return res[1] if len(res) > 1 else None


def _owning_vmr(device=0):
    """A VirtualMemoryResource whose deallocate frees ranges this test built
    itself (unmap every chunk in one call, free the reservation), so buffers
    made outside VirtualMemoryResource.allocate are still VMR buffers to
    vmmipc and are freed for real when closed."""
    from cuda.bindings import driver as d
    from cuda.core import VirtualMemoryResource, VirtualMemoryResourceOptions

    class OwningVMR(VirtualMemoryResource):
        def deallocate(self, ptr, size, stream=None):
            _ok(d.cuMemUnmap(int(ptr), size))
            _ok(d.cuMemAddressFree(int(ptr), size))

    return OwningVMR(device, VirtualMemoryResourceOptions(handle_type="posix_fd"))


def chunked_buffer(vmr, n_chunks=N_CHUNKS, chunk=CHUNK, device=0, sizes=None):
    """Separate allocations (n_chunks of chunk bytes, or the given sizes)
    mapped back to back, as one Buffer owned by vmr; each allocation's own
    handle is released right after mapping, so unmapping frees it."""
    from cuda.bindings import driver as d
    from cuda.core import Buffer

    sizes = sizes or [chunk] * n_chunks
    prop = d.CUmemAllocationProp()
    prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    prop.requestedHandleTypes = d.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    total = sum(sizes)
    ptr = int(_ok(d.cuMemAddressReserve(total, CHUNK, 0, 0)))
    off = 0
    for size in sizes:
        h = _ok(d.cuMemCreate(size, prop, 0))
        _ok(d.cuMemMap(ptr + off, size, 0, h, 0))
        _ok(d.cuMemRelease(h))
        off += size
    desc = d.CUmemAccessDesc()
    desc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    desc.location.id = device
    desc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _ok(d.cuMemSetAccess(ptr, total, [desc], 1))
    return Buffer.from_handle(ptr, total, mr=vmr)


GROWN_NOTE = []


def grown_buffer(vmr):
    """A VirtualMemoryResource buffer grown with modify_allocation: 2 MiB,
    grown 2 MiB at a time to 256 MiB, then by 768 MiB at once. cuda.core 1.2
    has refused to grow (CUDA_ERROR_NOT_SUPPORTED in its slow path) on the
    H200 here; then the test builds a buffer of the same mixed shape itself
    (allocations of 2, 4 and 6 MiB) and says so."""
    try:
        buf = vmr.allocate(CHUNK)
        for k in range(2, 129):
            buf = vmr.modify_allocation(buf, k * CHUNK)
        return vmr.modify_allocation(buf, 1 << 30)
    except Exception as e:  # noqa: BLE001 - cuda.core's own limitation, reported
        GROWN_NOTE.append(f"cuda.core modify_allocation failed ({e.__class__.__name__}: {str(e)[:80]}); "
                          "using a mixed-size buffer of 2/4/6 MiB allocations instead")
        sizes = [CHUNK * (1 + i % 3) for i in range(128)]
        return chunked_buffer(_owning_vmr(), sizes=sizes)


def make_buffer(kind):
    vmr = vmm_resource()
    buf = chunked_buffer(_owning_vmr()) if kind == "chunked" else grown_buffer(vmr)
    return vmr, buf


def chunk_count(buf):
    import vmmipc.cuda_core as vc
    t = vc.grant_buffer(buf, uses=1)
    try:
        return t.info().chunk_count
    finally:
        vmmipc.unregister(t)


# ------------------------------------------------------- child processes

_sampler = None


def child_prepare():
    """CUDA first (its descriptors are part of the baseline), then the
    RLIMIT_NOFILE of 64, then the sampler that watches the import."""
    global _sampler
    cuda_setup()
    limit_fds()
    _sampler = FdSampler()


class PrepareFirst:
    """First in Process(args=...): unpickled before the buffer after it."""

    def __reduce__(self):
        return (child_prepare, ())


def _report(buf, seed_in, seed_out):
    sampler = _sampler.stop()
    from cuda.core import Buffer
    after_import = fd_count()
    r = {"type_ok": isinstance(buf, Buffer) and
         type(buf.memory_resource).__name__ == "ImportedMemoryResource",
         "size": buf.size, "bad": count_bad(buf, seed_in)}
    fill(buf, seed_out)
    buf.close()  # unmaps
    r.update(baseline=sampler.baseline, peak=sampler.peak, after_import=after_import,
             after_close=fd_count(), nofile=resource.getrlimit(resource.RLIMIT_NOFILE)[0],
             live=vmmipc.live_registrations())
    return r


def child_queue(q, results, seed_in, seed_out):
    child_prepare()
    results.put(guard(lambda: _report(q.get(timeout=TIMEOUT), seed_in, seed_out)))


def child_pipe(conn, seed_in, seed_out):
    child_prepare()

    def run():
        if not conn.poll(TIMEOUT):
            raise TimeoutError("nothing arrived on the pipe")
        return _report(conn.recv(), seed_in, seed_out)
    conn.send(guard(run))


def child_process_args(_prepared, buf, results, seed_in, seed_out):
    results.put(guard(_report, buf, seed_in, seed_out))


def pool_task(args):
    buf, seed_in, seed_out = args
    return guard(_report, buf, seed_in, seed_out)


def child_after_free(conn, seed):
    child_prepare()

    def run():
        from multiprocessing.reduction import ForkingPickler
        if not conn.poll(TIMEOUT):
            raise TimeoutError("nothing arrived on the pipe")
        buf = ForkingPickler.loads(conn.recv_bytes())
        sampler = _sampler.stop()
        r = {"bad": count_bad(buf, seed), "size": buf.size, "peak": sampler.peak,
             "baseline": sampler.baseline}
        buf.close()
        return r
    conn.send(guard(run))


def child_repeated(q, results, n, seed):
    """Receive the same Buffer n times: check it through cuda.core's own
    __dlpack__ and the Mapping's array interface; report the addresses and
    the import cache's counters."""
    child_prepare()

    def run():
        import cupy as cp
        import vmmipc.cuda_core as vc
        addrs, bad, problems = [], 0, []
        for _ in range(n):
            buf = q.get(timeout=TIMEOUT)
            addrs.append(int(buf.handle))
            bad += count_bad_words(cp.from_dlpack(buf).view(cp.uint32), seed)
            cai = vc.buffer_mapping(buf).__cuda_array_interface__
            if cai["data"][0] != int(buf.handle) or cai["shape"] != (buf.size,):
                problems.append(f"array interface {cai} does not describe the Buffer")
            buf.close()
        return {"addrs": addrs, "bad": bad, "problems": problems,
                "cache": tuple(vmmipc.cache_info())}
    results.put(guard(run))


# ------------------------------------------------------------ the checks

def check_child(r, size):
    if "error" in r:
        return False, "child failed:\n" + r["error"]
    problems = []
    if not r["type_ok"]:
        problems.append("the child did not get a cuda.core Buffer over the import")
    if r["size"] != size:
        problems.append(f"size {r['size']} != {size}")
    if r["bad"]:
        problems.append(f"{r['bad']} words differ in the child")
    if r["nofile"] != CHILD_NOFILE:
        problems.append(f"child RLIMIT_NOFILE {r['nofile']}")
    if r["peak"] - r["baseline"] > FD_SLACK:
        problems.append(f"child fds peaked at baseline+{r['peak'] - r['baseline']}")
    if r["after_close"] - r["baseline"] > FD_SLACK:
        problems.append(f"child kept baseline+{r['after_close'] - r['baseline']} fds")
    return not problems, "; ".join(problems) or (
        f"child fds {r['baseline']}->peak {r['peak']}")


def transfer(kind, buf, mechanism, method):
    ctx = mp.get_context(method)
    fill(buf, 1)
    live = vmmipc.live_registrations()
    if mechanism == "queue":
        q, res = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=child_queue, args=(q, res, 1, 2))
        p.start()
        sampler = FdSampler()
        q.put(buf)
        r = res.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
    elif mechanism == "pipe":
        a, b = ctx.Pipe()
        p = ctx.Process(target=child_pipe, args=(b, 1, 2))
        p.start()
        b.close()
        sampler = FdSampler()
        a.send(buf)
        if not a.poll(TIMEOUT):
            return False, "no answer from the child"
        r = a.recv()
        p.join(TIMEOUT)
    elif mechanism == "pool":
        with ctx.Pool(1, initializer=child_prepare) as pool:
            pool.apply(fd_count)  # the worker is up and prepared
            sampler = FdSampler()
            r = pool.map_async(pool_task, [(buf, 1, 2)]).get(TIMEOUT)[0]
    else:
        res = ctx.Queue()
        sampler = FdSampler()
        p = ctx.Process(target=child_process_args, args=(PrepareFirst(), buf, res, 1, 2))
        p.start()
        r = res.get(timeout=TIMEOUT)
        p.join(TIMEOUT)
    sampler.stop()
    ok, detail = check_child(r, buf.size)
    problems = [] if ok else [detail]
    if sampler.peak - sampler.baseline > FD_SLACK:
        problems.append(f"parent fds peaked at baseline+{sampler.peak - sampler.baseline}")
    bad = count_bad(buf, 2)
    if bad:
        problems.append(f"parent sees {bad} words not written by the child")
    deadline = time.monotonic() + 10
    while vmmipc.live_registrations() > live and time.monotonic() < deadline:
        time.sleep(0.05)
    if vmmipc.live_registrations() != live:
        problems.append("the registration was not consumed")
    if problems:
        return False, "; ".join(problems)
    return True, f"{detail}; parent fds {sampler.baseline}->peak {sampler.peak}"


def sender_frees_after_pickling(method):
    from multiprocessing.reduction import ForkingPickler
    ctx = mp.get_context(method)
    vmr, buf = make_buffer("chunked")
    fill(buf, 5)
    size = buf.size
    data = bytes(ForkingPickler.dumps(buf))  # registers: the library retains each allocation
    buf.close()                              # the sender lets go at once
    a, b = ctx.Pipe()
    p = ctx.Process(target=child_after_free, args=(b, 5))
    p.start()
    b.close()
    a.send_bytes(data)
    if not a.poll(TIMEOUT):
        return False, "no answer from the child"
    r = a.recv()
    p.join(TIMEOUT)
    if "error" in r:
        return False, "child failed:\n" + r["error"]
    ok = r["bad"] == 0 and r["size"] == size and r["peak"] - r["baseline"] <= FD_SLACK
    return ok, f"{r['bad']} bad words after the sender freed its buffer; child fds +{r['peak'] - r['baseline']}"


def export_one_at_a_time(buf, n_chunks):
    """The export-side generator (also warms the driver's export path in
    this process before any fd baseline is taken)."""
    g = vmmipc.export_fds(buf)
    next(g)
    g.close()
    base, peak, count = fd_count(), 0, 0
    for fd in vmmipc.export_fds(buf):
        os.fstat(fd)
        count += 1
        peak = max(peak, fd_count())
    time.sleep(0.2)  # the in-process server closes its end of the stream
    ok = count == n_chunks and peak - base <= 4 and fd_count() <= base
    return ok, f"{count} fds, peak baseline+{peak - base}, after {fd_count() - base:+d}"


def array_protocols():
    """A CUDA Mapping seen by CuPy and torch without a copy, through
    __cuda_array_interface__ and __dlpack__: bytes read, bytes written (the
    exporter's buffer sees them), close() refused under a DLPack consumer."""
    import gc
    import cupy as cp
    import torch
    import vmmipc.cuda_core as vc
    buf = chunked_buffer(_owning_vmr(), n_chunks=32)
    fill(buf, 7)
    ticket = vc.grant_buffer(buf, uses=0)
    problems = []
    m = vmmipc.import_stream(ticket, cache=False)  # the server lives here too
    try:
        cai = m.__cuda_array_interface__
        if (cai["data"], cai["shape"], cai["typestr"], cai["version"]) != (
                (m.addr, False), (buf.size,), "|u1", 3):
            problems.append(f"array interface {cai}")
        a = cp.asarray(m)
        if (a.dtype, a.size, a.data.ptr) != (cp.uint8, buf.size, m.addr):
            problems.append(f"cupy.asarray: {a.dtype} {a.size} {a.data.ptr:#x}")
        if count_bad_words(a.view(cp.uint32), 7):
            problems.append("cupy.asarray (CAI) reads wrong bytes")
        t_cai = torch.as_tensor(m, device=f"cuda:{m.device}")
        if t_cai.data_ptr() != m.addr or t_cai.dtype != torch.uint8:
            problems.append("torch.as_tensor (CAI) is not a view of the mapping")
        x = cp.from_dlpack(m)
        if x.data.ptr != m.addr or count_bad_words(x.view(cp.uint32), 7):
            problems.append("cupy.from_dlpack reads wrong bytes")
        t = torch.from_dlpack(m)
        if (t.device.type, t.dtype, t.numel(), t.data_ptr()) != (
                "cuda", torch.uint8, buf.size, m.addr):
            problems.append(f"torch.from_dlpack: {t.device} {t.dtype} {t.numel()}")
        if count_bad_words(cp.from_dlpack(t).view(cp.uint32), 7):
            problems.append("torch.from_dlpack reads wrong bytes")
        _fill_kernel()(cp.uint64(0), cp.uint32(8), x.view(cp.uint32))  # write through DLPack
        cp.cuda.runtime.deviceSynchronize()
        if count_bad(buf, 8):
            problems.append("writes through the DLPack view did not reach the exporter")
        try:
            m.close()
            problems.append("close() succeeded under live DLPack consumers")
        except BufferError:
            pass
        del a, t_cai, x, t
        gc.collect()
        torch.cuda.synchronize()
        m.close()  # the consumers let go: now it closes
        try:
            m.addr
            problems.append("a closed Mapping gave its addr")
        except ValueError:
            pass
    finally:
        if not m.closed:
            m.close()
        vmmipc.unregister(ticket)
        buf.close()
    return not problems, "; ".join(problems) or "CAI (CuPy, torch) and DLPack (CuPy, torch) ok"


def repeated_sends(method):
    """One Buffer sent three times: one anchor registration, one register_again
    per send, one miss and two hits in the receiver at one address."""
    import vmmipc.cuda_core as vc
    buf = chunked_buffer(_owning_vmr(), n_chunks=64)
    fill(buf, 9)
    live = vmmipc.live_registrations()
    ctx = mp.get_context(method)
    q, res = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child_repeated, args=(q, res, 3, 9))
    p.start()
    for _ in range(3):
        q.put(buf)
    r = res.get(timeout=TIMEOUT)
    p.join(TIMEOUT)
    if "error" in r:
        return False, "child failed:\n" + r["error"]
    problems = list(r["problems"])
    info = vmmipc.CacheInfo(*r["cache"])
    if r["bad"]:
        problems.append(f"{r['bad']} words differ in the child")
    if (info.misses, info.hits) != (1, 2):
        problems.append(f"child cache: {info}")
    if len(set(r["addrs"])) != 1:
        problems.append(f"cache hits at other addresses: {r['addrs']}")
    deadline = time.monotonic() + 10
    while vmmipc.live_registrations() != live + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if vmmipc.live_registrations() != live + 1:
        problems.append(f"{vmmipc.live_registrations() - live} registrations left, want the anchor")
    if not vc.drop_anchor(buf) or vmmipc.live_registrations() != live:
        problems.append("drop_anchor did not end the anchor")
    buf.close()
    return not problems, "; ".join(problems) or f"1 miss, 2 hits at {r['addrs'][0]:#x}"


def query_range():
    import cupy as cp
    buf = chunked_buffer(_owning_vmr(), n_chunks=4)
    ptr = int(buf.handle)
    problems = []
    try:
        one = vmmipc.cuda_query_range(ptr + CHUNK + 100, 10)
        if (one.base, one.size, one.device) != (ptr + CHUNK, CHUNK, 0) or not one.handle_types & 1:
            problems.append(f"inside chunk 1: {one}")
        span = vmmipc.cuda_query_range(ptr + 100, 2 * CHUNK)
        if (span.base, span.size) != (ptr, 3 * CHUNK):
            problems.append(f"across chunks 0-2: {span}")
        plain = cp.empty(1 << 20, dtype=cp.uint8)  # cudaMalloc (CuPy's pool)
        try:
            vmmipc.cuda_query_range(plain.data.ptr, 1)
            problems.append("cudaMalloc memory was taken for VMM memory")
        except vmmipc.NotFoundError:
            pass
    finally:
        buf.close()
    return not problems, "; ".join(problems) or "boundaries found, cudaMalloc refused"


def fork_refused():
    vmr, buf = make_buffer("grown")
    problems = fork_refusals(buf, vmmipc.live_registrations())
    buf.close()
    return not problems, "; ".join(problems) or "queue and pool refused at once"


def main(argv):
    try:
        import vmmipc.cuda_core as vc
        vc.install()
        import cupy  # noqa: F401
        from cuda.core import Device, VirtualMemoryResource  # noqa: F401
    except ImportError as e:
        return skip_all(e)
    try:
        cuda_setup()
    except Exception as e:  # noqa: BLE001
        return skip_all(f"no usable GPU: {e}")
    vmmipc.live_registrations()  # load the library before any baseline
    only = set(argv)
    for method in ("spawn", "forkserver"):  # start them now: their fds predate baselines
        p = mp.get_context(method).Process(target=fd_count)
        p.start()
        p.join(TIMEOUT)

    for kind in ("chunked", "grown"):
        if only and kind not in only:
            continue
        try:
            vmr, buf = make_buffer(kind)
            n = chunk_count(buf)
            record(f"{kind}: build", True, f"{buf.size >> 20} MiB in {n} allocations")
            if kind == "grown" and GROWN_NOTE:
                print(f"NOTE {GROWN_NOTE[-1]}", flush=True)
        except BaseException as e:  # noqa: BLE001
            record(f"{kind}: build", False, "".join(traceback.format_exception(e))[-1500:])
            continue
        run_case(f"{kind}: export_fds yields one CUDA fd at a time",
                 lambda: export_one_at_a_time(buf, n))
        for method in ("spawn", "forkserver"):
            for mech in ("queue", "pipe", "pool", "process"):
                run_case(f"{kind}: {mech} under {method}",
                         lambda: transfer(kind, buf, mech, method))
        buf.close()
    if not only or "protocols" in only:
        run_case("CUDA Mapping through __cuda_array_interface__ and __dlpack__ (CuPy, torch)",
                 array_protocols)
    if not only or "cache" in only:
        for method in ("spawn", "forkserver"):
            run_case(f"repeated sends of one Buffer hit the receiver's cache ({method})",
                     lambda: repeated_sends(method))
    if not only or "query" in only:
        run_case("cuda_query_range", query_range)
    if not only or "free" in only:
        run_case("sender frees its buffer right after pickling (spawn)",
                 lambda: sender_frees_after_pickling("spawn"))
    if not only or "fork" in only:
        run_case("fork start method fails at once with VmmipcForkError", fork_refused)
    return summary()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
