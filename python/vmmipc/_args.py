"""Checks of the numbers handed to the library, before ctypes sees them.

ctypes converts a Python int to a C integer by wrapping it silently:
register([-4096]) would register a chunk of 2**64 - 4096 bytes, and
register_host_file(fd + 2**32, ...) would register fd. So every integer
argument goes through integer() (or one of its shorthands) first, with the
parameter's name, and every duration in seconds through milliseconds().

The rules, one for every parameter:
  - An integer is anything with __index__ (int, numpy integers) except bool:
    uses=True or device=False is a mistake, not 1 or 0. Anything else
    (float, str, None where None has no meaning) is a TypeError naming the
    parameter; 1.0 is refused too, since 1.7 would otherwise become 1.
  - A value outside the C type's range, or outside a bound the header names
    (VMMIPC_MAX_WINDOW, ...), is an InvalidError (status VMMIPC_EINVAL, also
    a ValueError) naming the parameter, its value and the range.
  - Durations are real numbers of seconds (int or float, not bool), finite.
"""

from __future__ import annotations

import math
import numbers
import operator

from . import _errors

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32_MIN, I32_MAX = -2**31, 2**31 - 1


def integer(value, name: str, lo: int, hi: int, function: str, hint: str = "") -> int:
    """value as an int in [lo, hi]: TypeError if it is not an integer,
    InvalidError if it is out of range. function is the C function the value
    is for (errors name its Python call, _errors.python_name); hint is
    appended to the range error."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{_errors.python_name(function)}: {name} must be an integer, not "
                        f"{type(value).__name__} ({value!r})")
    v = operator.index(value)
    if not lo <= v <= hi:
        raise _errors.InvalidError(f"{name}={v} is out of range: it must be in [{lo}, {hi}]"
                                   + (f" ({hint})" if hint else ""), _errors.EINVAL, function)
    return v


def u32(value, name: str, function: str, hint: str = "") -> int:
    return integer(value, name, 0, U32_MAX, function, hint)


def u64(value, name: str, function: str, hint: str = "") -> int:
    return integer(value, name, 0, U64_MAX, function, hint)


def i32(value, name: str, function: str, hint: str = "") -> int:
    return integer(value, name, I32_MIN, I32_MAX, function, hint)


def integers(values, name: str, lo: int, hi: int, function: str, max_count: int) -> list[int]:
    """A list of integers, each checked as integer() does (named name[i]),
    and at most max_count of them. A str or bytes is not a list of integers."""
    if isinstance(values, (str, bytes, bytearray)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{_errors.python_name(function)}: {name} must be a sequence of "
                        f"integers, not {type(values).__name__}")
    out = [integer(v, f"{name}[{i}]", lo, hi, function) for i, v in enumerate(values)]
    if len(out) > max_count:
        raise _errors.InvalidError(f"{name} has {len(out)} entries; at most {max_count} are "
                                   "allowed", _errors.EINVAL, function)
    return out


def milliseconds(seconds, name: str, lo_ms: int, hi_ms: int, function: str,
                 hint: str = "") -> int:
    """A duration in seconds as whole milliseconds (rounded up, so that a
    tiny positive duration is not 0), checked against [lo_ms, hi_ms]."""
    if hasattr(type(seconds), "__index__") and not isinstance(seconds, bool):
        seconds = operator.index(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real):
        raise TypeError(f"{_errors.python_name(function)}: {name} must be a number of "
                        f"seconds, not {type(seconds).__name__} ({seconds!r})")
    if not math.isfinite(seconds) or seconds < 0:
        ms = None
    else:
        ms = math.ceil(seconds * 1000)
    if ms is None or not lo_ms <= ms <= hi_ms:
        raise _errors.InvalidError(
            f"{name}={seconds!r} seconds is out of range: it must be in "
            f"[{lo_ms / 1000:g}, {hi_ms / 1000:g}] seconds" + (f" ({hint})" if hint else ""),
            _errors.EINVAL, function)
    return ms
