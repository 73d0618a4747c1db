"""The buffer protocol for HostBuffer and host Mappings, on every Python.

Their memory is not Python's: a memfd the owner mapped, or a mapping
libvmmipc made. Two things are needed: the object itself must export the
memory (memoryview(hb), numpy.frombuffer(hb), numpy.asarray(hb),
torch.frombuffer(hb), bytes(hb) in one copy), and close() must never unmap
memory that some buffer still points at.

- Memory holds the private ctypes object over the memory and the
  memoryview `view` of it. Every memoryview, array or tensor made from
  `view` keeps that ctypes object, which nothing else can reach,
  referenced, so `views_alive()` sees each one.
- Python 3.12+ (PEP 688): the classes define __buffer__, which hands out
  another memoryview of `view`; so every buffer taken from the object is
  seen by views_alive(), and close() refuses while one lives.
- Python 3.9-3.11 have no __buffer__: only a C type can export a buffer.
  `instance()` makes each object of a class that also derives from a ctypes
  array of `size` one-byte unions placed over the memory (a union's buffer
  format is "B", as bytes' is; c_ubyte's would be "<B", which memoryview
  cannot index). A buffer taken from the object that way holds the object
  itself and tells nobody when it is released, so close() cannot count it;
  `held_only_by_caller()` tells whether anything besides the code that
  called close() references the object. When something may (a buffer taken
  from it, or just another name), close() leaves the unmapping to the
  object's collection, which waits for all of them: later, never too early.
  When nothing does, close() unmaps at once.

After close() the object is an empty buffer, on every Python: close()
`disarm()`s it. Being a ctypes array (on 3.12+ too), the object is also
read through its address by ctypes itself, which no Python method sees:
ctypes.string_at(obj, n), ctypes.memmove(dst, obj, n), ctypes.cast(obj,
c_char_p).value and ctypes.Array.__getitem__(obj, i) all use the C struct's
b_ptr, b_size and b_length. disarm() makes it an array of 0 bytes (its
class, b_size and b_length: buffers taken from it are empty, item access is
an IndexError) and points b_ptr at `size` bytes of private anonymous zero
pages (MAP_NORESERVE: address space, not memory), which the objects
disarmed at that size share and which stay mapped for later ones
(TOMBSTONE_BYTES in all; beyond it, an object's own, unmapped with it). So
what reads through the address with a length of its own reads zeros (or
what a write through a closed object left there), not the freed memory
(nor a crash, nor whatever was mapped there next), and what writes there
writes into pages that only closed objects lead to. When those pages
cannot be mapped (no address space left), b_ptr stays on the memory and
close() leaves it mapped until the object's collection.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

PEP688 = sys.version_info >= (3, 12)


class _Byte(ctypes.Union):
    """One byte whose buffer format is "B"."""
    _fields_ = [("b", ctypes.c_ubyte)]


_classes: dict[tuple[type, int], type] = {}
_bytes_types: dict[int, type] = {}


def _cached(cache: dict, key, make):
    cls = cache.get(key)
    if cls is None:
        cls = make()
        if len(cache) < 64:  # sizes repeat in practice; do not grow without bound
            cache[key] = cls
    return cls


def instance(base: type, addr: int, size: int):
    """A new object of a subclass of `base` that exports [addr, addr + size)
    as its buffer (format "B", writable) and has an instance dict; neither
    __new__ nor __init__ of base runs. base must define __init__ (ctypes'
    own would take the array's items), __reduce_ex__, __hash__ and the item
    access it wants: the ctypes array's come after base's in the MRO."""
    return _sized(base, size).from_address(addr)


def _sized(base: type, size: int) -> type:
    return _cached(_classes, (base, size),
                   lambda: type(base.__name__, (base, _Byte * size),
                                {"__module__": base.__module__, "__qualname__": base.__qualname__}))


def _probe_layout():
    """Where b_ptr, b_size and b_length sit in a ctypes object's C struct
    (CDataObject: the object header, then b_ptr, b_needsfree, b_base,
    b_size, b_length), as word indices; None if not found. Found, not
    assumed: a debug or free-threaded build's header is larger."""
    probes = [((_Byte * 12345).from_address(0x1000), 0x1000, 12345, 12345),
              ((ctypes.c_uint16 * 321).from_address(0x2000), 0x2000, 642, 321)]  # never read
    found = None
    for obj, ptr, size, length in probes:
        n = type(obj).__basicsize__ // ctypes.sizeof(ctypes.c_ssize_t)  # no word beyond it
        words = (ctypes.c_ssize_t * n).from_address(id(obj))
        at = [i for i in range(2, n - 4) if words[i] == ptr and words[i + 3] == size
              and words[i + 4] == length]
        if len(at) != 1 or found not in (None, at[0]):
            return None
        found = at[0]
    return found, found + 3, found + 4


_LAYOUT = _probe_layout()
CAN_DISARM = _LAYOUT is not None

# MAP_NORESERVE (Python 3.10+ names it; Linux's value before).
_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)


