"""multiprocessing integration: fork detection and guarded reducers.

Pickling registers (no descriptor is opened); the receiver streams. A
spawned or forkserver child fetches from the parent's server like any other
receiver. Under the "fork" start method the child cannot use libvmmipc (the
Go runtime and CUDA do not survive fork): the child fails at once with
VmmipcForkError when it unpickles, and where the sender can tell that the
pickle is bound for a forked child, it refuses before registering anything.

A multiprocessing Queue pickles in a feeder thread: an exception raised
there is printed and dropped, and the receiver waits in get() for an object
that never comes. guarded_reduce turns such a failure into a pickle whose
unpickling raises the same error in the receiver. This module knows no
vmmipc type: the reducers (_reductions, cuda_core, _torch_reductions) use it.
"""

from __future__ import annotations

import logging
import os
import pickle
import threading
from multiprocessing import context as _mpcontext
from multiprocessing import popen_fork as _popen_fork
from multiprocessing import pool as _pool
from multiprocessing import queues as _queues

from . import _errors

log = logging.getLogger("vmmipc")

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


def _queue_feeder_args(t=None):
    """The Queue._feed arguments if this thread (t) is a Queue's feeder, else None."""
    if t is None:
        t = threading.current_thread()
    if getattr(t, "_target", None) is _queues.Queue._feed:
        return getattr(t, "_args", ())
    return None


def fork_destination() -> str | None:
    """Best effort: why the pickle being made is bound for a forked child
    ("pool", "queue", "process"), or None if it is not (or we cannot tell,
    as for a Pipe: then the child fails when it unpickles)."""
    try:
        if _is_fork_popen(_mpcontext.get_spawning_popen()):
            return "process"
        t = threading.current_thread()
        args = getattr(t, "_args", ())
        if getattr(t, "_target", None) is _pool.Pool._handle_tasks and len(args) >= 4:
            workers = args[3]
            if any(_is_fork_popen(getattr(p, "_popen", None)) for p in list(workers)):
                return "pool"
        feeder = _queue_feeder_args(t)
        if feeder is not None and len(feeder) >= 4 and feeder[3] is not None:
            if _is_fork_lock(feeder[3]):  # the queue's write lock, made by its context
                return "queue"
    except Exception:  # noqa: BLE001 - detection must never break pickling
        return None
    return None


def refuse_fork(where: str):
    """Unpickling side of a pickle refused because it was bound for a forked
    child: raises at once in the receiver (a Queue.get() never waits)."""
    raise _errors.VmmipcForkError(f"received through a fork-context {where}: " + _FORK_ADVICE,
                                  _errors.EFORK, "unpickle")


def raise_sender_error(what: str, pid: int, error: BaseException):
    """Unpickling side of a reducer that failed in the sender's Queue feeder
    thread: raises the sender's error here, in the receiver's get()."""
    if hasattr(error, "add_note"):  # Python 3.11+
        error.add_note(f"raised in the sending process (pid {pid}) while it pickled a "
                       f"{what} for this queue; nothing was registered for it")
    raise error


def _portable(error: Exception) -> Exception:
    """error itself if it survives pickling, else a VmmipcError that carries
    its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any failure means: not portable
        return _errors.VmmipcError(f"{type(error).__name__}: {error}", None, "pickle")


ASK = object()  # guarded_reduce's `where` when the caller has not asked yet


def guarded_reduce(what: str, reduce_fn, where=ASK):
    """For reducers: refuse a pickle bound for a forked child (a Queue's
    receiver then raises VmmipcForkError in get(); a Pool or Process fails
    in the sender), else return reduce_fn(). If reduce_fn raises while a
    Queue feeder thread pickles, return a reduce tuple that raises the same
    error in the receiver's get() (and log it here); elsewhere the error
    propagates to the caller (Pipe.send, Pool.map, pickle.dumps...). where:
    fork_destination() if the caller asked it already for this pickle (on
    this thread)."""
    if where is ASK:
        where = fork_destination()
    if where == "queue":
        return (refuse_fork, (where,))
    if where is not None:
        raise _errors.VmmipcForkError(f"cannot send a {what} to a fork-context {where}: "
                                      + _FORK_ADVICE, _errors.EFORK, "pickle")
    try:
        return reduce_fn()
    except Exception as e:
        if _queue_feeder_args() is None:
            raise
        log.error("vmmipc: pickling a %s for a multiprocessing Queue failed (the receiver's "
                  "get() raises it): %s: %s", what, type(e).__name__, e)
        return (raise_sender_error, (what, os.getpid(), _portable(e)))
