"""vmmipc.torch's blobs, for frameworks that carry handles themselves (HTTP,
ZMQ, Ray): share_tensors and open_tensors side by side.

A blob is BLOB_MAGIC, then a pickle of (kind, names, tensors) whose tensors
are reduced by reduce_tensor (_torch_reductions), as one batch, ending with
finish_load (the receiver's hits confirmed together). Opening one admits
nothing but calls of the two rebuild functions, LoadUses and finish_load,
Ticket, torch's tensor classes and dtypes, so a blob from the network runs
no other code.
"""

from __future__ import annotations

import io
import pickle

from . import _errors
from ._ticket import Ticket
from ._torch_batch import batch, run_anchor_of
from ._torch_env import plain_cuda, torch_module
from ._torch_received import LoadUses, finish_load, receiving_on
from ._torch_reductions import (finished, rebuild_storage, rebuild_tensor, reduce_storage,
                                reduce_tensor)

BLOB_MAGIC = b"vmmipc.torch/1\n"  # then a pickle _BlobUnpickler reads


class _PlainPickler(pickle.Pickler):
    """Pickles share_tensors' blob: tensors through reduce_tensor, and the
    rest (names, dtypes as strings) as plain data."""

    def reducer_override(self, obj):
        torch = torch_module()
        if isinstance(obj, torch.Tensor):
            return reduce_tensor(obj)
        if isinstance(obj, torch.UntypedStorage):
            return reduce_storage(obj)
        return NotImplemented


def share_tensors(named_tensors) -> bytes:
    """Share many CUDA tensors at once, for frameworks that carry handles
    themselves (HTTP, ZMQ, Ray): returns plain bytes for ONE receiver, who
    passes them to open_tensors. named_tensors: a dict name -> tensor (a
    state dict) or a list of (name, tensor) pairs. Storages are anchored
    together (one anchor per run of chunks), with one grant per anchor and
    one event per device; each tensor keeps its storage offset, shape,
    stride, dtype, requires_grad and Parameter-ness, and tensors sharing a
    storage arrive sharing one. The tensors stay alive here, out of torch's
    allocator's reach, until the receiver has let go of every tensor it
    opened from them, or has died (torch.multiprocessing's rule, as for a
    Queue); a blob never opened keeps them until set_pickle_ttl's time
    passes."""
    torch = torch_module()
    if isinstance(named_tensors, dict):
        items, kind = list(named_tensors.items()), "dict"
    else:
        items, kind = list(named_tensors), "list"
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise TypeError("share_tensors takes a dict name -> tensor or a list of (name, "
                            f"tensor) pairs; item {i} is {type(item).__name__}")
    tensors = [t for _, t in items]
    with batch(tensors) as b:
        for name, t in items:
            if not plain_cuda(torch, t) or run_anchor_of(t.untyped_storage(), b) is None:
                raise _errors.InvalidError(
                    f"share_tensors: {name!r} is a {t.device} tensor outside CUDA VMM memory "
                    "(CPU, the legacy cudaMalloc allocator, sparse or nested): share_tensors "
                    "sends CUDA tensors of expandable segments (PYTORCH_CUDA_ALLOC_CONF="
                    "expandable_segments:True) or other VMM memory only", _errors.EINVAL,
                    "vmmipc.torch.share_tensors")
        buf = io.BytesIO()
        buf.write(BLOB_MAGIC)
        _PlainPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(
            finished((kind, [name for name, _ in items], tensors), b))
        return buf.getvalue()


class _BlobUnpickler(pickle.Unpickler):
    """share_tensors' blob holds plain data and calls of our two rebuild
    functions, LoadUses and finish_load only: anything else is refused, so opening a blob from the
    network runs no other code."""

    _CLASSES = {("torch", "Tensor"), ("torch._tensor", "Tensor"),
                ("torch.nn.parameter", "Parameter")}
    _REBUILDERS = {(f.__module__, f.__name__): f
                   for f in (rebuild_storage, rebuild_tensor, finish_load)}

    def __init__(self, file):
        super().__init__(file)
        self.loads: list = []  # the LoadUses made: each must be finished by the blob's end

    def _load_uses(self):
        load = LoadUses()
        self.loads.append(load)
        return load

    def find_class(self, module, name):
        if (module, name) == (LoadUses.__module__, LoadUses.__name__):
            return self._load_uses
        rebuild = self._REBUILDERS.get((module, name))
        if rebuild is not None:
            return rebuild
        if (module, name) == (Ticket.__module__, "Ticket"):
            return Ticket
        if (module, name) in self._CLASSES or module == "torch":
            torch = torch_module()
            found = super().find_class(module, name)
            if (module, name) in self._CLASSES or isinstance(found, torch.dtype):
                return found
        raise pickle.UnpicklingError(f"a vmmipc.torch blob may not name {module}.{name}")


def open_tensors(blob: bytes, device: int | None = None):
    """Open what share_tensors returned, in another process: a dict name ->
    tensor (or a list of (name, tensor) pairs, as it was shared) of
    zero-copy CUDA tensors, valid until this process drops them. device:
    None maps onto the exporter's GPU (by UUID); an ordinal maps there."""
    if not isinstance(blob, (bytes, bytearray, memoryview)):
        raise TypeError(f"open_tensors takes the bytes share_tensors returned, not "
                        f"{type(blob).__name__}")
    blob = bytes(blob)
    if not blob.startswith(BLOB_MAGIC):
        raise ValueError("not a vmmipc.torch blob (share_tensors makes them; this one has "
                         f"another header: {blob[:16]!r})")
    with receiving_on(device, "vmmipc.torch.open_tensors"):
        unpickler = _BlobUnpickler(io.BytesIO(blob[len(BLOB_MAGIC):]))
        kind, names, tensors = unpickler.load()
    if not all(load.finished for load in unpickler.loads):
        # Its hits were never confirmed: nothing checked their tickets or
        # holds their memory (the storages go with this error).
        raise _errors.InvalidError(
            "open_tensors: the blob does not end with the finish its storages name, so they "
            "were never confirmed with their sender: the blob is damaged or not from "
            "share_tensors", _errors.EINVAL, "vmmipc.torch.open_tensors")
    pairs = list(zip(names, tensors))
    return dict(pairs) if kind == "dict" else pairs
