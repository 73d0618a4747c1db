#!/usr/bin/env python3
"""GPU test of vmmipc.torch against what PyTorch's own multiprocessing tests
ask of CUDA sharing (issue 24, "PyTorch's own tests"): the CUDA scenarios of
pytorch/pytorch test/test_multiprocessing.py, written anew for this suite
(no code copied), with vmmipc.torch installed in EVERY process (the sender,
the receivers, a forwarder), plus the lifetime rules torch's CUDA sharing
keeps and vmmipc.torch must keep too:

  - send, delete, reuse: the sender puts a tensor and drops it; once the
    receiver has it, the sender allocates a tensor of the same size (the
    caching allocator's first pick is the freed block) and fills it; the
    receiver's tensor must keep its values (torch keeps a sent block out of
    its allocator until every receiver let go);
  - receivers that die (SIGTERM as Pool.terminate sends, SIGKILL) after they
    unpickled: within RELEASE_BOUND_S the sender's registrations
    (vmmipc.live_registrations()) and its allocated memory
    (torch.cuda.memory_allocated()) are back where they were;
  - many small sends (send_many, 100 000 by default): correct sums, flat
    descriptor counts and flat GPU memory in every process, timed next to
    torch's own path in the same run.

Run from the repository root on a machine with a CUDA GPU and PyTorch,
after `make lib` (TORCH_TEST=tests/gpu/test_torch_mp.py sh
tests/gpu/run_torch.sh runs it plainly and under the seccomp filter that
refuses pidfd_getfd; run_all.sh's suite torch-mp does that):

    python3 tests/gpu/test_torch_mp.py [scenario ...]
    python3 -m pytest -q tests/gpu/test_torch_mp.py     # the same, one test a scenario

Scenarios (default: all): simple, memory, deadlock, send_many, event,
event_multiprocess, event_handles, empty, autograd, mixed, int_param,
is_shared, errors, reuse, dying. VMMIPC_TEST_SEND_MANY sets send_many's
count. Without torch or a usable GPU everything is skipped, saying why
(pytest.skip under pytest, "SKIP all" as a script). Prints one PASS/FAIL
line per check and "N passed, M failed"; exits non-zero if anything failed.

Counts come from public API only: vmmipc.live_registrations() (this
process's registrations: anchors and grants not ended),
torch.cuda.memory_allocated() and torch.cuda.mem_get_info(), and
/proc/self/fd.
"""

import copy
import gc
import importlib
import json
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import time
import traceback
from multiprocessing.reduction import ForkingPickler

# _gpu_helpers first: it puts this checkout's vmmipc and library on the path.
import _gpu_helpers
from _gpu_helpers import (Worker, guard, import_torch_expandable, is_vmm_memory, no_torch_gpu,
                          pidfd_getfd_refused, problems_of, record, require_vmm, run_problems,
                          set_expandable, settled_live, skip_all, summary, torch_run_banner)
from _mp_helpers import fd_count, settled_fd_count, wait_for

torch, TORCH_MISSING = import_torch_expandable()  # before CUDA starts, here and in children

import vmmipc  # noqa: E402  (loads nothing yet; vmmipc.torch is installed in setup())

try:
    import pytest
except ImportError:  # run as a script: pytest is not needed
    pytest = None

TIMEOUT = 120
MiB = 1 << 20
# "Within a few seconds" (issue 24): how long the sender's counts may take
# to come back after its receivers let go or died. Receivers release in
# batches; this bounds the batch's delay too.
RELEASE_BOUND_S = 10.0
SLEEP_CYCLES = int(2.5e9)  # torch.cuda._sleep: about 1.5 s on the H200 (test_torch.py)

# ------------------------------------------------------------------ helpers


def setup_child(use_vmmipc=True, expandable=True):
    """The start of every child: vmmipc.torch installed (issue 24: in every
    process) unless this is torch's own path, CUDA started, the library
    loaded before anything is timed. expandable=False: the tensors made from
    now on use cudaMalloc (torch's legacy allocator)."""
    if use_vmmipc:
        importlib.import_module("vmmipc.torch")  # importing installs the reducers
    torch.zeros(1, device="cuda")
    if not expandable:
        set_expandable(False)
    if use_vmmipc:
        vmmipc.live_registrations()


def value_problems(t, value, when):
    """[] if every element of t equals value, else what differs."""
    bad = t != value
    n = int(bad.sum())
    if not n:
        return []
    first = int(bad.reshape(-1).nonzero()[0])
    return [f"{when}: {n} of {t.numel()} elements are not {value} (element {first} is "
            f"{t.reshape(-1)[first].item()})"]


def released_problems(live0, alloc0, what):
    """[] once this process is back to at most live0 registrations
    (vmmipc.live_registrations()) and alloc0 allocated bytes
    (torch.cuda.memory_allocated()) within RELEASE_BOUND_S, else what is
    still held."""
    gc.collect()
    wait_for(lambda: (vmmipc.live_registrations() <= live0
                      and torch.cuda.memory_allocated() <= alloc0), RELEASE_BOUND_S)
    problems = []
    live, alloc = vmmipc.live_registrations(), torch.cuda.memory_allocated()
    if live > live0:
        problems.append(f"{live - live0} registrations of the sender still live "
                        f"{RELEASE_BOUND_S:.0f} s {what} (a grant pending or an anchor kept)")
    if alloc > alloc0:
        problems.append(f"{alloc - alloc0} bytes still allocated in the sender "
                        f"{RELEASE_BOUND_S:.0f} s {what}")
    return problems


def start(ctx, target, *args):
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def finish(p, problems, what="the child"):
    """Join p (TIMEOUT); a child still alive is a problem (and is killed)."""
    p.join(TIMEOUT)
    if p.is_alive():
        problems.append(f"{what} is still running after {TIMEOUT} s")
        p.kill()
        p.join(TIMEOUT)
    return problems


def get_reply(q, what):
    """The next message on q: an ("error", traceback) tuple a child sent
    instead is raised here with its traceback."""
    try:
        msg = q.get(timeout=TIMEOUT)
    except queue.Empty:
        raise TimeoutError(f"no {what} within {TIMEOUT} s") from None
    if isinstance(msg, tuple) and len(msg) == 2 and msg[0] == "error":
        raise RuntimeError(f"the child failed:\n{msg[1]}")
    return msg


def send_error(q, fn, *args):
    """fn(*args) in a child; its traceback goes on q if it fails."""
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - the parent must hear why
        q.put(("error", traceback.format_exc()[-2500:]))


# ------------------------------------------------ run in the worker child

KEPT = {}


def w_install():
    import vmmipc.torch  # noqa: F401 - the worker sends back too: installed there as well
    return {"problems": []}


def w_keep(got, key, value):
    """Keep what arrived (a dict {"t": tensor}) under key; check it reads value."""
    t = got["t"]
    KEPT[key] = t
    torch.cuda.current_stream().synchronize()  # the sender's event waited on
    return {"problems": value_problems(t, value, "on arrival")}


def w_check(key, value):
    torch.cuda.synchronize()
    return {"problems": value_problems(KEPT[key], value, "while the receiver holds it")}


def w_drop(key):
    KEPT.pop(key, None)
    gc.collect()
    torch.cuda.synchronize()
    return {"problems": []}


def _pipe_input():
    if not _gpu_helpers.PIPE.poll(TIMEOUT):
        raise TimeoutError("nothing arrived on the pipe")
    return _gpu_helpers.PIPE