def disarm(obj) -> bool:
    """Make obj (from instance()) an empty buffer for good, on any Python
    (the module docstring says why and how). True when its address now
    leads to a mapping of its own, so that its memory may be unmapped;
    False when no such mapping could be made (its address stays on the
    memory, which must then stay mapped while obj lives), or the layout is
    unknown (nothing changed). Call it when closing, whatever the views:
    a buffer already taken from obj keeps its own pointer and length."""
    if not isinstance(obj, ctypes.Array):
        return True  # not from instance(): it has no address to lead anywhere
    if _LAYOUT is None:
        return False
    ptr_at, size_at, length_at = _LAYOUT
    words = (ctypes.c_ssize_t * (length_at + 1)).from_address(id(obj))
    armed = getattr(obj, "_exported_armed_class", None)
    if armed is None:
        armed = type(obj)
        # Buffers taken before keep pointers into the old class (its shape):
        # it lives as long as obj does.
        obj._exported_armed_class = armed
        obj.__class__ = _sized(armed.__bases__[0], 0)
        words[size_at] = 0
        words[length_at] = 0
    if getattr(obj, "_exported_tombstone", None) is not None:
        return True
    tomb = _tombstone(max(ctypes.sizeof(armed), 1))
    if tomb is None:
        return False
    obj._exported_tombstone = tomb[0]  # mapped while obj lives
    words[ptr_at] = tomb[1]
    return True


# Zero pages by size, shared by the objects disarmed at that size and kept:
# mapping and unmapping them at each close was a quarter of an imported
# HostBuffer's close(). Bounded, as address space counts in RLIMIT_AS.
_tombstones: dict[int, tuple[mmap.mmap, int]] = {}
TOMBSTONE_BYTES = 16 << 30  # kept at most, over at most 64 sizes


def _tombstone(size: int) -> tuple[mmap.mmap, int] | None:
    """size bytes of private anonymous zero pages (MAP_NORESERVE) and their
    address: kept ones, or new ones for this object alone once the bound is
    reached; None when they cannot be mapped."""
    tomb = _tombstones.get(size)
    if tomb is None:
        try:
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | _NORESERVE)
        except OSError:
            return None
        tomb = (mm, ctypes.addressof(ctypes.c_char.from_buffer(mm)))
        kept = sum(len(pages) for pages, _ in _tombstones.values())
        if len(_tombstones) < 64 and kept + size <= TOMBSTONE_BYTES:
            _tombstones[size] = tomb
    return tomb


class Buffer:
    """What HostBuffer and Mapping share as buffers of their `view`: the
    3.12+ buffer methods, item access through the memoryview, hashing by
    identity (ctypes objects are unhashable) and the end of a `with` block.
    Before 3.12 the ctypes base that instance() adds exports the buffer."""
    __slots__ = ()

    def __exit__(self, *exc) -> None:
        # Straight to _close(via_exit), as close() goes: closable() counts
        # references at that depth (not Closeable's __exit__, via close()).
        self._close(True)

    def __buffer__(self, flags: int) -> memoryview:  # Python 3.12+ (PEP 688)
        if self.closed and isinstance(self, ctypes.Array):
            # Empty, as a closed object's buffer is before 3.12 (disarm()).
            return memoryview(bytearray())
        return memoryview(self.view)

    def __release_buffer__(self, view: memoryview) -> None:
        # Python releases `view` itself. Defined so that consumers see a
        # releasing exporter: numpy then keeps a memoryview, which
        # views_alive() sees, rather than only a reference to self.
        pass

    def __getitem__(self, key):
        return self.view[key]

    def __setitem__(self, key, value) -> None:
        self.view[key] = value

    def __iter__(self):
        return iter(self.view)

    __hash__ = object.__hash__


