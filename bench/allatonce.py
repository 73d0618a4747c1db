"""The all-at-once way to share a VMM buffer of N chunks, for comparison.

This reproduces how cuda.core shares VMM buffers between processes: the
sender exports every chunk's POSIX file descriptor up front, pickles them
through a multiprocessing.Queue with multiprocessing.reduction.DupFd (each
DupFd registers a duplicate with the sender's resource sharer; unpickling
connects to it once per descriptor), and the receiver unpickles them all,
imports all, reserves one range, maps every chunk and sets access.

    python3 bench/allatonce.py --chunks N [--chunk-size B] [--nofile L] [--host]

Sender and receiver are separate processes (start method "spawn"). Time is
from the sender's first export to the receiver's last cuMemSetAccess, on
CLOCK_MONOTONIC, which both processes share. A thread in the sender samples
the descriptor counts of both processes from /proc/<pid>/fd. Prints one JSON
object on stdout. --host moves memfd chunks instead (no GPU needed), for
testing the harness. --nofile sets the receiver's soft RLIMIT_NOFILE.
"""

import argparse
import json
import multiprocessing as mp
import multiprocessing.reduction as reduction
import os
import resource
import sys
import threading
import time
import traceback


def marker(i):
    return (i * 7 + 1) & 0xFF


