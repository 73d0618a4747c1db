"""Where vmmipc's pickling is installed: HostBuffer's reduce / rebuild pair,
and init_reductions(), the one function that registers reducers, for every
kind of object vmmipc pickles.

Each kind's reduce_X and rebuild_X stand side by side in one module, which
also says what the kind registers (a Reductions value); the types know
nothing of their reducers, so imports run one way: this module imports _host
and _mp, and the kinds' modules import this one.

  - HostBuffer pickles through vmmipc with every pickler (pickle.dumps,
    copy, multiprocessing): HOST registers its reducer with copyreg, where
    HostBuffer.__reduce_ex__ finds it (instances are of per-size subclasses,
    which no pickler's table names). `import vmmipc` installs it; it loads
    no library.
  - Frameworks' types (cuda.core Buffer: vmmipc.cuda_core; torch tensors and
    storages: _torch_reductions) pickle through vmmipc only in
    multiprocessing, next to their own pickling: their reducers are
    registered with ForkingPickler. vmmipc.torch also wraps
    ForkingPickler.dump, so that one pickle's tensors are shared together.
    vmmipc.cuda_core and vmmipc.torch install theirs when imported or
    installed.

Pickling a HostBuffer grants its anchor (HostBuffer.grant());
unpickling imports it (HostBuffer.from_ticket). A failure while a Queue's
feeder thread pickles reaches the receiver's get() (_mp.guarded_reduce).
"""

from __future__ import annotations

import copyreg
import threading
from typing import Callable, NamedTuple

from ._host import HostBuffer

# multiprocessing (and _mp, which needs it) is imported by the functions
# that use it, not here: `import vmmipc` does not need it, and it is a
# third of what importing vmmipc took.

_lock = threading.Lock()


class Reductions(NamedTuple):
    """What one kind of object registers so that it pickles through vmmipc
    (built by the module of its reduce_X / rebuild_X pairs)."""
    everywhere: tuple = ()  # (cls, reduce_X) pairs for every pickler (copyreg)
    forking: tuple = ()     # (cls, reduce_X) pairs for multiprocessing only (ForkingPickler)
    dump: Callable | None = None  # wrapper(dump) -> the ForkingPickler.dump to use instead


def init_reductions(reductions: Reductions | None = None) -> None:
    """Install reductions (default HOST, HostBuffer's), the one way vmmipc
    registers reducers: each (cls, reduce_X) pair with copyreg or with
    ForkingPickler (registering again replaces the pair, so installing twice
    changes nothing), and ForkingPickler.dump wrapped once per wrapper, so
    that every multiprocessing pickle (Queue, Pipe, Pool, Process arguments,
    ForkingPickler.dumps) and every ForkingPickler(f).dump runs through it.
    A reducer should wrap its work in _mp.guarded_reduce. Loads no library."""
    r = HOST if reductions is None else reductions
    with _lock:
        for cls, reduce in r.everywhere:
            copyreg.pickle(cls, reduce)
        if not (r.forking or r.dump):
            return  # HostBuffer's: `import vmmipc` imports no multiprocessing
        from multiprocessing.reduction import ForkingPickler
        for cls, reduce in r.forking:
            ForkingPickler.register(cls, reduce)
        if r.dump is not None and getattr(ForkingPickler.dump, "_vmmipc_wrapper", None) \
                is not r.dump:
            dump = r.dump(ForkingPickler.dump)
            dump._vmmipc_wrapper = r.dump
            ForkingPickler.dump = dump


# ------------------------------------------------------------------ HostBuffer


_mp = None  # multiprocessing's, imported by the first pickle (see above)


def reduce_host_buffer(hb: HostBuffer):
    global _mp
    if _mp is None:
        from . import _mp

    def reduce():
        # The ticket as plain bytes: a Ticket pickles through its class (a
        # global saved, a constructor called back), which doubled what
        # pickling and unpickling this tuple cost.
        return (rebuild_host_buffer, (bytes(hb.grant()), hb.chunk_size))
    return _mp.guarded_reduce("HostBuffer", reduce)


def rebuild_host_buffer(ticket, chunk_size):
    """Unpickling side of a HostBuffer: map the sender's memory. A buffer
    mapped here already (the import cache) is a hit that the sender's grant
    table vouches for without a round trip: the whole ticket is compared (a
    changed byte is no hit, and the sender refuses it), and an ended,
    expired or used-up grant raises NotFoundError as for a new receiver;
    its use is spent soon after, by the sender when it next makes grants
    (a loop's come 32 at a time: _anchor.py) or else by a library thread,
    within about 10 ms of a stream's hit (vmmipc.h, vmmipc_import; at exit
    this process waits for those, and were it killed first, the sender
    spends them from this process's spend log). Nothing is held: a
    HostBuffer's memfd is its own, and its pages live as long as any
    mapping of them (holds are for memory handed out again, vmmipc.h
    "Holds")."""
    return HostBuffer.from_ticket(ticket, chunk_size)


HOST = Reductions(everywhere=((HostBuffer, reduce_host_buffer),))
