"""vmmipc.confirm_many (vmmipc.h, vmmipc_confirm_many): many tickets'
uses spent with one connection per exporter, each one's outcome its own."""

import fcntl
import os
import threading
import time

import vmmipc

SIZE = 1 << 20


def test_confirm_many_holds_each_and_reports_each():
    fd = os.memfd_create("test-confirm-many", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, SIZE)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    anchor = vmmipc.register_host_file(fd, SIZE, SIZE, uses=0)
    os.close(fd)
    m = vmmipc.import_stream(anchor)  # the memory is mapped here: the grants need no import
    try:
        released = [threading.Event() for _ in range(20)]
        grants = [vmmipc.register_again(anchor, uses=1, hold=True, release=r.set)
                  for r in released]
        vmmipc.unregister(grants[4])
        got = vmmipc.confirm_many(grants, hold=True)
        assert isinstance(got[4], vmmipc.NotFoundError), got[4]
        assert all(e is None for i, e in enumerate(got) if i != 4), got
        assert vmmipc.holds() == 19
        assert vmmipc.cache_info().holds == 19
        assert not any(r.is_set() for i, r in enumerate(released) if i != 4)
        for i, g in enumerate(grants):
            if i != 4:
                vmmipc.release(g)
        deadline = time.monotonic() + 10
        while vmmipc.holds() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert vmmipc.holds() == 0
        assert all(r.wait(5) for r in released)
        assert vmmipc.confirm_many([]) == []
    finally:
        m.close()
        vmmipc.unregister(anchor)