def w_pipe_keep(key, value):
    return w_keep(_pipe_input().recv(), key, value)


def w_bytes_keep(key, value):
    return w_keep(ForkingPickler.loads(_pipe_input().recv_bytes()), key, value)


def w_bulk_keep(key, value):
    import vmmipc.torch as vt
    return w_keep(vt.open_tensors(_pipe_input().recv_bytes()), key, value)


def w_empty(named):
    problems = []
    for name, t in named.items():
        if name.endswith("/beside"):
            continue  # the non-empty tensor sent with them: its values are returned
        dtype = getattr(torch, name.split("/")[0])
        if t.device.type != "cuda" or t.dtype != dtype or tuple(t.shape) != (0,):
            problems.append(f"{name}: arrived as {t.dtype} {tuple(t.shape)} on {t.device}")
    full = named.get("float32/beside")
    return {"problems": problems, "beside": None if full is None else full.tolist()}


def w_is_shared(t):
    return {"problems": [] if t.is_shared() else ["a received CUDA tensor says is_shared() False"]}


# ------------------------------------------------------------------- simple
# torch: test_cuda_simple (_test_sharing's test_fill and test_receive, spawn)


def child_simple_fill(q, filled, res):
    def run():
        setup_child()
        data = q.get(timeout=TIMEOUT)
        data[0][:] = 4
        # torch's child sets its event right after the write; the parent
        # reads through its own stream, so the write must be done first.
        torch.cuda.synchronize()
        same = data[1].untyped_storage().data_ptr() == data[0].untyped_storage().data_ptr()
        return {"problems": [] if same else ["the view arrived over another storage"]}
    r = guard(run)
    res.put(r)
    filled.set()


def child_send_twice(q, done):
    def run():
        setup_child()
        t = torch.ones(5, 5, device="cuda")
        require_vmm(t)
        q.put(t)
        q.put(t)
        done.wait(TIMEOUT)  # its server serves the parent until then
    send_error(q, run)


def simple_fill_once(ctx):
    x = torch.zeros(5, 5, device="cuda")
    require_vmm(x)
    q, filled, res = ctx.Queue(), ctx.Event(), ctx.Queue()
    data = [x, x[:, 1]]
    q.put(data)
    p = start(ctx, child_simple_fill, q, filled, res)
    problems = []
    if not filled.wait(TIMEOUT):
        problems.append("the child did not fill the tensor")
    else:
        problems += problems_of(res.get(timeout=TIMEOUT))
        problems += value_problems(data[0], 4.0, "the parent's tensor after the child's fill")
        problems += value_problems(data[1], 4.0, "the parent's view after the child's fill")
    return finish(p, problems)


def simple_receive_once(ctx):
    q, done = ctx.Queue(), ctx.Event()
    p = start(ctx, child_send_twice, q, done)
    problems = []
    try:
        t1 = get_reply(q, "first tensor")
        t2 = get_reply(q, "second tensor")
        problems += value_problems(t1, 1.0, "first") + value_problems(t2, 1.0, "second")
        if t1.untyped_storage().data_ptr() != t2.untyped_storage().data_ptr():
            problems.append("one tensor sent twice arrived over two storages")
        del t1, t2
    finally:
        done.set()
    return finish(p, problems)


def simple(s):
    from multiprocessing import resource_tracker
    resource_tracker.ensure_running()  # spawn starts it once, with a descriptor of its own
    ctx = mp.get_context("spawn")
    problems, fds = [], []
    for rep in range(3):
        problems += [f"fill {rep}: {p}" for p in simple_fill_once(ctx)]
        problems += [f"receive {rep}: {p}" for p in simple_receive_once(ctx)]
        fds.append(settled_fd_count())
    if fds[-1] > fds[0]:
        problems.append(f"the parent's descriptors grew over the repeats: {fds}")
    return problems, f"3 repeats; the parent's descriptors {fds}"


# ------------------------------------------------------------------- memory
# torch: test_cuda_memory_allocation, with the reallocation torch's test
# leaves implicit made explicit.

MEMORY_COUNT = 5


def child_send_and_delete(q, go, done, count):
    def run():
        setup_child()
        for i in range(count):
            t = torch.full([5], i, device="cuda", dtype=torch.int32)
            q.put(t)
            del t
        if not go.wait(TIMEOUT):
            raise TimeoutError("the parent never said it had the tensors")
        # The same size again: the caching allocator's first pick is a
        # freed block of that size.
        again = [torch.full([5], 99, device="cuda", dtype=torch.int32) for _ in range(count)]
        torch.cuda.synchronize()
        q.put("reallocated")
        done.wait(TIMEOUT)
        del again
    send_error(q, run)


def memory(s):
    ctx = mp.get_context("spawn")
    q, go, done = ctx.Queue(), ctx.Event(), ctx.Event()
    p = start(ctx, child_send_and_delete, q, go, done, MEMORY_COUNT)
    problems = []
    try:
        got = [get_reply(q, f"tensor {i}") for i in range(MEMORY_COUNT)]
        for i, t in enumerate(got):
            if t.dtype != torch.int32 or tuple(t.shape) != (5,):
                problems.append(f"tensor {i} arrived as {t.dtype} {tuple(t.shape)}")
            problems += value_problems(t, i, f"tensor {i} on arrival")
        go.set()
        if get_reply(q, "the reallocation") != "reallocated":
            problems.append("the child said something else than 'reallocated'")
        torch.cuda.synchronize()
        for i, t in enumerate(got):
            problems += value_problems(t, i, f"tensor {i} after the sender allocated "
                                       f"{MEMORY_COUNT} more of its size")
        del got
    finally:
        done.set()
    return finish(p, problems), (f"{MEMORY_COUNT} int32 tensors put and deleted, then the sender "
                                 "allocated as many of the same size")


# ----------------------------------------------------------------- deadlock
# torch: test_cuda_ipc_deadlock. A learner puts copies of a state dict on a
# Queue(1) while an actor takes what is there; both must end, whatever is
# left in the queue when the learner exits.

DEADLOCK_ITERATIONS = 100
DEADLOCK_BOUND_S = 60  # after the start: spawn, torch and CUDA start, then ~1 s of work


def deadlock_actor(q, res, iterations):
    def run():
        setup_child()
        got, errors = 0, []
        for _ in range(iterations):
            if not q.empty():
                try:
                    q.get(timeout=TIMEOUT)  # and dropped at once, as torch's actor does
                    got += 1
                except Exception as e:  # noqa: BLE001 - judged by the parent
                    errors.append((time.monotonic(), f"{type(e).__name__}: {str(e)[:300]}"))
            time.sleep(0.01)
        return {"problems": [], "got": got, "errors": errors}
    res.put(guard(run))


def deadlock_learner(q, res, iterations):
    setup_child()
    net = torch.nn.LSTM(1, 1).cuda()
    for _ in range(iterations):
        if not q.full():
            q.put(copy.deepcopy(net.state_dict()))
        time.sleep(0.01)
    res.put({"problems": [], "learner_done": time.monotonic()})  # then it exits


