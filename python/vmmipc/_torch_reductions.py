"""vmmipc.torch's reductions: each kind's reduce_X and rebuild_X side by
side (a storage, a tensor over one), as torch.multiprocessing.reductions
keeps them, and reductions(), what vmmipc.torch installs
(_reductions.init_reductions registers it).

A pair changes together: what reduce_storage sends is what rebuild_storage
takes, (ticket, anchor id, offset, nbytes, exporter's device, event
handle). The sender's state (batches, run anchors: _torch_batch,
_torch_runs) and the receiver's (mapped runs, received storages, spent and
held tickets: _torch_received) are modules of their own; this module uses
both, and neither imports the other.

The reducers route by memory: CUDA tensors and storages in VMM memory that
allows POSIX-fd export go through vmmipc; other VMM memory raises
(InvalidError, saying why); CPU storages go as a DataLoader arena's blocks
(in a worker writing into one: _torch_arena) or as blocks of this process's
host arena (_torch_host, where it is wanted), rebuilt by
rebuild_cpu_storage the way rebuild_storage rebuilds a CUDA run's;
everything else (meta, the legacy cudaMalloc allocator, sparse, nested,
quantized, empty) keeps torch's own reducer. One pickle is one batch
(_torch_batch): one grant per run anchor or host chunk, one event per
device.
"""

from __future__ import annotations

import functools

from . import _errors, _mp, _reductions, _torch_arena, _torch_host
from ._mapping import confirm
from ._torch_batch import (Batch, anchor_pending, current_batch, dump_in_batch, find_run,
                           run_anchor_of)
from ._torch_env import plain_cuda, torch_module, torch_mp_reductions
from ._torch_received import (HOST, LoadUses, finish_load, holds, map_run, receive_device,
                              received, received_on_host, spent, storage_over, wait_event)
from ._torch_runs import RunAnchor, run_anchors


def reductions() -> _reductions.Reductions:
    """What vmmipc.torch installs: reduce_tensor for torch.Tensor and
    torch.nn.Parameter and reduce_storage for the UntypedStorage classes
    torch registers, after torch.multiprocessing's own (so that ours
    replace them), with each ForkingPickler.dump one batch. ImportError
    without torch."""
    torch = torch_module()
    import torch.multiprocessing  # noqa: F401 - its init_reductions first, so ours replace it
    pairs = [(torch.Tensor, reduce_tensor), (torch.nn.Parameter, reduce_tensor)]
    pairs += [(cls, reduce_storage) for cls in torch._storage_classes
              if cls.__name__ == "UntypedStorage"]
    return _reductions.Reductions(forking=tuple(pairs), dump=_dump_in_batch)


def _dump_in_batch(pickler_dump):
    return dump_in_batch(pickler_dump, finished, _torch_host.wanted)


class _LoadMark:
    """A batch's mark, named by each storage it sends and by its pickle's
    last call: it unpickles to one LoadUses per load (the memo)."""
    __slots__ = ()

    def __reduce__(self):
        return (LoadUses, ())


class _Finished:
    """What a batch's pickle is made of: obj, then finish_load(obj, mark),
    which runs after every storage in obj was rebuilt and spends the load's
    hits together."""
    __slots__ = ("obj", "mark")

    def __init__(self, obj, mark):
        self.obj, self.mark = obj, mark

    def __reduce__(self):
        return (finish_load, (self.obj, self.mark))


def finished(obj, b: Batch):
    """obj, to be pickled as batch b, wrapped so that its receiver spends
    its hits together once it is rebuilt (b's storages name b's mark)."""
    b.mark = _LoadMark()
    return _Finished(obj, b.mark)


# ---------------------------------------------------------- route by memory


def _raise(error):
    raise error


def _reduce_through(what: str, storage, torch_reduce, vmm_reduce):
    """The one decision of both reducers: torch's own reducer for memory
    that vmmipc does not hold; otherwise vmm_reduce(run, batch), guarded
    (fork destinations refused before anything is registered, errors
    carried to the receiver of a Queue)."""
    b = current_batch()
    try:
        run, pending = find_run(storage, b)
    except _errors.VmmipcError as e:  # e.g. no POSIX fd, libvmmipc or libcuda missing
        return _mp.guarded_reduce(what, functools.partial(_raise, e),
                                  b.where if b is not None else _mp.ASK)
    if run is None and pending is None:
        return torch_reduce()
    if b is None:  # reduced outside a pickle's batch: a batch of its own
        b = Batch()

    def reduce():
        anchored = run if pending is None else anchor_pending(storage, pending, b)
        return vmm_reduce(anchored, b)
    return _mp.guarded_reduce(what, reduce, b.where)


def is_vmm_tensor(obj) -> bool:
    """Whether a tensor's (or storage's) memory is CUDA VMM memory, so that
    pickling it goes through vmmipc rather than torch's CUDA IPC."""
    torch = torch_module()
    if isinstance(obj, torch.Tensor):
        if not plain_cuda(torch, obj):
            return False
        obj = obj.untyped_storage()
    try:
        run, pending = find_run(obj, None)
    except _errors.InvalidError:
        return True  # VMM memory, just not sendable
    return run is not None or pending is not None


