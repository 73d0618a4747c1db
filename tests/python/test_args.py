"""Every integer (and duration) handed to the library is checked in Python
first, because ctypes would wrap it silently: out of range is an
InvalidError (also a ValueError) naming the parameter, a non-integer a
TypeError naming it. Nothing is registered or mapped by a refused call."""

import math
import mmap
import os
import re
import sys

import pytest

import vmmipc

PAGE = mmap.PAGESIZE
TICKET = vmmipc.Ticket(bytes(256))  # never reaches the library: the checks come first
I32 = 2**31
U32 = 2**32
U64 = 2**64


def never(i):
    raise AssertionError("export_fn must not run")


# (call, parameter named in the error)
OUT_OF_RANGE = [
    (lambda: vmmipc.register([-4096], never), "sizes[0]=-4096"),
    (lambda: vmmipc.register([PAGE, U64 + 4096], never), f"sizes[1]={U64 + 4096}"),
    (lambda: vmmipc.register([PAGE], never, uses=-1), "uses=-1"),
    (lambda: vmmipc.register([PAGE], never, uses=U32), f"uses={U32}"),
    (lambda: vmmipc.register([PAGE], never, ttl=0), "ttl=0"),
    (lambda: vmmipc.register([PAGE], never, ttl=-1.5), "ttl=-1.5"),
    (lambda: vmmipc.register([PAGE], never, ttl=math.nan), "ttl=nan"),
    (lambda: vmmipc.register([PAGE], never, ttl=math.inf), "ttl=inf"),
    (lambda: vmmipc.register([PAGE], never, ttl=(vmmipc.MAX_TTL_MS + 1) / 1000), "ttl="),
    (lambda: vmmipc.register([PAGE], never, memory_kind=U32), "memory_kind="),
    (lambda: vmmipc.register_host_file(3 + U32, PAGE, PAGE), f"fd={3 + U32}"),
    (lambda: vmmipc.register_host_file(-I32 - 1, PAGE, PAGE), f"fd={-I32 - 1}"),
    (lambda: vmmipc.register_host_file(0, -1, PAGE), "size=-1"),
    (lambda: vmmipc.register_host_file(0, U64, PAGE), f"size={U64}"),
    (lambda: vmmipc.register_host_file(0, PAGE, U64 + PAGE), f"chunk_size={U64 + PAGE}"),
    (lambda: vmmipc.register_host_file(0, PAGE, PAGE, uses=U32), "uses="),
    (lambda: vmmipc.share(-1, PAGE), "dptr=-1"),
    (lambda: vmmipc.share(U64, PAGE), f"dptr={U64}"),
    (lambda: vmmipc.share(0, -PAGE), f"size={-PAGE}"),
    (lambda: vmmipc.share(0, PAGE, ttl=-1), "ttl=-1"),
    (lambda: vmmipc.register_cuda_handles([-1], [PAGE]), "handles[0]=-1"),
    (lambda: vmmipc.register_cuda_handles([1], [U64]), f"sizes[0]={U64}"),
    (lambda: vmmipc.register_again(TICKET, uses=-1), "uses=-1"),
    (lambda: vmmipc.register_again(TICKET, ttl=0), "ttl=0"),
    (lambda: vmmipc.open(TICKET, window=vmmipc.MAX_WINDOW + 1), "window=1025"),
    (lambda: vmmipc.open(TICKET, window=U32), f"window={U32}"),
    (lambda: vmmipc.open(TICKET, window=-1), "window=-1"),
    (lambda: vmmipc.open(TICKET, timeout=0), "timeout=0"),
    (lambda: vmmipc.open(TICKET, timeout=U32 / 1000), "timeout="),
    (lambda: vmmipc.open(TICKET, timeout=-math.inf), "timeout=-inf"),
    (lambda: vmmipc.import_stream(TICKET, -3), "device=-3"),
    (lambda: vmmipc.import_stream(TICKET, I32), f"device={I32}"),
    (lambda: vmmipc.import_stream(TICKET, 0, access_devices=[I32]), f"access_devices[0]={I32}"),
    (lambda: vmmipc.import_stream(TICKET, 0, access_devices=range(65)), "65 entries"),
    (lambda: vmmipc.import_stream(TICKET, window=2000), "window=2000"),
    (lambda: vmmipc.import_stream(TICKET, timeout=math.nan), "timeout=nan"),
    (lambda: vmmipc.wait(TICKET, -1), "timeout=-1"),
    (lambda: vmmipc.wait(TICKET, U32 / 1000), "timeout="),
    (lambda: TICKET.wait(math.nan), "timeout=nan"),
    (lambda: vmmipc.cuda_query_range(-1, PAGE), "dptr=-1"),
    (lambda: vmmipc.cuda_query_range(0, U64), f"size={U64}"),
    (lambda: vmmipc.set_cache_limit(-1), "nbytes=-1"),
    (lambda: vmmipc.set_cache_limit(U64), f"nbytes={U64}"),
    (lambda: vmmipc.strerror(U32), f"status={U32}"),
    (lambda: vmmipc.HostBuffer(0), "size=0"),
    (lambda: vmmipc.HostBuffer(-PAGE), f"size={-PAGE}"),
    (lambda: vmmipc.HostBuffer(U64), f"size={U64}"),
    (lambda: vmmipc.HostBuffer(PAGE, chunk_size=100), "chunk_size=100"),
    (lambda: vmmipc.HostBuffer(PAGE, chunk_size=PAGE + 1), f"chunk_size={PAGE + 1}"),
    (lambda: vmmipc.HostBuffer(PAGE, pickle_uses=-1), "pickle_uses=-1"),
    (lambda: vmmipc.HostBuffer(PAGE, pickle_ttl=0), "pickle_ttl=0"),
    (lambda: vmmipc.HostBuffer.from_ticket(TICKET, chunk_size=0), "chunk_size=0"),
]

