"""Tickets: 256 bytes of plain data naming one registration."""

from __future__ import annotations

from typing import NamedTuple

import ctypes

from . import _args, _errors, _lib
from ._errors import InvalidError
from ._lib import MEMORY_CUDA, MEMORY_HOST, TICKET_SIZE


class TicketInfo(NamedTuple):
    memory_kind: int       # MEMORY_HOST or MEMORY_CUDA
    exporter_pid: int      # pid of the registering process
    chunk_count: int
    total_size: int        # bytes
    device_uuid: bytes     # 16 bytes; zeros for host memory


class Ticket(bytes):
    """256 bytes naming one registration. Plain data: copy, pickle and send it
    anywhere. Whoever holds it can map the memory: treat it like a password
    (its repr never shows the bytes)."""

    def __new__(cls, data, function: str = "Ticket") -> "Ticket":
        if type(data) is bytes and len(data) == TICKET_SIZE:
            return super().__new__(cls, data)  # what unpickling gives: nothing to check
        # bytes(256) would be 256 zeros, bytes('x') needs an encoding, and
        # bytes(None) says nothing of tickets: only bytes-like objects.
        if hasattr(type(data), "__index__") or isinstance(data, str) or not _bytes_like(data):
            shown = repr(data) if len(repr(data)) <= 40 else repr(data)[:37] + "..."
            raise TypeError(f"{_errors.python_name(function)}: ticket must be a vmmipc.Ticket "
                            f"or its {TICKET_SIZE} bytes (from share(), register_*(), "
                            f"HostBuffer.grant() or a pickle), not {type(data).__name__} ({shown})")
        b = bytes(data)
        if len(b) != TICKET_SIZE:
            raise InvalidError(f"a ticket is {TICKET_SIZE} bytes, got {len(b)}",
                               _errors.EINVAL, function)
        return super().__new__(cls, b)

    @classmethod
    def _made(cls, data) -> "Ticket":
        """The ticket the library just wrote (TICKET_SIZE bytes, checked by
        the type that holds them): no checks to repeat."""
        return bytes.__new__(cls, data)

    def __reduce__(self):
        return (Ticket, (bytes(self),))

    def _c(self) -> _lib.vmmipc_ticket:
        return _lib.vmmipc_ticket.from_buffer_copy(self)

    def info(self) -> TicketInfo:
        """Decode the ticket without contacting anyone (InvalidError if
        malformed)."""
        out = _lib.vmmipc_ticket_info()
        _lib.call("vmmipc_ticket_decode", ctypes.byref(self._c()), ctypes.byref(out))
        return TicketInfo(out.memory_kind, out.exporter_pid, out.chunk_count,
                          out.total_size, bytes(out.device_uuid))

    def wait(self, timeout: float = 30.0) -> bool:
        """Wait until this registration (one of this process's) has ended and
        its release callback has returned (vmmipc_wait): True then, False if
        it is still live after `timeout` seconds (0: just check). After True
        the library holds nothing this registration lent it. NotFoundError if
        this process did not issue the ticket."""
        ms = _args.milliseconds(timeout, "timeout", 0, _args.U32_MAX, "vmmipc_wait",
                                "0 = just check")
        status = _lib.lib("vmmipc_wait").vmmipc_wait(ctypes.byref(self._c()), ms)
        if status == _errors.ETIMEDOUT:
            return False
        _lib.check("vmmipc_wait", status)
        return True

    def __repr__(self) -> str:
        try:
            i = self.info()
        except Exception:  # repr must not raise (bad bytes, no library, fork)
            return f"<vmmipc.Ticket {len(self)} bytes>"
        kind = {MEMORY_HOST: "host", MEMORY_CUDA: "cuda"}.get(i.memory_kind, i.memory_kind)
        return (f"<vmmipc.Ticket {kind} pid={i.exporter_pid} chunks={i.chunk_count} "
                f"size={i.total_size}>")

    __str__ = __repr__


def _bytes_like(data) -> bool:
    try:
        memoryview(data).release()
        return True
    except TypeError:
        return False


def as_ticket(ticket, function: str = "Ticket") -> Ticket:
    """ticket as a Ticket; TypeError naming `function` and the parameter for
    anything but a Ticket or bytes-like object."""
    return ticket if isinstance(ticket, Ticket) else Ticket(ticket, function)


def wait(ticket, timeout: float = 30.0) -> bool:
    """Wait until the registration named by `ticket` has ended and its
    release callback has returned; False if it is still live after `timeout`
    seconds. Same as Ticket(ticket).wait(timeout)."""
    return as_ticket(ticket, "vmmipc_wait").wait(timeout)