class Memory:
    """The private ctypes object over [addr, addr + size) (or over a mapped
    `buffer`, which it then keeps mapped: an mmap object cannot close while
    it lives) and the memoryview (format "B") that `view()` gives out. It
    unmaps nothing itself: whoever owns the memory unmaps it when `obj` is
    collected, or once views_alive() is 0."""

    def __init__(self, size: int, addr: int = 0, buffer=None):
        # A subclass of its own, so that it takes weak references.
        t = _cached(_bytes_types, size, lambda: type("_MappedBytes", (ctypes.c_ubyte * size,), {}))
        self.obj = t.from_address(addr) if buffer is None else t.from_buffer(buffer)
        self.addr = ctypes.addressof(self.obj)
        self._view: memoryview | None = None
        self._view_refs = 0  # _view's count while only this object holds it
        self._bare = self._count()  # obj's count while no memoryview of it lives

    def _count(self) -> int:
        return sys.getrefcount(self.obj)

    def view(self) -> memoryview:
        if self._view is None:
            self._view = memoryview(self.obj).cast("B")
            self._view_refs = sys.getrefcount(self._view)
        return self._view

    def views_alive(self) -> int:
        """How many memoryviews of the memory are still alive: `view` itself
        where someone kept it (v = hb.view), slices, casts, and those that
        numpy arrays, torch tensors and the like hold. 0: none, and none can
        appear but through view(). Lets go of `view` when nobody else holds
        it (view() makes a new one)."""
        if self._view is not None and sys.getrefcount(self._view) <= self._view_refs:
            try:
                self._view.release()
            except BufferError:  # a consumer holds a buffer of it right now
                return max(1, _memoryviews_over(self.obj))
            self._view = None
        # Every memoryview keeps obj referenced through its managed buffer.
        if self._view is None and self._count() == self._bare:
            return 0
        return max(1, _memoryviews_over(self.obj))


def _memoryviews_over(target) -> int:
    """The memoryviews whose managed buffer holds target."""
    import gc
    mbufs = [r for r in gc.get_referrers(target) if type(r).__name__ == "managedbuffer"]
    return sum(1 for m in mbufs for r in gc.get_referrers(m) if type(r) is memoryview)


def memoryviews_of(obj) -> int:
    """Python < 3.12: the memoryviews taken from obj itself (the garbage
    collector sees them; numpy arrays and tensors it does not)."""
    return 0 if PEP688 else _memoryviews_over(obj)


def in_use_message(what: str, n: int) -> str:
    return (f"{n} view{'s' if n != 1 else ''} of its memory "
            f"{'are' if n != 1 else 'is'} still alive: memoryviews or slices of it, or numpy arrays "
            f"or torch tensors made from it (numpy.frombuffer, numpy.asarray, torch.frombuffer, "
            f"of the {what} or of its .view); delete them (or call .release() on memoryviews) and "
            f"close again; the {what} stays open")


_LIMITS: tuple[int, int] | None = None  # set by _calibrate() below


def closable(obj, views: int, via_exit: bool) -> tuple[bool, int]:
    """close()'s check of HostBuffer and Mapping: (whether obj may be
    unmapped now, held_only_by_caller; the views alive: `views`, their
    memory's views_alive(), plus, before 3.12, the memoryviews taken from
    obj itself where something besides the caller holds it). While views
    are alive, close() refuses (BufferInUseError, in_use_message). Call it
    as `_close(self, via_exit)` does, from a method that close() (via_exit
    False) or __exit__ (True) calls at once: the limits were counted at
    that depth (_Probe)."""
    unmap = held_only_by_caller(obj, via_exit)
    if not unmap:
        views += memoryviews_of(obj)
    return unmap, views


def held_only_by_caller(obj, via_exit: bool) -> bool:
    """Whether nothing but the code that called close() (one name, or a
    `with` statement) references obj, so that no buffer taken from obj can
    be alive, and disarm() works here. Also on 3.12+, where __release_buffer__
    counts the views: a consumer may release its view at once and hold obj
    instead (torch.frombuffer does), and must not be left over unmapped
    memory. Called by closable() only: the limits were counted at its
    depth."""
    n = sys.getrefcount(obj)
    if _LIMITS is None:
        return n  # calibrating
    return CAN_DISARM and n <= _LIMITS[via_exit]


class _Probe:
    """Closes as HostBuffer and Mapping do, to count what this interpreter
    sees for a caller that holds the object by one name (3.9 and 3.10 count
    more than 3.11 does)."""

    def close(self):
        return self._close(False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.counted = self._close(True)

    def _close(self, via_exit):
        return closable(self, 0, via_exit)[0]


def _calibrate() -> tuple[int, int]:
    p = _Probe()
    by_name = p.close()
    with p:
        pass
    return by_name, p.counted


_LIMITS = _calibrate()