def deadlock(s):
    ctx = mp.get_context("spawn")
    q, res = ctx.Queue(1), ctx.Queue()
    procs = {"actor": start(ctx, deadlock_actor, q, res, DEADLOCK_ITERATIONS),
             "learner": start(ctx, deadlock_learner, q, res, DEADLOCK_ITERATIONS)}
    deadline = time.monotonic() + DEADLOCK_BOUND_S
    for p in procs.values():
        p.join(max(0.1, deadline - time.monotonic()))
    problems = []
    for name, p in procs.items():
        if p.is_alive():
            problems.append(f"the {name} has not ended {DEADLOCK_BOUND_S} s after the start")
            p.kill()
            p.join(TIMEOUT)
        elif p.exitcode != 0:
            problems.append(f"the {name} exited with {p.exitcode}")
    replies = []
    try:
        while len(replies) < 2:
            replies.append(res.get(timeout=5))
    except queue.Empty:
        return problems + [f"{2 - len(replies)} of the two children sent no result"], ""
    for r in replies:
        problems += problems_of(r)
    actor = next((r for r in replies if "got" in r), {})
    learner_done = next((r["learner_done"] for r in replies if "learner_done" in r), None)
    errors = actor.get("errors", [])
    # A state dict still in the queue when the learner has exited cannot be
    # received (the memory went with the learner): an error then is not a
    # fault; one while the learner still ran is.
    problems += [f"the actor's get() raised while the learner ran: {msg}"
                 for when, msg in errors if learner_done is None or when < learner_done]
    return problems, (f"both ended; the actor took {actor.get('got')} state dicts"
                      + (f", {len(errors)} raised after the learner was done ({errors[0][1]})"
                         if errors else ""))


# ---------------------------------------------------------------- send_many
# torch: test_cuda_send_many (a sender creating and deleting small tensors, a
# forwarder putting t.clone(), a summer), at 100 000 tensors, with descriptor
# and memory counts in every process, once with vmmipc.torch installed and
# once on torch's own path, in the same run.

SEND_MANY = int(os.environ.get("VMMIPC_TEST_SEND_MANY", "100000"))
SEND_MANY_SIZE = 5          # int64 elements a tensor, as torch's test
SEND_MANY_WINDOW = 1000     # Queue(maxsize): tensors in flight between two processes
SEND_MANY_TIMEOUT = 900     # seconds for all of them (vmmipc's run)
SAMPLES = 10                # counts taken at every tenth of the way
FLAT_FDS = 3                # descriptors a process may gain between its first and last sample
FLAT_BYTES = 4 * MiB        # allocated bytes likewise: the window's tensors (0.5 MiB) and
                            # those a batch of releases has not given back yet
SETTLED_FDS = 7             # descriptors a process may keep after the run over its count
                            # before any send: what using vmmipc costs once, not per tensor
                            # (the Go runtime's poller and wake-up descriptors, the server's
                            # listener, one kept holder connection per peer on each side);
                            # the first-tenth sample must already include all of them
SETTLED_BYTES = 16 << 10    # allocated bytes likewise (32 of the smallest blocks)
FLAT_DEVICE_BYTES = 64 * MiB  # GPU memory (mem_get_info) the device may lose during the run


