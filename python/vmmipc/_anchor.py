"""Anchors: the one long-lived registration a sender keeps of memory it
shares again and again, the grants made from it, and the thread and fork
hook they need. HostBuffer, vmmipc.cuda_core and vmmipc.torch all use it.

An anchor is a registration with unlimited uses: the library holds its own
references to the memory (a memfd's duplicate, retained CUDA allocations)
for as long as it, or any registration made from it, lives. Each share or
pickle is a *grant*: vmmipc.register_again of the anchor for `uses`
receivers and `ttl` seconds, which opens no descriptor, makes no driver call
and keeps the buffer identity, so a receiver that has the memory mapped
imports it from its cache. A grant may keep Python objects alive until it
ends (a torch storage until its receiver has it): they are let go on the
reaper thread, never on the library thread that runs the release callback.
A grant that keeps nothing and holds nothing (a HostBuffer's or a cuda.core
Buffer's pickle) is registered without a release callback: such a callback
only told the anchor which grants had ended, and it cost the sender more
than the grant itself (a library thread taking the GIL, for every pickle).
The anchor asks the library instead, one vmmipc_live_many call for all of
them, when pending() is called and each time its list of such grants has
doubled, so the list stays about twice the grants that are live.
Ending an anchor (retire) ends no grant: each lives until used, expired or
unregistered, and receivers' mappings outlive everything.

Grants made ahead: a sender that re-sends one buffer in a loop would call
into the library once per pickle, and on a small machine that call costs
far more than its work: each call from a thread that has waited wakes the
Go runtime's threads, which then compete with the receiver for the CPUs
(bench/results/2026-12-06-grants-ahead-cpu.md). So a grant without a
callback or ttl that comes within AHEAD_WINDOW of the anchor's last makes
AHEAD grants at once, and the next pickles take them in order. A grant made
ahead is a registration whose ticket nobody has seen: no receiver can use
it, and until a pickle names it live_registrations() does not count it
(made_ahead()). Those left when the anchor ends are ended with it.

Fork: a child made by fork() inherits this module's state but cannot use
libvmmipc (its Go runtime does not survive fork). after_fork(fn) registers
fn to run in such a child (os.register_at_fork), so each module resets its
state in one place; anchors inherited that way are never ended by the child.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
import weakref

from . import _errors, _lib
from ._register import (library_live_registrations, live_many, register_again,
                        register_again_quiet, unregister)
from ._ticket import Ticket

log = logging.getLogger("vmmipc")

# ----------------------------------------------------------------- fork hook

_after_fork: list = []


def after_fork(fn) -> None:
    """Run fn() (no arguments) in every child made by fork() from now on."""
    _after_fork.append(fn)


def _run_after_fork() -> None:
    for fn in _after_fork:
        try:
            fn()
        except Exception:  # noqa: BLE001 - one module's reset must not stop the others
            log.exception("vmmipc: after-fork hook %r failed", fn)


os.register_at_fork(after_in_child=_run_after_fork)

# -------------------------------------------------------------------- reaper


class _Reaper:
    """One daemon thread for work that must not run where it arises: a
    release callback runs on a library thread, which must not call vmmipc,
    and dropping the last reference to an object (a torch storage) can run
    any finalizer."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> None:
        self._start()
        self._queue.put((fn, args))

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="vmmipc reaper",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            fn, args = self._queue.get()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("vmmipc: %s failed on the reaper", getattr(fn, "__qualname__", fn))
            del fn, args  # whatever they held is freed here, on this thread


reaper = _Reaper()
# In a forked child the parent's thread does not exist: start afresh, in
# place, since other modules hold this object under their own names.
after_fork(reaper.__init__)


def _let_go(_objects) -> None:
    """Runs on the reaper: what it was given dies when it returns."""


def end_quietly(ticket: Ticket) -> None:
    try:
        unregister(ticket)
    except _errors.NotFoundError:
        pass  # ended already (used up, unregistered by hand or at exit)


# -------------------------------------------------------------------- anchor

_generation = [0]  # bumped in a forked child: anchors of older ones are inherited


def _forked() -> None:
    _generation[0] += 1


after_fork(_forked)


