"""multiprocessing integration: ForkingPickler reducers and fork detection.

Pickling registers (no descriptor is opened); the receiver streams. A
spawned or forkserver child fetches from the parent's server like any other
receiver. Under the "fork" start method the child cannot use libvmmipc (the
Go runtime and CUDA do not survive fork): the child fails at once with
VmmipcForkError when it unpickles, and where the sender can tell that the
pickle is bound for a forked child, it refuses before registering anything.
"""

from __future__ import annotations

import threading
from multiprocessing import context as _mpcontext
from multiprocessing import popen_fork as _popen_fork
from multiprocessing.reduction import ForkingPickler

from . import _errors

_FORK_ADVICE = ("libvmmipc cannot run in a child made by fork() (its Go runtime and CUDA do "
                "not survive fork); use multiprocessing.get_context('spawn') or "
                "get_context('forkserver')")


def _is_fork_popen(popen) -> bool:
    # popen_spawn_posix.Popen and popen_forkserver.Popen subclass it.
    return type(popen) is _popen_fork.Popen


def _is_fork_lock(lock) -> bool:
    flag = getattr(lock, "_is_fork_ctx", None)
    if flag is not None:
        return bool(flag)
    semlock = getattr(lock, "_semlock", None)  # Python < 3.11: unlinked at once
    return semlock is not None and getattr(semlock, "name", "") is None


def fork_destination() -> str | None:
    """Best effort: why the pickle being made is bound for a forked child
    ("pool", "queue", "process"), or None if it is not (or we cannot tell,
    as for a Pipe: then the child fails when it unpickles)."""
    try:
        if _is_fork_popen(_mpcontext.get_spawning_popen()):
            return "process"
        t = threading.current_thread()
        target = getattr(t, "_target", None)
        args = getattr(t, "_args", ())
        from multiprocessing import pool as _pool, queues as _queues
        if target is _pool.Pool._handle_tasks and len(args) >= 4:
            workers = args[3]
            if any(_is_fork_popen(getattr(p, "_popen", None)) for p in list(workers)):
                return "pool"
        if target is _queues.Queue._feed and len(args) >= 4 and args[3] is not None:
            if _is_fork_lock(args[3]):  # the queue's write lock, made by its context
                return "queue"
    except Exception:  # noqa: BLE001 - detection must never break pickling
        return None
    return None


def refuse_fork(where: str):
    """Unpickling side of a pickle refused because it was bound for a forked
    child: raises at once in the receiver (a Queue.get() never waits)."""
    raise _errors.VmmipcForkError(f"received through a fork-context {where}: " + _FORK_ADVICE,
                                  _errors.EFORK, "unpickle")


def check_not_fork(what: str):
    """For reducers: None if fine; else a reduce tuple (queue: the receiver
    raises at once) or an exception (pool, process: the sender's call
    fails). Nothing is registered either way."""
    where = fork_destination()
    if where is None:
        return None
    if where == "queue":
        # Raising here would only print in the feeder thread and leave the
        # child waiting in get(); make the child's get() raise instead.
        return (refuse_fork, (where,))
    raise _errors.VmmipcForkError(f"cannot send a {what} to a fork-context {where}: "
                                  + _FORK_ADVICE, _errors.EFORK, "pickle")


def reduce_host_buffer(hb):
    from ._host import rebuild_host_buffer
    refused = check_not_fork("HostBuffer")
    if refused is not None:
        return refused
    ticket = hb.share()
    return (rebuild_host_buffer, (ticket, hb.chunk_size))


def install() -> None:
    from ._host import HostBuffer
    ForkingPickler.register(HostBuffer, reduce_host_buffer)
