"""DLPack export through ctypes: a byte range as a 1-D uint8 tensor.

The protocol (dlpack.h): the producer hands out a PyCapsule named
"dltensor" holding a DLManagedTensor* or, to a consumer that asked for
max_version >= (1, 0), one named "dltensor_versioned" holding a
DLManagedTensorVersioned* (which can say "writable": numpy makes read-only
arrays of unversioned tensors). A consumer renames the capsule
"used_dltensor[_versioned]" and, when it no longer needs the memory, calls
the tensor's deleter exactly once. A capsule that is freed under its first
name was never consumed: its destructor calls the deleter instead. Either
way the deleter runs once, and what the export keeps alive (the Mapping the
bytes belong to) is dropped then, not before.

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
DLPACK_VERSION = (1, 0)  # of DLManagedTensorVersioned, as produced here


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


DELETER = CFUNCTYPE(None, c_void_p)  # void (*deleter)(DLManagedTensor[Versioned] *self)


class DLManagedTensor(Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", c_void_p), ("deleter", DELETER)]


class DLPackVersion(Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(Structure):
    _fields_ = [("version", DLPackVersion), ("manager_ctx", c_void_p), ("deleter", DELETER),
                ("flags", c_uint64),  # 0: writable, not a copy
                ("dl_tensor", DLTensor)]


class _Export:
    """One live export: the tensor C reads, its shape array, and the callback
    that lets go of what the export kept alive."""
    __slots__ = ("managed", "shape", "release")

    def __init__(self, managed, shape, release):
        self.managed, self.shape, self.release = managed, shape, release


_exports: dict[int, _Export] = {}
_keys = itertools.count(1)


def _deleter(struct):
    def delete(managed_ptr) -> None:
        """The deleter: forget the export (freeing the ctypes memory C was
        given; C does not touch it after the deleter returns) and run its
        release. A second call for the same tensor finds nothing."""
        if not managed_ptr:
            return
        export = _exports.pop(struct.from_address(managed_ptr).manager_ctx or 0, None)
        if export is not None:
            export.release()
    return delete


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


def _destructor(name: bytes, delete):
    def destroy(capsule, _is_valid=_capsule_is_valid, _get=_capsule_get_pointer) -> None:
        # Runs with the GIL held when the capsule is freed; what it uses is
        # bound here, not looked up in module globals (cleared at exit). A
        # consumed capsule ("used_...") is the consumer's to delete: leave it.
        if _is_valid(capsule, name):
            delete(_get(capsule, name))
    return destroy


class _Kind:
    """One flavour of the protocol: its struct, capsule name and the two
    module-lifetime callbacks (C can never call a freed callback object)."""

    def __init__(self, struct, name: bytes):
        self.struct, self.name = struct, name
        delete = _deleter(struct)
        self.deleter = DELETER(delete)
        self.destructor = _CAPSULE_DESTRUCTOR(_destructor(name, delete))


LEGACY = _Kind(DLManagedTensor, b"dltensor")
VERSIONED = _Kind(DLManagedTensorVersioned, b"dltensor_versioned")


def export_bytes(data: int, size: int, device_type: int, device_id: int,
                 release: Callable[[], None], *, versioned: bool):
    """A capsule for [data, data + size) as a 1-D uint8 tensor on
    (device_type, device_id): "dltensor_versioned" (DLPack 1.0, writable)
    or the unversioned "dltensor". release() runs exactly once, when the
    consumer calls the deleter or the unconsumed capsule is freed; it (and
    whatever it references) is kept until then."""
    kind = VERSIONED if versioned else LEGACY
    shape = (c_int64 * 1)(size)
    managed = kind.struct()
    if versioned:
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = 0
    t = managed.dl_tensor
    t.data = data
    t.device = DLDevice(device_type, device_id)
    t.ndim = 1
    t.dtype = DLDataType(KDL_UINT, 8, 1)
    t.shape = ctypes.cast(shape, POINTER(c_int64))
    t.byte_offset = 0
    key = next(_keys)
    managed.manager_ctx = key
    managed.deleter = kind.deleter
    _exports[key] = _Export(managed, shape, release)
    try:
        return _capsule_new(ctypes.addressof(managed), kind.name, kind.destructor)
    except BaseException:
        del _exports[key]
        raise


def live_exports() -> int:
    """Exports whose deleter has not run yet (for tests and leak checks)."""
    return len(_exports)
