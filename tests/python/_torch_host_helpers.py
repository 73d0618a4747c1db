"""Children of test_torch_host.py, in a module of their own so that spawn
children and Pool workers can import them. Each installs vmmipc.torch, as
every process of the tests does."""

import gc
import os
import time

import torch

import vmmipc
import vmmipc.torch  # noqa: F401 - installed in every process


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def fill_views(q, back):
    """torch's fd_sharing / fs_sharing child: fill [x, x[:, 1]] in place;
    tell the parent what arrived (one storage?), its descriptors and holds
    before and after."""
    x, col = q.get()
    one = x.untyped_storage().data_ptr() == col.untyped_storage().data_ptr()
    held = vmmipc.cache_info().holds  # the uses this receiver holds
    x.fill_(1)
    col.fill_(2)
    del x, col
    gc.collect()
    deadline = time.monotonic() + 10
    while vmmipc.cache_info().holds and time.monotonic() < deadline:
        time.sleep(0.02)
    back.put((one, held, vmmipc.cache_info().holds))


def keep_many(q, back, n):
    """Receive n CPU tensors, one a put, and keep them all; each one's bytes
    checked; the descriptors after the first and at the end."""
    kept, first = [], None
    for i in range(n):
        t = q.get()
        assert t.tolist() == [float(i)] * 16, (i, t)
        kept.append(t)
        if first is None:
            first = fds()
    assert all(t.tolist() == [float(i)] * 16 for i, t in enumerate(kept))
    back.put((first, fds(), vmmipc.cache_info().holds))


def fill_and_double(args):
    """A Pool task: fill the tensor received in place, return a new one."""
    t, value = args
    t.fill_(value)
    return t * 2


def fill_inherited(t, value):
    """torch's inherit_tensor: the child fills the tensor it inherited."""
    t.fill_(value)


def echo_shape(q, back):
    t = q.get()
    back.put((tuple(t.shape), t.untyped_storage().nbytes()))


def hold_forever(q, back):
    """Receive a tensor, say so, and keep it until killed."""
    t = q.get()
    back.put((t.tolist()[:3], vmmipc.cache_info().holds))
    time.sleep(600)