# ------------------------------------------------------------------ storage


def reduce_storage(storage):
    """ForkingPickler reducer for torch.UntypedStorage: CUDA storages in VMM
    memory go through vmmipc, all others through torch's own reduce_storage
    (which refuses CUDA storages). Typed storages need no reducer of ours:
    torch's reduces them to their UntypedStorage."""
    own = torch_mp_reductions().reduce_storage
    arena_args = _torch_arena.storage_args(storage)
    if arena_args is not None:  # a DataLoader worker's CPU storage: an arena block
        return (_torch_arena.rebuild_storage, arena_args)
    if storage.device.type == "cpu" and storage.nbytes() > 0:
        b = current_batch()
        where = b.where if b is not None else _mp.fork_destination()
        if _torch_host.wanted(where):
            return _mp.guarded_reduce("CPU storage", lambda: _cpu_reduction(storage, b), where)
    return _reduce_through("CUDA storage", storage, lambda: own(storage),
                           lambda run, b: _storage_reduction(storage, run, b))


def _storage_reduction(storage, run: RunAnchor, b: Batch):
    return (rebuild_storage, _storage_args(storage, run, b))


def _storage_args(storage, run: RunAnchor, b: Batch) -> tuple:
    """rebuild_storage's arguments for storage (one tuple per storage and
    batch, so the pickler's memo sends it once for all its views)."""
    found = b.args.get(id(storage))
    if found is not None and found[0] is storage:
        return found[1]
    try:
        ticket = b.ticket(run, storage)
    except _errors.NotFoundError:
        # The anchor ended under us (RunAnchors retired it after this batch
        # found it, or its registration ended some other way): retire it
        # here too and anchor the storage anew.
        run_anchors.retire(run)
        run = run_anchor_of(storage, None)
        b.remember(storage, run)
        ticket = b.ticket(run, storage)
    device = storage.device.index
    args = (ticket, run.id, storage.data_ptr() - run.base, storage.nbytes(), device,
            b.event(device))
    if b.mark is not None:  # the pickle ends with finish_load: its hits wait for it
        args += (b.mark,)
    b.args[id(storage)] = (storage, args)
    return args


def _cpu_reduction(storage, b: Batch | None):
    """A CPU storage as a block of this process's host arena (moved there,
    unless it is memory this process received: that one crosses as a copy
    and keeps sharing with its own sender), granted by this pickle's batch."""
    if b is None:  # reduced outside a pickle's batch: a batch of its own
        b = Batch()
    found = b.args.get(id(storage))
    if found is not None and found[0] is storage:
        return (rebuild_cpu_storage, found[1])
    chunk, offset, kept = _torch_host.host_arena.share(storage,
                                                       move=not received_on_host(storage))
    # No bound on a chunk's pickles waiting for receivers (torch's own CPU
    # sharing has none): every small tensor of this process shares one
    # chunk, and ending the oldest would fail a Queue's backlog.
    # set_pickle_ttl bounds the wait in time.
    args = (b.ticket(chunk, kept, limit=None), chunk.id, offset, storage.nbytes())
    if b.mark is not None:  # the pickle ends with finish_load: its hits wait for it
        args += (b.mark,)
    b.args[id(storage)] = (storage, args)
    return (rebuild_cpu_storage, args)


def rebuild_cpu_storage(ticket, chunk_id, offset, nbytes, load=None):
    """Unpickling side of a CPU storage sent through a host arena: a storage
    over the sender's chunk mapped here (imported with ticket, held, on
    first use; from the import cache after that), zero-copy and writable,
    as rebuild_storage does for a CUDA run; the use is let go of when the
    storage dies."""
    return _rebuild(ticket, chunk_id, offset, nbytes, None, None, load, HOST)


def rebuild_storage(ticket, anchor_id, offset, nbytes, exporter_device, event_handle,
                    load=None):
    """Unpickling side of a VMM storage: the storage received here already
    at that place while it lives, else a view of the run mapped here (the
    run imported with ticket when it is not). A ticket's use is spent once:
    by the import, or else confirmed (with the load's other hits, by
    finish_load, when the pickle names a load); its event waited on once;
    and held while a storage whose newest ticket it is lives
    (_torch_received)."""
    return _rebuild(ticket, anchor_id, offset, nbytes, exporter_device, event_handle, load,
                    receive_device())