_QUIET_FIRST_CHECK = 64  # grants without a callback listed before the first prune
AHEAD = 32            # grants made at once for a buffer re-sent in a loop (module doc)
AHEAD_WINDOW = 1.0    # seconds: a grant this soon after the last one makes AHEAD
_ahead_lock = threading.Lock()  # grants made ahead change, or are counted, under it
_anchors: "weakref.WeakSet[Anchor]" = weakref.WeakSet()  # for the exit hook below
_anchors_lock = threading.Lock()  # a WeakSet is not safe to add to while it is copied


def _end_quiet_grants_at_exit() -> None:
    # _register's exit hook (priority -100, run just before this one) told
    # the library the process is exiting and ended the registrations with a
    # callback; this ends the grants without one, so that a receiver that
    # comes now hears, for every grant alike, that its exporter is exiting.
    with _anchors_lock:
        anchors = list(_anchors)
    for anchor in anchors:
        if anchor._generation == _generation[0]:
            anchor._end_ahead()
            with anchor._lock:
                anchor._prune_quiet()
                quiet = list(anchor._quiet.values())
            for t in quiet:
                end_quietly(t)


_lib.at_exit(_end_quiet_grants_at_exit, -101)


class Anchor:
    """One anchor registration and the grants made from it that have not
    ended. Grants and retire() may be called from any thread."""

    def __init__(self, ticket: Ticket):
        self.ticket = ticket
        self._c_ticket = None  # the ticket as the library takes it (_c)
        self._generation = _generation[0]
        self._lock = threading.Lock()
        self._grants: dict[int, Ticket | None] = {}  # grants with a release callback
        self._quiet: dict[int, Ticket] = {}  # grants without one, maybe ended (module doc)
        self._quiet_check = _QUIET_FIRST_CHECK  # prune _quiet when it is this long
        self._ahead: list[Ticket] = []  # grants made ahead, for _ahead_uses receivers each
        self._ahead_uses = 0
        self._last_quiet = float("-inf")  # when the last grant without a callback was asked for
        self._keys = itertools.count()
        with _anchors_lock:
            _anchors.add(self)
        self.retired = False
        self._warned = False  # about the limit of pending grants

    def grant(self, *, uses: int = 1, ttl: float | None = None, keep=None,
              limit: int | None = None, hold: bool = False) -> Ticket:
        """A new registration of the anchor's memory (register_again) for
        `uses` receivers (0 = unlimited) and `ttl` seconds; `keep` (any
        object) stays referenced until the grant ends. limit: at most this
        many grants pending; beyond it the oldest is ended (on the reaper),
        so a receiver that never comes cannot make the sender hold more and
        more. hold=True: receivers that hold their use (import or confirm
        with hold=True) keep `keep` referenced until they let go or end
        (register_again(hold=True)). NotFoundError if the anchor ended
        (retired, or unregistered at exit)."""
        key = next(self._keys)
        if keep is None and not hold and limit is None:
            ticket = self._quiet_grant(uses, ttl)
            with self._lock:
                self._quiet[key] = ticket
                if len(self._quiet) >= self._quiet_check:
                    self._prune_quiet()
                    self._quiet_check = max(_QUIET_FIRST_CHECK, 2 * len(self._quiet))
            return ticket
        with self._lock:
            if limit is not None and len(self._grants) >= limit:
                oldest = next((k for k, t in self._grants.items() if t is not None), None)
                if oldest is not None:
                    if not self._warned:  # once: receivers that hold many would repeat it
                        self._warned = True
                        log.warning("vmmipc: %d grants of one anchor have not ended (not received "
                                    "yet, or held by their receivers); ending the oldest ones from "
                                    "now on: a receiver that has not received one yet will be told "
                                    "it was unregistered; one that holds it keeps its memory",
                                    len(self._grants))
                    reaper.submit(end_quietly, self._grants.pop(oldest))
            self._grants[key] = None  # a release that comes first removes it
        release = _Release(self, key, keep)
        try:
            ticket = register_again(self.ticket, uses=uses, ttl=ttl, release=release, hold=hold)
        except BaseException:
            release.keep = None  # never granted: nothing to let go later
            release()
            raise
        with self._lock:
            if key in self._grants:
                self._grants[key] = ticket
        return ticket

    def _quiet_grant(self, uses: int, ttl: float | None) -> Ticket:
        """A grant without a callback: the oldest made ahead for `uses`
        receivers, else one made now, with AHEAD - 1 more when the last
        came within AHEAD_WINDOW (module doc). A ttl counts from the grant,
        so such grants are made one at a time."""
        with self._lock:
            if ttl is not None or self.retired or self._generation != _generation[0]:
                return register_again_quiet(self._c(), uses, ttl)
            now, last = time.monotonic(), self._last_quiet
            self._last_quiet = now
            with _ahead_lock:
                if self._ahead and self._ahead_uses == uses:
                    return self._ahead.pop(0)
            ticket = register_again_quiet(self._c(), uses, None)
            if now - last < AHEAD_WINDOW and not self._ahead:
                self._stock(uses, AHEAD - 1)
            return ticket

    def _c(self) -> _lib.vmmipc_ticket:
        """The anchor's ticket as the library takes it, made by the first
        grant without a callback (under _lock)."""
        if self._c_ticket is None:
            self._c_ticket = self.ticket._c()
        return self._c_ticket

    def make_ahead(self, uses: int) -> None:
        """Make one grant ahead for `uses` receivers, for the first pickle
        (HostBuffer makes it with its anchor: module doc)."""
        with self._lock:
            if not self._ahead and not self.retired:
                self._stock(uses, 1)

    def _stock(self, uses: int, n: int) -> None:
        """Make n grants ahead for `uses` receivers (under _lock, none
        ahead: nothing is dropped). A failure stops there: the grants not
        made are made when asked for."""
        ahead = []
        try:
            for _ in range(n):
                ahead.append(register_again_quiet(self._c(), uses, None))
        except _errors.VmmipcError:
            pass
        with _ahead_lock:
            self._ahead, self._ahead_uses = ahead, uses

    def _end_ahead(self) -> None:
        """End the grants made ahead that no pickle has named."""
        with _ahead_lock:
            ahead, self._ahead = self._ahead, []
        for t in ahead:
            end_quietly(t)

    def _ended(self, key: int) -> None:
        with self._lock:
            self._grants.pop(key, None)

    def _prune_quiet(self) -> None:
        """Forget the grants without a callback that have ended (under _lock;
        one call into the library, which calls nothing back)."""
        live = live_many(list(self._quiet.values()))  # no call for none
        self._quiet = {k: t for (k, t), alive in zip(self._quiet.items(), live) if alive}

    def pending(self) -> list[Ticket]:
        """Tickets of grants that have not ended, in the order they were made."""
        with self._lock:
            self._prune_quiet()
            if not self._grants:
                return list(self._quiet.values())
            both = [(k, t) for k, t in self._grants.items() if t is not None]
            both += self._quiet.items()
            return [t for _, t in sorted(both, key=lambda kt: kt[0])]

    def retire(self, now: bool = False) -> None:
        """End the anchor (once): now, or on the reaper (from a finalizer
        or a library callback). Grants made from it live on. An anchor
        inherited through fork() is only marked."""
        if self.retired:
            return
        self.retired = True
        if self._generation != _generation[0]:
            return
        if now:
            self._end()
        else:
            reaper.submit(self._end)

    def _end(self) -> None:
        with self._lock:  # a batch being made finishes first, and is ended too
            self._end_ahead()
        end_quietly(self.ticket)


class _Release:
    """A grant's release callback (library thread): forget the grant, and
    hand what it kept alive to the reaper."""
    __slots__ = ("anchor", "key", "keep")

    def __init__(self, anchor: Anchor, key: int, keep):
        self.anchor, self.key, self.keep = anchor, key, keep

    def __call__(self) -> None:
        keep, self.keep = self.keep, None
        self.anchor._ended(self.key)
        if keep is not None:
            reaper.submit(_let_go, keep)


def made_ahead() -> int:
    """Grants that this process's anchors made ahead and no pickle has
    named yet (under _ahead_lock)."""
    with _anchors_lock:
        anchors = list(_anchors)
    return sum(len(a._ahead) for a in anchors if a._generation == _generation[0])


def live_registrations() -> int:
    """Registrations of this process that have not ended yet
    (vmmipc_live_registrations), less the grants made ahead that no pickle
    has named (module doc): a receiver can see only those it was sent."""
    with _ahead_lock:
        return library_live_registrations() - made_ahead()