NOT_AN_INTEGER = [
    (lambda: vmmipc.register([1.5 * PAGE], never), "sizes[0]"),
    (lambda: vmmipc.register([float(PAGE)], never), "sizes[0]"),  # integral floats too
    (lambda: vmmipc.register([True], never), "sizes[0]"),
    (lambda: vmmipc.register("4096", never), "sizes"),
    (lambda: vmmipc.register(PAGE, never), "sizes"),
    (lambda: vmmipc.register([PAGE], None), "export_fn"),
    (lambda: vmmipc.register([PAGE], never, release=1), "release"),
    (lambda: vmmipc.register([PAGE], never, uses=1.0), "uses"),
    (lambda: vmmipc.register([PAGE], never, uses=True), "uses"),
    (lambda: vmmipc.register([PAGE], never, uses=None), None),  # None = default: fine
    (lambda: vmmipc.register([PAGE], never, ttl="1"), "ttl"),
    (lambda: vmmipc.register([PAGE], never, ttl=True), "ttl"),
    (lambda: vmmipc.register_host_file(3.0, PAGE, PAGE), "fd"),
    (lambda: vmmipc.register_host_file("3", PAGE, PAGE), "fd"),
    (lambda: vmmipc.register_host_file(0, None, PAGE), "size"),
    (lambda: vmmipc.register_host_file(0, PAGE, float(PAGE)), "chunk_size"),
    (lambda: vmmipc.share(1.5, PAGE), "dptr"),
    (lambda: vmmipc.share(0, "4096"), "size"),
    (lambda: vmmipc.register_cuda_handles([1.0], [PAGE]), "handles[0]"),
    (lambda: vmmipc.open(TICKET, window=1.0), "window"),
    (lambda: vmmipc.open(TICKET, timeout="30"), "timeout"),
    (lambda: vmmipc.import_stream(TICKET, 0.0), "device"),
    (lambda: vmmipc.import_stream(TICKET, False), "device"),
    (lambda: vmmipc.import_stream(TICKET, 0, access_devices=[1.0]), "access_devices[0]"),
    (lambda: vmmipc.import_stream(TICKET, 0, access_devices=1), "access_devices"),
    (lambda: vmmipc.wait(TICKET, "1"), "timeout"),
    (lambda: vmmipc.set_cache_limit(1.5), "nbytes"),
    (lambda: vmmipc.strerror("-1"), "status"),
    (lambda: vmmipc.HostBuffer(1.7), "size"),
    (lambda: vmmipc.HostBuffer(float(PAGE)), "size"),
    (lambda: vmmipc.HostBuffer(PAGE, chunk_size=float(PAGE)), "chunk_size"),
    (lambda: vmmipc.HostBuffer(PAGE, pickle_uses=1.0), "pickle_uses"),
    (lambda: vmmipc.HostBuffer(PAGE, name=3), "name"),
    (lambda: vmmipc.Ticket(256), "Ticket"),
]

# Anything but a Ticket or its bytes, where a ticket goes: TypeError naming
# the function and the parameter (not "string argument without an encoding").
NOT_A_TICKET = [
    (lambda t: vmmipc.import_stream(t), "vmmipc.import_stream"),
    (lambda t: vmmipc.open(t), "vmmipc.open"),
    (lambda t: vmmipc.wait(t), "vmmipc.wait"),
    (lambda t: vmmipc.register_again(t), "vmmipc.register_again"),
    (lambda t: vmmipc.unregister(t), "vmmipc.unregister"),
    (lambda t: vmmipc.confirm(t), "vmmipc.confirm"),
    (lambda t: vmmipc.HostBuffer.from_ticket(t), "HostBuffer.from_ticket"),
    (lambda t: vmmipc.Ticket(t), "Ticket"),
]