def _rebuild(ticket, anchor_id, offset, nbytes, exporter_device, event_handle, load, target):
    if load is not None and not isinstance(load, LoadUses):
        raise _errors.InvalidError(
            f"vmmipc.torch: a received storage names a {type(load).__name__} as its load: the "
            "pickle is damaged or not from vmmipc.torch", _errors.EINVAL, "vmmipc.torch")
    key = (anchor_id, offset, nbytes, target)
    storage = received.get(key)
    imported = False
    if storage is None:
        torch = torch_module()
        if target != HOST:
            torch.cuda.init()  # a fresh child may not have touched CUDA yet
        run, imported = map_run(torch, ticket, anchor_id, target)
        try:
            storage = received.add(key, storage_over(torch, run, offset, nbytes))
        except BaseException:
            if imported:  # the import held the use, and no storage will
                holds.let_go(ticket)
            raise
    if (not imported and load is not None
            and load.defer(ticket, storage, exporter_device, event_handle, target)):
        return storage  # a hit: finish_load spends it with the load's others
    if spent.add(ticket):  # the first storage of this ticket here
        held = imported
        try:
            if not imported:
                confirm(ticket, hold=True)
                held = True
            if event_handle is not None:  # None: the sender synchronized instead
                wait_event(storage, ticket, exporter_device, event_handle, target)
        except BaseException:
            if held:  # the use is spent and held, and no storage will let go of it
                holds.let_go(ticket)
            else:
                spent.forget(ticket)
            raise
    holds.attach(storage, ticket, storage.device.index)
    return storage


# ------------------------------------------------------------------- tensor


def reduce_tensor(tensor):
    """ForkingPickler reducer for torch.Tensor and torch.nn.Parameter: CUDA
    tensors in VMM memory that allows POSIX-fd export go through vmmipc;
    other VMM memory raises (InvalidError, saying why); every other tensor
    goes through torch's own reduce_tensor. Returns (rebuild, args) like
    torch's: a receiver calls rebuild(*args)."""
    torch = torch_module()
    own = torch_mp_reductions().reduce_tensor
    if _shared_cpu(torch, tensor):
        # The storage is pickled on its own (the pickler's memo sends it
        # once for all its views), and reduce_storage sends its block.
        return (tensor_over, (tensor.untyped_storage(),) + tensor_meta(torch, tensor))
    if not plain_cuda(torch, tensor):
        return own(tensor)
    storage = tensor.untyped_storage()
    return _reduce_through("CUDA tensor", storage, lambda: own(tensor),
                           lambda run, b: _tensor_reduction(torch, tensor, storage, run, b))


def _shared_cpu(torch, tensor) -> bool:
    """Whether tensor's storage crosses through vmmipc: a plain CPU tensor
    pickled by a DataLoader worker writing into an arena (an arena block),
    or by a process whose CPU tensors go through its host arena
    (_torch_host.wanted). A non-leaf tensor that requires grad, or one with
    a lazy conjugate or negative bit, goes to torch's reducer, which
    refuses or resolves it in torch's words; so do empty tensors."""
    if not (tensor.device.type == "cpu" and tensor.layout == torch.strided
            and not tensor.is_nested and not tensor.is_quantized
            and not (tensor.requires_grad and not tensor.is_leaf)
            and not tensor.is_conj() and not tensor.is_neg()
            and tensor.untyped_storage().nbytes() > 0):
        return False
    if _torch_arena.writing_arena() is not None:
        return True
    b = current_batch()
    return _torch_host.wanted(b.where if b is not None else _mp.fork_destination())


def _tensor_reduction(torch, tensor, storage, run: RunAnchor, b: Batch):
    # One call per tensor, its storage's arguments inline: the receiver's
    # table of received storages gives views of one storage one storage.
    # The checks first: a tensor refused must leave no grant behind.
    meta = tensor_meta(torch, tensor)
    return (rebuild_tensor, (_storage_args(storage, run, b),) + meta)


def rebuild_tensor(storage_args, cls, storage_offset, size, stride, dtype, requires_grad):
    """Unpickling side of a VMM tensor: its storage, then the view."""
    return tensor_over(rebuild_storage(*storage_args), cls, storage_offset, size, stride, dtype,
                       requires_grad)


def tensor_meta(torch, tensor) -> tuple:
    """What rebuilds tensor over its storage (tensor_over's arguments after
    the storage), checking that it can be sent."""
    if tensor.requires_grad and not tensor.is_leaf:
        raise RuntimeError("cannot send a non-leaf tensor with requires_grad=True: autograd "
                           "does not cross processes; send tensor.detach() instead")
    if tensor.is_conj() or tensor.is_neg():
        raise ValueError("cannot send a tensor with a lazy conjugate or negative bit through "
                         "vmmipc: call tensor.resolve_conj() or tensor.resolve_neg() first")
    # torch's own checks and words (named tensors: RuntimeError, "NYI: ..."):
    # names would be lost on the way.
    named = getattr(torch, "_namedtensor_internals", None)  # torch 2.15 has no named tensors
    if named is not None:
        named.check_serializing_named_tensor(tensor)
    torch.utils.hooks.warn_if_has_hooks(tensor)
    return (type(tensor), tensor.storage_offset(), tuple(tensor.size()), tuple(tensor.stride()),
            tensor.dtype, tensor.requires_grad)


def tensor_over(storage, cls, storage_offset, size, stride, dtype, requires_grad):
    """A tensor of class cls viewing storage as the sender's did."""
    torch = torch_module()
    tensor = torch.empty((0,), dtype=dtype, device=storage.device).set_(
        storage, storage_offset, size, stride)
    if issubclass(cls, torch.nn.Parameter):
        # As a constructor argument: integer Parameters must say False there.
        return cls(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)
