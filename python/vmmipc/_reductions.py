"""Where vmmipc's pickling is installed: paired reduce_* / rebuild_*
functions and the one place that registers reducers.

The types know nothing of their reducers, so imports run one way: this
module imports _host and _mp; they import nothing of it.

  - HostBuffer pickles through vmmipc with every pickler (pickle.dumps,
    copy, multiprocessing): its reducer is registered with copyreg, where
    HostBuffer.__reduce_ex__ finds it (instances are of per-size subclasses,
    which no pickler's table names). Installed by
    init_reductions(), which `import vmmipc` calls; it loads no library.
  - Frameworks' types (cuda.core Buffer, torch storages) pickle through
    vmmipc only in multiprocessing, next to their own pickling: they are
    registered with ForkingPickler by register_reducer(cls, reducer), which
    vmmipc.cuda_core and vmmipc.torch call. vmmipc.torch also wraps
    ForkingPickler.dump (wrap_dump), so that one pickle's tensors are shared
    together.

Pickling a HostBuffer grants its anchor (grant());
unpickling imports it (HostBuffer.from_ticket). A failure while a Queue's
feeder thread pickles reaches the receiver's get() (_mp.guarded_reduce).
"""

from __future__ import annotations

import copyreg
import threading

from ._host import HostBuffer

# multiprocessing (and _mp, which needs it) is imported by the functions
# that use it, not here: `import vmmipc` does not need it, and it is a
# third of what importing vmmipc took.

_lock = threading.Lock()
_installed = False


def reduce_host_buffer(hb: HostBuffer):
    from . import _mp

    def reduce():
        return (rebuild_host_buffer, (hb.grant(), hb.chunk_size))
    return _mp.guarded_reduce("HostBuffer", reduce)


def rebuild_host_buffer(ticket, chunk_size):
    """Unpickling side of a HostBuffer: map the sender's memory. A buffer
    mapped here already (the import cache) spends its ticket's use with one
    message on this process's kept connection to the sender (hold=True;
    HostBuffer grants hold nothing), before this returns: a receiver killed
    right after unpickling cannot leave the sender's grant pending."""
    return HostBuffer.from_ticket(ticket, chunk_size, hold=True)


def init_reductions() -> None:
    """Install vmmipc's own reducers (idempotent; loads no library)."""
    global _installed
    with _lock:
        if not _installed:
            copyreg.pickle(HostBuffer, reduce_host_buffer)
            _installed = True


def register_reducer(cls: type, reducer) -> None:
    """Make multiprocessing (ForkingPickler) pickle instances of cls with
    reducer(obj) -> reduce tuple. For frameworks' types; a reducer should
    wrap its work in _mp.guarded_reduce. Registering again replaces it."""
    from multiprocessing.reduction import ForkingPickler
    ForkingPickler.register(cls, reducer)


def wrap_dump(wrapper) -> None:
    """Replace ForkingPickler.dump by wrapper(the current dump) (once per
    wrapper; idempotent): every multiprocessing pickle (Queue, Pipe, Pool,
    Process arguments, ForkingPickler.dumps) and every ForkingPickler(f).dump
    then runs through it. vmmipc.torch groups one pickle's tensors this way."""
    from multiprocessing.reduction import ForkingPickler
    with _lock:
        if getattr(ForkingPickler.dump, "_vmmipc_wrapper", None) is wrapper:
            return
        dump = wrapper(ForkingPickler.dump)
        dump._vmmipc_wrapper = wrapper
        ForkingPickler.dump = dump
