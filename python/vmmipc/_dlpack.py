"""DLPack export through ctypes: a byte range as a 1-D uint8 tensor.

The protocol (dlpack.h, unversioned DLManagedTensor): the producer hands out
a PyCapsule named "dltensor" holding a DLManagedTensor*. A consumer renames
the capsule "used_dltensor" and, when it no longer needs the memory, calls
the tensor's deleter exactly once. A capsule that is freed while still named
"dltensor" was never consumed: its destructor calls the deleter instead.
Either way the deleter runs once, and what the export keeps alive (the
Mapping the bytes belong to) is dropped then, not before.

State lives in a table keyed by manager_ctx (keys are never reused); the
deleter and the capsule destructor are module-level ctypes callbacks, so C
can never call a freed callback object.
"""

from __future__ import annotations

import ctypes
import itertools
from ctypes import CFUNCTYPE, POINTER, Structure, c_int32, c_int64, c_uint8, c_uint16, c_uint64, c_void_p
from typing import Callable

KDL_CPU = 1
KDL_CUDA = 2
KDL_UINT = 1
CAPSULE_NAME = b"dltensor"
USED_CAPSULE_NAME = b"used_dltensor"


class DLDevice(Structure):
    _fields_ = [("device_type", c_int32), ("device_id", c_int32)]


class DLDataType(Structure):
    _fields_ = [("code", c_uint8), ("bits", c_uint8), ("lanes", c_uint16)]


class DLTensor(Structure):
    _fields_ = [
        ("data", c_void_p),
        ("device", DLDevice),
        ("ndim", c_int32),
        ("dtype", DLDataType),
        ("shape", POINTER(c_int64)),
        ("strides", POINTER(c_int64)),  # NULL: compact, row-major
        ("byte_offset", c_uint64),
    ]


DELETER = CFUNCTYPE(None, c_void_p)  # void (*deleter)(DLManagedTensor *self)


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DELETER)]


class _Export:
    """One live export: the tensor C reads, its shape array, and the callback
    that lets go of what the export kept alive."""
    __slots__ = ("managed", "shape", "release")

    def __init__(self, managed, shape, release):
        self.managed, self.shape, self.release = managed, shape, release


_exports: dict[int, _Export] = {}
_keys = itertools.count(1)


def _delete(managed_ptr) -> None:
    """The deleter: forget the export (freeing the ctypes memory C was given;
    C does not touch it after the deleter returns) and run its release.
    A second call for the same tensor finds nothing and does nothing."""
    if not managed_ptr:
        return
    export = _exports.pop(DLManagedTensor.from_address(managed_ptr).manager_ctx or 0, None)
    if export is not None:
        export.release()


_DELETER_CB = DELETER(_delete)

# Private function objects: setting argtypes on ctypes.pythonapi's cached
# attributes would change them for every other user in the process.
_capsule_new = ctypes.pythonapi["PyCapsule_New"]
_capsule_new.restype = ctypes.py_object
_CAPSULE_DESTRUCTOR = CFUNCTYPE(None, c_void_p)
_capsule_new.argtypes = [c_void_p, ctypes.c_char_p, _CAPSULE_DESTRUCTOR]
_capsule_is_valid = ctypes.pythonapi["PyCapsule_IsValid"]
_capsule_is_valid.restype = ctypes.c_int
_capsule_is_valid.argtypes = [c_void_p, ctypes.c_char_p]
_capsule_get_pointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_capsule_get_pointer.restype = c_void_p
_capsule_get_pointer.argtypes = [c_void_p, ctypes.c_char_p]


def _capsule_destructor(capsule, _is_valid=_capsule_is_valid, _get=_capsule_get_pointer,
                        _name=CAPSULE_NAME, _delete=_delete) -> None:
    # Runs with the GIL held when the capsule is freed. Its own references
    # (default arguments) keep it working when module globals are already
    # cleared at interpreter exit. A consumed capsule ("used_dltensor") is
    # the consumer's to delete: leave it.
    if _is_valid(capsule, _name):
        _delete(_get(capsule, _name))


_CAPSULE_DESTRUCTOR_CB = _CAPSULE_DESTRUCTOR(_capsule_destructor)


def export_bytes(data: int, size: int, device_type: int, device_id: int,
                 release: Callable[[], None]):
    """A "dltensor" capsule for [data, data + size) as a 1-D uint8 tensor on
    (device_type, device_id). release() runs exactly once, when the consumer
    calls the deleter or the unconsumed capsule is freed; it (and whatever it
    references) is kept until then."""
    shape = (c_int64 * 1)(size)
    managed = DLManagedTensor()
    t = managed.dl_tensor
    t.data = data
    t.device = DLDevice(device_type, device_id)
    t.ndim = 1
    t.dtype = DLDataType(KDL_UINT, 8, 1)
    t.shape = ctypes.cast(shape, POINTER(c_int64))
    t.byte_offset = 0
    key = next(_keys)
    managed.manager_ctx = key
    managed.deleter = _DELETER_CB
    _exports[key] = _Export(managed, shape, release)
    try:
        return _capsule_new(ctypes.addressof(managed), CAPSULE_NAME, _CAPSULE_DESTRUCTOR_CB)
    except BaseException:
        del _exports[key]
        raise


def live_exports() -> int:
    """Exports whose deleter has not run yet (for tests and leak checks)."""
    return len(_exports)