def _points(count):
    return sorted({max(1, count * k // SAMPLES) for k in range(1, SAMPLES + 1)})


def _counts(device=False):
    row = {"fds": fd_count(), "allocated": torch.cuda.memory_allocated()}
    if device:
        row["free"] = torch.cuda.mem_get_info()[0]
    return row


class Samples:
    """The counts at every tenth of the way."""

    def __init__(self, count, device=False):
        self.points, self.device, self.rows = set(_points(count)), device, []

    def at(self, done):
        if done in self.points:
            self.rows.append(dict(_counts(self.device), at=done))


def _settled(base, use_vmmipc):
    """Counts once what this process sent has come back: allocated bytes at
    most the baseline's + SETTLED_BYTES within RELEASE_BOUND_S."""
    gc.collect()

    def back():
        if not use_vmmipc:
            torch.cuda.ipc_collect()  # torch's own sender frees what receivers let go of here
        return torch.cuda.memory_allocated() <= base["allocated"] + SETTLED_BYTES
    wait_for(back, RELEASE_BOUND_S)
    return {"fds": settled_fd_count(), "allocated": torch.cuda.memory_allocated()}


def many_stage(role, res, go, settle, done, use_vmmipc, expandable, loop):
    """One process of send_many: set up and report the baseline; run
    loop() when told, report what it returns; settle and report the counts
    when told; then wait to be let go (its server serves until then)."""
    try:
        setup_child(use_vmmipc, expandable)
        base = _counts()
        res.put((role, "ready", base))
        if not go.wait(TIMEOUT):
            raise TimeoutError("never told to start")
        res.put((role, "done", loop()))
        if not settle.wait(SEND_MANY_TIMEOUT):
            raise TimeoutError("never told to settle")
        res.put((role, "settled", _settled(base, use_vmmipc)))
        done.wait(TIMEOUT)
    except BaseException:  # noqa: BLE001 - the parent must hear why
        res.put((role, "error", traceback.format_exc()[-2500:]))


def many_sender(q1, res, go, settle, done, count, use_vmmipc, expandable):
    def loop():
        samples, vmm = Samples(count), None
        t0 = time.monotonic()
        for i in range(count):
            t = torch.full([SEND_MANY_SIZE], i, device="cuda", dtype=torch.long)
            if i == 0:
                try:
                    vmm = is_vmm_memory(t.data_ptr())
                except ImportError:  # cuda-python missing: the check is skipped
                    vmm = None
            q1.put(t, timeout=TIMEOUT)
            del t
            samples.at(i + 1)
        return {"t0": t0, "vmm": vmm, "samples": samples.rows}
    many_stage("sender", res, go, settle, done, use_vmmipc, expandable, loop)


def many_forwarder(q1, q2, res, go, settle, done, count, use_vmmipc, expandable):
    def loop():
        samples = Samples(count)
        for i in range(count):
            t = q1.get(timeout=TIMEOUT)
            q2.put(t.clone(), timeout=TIMEOUT)
            del t
            samples.at(i + 1)
        return {"samples": samples.rows}
    many_stage("forwarder", res, go, settle, done, use_vmmipc, expandable, loop)


def many_summer(q2, res, go, settle, done, count, use_vmmipc, expandable):
    def loop():
        samples = Samples(count, device=True)
        acc = torch.zeros([SEND_MANY_SIZE], device="cuda", dtype=torch.long)
        for i in range(count):
            acc += q2.get(timeout=TIMEOUT)
            samples.at(i + 1)
        torch.cuda.synchronize()
        t1 = time.monotonic()
        total = acc.cpu().tolist()
        del acc
        return {"t1": t1, "sum": total, "samples": samples.rows}
    many_stage("summer", res, go, settle, done, use_vmmipc, expandable, loop)


ROLES = ("sender", "forwarder", "summer")


def _gather(res, procs, phase, timeout):
    """{role: what it reported} for one phase; raises RuntimeError for a
    process that failed or died, TimeoutError past timeout."""
    got = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            role, what, payload = res.get(timeout=0.5)
        except queue.Empty:
            for role, p in procs.items():
                if role not in got and p.exitcode is not None:
                    raise RuntimeError(f"the {role} ended (exit {p.exitcode}) before "
                                       f"'{phase}'") from None
            if time.monotonic() > deadline:
                raise TimeoutError(f"no '{phase}' from {sorted(set(procs) - set(got))} within "
                                   f"{timeout:.0f} s") from None
            continue
        if what == "error":
            raise RuntimeError(f"the {role} failed:\n{payload}")
        if what != phase:
            raise RuntimeError(f"the {role} said {what!r}, not {phase!r}")
        got[role] = payload
    return got


def flat_problems(role, base, rows, settled):
    """The counts of one process: flat between its first and last sample,
    and back near its baseline once settled."""
    problems = []
    if rows:
        first = rows[0]
        for row in rows[1:]:
            if row["fds"] - first["fds"] > FLAT_FDS:
                problems.append(f"{role}: {row['fds'] - first['fds']} more descriptors at "
                                f"{row['at']} tensors than at {first['at']}")
                break
        for row in rows[1:]:
            if row["allocated"] - first["allocated"] > FLAT_BYTES:
                problems.append(f"{role}: {row['allocated'] - first['allocated']} more bytes "
                                f"allocated at {row['at']} tensors than at {first['at']}")
                break
        for row in rows[1:]:
            if "free" in row and first["free"] - row["free"] > FLAT_DEVICE_BYTES:
                problems.append(f"{role}: the GPU had {(first['free'] - row['free']) / MiB:.0f} "
                                f"MiB less free at {row['at']} tensors than at {first['at']}")
                break
    if settled["fds"] - base["fds"] > SETTLED_FDS:
        problems.append(f"{role}: {settled['fds'] - base['fds']} more descriptors after the run "
                        "than before")
    if rows and settled["fds"] > rows[0]["fds"]:
        problems.append(f"{role}: {settled['fds'] - rows[0]['fds']} more descriptors after the "
                        f"run than at {rows[0]['at']} tensors")
    if settled["allocated"] - base["allocated"] > SETTLED_BYTES:
        problems.append(f"{role}: {settled['allocated'] - base['allocated']} more bytes allocated "
                        f"{RELEASE_BOUND_S:.0f} s after the run than before")
    return problems


def send_many_run(mode, count, timeout):
    """One run of the three processes: mode "vmmipc" (vmmipc.torch installed
    in all three), "torch-es" (torch's own, expandable segments) or
    "torch-legacy" (torch's own, cudaMalloc). Returns a dict: seconds (None
    if it did not finish), problems (wrong sums, counts not flat), sides."""
    use_vmmipc, expandable = mode == "vmmipc", mode != "torch-legacy"
    ctx = mp.get_context("spawn")
    q1, q2, res = ctx.Queue(SEND_MANY_WINDOW), ctx.Queue(SEND_MANY_WINDOW), ctx.Queue()
    go, settle, done = ctx.Event(), ctx.Event(), ctx.Event()
    common = (res, go, settle, done, count, use_vmmipc, expandable)
    procs = {"sender": start(ctx, many_sender, q1, *common),
             "forwarder": start(ctx, many_forwarder, q1, q2, *common),
             "summer": start(ctx, many_summer, q2, *common)}
    out = {"mode": mode, "count": count, "seconds": None, "problems": [], "sides": {}}
    failed = True
    try:
        base = _gather(res, procs, "ready", TIMEOUT)
        go.set()
        ran = _gather(res, procs, "done", timeout)
        settle.set()
        settled = _gather(res, procs, "settled", TIMEOUT + RELEASE_BOUND_S)
        failed = False
    except (RuntimeError, TimeoutError) as e:
        out["problems"].append(str(e)[-2500:])
        return out
    finally:
        done.set()
        for p in procs.values():
            p.join(5 if failed else TIMEOUT)  # after a failure the others wait on queues
            if p.is_alive():
                p.kill()
                p.join(TIMEOUT)
    out["seconds"] = ran["summer"]["t1"] - ran["sender"]["t0"]
    want = count * (count - 1) // 2
    if ran["summer"]["sum"] != [want] * SEND_MANY_SIZE:
        out["problems"].append(f"the sum is {ran['summer']['sum']}, not {want} in each of "
                               f"{SEND_MANY_SIZE} elements")
    if ran["sender"]["vmm"] is not None and ran["sender"]["vmm"] != expandable:
        out["problems"].append(f"the sender's tensors are {'' if ran['sender']['vmm'] else 'not '}"
                               "in VMM memory: the allocator setting did not take")
    for role in ROLES:
        rows = ran[role]["samples"]
        out["sides"][role] = {"base": base[role], "first": rows[0] if rows else None,
                              "last": rows[-1] if rows else None, "settled": settled[role]}
        out["problems"] += flat_problems(role, base[role], rows, settled[role])
    return out


def _side_line(r):
    parts = []
    for role in ROLES:
        side = r["sides"].get(role)
        if not side or not side["first"]:
            continue
        first, last, b, st = side["first"], side["last"], side["base"], side["settled"]
        parts.append(f"{role} fds {b['fds']}/{first['fds']}/{last['fds']}/{st['fds']}, allocated "
                     f"+{last['allocated'] - first['allocated']} B during, "
                     f"+{st['allocated'] - b['allocated']} B after")
    summer = r["sides"].get("summer", {})
    if summer.get("first") and "free" in summer["first"]:
        parts.append(f"GPU free {(summer['last']['free'] - summer['first']['free']) / MiB:+.0f} "
                     "MiB during")
    return "; ".join(parts) + " (fds: before/first tenth/end/after)"


def send_many(s):
    count = SEND_MANY
    mine = send_many_run("vmmipc", count, SEND_MANY_TIMEOUT)
    # torch's own path shares expandable segments with pidfd_getfd; where
    # that is refused it runs on the legacy allocator (cudaIpc), which the
    # filter allows.
    own_mode = "torch-legacy" if pidfd_getfd_refused() else "torch-es"
    own_bound = min(SEND_MANY_TIMEOUT, max(120.0, 4 * (mine["seconds"] or 75.0)))
    own = send_many_run(own_mode, count, own_bound)
    own_name = ("torch's own (legacy allocator: pidfd_getfd is refused here)"
                if own_mode == "torch-legacy" else "torch's own (expandable segments)")

    def took(r):
        return f"{r['seconds']:.1f} s" if r["seconds"] is not None else "did not finish"
    print(f"send_many: vmmipc {count} tensors in {took(mine)}, {own_name} {count} in {took(own)}",
          flush=True)
    print(f"send_many: vmmipc counts: {_side_line(mine)}", flush=True)
    print(f"send_many: torch's own counts: {_side_line(own)}"
          + (f"; its problems (not judged): {'; '.join(own['problems'])[:1500]}"
             if own["problems"] else ""), flush=True)
    return mine["problems"], (f"vmmipc {count} tensors in {took(mine)}, torch's own in "
                              f"{took(own)}")


# -------------------------------------------------------------------- events
# torch: test_event, test_event_multiprocess, test_event_handle_importer,
# test_event_handle_exporter, test_event_handle_multi_gpu


def child_event(q, ready, done, release, res):
    def run():
        setup_child()
        ready.set()
        with torch.cuda.stream(torch.cuda.Stream()):
            event, tensor = q.get(timeout=TIMEOUT)
            event.wait()
            tensor.mul_(2)
            event.record()
            done.set()
            del event
        release.wait(TIMEOUT)  # the parent has synchronized: the multiply is done
        return {"problems": []}
    res.put(guard(run))


def event(s):
    ctx = mp.get_context("spawn")
    q, ready, done, release, res = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Event(), ctx.Queue()
    p = start(ctx, child_event, q, ready, done, release, res)
    problems = []
    try:
        if not ready.wait(TIMEOUT):
            raise TimeoutError("the child did not start")
        with torch.cuda.stream(torch.cuda.Stream()):
            tensor = torch.ones(4, device="cuda")
            require_vmm(tensor)
            ev = torch.cuda.Event(interprocess=True)
            torch.cuda._sleep(SLEEP_CYCLES)  # without the event the multiply comes first
            tensor.add_(1)
            ev.record()
            q.put((ev, tensor))
            if not done.wait(TIMEOUT):
                problems.append("the child did not record the event")
            ev.synchronize()
            got = tensor.tolist()
        if got != [4.0] * 4:
            problems.append(f"the tensor is {got}, not [4, 4, 4, 4]: (1 + 1) * 2 in that order")
    finally:
        release.set()
    problems += problems_of(res.get(timeout=TIMEOUT))
    return finish(p, problems), "the child's multiply waited on the parent's event"


def child_event_multiprocess(ev, p2c, c2p):
    def run():
        setup_child()
        c2p.put(0)
        p2c.get(timeout=TIMEOUT)
        ev.synchronize()
        c2p.put(1)
    send_error(c2p, run)


def child_waits_problems(ev, p2c, c2p, who):
    """Record ev behind a long kernel, let the child (who) synchronize on it
    (p2c), and check query() before and after its answer (c2p)."""
    problems = []
    torch.cuda._sleep(SLEEP_CYCLES)
    ev.record()
    p2c.put(0)
    if ev.query():
        problems.append(f"{who}: query() is True while the kernel before the event still runs")
    get_reply(c2p, f"the {who}'s synchronize")
    if not ev.query():
        problems.append(f"{who}: query() is False after the child synchronized on the event")
    return problems


def event_multiprocess(s):
    ctx = mp.get_context("spawn")
    ev = torch.cuda.Event(enable_timing=False, interprocess=True)
    problems = [] if ev.query() else ["a new event's query() is False"]
    p2c, c2p = ctx.Queue(), ctx.Queue()
    p = start(ctx, child_event_multiprocess, ev, p2c, c2p)
    get_reply(c2p, "the child's start")
    problems += child_waits_problems(ev, p2c, c2p, "child")
    return finish(p, problems), "an interprocess event as a Process argument"


def child_event_importer(handle, p2c, c2p):
    def run():
        setup_child()
        e1 = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
        c2p.put(0)
        p2c.get(timeout=TIMEOUT)
        e1.synchronize()
        c2p.put(1)
        p2c.get(timeout=TIMEOUT)  # the parent is done: e1 may go
    send_error(c2p, run)


def child_event_exporter(handle, p2c, c2p):
    def run():
        setup_child()
        with torch.cuda.stream(torch.cuda.Stream()):
            e1 = torch.cuda.Event.from_ipc_handle(torch.cuda.current_device(), handle)
            torch.cuda._sleep(SLEEP_CYCLES)
            e1.record()
            c2p.put(0)
            p2c.get(timeout=TIMEOUT)  # the parent has synchronized on it
    send_error(c2p, run)


def event_handles(s):
    ctx = mp.get_context("spawn")
    problems = []
    e0 = torch.cuda.Event(enable_timing=False, interprocess=True)
    if not e0.query():
        problems.append("importer: a new event's query() is False")
    p2c, c2p = ctx.Queue(), ctx.Queue()
    p = start(ctx, child_event_importer, e0.ipc_handle(), p2c, c2p)
    try:
        get_reply(c2p, "the importer's start")
        problems += child_waits_problems(e0, p2c, c2p, "importer")
    finally:
        p2c.put(1)
    finish(p, problems, "the importer")

    e0 = torch.cuda.Event(enable_timing=False, interprocess=True)
    p2c, c2p = ctx.Queue(), ctx.Queue()
    p = start(ctx, child_event_exporter, e0.ipc_handle(), p2c, c2p)
    try:
        get_reply(c2p, "the exporter's record")
        if e0.query():
            problems.append("exporter: query() is True while the child's kernel still runs")
        e0.synchronize()
        if not e0.query():
            problems.append("exporter: query() is False after synchronize()")
    finally:
        p2c.put(0)
    finish(p, problems, "the exporter")

    detail = "a handle opened in a child: waited on there (importer), recorded there (exporter)"
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(0):
            e0 = torch.cuda.Event(enable_timing=False, interprocess=True)
        with torch.cuda.device(1):
            e0.ipc_handle()  # a handle made on another device, of an event never recorded
        with torch.cuda.device(0):
            e1 = torch.cuda.Event(enable_timing=False, interprocess=True)
            stream = torch.cuda.Stream()
            torch.cuda._sleep(50_000_000)
            e1.record(stream)
        with torch.cuda.device(1):
            e1.ipc_handle()  # ...and of one recorded
        torch.cuda.synchronize(0)
        detail += "; handles made on another GPU"
    else:
        print("SKIP event handles across GPUs: one GPU here", flush=True)
    return problems, detail


# --------------------------------------------------------------------- empty
# torch: test_empty_tensor_sharing_cuda (one process), and across processes


def empty(s):
    problems = []
    q = mp.get_context("spawn").Queue()
    named = {}
    for name in ("float32", "int64"):
        dtype = getattr(torch, name)
        e = torch.tensor([], dtype=dtype, device="cuda")
        q.put(e)
        out = q.get(timeout=TIMEOUT)
        if out.device.type != "cuda" or out.dtype != dtype or tuple(out.shape) != (0,):
            problems.append(f"{name} in one process: came back as {out.dtype} {tuple(out.shape)} "
                            f"on {out.device}")
        named[f"{name}/alone"] = e
    beside = torch.arange(6, device="cuda", dtype=torch.float32)
    require_vmm(beside)
    named["float32/beside"] = beside
    named["float32/empty view"] = beside[6:]  # an empty view of VMM memory
    r = s.worker().call(w_empty, {k: v for k, v in named.items() if k != "float32/beside"})
    problems += [f"across processes: {p}" for p in problems_of(r)]
    r = s.worker().call(w_empty, named)
    problems += [f"beside a VMM tensor: {p}" for p in problems_of(r)]
    if r.get("beside") not in (None, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]):
        problems.append(f"the tensor sent with the empty ones arrived as {r['beside']}")
    return problems, "float32 and int64, in one process and to a child, alone and beside a tensor"


# ------------------------------------------------------------------ autograd
# torch: test_cuda_variable_sharing, test_cuda_parameter_sharing,
# test_leaf_variable_sharing, test_non_leaf_variable_sharing


def child_autograd(q, ready, modified, res, is_parameter):
    def run():
        setup_child()
        var = q.get(timeout=TIMEOUT)
        ready.set()
        if not modified.wait(TIMEOUT):
            raise TimeoutError("the parent did not modify the tensor")
        expected = torch.arange(1.0, 26, device="cuda").view(5, 5)
        expected[0, 0] = 1000
        problems = []
        if not var.data.equal(expected):
            problems.append("the parent's write after put() is not seen in the child")
        var.data[:] = torch.ones(5, 5, device="cuda")
        torch.cuda.synchronize()  # the parent reads it after our answer
        if var.grad is not None:
            problems.append("the gradient was sent along")
        if var._backward_hooks:
            problems.append("the backward hooks were sent along")
        want = torch.nn.Parameter if is_parameter else torch.Tensor
        if type(var) is not want:
            problems.append(f"arrived as {type(var).__name__}, not {want.__name__}")
        var._grad = torch.ones(5, 5, device="cuda")  # the child's own: the parent's must stay
        return {"problems": problems, "requires_grad": var.requires_grad, "is_leaf": var.is_leaf}
    res.put(guard(run))


def autograd_case(var, is_parameter):
    ctx = mp.get_context("spawn")
    q, ready, modified, res = ctx.Queue(), ctx.Event(), ctx.Event(), ctx.Queue()
    p = start(ctx, child_autograd, q, ready, modified, res, is_parameter)
    require_vmm(var)

    @torch.utils.hooks.unserializable_hook
    def hook(*unused):
        pass
    if var.requires_grad:
        var.register_hook(hook)
    var._grad = torch.zeros(5, 5, device="cuda")
    q.put(var)
    problems = []
    if not ready.wait(TIMEOUT):
        problems.append("the child did not get the tensor")
    var.data[0, 0] = 1000
    var.grad.data[:] = torch.ones(5, 5, device="cuda") * 4
    torch.cuda.synchronize()  # the child reads it after the event
    modified.set()
    r = res.get(timeout=TIMEOUT)
    problems += problems_of(r)
    if "error" not in r:
        if r["requires_grad"] != var.requires_grad:
            problems.append(f"requires_grad {var.requires_grad} arrived as {r['requires_grad']}")
        if not r["is_leaf"]:
            problems.append("a leaf arrived as a non-leaf")
        if not torch.equal(var.data, torch.ones(5, 5, device="cuda")):
            problems.append("the child's write is not seen in the parent")
        if not torch.equal(var.grad.data, torch.ones(5, 5, device="cuda") * 4):
            problems.append("the parent's gradient changed")
    return finish(p, problems)


def refusal_problems(s, var):
    """Send var by every path: each must raise a RuntimeError naming
    requires_grad (torch's test matches that word)."""
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    paths = (("SimpleQueue.put", lambda: ctx.SimpleQueue().put(var)),  # pickles in this thread
             ("Pipe.send", lambda: a.send(var)),
             ("ForkingPickler.dumps", lambda: ForkingPickler.dumps(var)),
             ("share_tensors", lambda: s.vt.share_tensors({"var": var})),
             ("reduce_tensor", lambda: s.vt.reduce_tensor(var)))
    problems = []
    try:
        for name, send in paths:
            try:
                send()
                problems.append(f"{name}: sent without an error")
            except RuntimeError as e:
                if "requires_grad" not in str(e):
                    problems.append(f"{name}: the RuntimeError does not say requires_grad: {e}")
            except BaseException as e:  # noqa: BLE001 - the type is what is checked
                problems.append(f"{name}: {type(e).__name__}, not RuntimeError: {e}")
    finally:
        a.close()
        b.close()
    return problems


def nonleaf_problems(s):
    """A non-leaf tensor that requires grad is refused by every path, and
    the refusal keeps nothing: no registration, no memory."""
    gc.collect()
    live0, alloc0 = settled_live(), torch.cuda.memory_allocated()
    var0 = torch.arange(1.0, 26, device="cuda").view(5, 5).requires_grad_(True)
    var = var0 * 2
    require_vmm(var)
    problems = refusal_problems(s, var)
    del var, var0
    problems += released_problems(live0, alloc0, "after the refused sends and the tensor's del")
    return problems


def autograd(s):
    problems = []
    for requires_grad in (True, False):
        var = torch.arange(1.0, 26, device="cuda").view(5, 5).requires_grad_(requires_grad)
        if not var.is_leaf:
            problems.append("the test's tensor is not a leaf")
        problems += [f"variable (requires_grad={requires_grad}): {p}"
                     for p in autograd_case(var, False)]
    param = torch.nn.Parameter(torch.arange(1.0, 26, device="cuda").view(5, 5))
    problems += [f"parameter: {p}" for p in autograd_case(param, True)]
    problems += [f"non-leaf: {p}" for p in nonleaf_problems(s)]
    return problems, ("leaf tensors (requires_grad True/False) and a Parameter: data shared, "
                      "grad and hooks not; a non-leaf refused by 5 paths, nothing kept")


# --------------------------------------------------------------------- mixed
# torch: test_mixed_types_cuda_sharing

MIXED_ROUNDS = 10


def child_mixed(q, ev, res):
    def run():
        setup_child()
        for _ in range(MIXED_ROUNDS):
            float_tensor = torch.ones(2, 2).float().cuda()
            byte_tensor = torch.zeros(2, 2).byte().cuda()
            q.put(float_tensor)
            q.put(byte_tensor)
            if not ev.wait(TIMEOUT):
                raise TimeoutError("the parent did not take the pair")
            ev.clear()
        return {"problems": []}
    res.put(guard(run))


def mixed(s):
    ctx = mp.get_context("spawn")
    q, ev, res = ctx.Queue(), ctx.Event(), ctx.Queue()
    p = start(ctx, child_mixed, q, ev, res)
    problems = []
    ones = torch.ones(2, 2, device="cuda")
    zeros = torch.zeros(2, 2, dtype=torch.uint8, device="cuda")
    for k in range(MIXED_ROUNDS):
        try:
            f, b = q.get(timeout=TIMEOUT), q.get(timeout=TIMEOUT)
        except queue.Empty:
            problems.append(f"round {k}: nothing arrived")
            break
        if f.dtype != torch.float32 or not torch.equal(f, ones):
            problems.append(f"round {k}: the float tensor arrived as {f.dtype} {f.tolist()}")
        if b.dtype != torch.uint8 or not torch.equal(b, zeros):
            problems.append(f"round {k}: the byte tensor arrived as {b.dtype} {b.tolist()}")
        del f, b
        ev.set()
    try:
        problems += problems_of(res.get(timeout=TIMEOUT))
    except queue.Empty:
        problems.append("the child sent no result")
    return finish(p, problems), f"{MIXED_ROUNDS} rounds of a float32 and a uint8 tensor"


# ----------------------------------------------------------------- int_param
# torch: test_integer_parameter_serialization_cuda


def child_int_param(iparam, res):
    def run():
        setup_child()
        out = iparam + 1
        problems = []
        if type(iparam) is not torch.nn.Parameter:
            problems.append(f"arrived as {type(iparam).__name__}, not Parameter")
        if iparam.dtype != torch.int64 or iparam.requires_grad or int(out) != 1:
            problems.append(f"arrived as {iparam.dtype}, requires_grad {iparam.requires_grad}, "
                            f"+1 = {int(out)}")
        return {"problems": problems}
    res.put(guard(run))


def int_param(s):
    ctx = mp.get_context("spawn")
    param = torch.nn.Parameter(torch.tensor(0, dtype=torch.int64, device="cuda"),
                               requires_grad=False)
    require_vmm(param)
    res = ctx.Queue()
    p = ctx.Process(target=child_int_param, args=(param, res))
    p.start()
    problems = problems_of(res.get(timeout=TIMEOUT))
    finish(p, problems)
    if p.exitcode != 0:
        problems.append(f"the child exited with {p.exitcode}")
    return problems, "an int64 Parameter (requires_grad=False) as a Process argument"


# ----------------------------------------------------------------- is_shared
# torch: test_is_shared_cuda


def is_shared(s):
    t = torch.randn(5, 5).cuda()
    require_vmm(t)
    problems = [] if t.is_shared() else ["a CUDA tensor says is_shared() False"]
    problems += problems_of(s.worker().call(w_is_shared, t))
    return problems, "in the sender and in the receiver"


# -------------------------------------------------------------------- errors
# The exception types and words torch's own tests assert and that a process
# with vmmipc.torch installed must keep: a fork Pool running autograd
# ("Unable to handle autograd", test_autograd_errors), a spawn Pool running
# it (test_autograd_fine_with_spawn), CUDA in a forked child ("Cannot
# re-initialize CUDA in forked subprocess", test_wrong_cuda_fork and
# test_cuda_bad_call). The non-leaf refusal ("requires_grad") is in
# autograd. They run in a fresh process (--fork-errors): forking this one,
# with its worker and its server, is not what they are about.


def simple_autograd_function(a=1):
    torch.rand(3).requires_grad_(True).mean().backward()
    return a ** 2


def fork_cuda_child(res):
    try:
        torch.zeros(5, 5).cuda()
        res.put(("no error", False, ""))
    except Exception as e:  # noqa: BLE001 - its type is what is checked
        res.put((type(e).__name__, isinstance(e, RuntimeError), str(e)[:500]))


def fork_errors_main():
    """--fork-errors: the checks above in this fresh process; one JSON line."""
    import vmmipc.torch  # noqa: F401 - installed here too
    torch.zeros(1, device="cuda")
    vmmipc.live_registrations()
    problems, seen = [], []
    simple_autograd_function()  # autograd's device threads start here first
    try:
        with mp.get_context("fork").Pool(3) as pool:
            pool.map(simple_autograd_function, [1, 2, 3])
        problems.append("autograd in a fork Pool: no error")
    except RuntimeError as e:
        if "Unable to handle autograd" in str(e):
            seen.append(f"fork Pool + autograd: RuntimeError: {str(e)[:80]}")
        else:
            problems.append(f"autograd in a fork Pool: RuntimeError without 'Unable to handle "
                            f"autograd': {e}")
    except BaseException as e:  # noqa: BLE001
        problems.append(f"autograd in a fork Pool: {type(e).__name__}, not RuntimeError: {e}")
    try:
        with mp.get_context("spawn").Pool(3, initializer=setup_child) as pool:
            pool.map(simple_autograd_function, [1, 2, 3])
        seen.append("spawn Pool + autograd: fine")
    except BaseException as e:  # noqa: BLE001
        problems.append(f"autograd in a spawn Pool failed: {type(e).__name__}: {e}")
    ctx = mp.get_context("fork")
    res = ctx.Queue()
    p = ctx.Process(target=fork_cuda_child, args=(res,))
    p.start()
    try:
        name, is_runtime, msg = res.get(timeout=TIMEOUT)
        if not is_runtime or "Cannot re-initialize CUDA in forked subprocess" not in msg:
            problems.append(f"CUDA in a forked child gave {name}: {msg}")
        else:
            seen.append(f"CUDA in a forked child: RuntimeError: {msg[:60]}")
    except queue.Empty:
        problems.append("the forked child said nothing")
    p.join(TIMEOUT)
    print(json.dumps({"problems": problems, "seen": seen}), flush=True)


def errors(s):
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--fork-errors"],
                       capture_output=True, text=True, timeout=3 * TIMEOUT)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return [f"--fork-errors failed (exit {r.returncode}): {r.stdout[-800:]} "
                f"{r.stderr[-1500:]}"], ""
    got = json.loads(lines[-1])
    return got["problems"], "; ".join(got["seen"])


# --------------------------------------------------------------------- reuse
# The case: the sender puts t = full([n], 1.0), deletes it; once the
# receiver has it, allocates a tensor of the same size and fills it with
# 2.0; the receiver's tensor must still read 1.0. At sizes in both of the
# caching allocator's pools, with and without the segment growing between
# the delete and the new allocation, through four transports.

REUSE_SIZES = ((5, "small pool, 20 B"), (1 << 18, "small pool, 1 MiB"),
               (1 << 24, "large pool, 64 MiB"))
TRANSPORTS = ("queue", "pipe", "bytes", "share_tensors")


def grow(n):
    """Tensors that make the current stream's segment of n's pool grow:
    8 MiB of 1 MiB tensors (small pool) or 256 MiB (large pool)."""
    if n * 4 <= MiB:
        return [torch.full([1 << 18], 3.0, device="cuda") for _ in range(8)]
    return [torch.full([1 << 26], 3.0, device="cuda")]


def send_and_drop(w, transport, box, key):
    """Send box's one tensor to the worker through transport, keeping no
    reference here, and return the worker's answer (it has it then)."""
    import vmmipc.torch as vt
    t = box.pop()
    if transport == "queue":
        w.put(w_keep, {"t": t}, key, 1.0)  # the Queue's feeder pickles it later
        del t
        return w.answer()
    if transport == "pipe":
        w.put(w_pipe_keep, key, 1.0)
        w.pipe.send({"t": t})
        del t
        return w.answer()
    if transport == "bytes":
        blob = bytes(ForkingPickler.dumps({"t": t}))
        fn = w_bytes_keep
    else:
        blob = vt.share_tensors({"t": t})
        fn = w_bulk_keep
    del t
    w.put(fn, key, 1.0)
    w.send_bytes(blob)
    return w.answer()


def reuse_case(w, transport, n, growth):
    key = f"reuse/{transport}/{n}/{growth}"
    gc.collect()
    live0, alloc0 = settled_live(), torch.cuda.memory_allocated()
    # The growth case on a stream of its own: its segment starts with t.
    stream = torch.cuda.Stream() if growth else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        t = torch.full([n], 1.0, device="cuda")
    stream.synchronize()
    require_vmm(t)
    ptr = t.data_ptr()
    box = [t]
    del t
    problems = problems_of(send_and_drop(w, transport, box, key))
    # Where the sender lets go of t as soon as the receiver has it, give that
    # a moment, so that the new tensor does get t's block (the bug shows
    # every time); where it keeps t, as it must, this waits 0.5 s for nothing.
    wait_for(lambda: torch.cuda.memory_allocated() <= alloc0, 0.5)
    with torch.cuda.stream(stream):
        grown = grow(n) if growth else []
        u = torch.full([n], 2.0, device="cuda")
    torch.cuda.synchronize()
    reused = u.data_ptr() == ptr
    problems += problems_of(w.call(w_check, key, 1.0))
    problems += value_problems(u, 2.0, "the sender's new tensor")
    del u, grown
    problems += problems_of(w.call(w_drop, key))
    problems += released_problems(live0, alloc0, "after the receiver dropped it")
    return problems, reused


def reuse(s):
    w = s.worker()
    problems, reused = [], []
    for transport in TRANSPORTS:
        for growth in (False, True):
            for n, pool in REUSE_SIZES:
                label = f"{transport}, {pool}{', segment grown' if growth else ''}"
                got, same_address = reuse_case(w, transport, n, growth)
                problems += [f"{label}: {p}" for p in got]
                if same_address:
                    reused.append(label)
    return problems, (f"{len(TRANSPORTS) * 2 * len(REUSE_SIZES)} cases; the new tensor got the "
                      f"sent one's address in {len(reused)} of them")


# --------------------------------------------------------------------- dying
# A receiver killed at any point after it unpickled (SIGTERM as
# Pool.terminate sends, SIGKILL; while it holds the tensors, or just after
# it dropped them) leaves nothing held in the sender.


def dying_named():
    """What the dying receivers get: a large-pool and a small-pool tensor."""
    named = {"large": torch.full([1 << 24], 1.0, device="cuda"),
             "small": torch.full([1024], 3.0, device="cuda")}
    require_vmm(*named.values())
    return named


def dying_problems(named):
    return (value_problems(named["large"], 1.0, "large") +
            value_problems(named["small"], 3.0, "small"))


def child_hold(q, res, drop):
    def run():
        setup_child()
        res.put({"problems": [], "ready": os.getpid()})
        got = q.get(timeout=TIMEOUT)
        torch.cuda.current_stream().synchronize()
        problems = dying_problems(got)
        if drop:
            del got
            gc.collect()
            torch.cuda.synchronize()
        return {"problems": problems}
    r = guard(run)
    res.put(r)
    if "error" not in r:
        time.sleep(10 * TIMEOUT)  # until it is killed


POOL_RES = None  # in a Pool worker: where pool_hold reports


def pool_init(res):
    global POOL_RES
    POOL_RES = res
    setup_child()


def pool_hold(named):
    torch.cuda.current_stream().synchronize()
    POOL_RES.put(guard(lambda: {"problems": dying_problems(named)}))
    time.sleep(10 * TIMEOUT)  # until Pool.terminate()


def dying_case(sig, drop):
    ctx = mp.get_context("spawn")
    q, res = ctx.Queue(), ctx.Queue()
    p = start(ctx, child_hold, q, res, drop)
    problems = []
    try:
        problems += problems_of(res.get(timeout=TIMEOUT))
        if problems:
            return problems
        gc.collect()
        live0, alloc0 = settled_live(), torch.cuda.memory_allocated()
        q.put(dying_named())  # no reference kept here
        problems += problems_of(res.get(timeout=TIMEOUT))
        os.kill(p.pid, sig)
        p.join(TIMEOUT)
        if p.exitcode != -sig:
            problems.append(f"the receiver ended with {p.exitcode}, not -{int(sig)}")
        problems += released_problems(live0, alloc0, f"after the receiver's {sig.name}")
    finally:
        if p.is_alive():
            p.kill()
            p.join(TIMEOUT)
    return problems


def dying_pool():
    ctx = mp.get_context("spawn")
    res = ctx.Queue()
    pool = ctx.Pool(1, initializer=pool_init, initargs=(res,))
    problems = []
    try:
        pool.apply(os.getpid)  # the worker is up (its initializer ran: CUDA, vmmipc.torch)
        gc.collect()
        live0, alloc0 = settled_live(), torch.cuda.memory_allocated()
        pool.apply_async(pool_hold, (dying_named(),))
        problems += problems_of(res.get(timeout=TIMEOUT))
    finally:
        pool.terminate()  # SIGTERM to the worker
        pool.join()
    if problems:
        return problems
    return released_problems(live0, alloc0, "after Pool.terminate()")


def dying(s):
    problems = []
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for drop in (False, True):
            when = "just after it dropped them" if drop else "while it holds them"
            problems += [f"{sig.name} {when}: {p}" for p in dying_case(sig, drop)]
    problems += [f"Pool.terminate(): {p}" for p in dying_pool()]
    return problems, ("SIGTERM and SIGKILL while the receiver holds the tensors and just after "
                      "it dropped them, and Pool.terminate(): the sender's registrations and "
                      f"memory back within {RELEASE_BOUND_S:.0f} s")


# ------------------------------------------------------------------- running

SCENARIOS = [
    ("simple", "cuda_simple: a child fills the parent's tensor and view; a tensor sent twice "
     "arrives as one storage", simple),
    ("memory", "memory_allocation: tensors put and deleted keep their values while the sender "
     "allocates more", memory),
    ("deadlock", "ipc_deadlock: a learner and an actor over a Queue(1) both end", deadlock),
    ("send_many", f"send_many: {SEND_MANY} small tensors through a forwarder to a summer; flat "
     "counts", send_many),
    ("event", "event: a child's kernel waits on the parent's interprocess event", event),
    ("event_multiprocess", "event_multiprocess: an interprocess event waited on in a child",
     event_multiprocess),
    ("event_handles", "event handles: imported and exported", event_handles),
    ("empty", "empty tensors", empty),
    ("autograd", "variable, parameter, leaf and non-leaf sharing", autograd),
    ("mixed", "mixed types in one allocation", mixed),
    ("int_param", "integer parameters", int_param),
    ("is_shared", "is_shared()", is_shared),
    ("errors", "torch's exception types and words with vmmipc.torch installed", errors),
    ("reuse", "send, delete, reuse: the receiver keeps its values (4 transports, both pools, "
     "a segment grown)", reuse),
    ("dying", "receivers that die leave nothing held in the sender", dying),
]


class Session:
    """What the scenarios share: vmmipc.torch, and one worker child (with
    vmmipc.torch installed) made when first needed."""

    def __init__(self, vt):
        self.vt = vt
        self._worker = None

    def worker(self):
        if self._worker is None:
            w = Worker("spawn")
            problems = problems_of(w.call(w_install))
            if problems:
                w.stop()
                raise RuntimeError("the worker could not install vmmipc.torch: "
                                   + "; ".join(problems))
            self._worker = w
        return self._worker

    def close(self):
        if self._worker is not None:
            self._worker.stop()
            self._worker = None


def setup():
    """(vmmipc.torch, None) with the reducers installed here and the library
    loaded, or (None, why not)."""
    try:
        import vmmipc.torch as vt
        vt.install()
        torch.zeros(1, device="cuda")
        vmmipc.live_registrations()
    except (ImportError, AttributeError, vmmipc.VmmipcError) as e:
        return None, (f"vmmipc.torch or its library cannot be used ({type(e).__name__}: {e}): "
                      "merge main and run make lib")
    return vt, None


def main(argv):
    why = no_torch_gpu(torch, TORCH_MISSING)
    if why:
        return skip_all(why)
    names = [name for name, _, _ in SCENARIOS]
    unknown = [a for a in argv if a not in names]
    if unknown:
        print(f"unknown scenario(s) {unknown}; choose from {', '.join(names)}", file=sys.stderr)
        return 2
    vt, err = setup()
    if err:
        record("setup", False, err)
        return summary()
    if torch_run_banner(torch) is None:
        return summary()
    s = Session(vt)
    try:
        for name, title, fn in SCENARIOS:
            if not argv or name in argv:
                run_problems(title, lambda: fn(s))
    finally:
        s.close()
    return summary()


if pytest is not None:
    @pytest.fixture(scope="module")
    def mp_session():
        why = no_torch_gpu(torch, TORCH_MISSING)
        if why:
            pytest.skip(why)
        vt, err = setup()
        if err:
            pytest.fail(err)
        s = Session(vt)
        yield s
        s.close()

    @pytest.mark.parametrize("name", [name for name, _, _ in SCENARIOS])
    def test_scenario(mp_session, name):
        title, fn = next((t, f) for n, t, f in SCENARIOS if n == name)
        problems, detail = fn(mp_session)
        print(f"{title}: {detail}")
        assert not problems, "; ".join(problems)


if __name__ == "__main__":
    if sys.argv[1:] == ["--fork-errors"]:
        fork_errors_main()
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