@pytest.mark.parametrize("value", ["abc", None, 5, 1.5, ["x"]], ids=repr)
@pytest.mark.parametrize("call,function", NOT_A_TICKET, ids=[f for _, f in NOT_A_TICKET])
def test_not_a_ticket_is_type_error_naming_the_parameter(call, function, value, nothing_registered):
    with pytest.raises(TypeError) as e:
        call(value)
    msg = str(e.value)
    assert msg.startswith(f"{function}: ticket must be a vmmipc.Ticket or its 256 bytes"), msg
    assert f"not {type(value).__name__} ({value!r})" in msg, msg


def test_stream_repr_says_where_it_is(hb):
    with vmmipc.open(hb.grant()) as s:
        assert repr(s) == f"<vmmipc.Stream 0 of 16 chunks pulled, {hb.size} bytes from pid {os.getpid()}, next chunk 0>"
        next(s)
        assert "1 of 16 chunks pulled" in repr(s) and repr(s).endswith("next chunk 1>")
        for _ in s:
            pass
        assert repr(s).endswith("16 of 16 chunks pulled, %d bytes from pid %d, done>" % (hb.size, os.getpid()))


@pytest.fixture
def nothing_registered():
    live = vmmipc.live_registrations()
    yield
    assert vmmipc.live_registrations() == live, "a refused call registered something"


@pytest.mark.parametrize("call,named", OUT_OF_RANGE, ids=[n for _, n in OUT_OF_RANGE])
def test_out_of_range_is_invalid_error_naming_the_parameter(call, named, nothing_registered):
    with pytest.raises(vmmipc.InvalidError) as e:
        call()
    assert isinstance(e.value, ValueError) and e.value.status == vmmipc.EINVAL
    assert named in e.value.message, e.value.message
    assert e.value.function, "the error names the function the value was for"


@pytest.mark.parametrize("call,named", NOT_AN_INTEGER, ids=[str(n) for _, n in NOT_AN_INTEGER])
def test_not_an_integer_is_type_error_naming_the_parameter(call, named, nothing_registered):
    if named is None:
        # None means "the default" for options: it is accepted (and the
        # registration is made; end it).
        vmmipc.unregister(call())
        return
    with pytest.raises(TypeError, match=re.escape(named)):
        call()


def test_integer_like_values_are_accepted(nothing_registered):
    class Index:  # what numpy integers look like to Python
        def __init__(self, v):
            self.v = v

        def __index__(self):
            return self.v

    t = vmmipc.register([Index(PAGE)], never, uses=Index(2), ttl=Index(5))
    assert t.info().total_size == PAGE
    vmmipc.unregister(t)


def test_bounds_are_inclusive(nothing_registered):
    hb = vmmipc.HostBuffer(PAGE, pickle_uses=vmmipc._args.U32_MAX)  # the largest uses
    t = hb.grant(ttl=vmmipc.MAX_TTL_MS / 1000)               # the longest ttl
    with vmmipc.import_stream(t, window=vmmipc.MAX_WINDOW, timeout=vmmipc._args.U32_MAX / 1000,
                              access_devices=[]) as m:
        assert m.size == PAGE
    # a tiny duration rounds up to 1 ms, never down to 0 (which would mean "default")
    assert vmmipc._lib.options("test", timeout=1e-6, ttl=1e-9).timeout_ms == 1
    assert vmmipc.wait(t, 0) is False  # still live: uses = U32_MAX
    vmmipc.unregister(t)
    hb.close()


@pytest.mark.parametrize("size", [1 << 58, sys.maxsize])
def test_hostbuffer_beyond_the_address_space_is_a_memory_error(size, nothing_registered):
    with pytest.raises(vmmipc.VmmipcMemoryError) as e:
        vmmipc.HostBuffer(size)
    assert isinstance(e.value, MemoryError) and e.value.status == vmmipc.ENOMEM
    assert f"size={size}" in e.value.message and e.value.function == "HostBuffer"


def test_pickle_settings_are_checked_when_set():
    hb = vmmipc.HostBuffer(PAGE)
    with pytest.raises(vmmipc.InvalidError, match="pickle_uses=-1"):
        hb.pickle_uses = -1
    with pytest.raises(TypeError, match="pickle_ttl"):
        hb.pickle_ttl = "soon"
    hb.pickle_ttl = 0.5
    assert (hb.pickle_uses, hb.pickle_ttl) == (1, 0.5)
    hb.close()