def count_fds(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def raise_nofile(need):
    """Raise RLIMIT_NOFILE so that `need` descriptors fit (root may also
    raise the hard limit); returns the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= need:
        return soft
    for new_hard in (max(hard, need), hard):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(need, new_hard) if new_hard != resource.RLIM_INFINITY else need, new_hard))
            break
        except (ValueError, OSError):
            continue
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Cuda:
    """The few driver calls both sides make, through cuda.bindings."""

    def __init__(self):
        from cuda.bindings import driver as cu

        self.cu = cu
        self.check(cu.cuInit(0))
        dev = self.check(cu.cuDeviceGet(0))
        ctx = self.check(cu.cuDevicePrimaryCtxRetain(dev))
        self.check(cu.cuCtxSetCurrent(ctx))
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = 0
        prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.prop = prop
        self.fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.gran = int(self.check(cu.cuMemGetAllocationGranularity(
            prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))

    def check(self, res, what=""):
        err, rest = res[0], res[1:]
        if err != self.cu.CUresult.CUDA_SUCCESS:
            name = getattr(err, "name", str(err))
            raise RuntimeError(f"{what}: {name}" if what else name)
        return rest[0] if len(rest) == 1 else rest

    def reserve(self, total):
        return int(self.check(self.cu.cuMemAddressReserve(total, self.gran, 0, 0), "cuMemAddressReserve"))

    def set_access(self, base, total):
        cu = self.cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = 0
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.check(cu.cuMemSetAccess(base, total, [desc], 1), "cuMemSetAccess")

    def write_byte(self, addr, value):
        import numpy as np

        b = np.full(1, value, dtype=np.uint8)
        self.check(self.cu.cuMemcpyHtoD(addr, b.ctypes.data, 1), "cuMemcpyHtoD")

    def read_byte(self, addr):
        import numpy as np

        b = np.zeros(1, dtype=np.uint8)
        self.check(self.cu.cuMemcpyDtoH(b.ctypes.data, addr, 1), "cuMemcpyDtoH")
        return int(b[0])


class CudaBuffer:
    """The sender's buffer: N chunks made by cuMemCreate, mapped contiguously
    and marked, so the receiver can check what it mapped."""

    def __init__(self, n, size):
        self.c = c = Cuda()
        cu = c.cu
        self.n, self.size = n, size
        self.base = c.reserve(n * size)
        self.handles = []
        for i in range(n):
            h = c.check(cu.cuMemCreate(size, c.prop, 0), f"chunk {i}: cuMemCreate")
            c.check(cu.cuMemMap(self.base + i * size, size, 0, h, 0), f"chunk {i}: cuMemMap")
            self.handles.append(h)
        c.set_access(self.base, n * size)
        for i in range(n):
            c.check(cu.cuMemsetD8(self.base + i * size, marker(i), size), "cuMemsetD8")
        c.check(cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def export(self, i):
        fd = self.c.check(self.c.cu.cuMemExportToShareableHandle(self.handles[i], self.c.fd_type, 0),
                          f"chunk {i}: cuMemExportToShareableHandle")
        return int(fd)


class HostBuffer:
    """The host stand-in: one memfd; a chunk's descriptor is a duplicate."""

    def __init__(self, n, size):
        self.n, self.size = n, size
        self.fd = os.memfd_create("allatonce", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, n * size)
        for i in range(n):
            os.pwrite(self.fd, bytes([marker(i)]), i * size)

    def export(self, i):
        return os.dup(self.fd)


def import_map(fds, n, size, host):
    """The receiver's half: import all, reserve, map all, set access.
    Returns (base, undo)."""
    total = n * size
    if host:
        import mmap

        # mmap keeps its own duplicate of each descriptor; close ours at
        # once so the host stand-in holds N, as the CUDA receiver does.
        maps = []
        for i, fd in enumerate(fds):
            maps.append(mmap.mmap(fd, size, offset=i * size))
            os.close(fd)
        fds.clear()
        return maps, lambda: [m.close() for m in maps]
    c = Cuda.instance
    cu = c.cu
    handles = [c.check(cu.cuMemImportFromShareableHandle(fd, c.fd_type), f"chunk {i}: cuMemImportFromShareableHandle")
               for i, fd in enumerate(fds)]
    base = c.reserve(total)
    for i, h in enumerate(handles):
        c.check(cu.cuMemMap(base + i * size, size, 0, h, 0), f"chunk {i}: cuMemMap")
    c.set_access(base, total)

    def undo():
        for i, h in enumerate(handles):
            cu.cuMemUnmap(base + i * size, size)
            cu.cuMemRelease(h)
        cu.cuMemAddressFree(base, total)

    return base, undo


def receiver(q, results, n, size, nofile, host):
    try:
        if nofile:
            hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard))
        else:
            raise_nofile(n + 1024)
        if not host:
            Cuda.instance = Cuda()
        results.put(("ready", os.getpid()))
        wrapped = q.get()  # unpickles N DupFd objects
        fds, err = [], ""
        try:
            for w in wrapped:  # one resource-sharer connection per descriptor
                fds.append(w.detach())
        except Exception as e:  # noqa: BLE001 - reported to the sender as is
            err = f"{type(e).__name__}: {e} (after receiving {len(fds)} of {n} descriptors)"
        if err:
            results.put(("done", time.monotonic(), False, err, len(fds)))
            return
        received = len(fds)
        try:
            base, undo = import_map(fds, n, size, host)
        except Exception as e:  # noqa: BLE001
            results.put(("done", time.monotonic(), False, f"{type(e).__name__}: {e}", received))
            return
        t1 = time.monotonic()
        if host:
            ok = all(base[i][0] == marker(i) for i in (0, n // 2, n - 1))
        else:
            ok = all(Cuda.instance.read_byte(base + i * size) == marker(i) for i in (0, n // 2, n - 1))
        results.put(("done", t1, ok, "" if ok else "the mapped chunks do not hold the sender's markers", received))
        undo()
        for fd in fds:
            os.close(fd)
    except Exception:  # noqa: BLE001
        results.put(("done", time.monotonic(), False, traceback.format_exc(limit=3), 0))


def stop_child(proc, q):
    """Tells a benchmark child (None on its queue) to end, and kills it if it
    has not within a minute."""
    if proc.is_alive():
        q.put(None)
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()


class Sampler(threading.Thread):
    """Samples the descriptor counts of some processes until stopped."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids = pids
        self.peak = {p: count_fds(p) for p in pids}
        self.stopping = False

    def run(self):
        while not self.stopping:
            for p in self.pids:
                self.peak[p] = max(self.peak[p], count_fds(p))
            time.sleep(0.001)  # the all-at-once peaks last; spare the GIL


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks", type=int, required=True)
    ap.add_argument("--chunk-size", type=int, default=0)
    ap.add_argument("--nofile", type=int, default=0, help="the receiver's soft RLIMIT_NOFILE (0: as needed)")
    ap.add_argument("--host", action="store_true", help="memfd chunks instead of CUDA (no GPU needed)")
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args()
    n = a.chunks
    size = a.chunk_size or ((64 << 10) if a.host else (2 << 20))
    raise_nofile(2 * n + 1024)  # the exported descriptors plus the resource sharer's duplicates
    out = {"approach": "allatonce", "memory": "host" if a.host else "cuda", "N": n, "chunk_size": size,
           "window": None, "nofile": a.nofile}
    t = time.monotonic()
    buf = HostBuffer(n, size) if a.host else CudaBuffer(n, size)
    print(f"allatonce: buffer of {n} x {size} bytes made in {(time.monotonic() - t) * 1e3:.0f} ms", file=sys.stderr)

    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=receiver, args=(q, results, n, size, a.nofile, a.host))
    proc.start()
    msg = results.get(timeout=a.timeout)
    if msg[0] != "ready":
        raise SystemExit(f"receiver: {msg}")
    me, them = os.getpid(), proc.pid
    base = {me: count_fds(me), them: count_fds(them)}
    sampler = Sampler([me, them])
    sampler.start()
    exported, wrapped, err = [], [], ""
    t0 = time.monotonic()
    try:
        for i in range(n):
            exported.append(buf.export(i))
        for fd in exported:
            wrapped.append(reduction.DupFd(fd))  # a duplicate held by the resource sharer
        q.put(wrapped)  # pickled by the queue's feeder thread
    except Exception as e:  # noqa: BLE001 - e.g. the sender runs out of descriptors
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        err = (f"sender: {type(e).__name__}: {e} (exported {len(exported)} of {n}, wrapped {len(wrapped)} in DupFd; "
               f"the sender's RLIMIT_NOFILE is {soft})")
        q.put([])
    try:
        _, t1, ok, rerr, received = results.get(timeout=a.timeout)
    except Exception as e:  # noqa: BLE001
        t1, ok, rerr, received = time.monotonic(), False, f"no result from the receiver: {e!r}", 0
    sampler.stopping = True
    sampler.join()
    proc.join(timeout=60)
    if proc.is_alive():
        proc.kill()
    for fd in exported:
        os.close(fd)
    ms = (t1 - t0) * 1e3
    out.update({"ok": bool(ok) and not err, "ms": round(ms, 3), "us_per_chunk": round(ms * 1e3 / n, 3),
                "peak_fds_sender": sampler.peak[me] - base[me], "peak_fds_receiver": sampler.peak[them] - base[them],
                "received": received, "error": err or rerr})
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
