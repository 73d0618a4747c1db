"""Datasets and collate functions for test_dataloader.py, in a module of their
own so that spawn and forkserver workers can import them."""

import os
import time

import torch
from torch.utils.data import Dataset


class Mixed(Dataset):
    """Samples of every kind default_collate takes: tensors (two dtypes, one
    empty), ints, floats, strings, nested dicts and lists, numpy arrays."""

    def __init__(self, n: int = 48):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import numpy as np
        return {"x": torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * i,
                "idx": i, "w": float(i) / 2, "name": f"s{i}",
                "nested": {"y": torch.full((5,), i, dtype=torch.int64), "tags": [i, i + 1]},
                "empty": torch.zeros(0, 3),
                "np": np.full((2,), i, dtype=np.int16)}


def check_mixed(batch, first: int, size: int) -> None:
    """Every byte of a Mixed batch of samples first..first+size-1."""
    ids = list(range(first, first + size))
    want_x = torch.stack([torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * i
                          for i in ids])
    assert torch.equal(batch["x"], want_x)
    assert batch["idx"].tolist() == ids and batch["w"].tolist() == [i / 2 for i in ids]
    assert batch["name"] == [f"s{i}" for i in ids]
    assert torch.equal(batch["nested"]["y"], torch.tensor(ids).view(-1, 1).expand(-1, 5))
    assert [t.tolist() for t in batch["nested"]["tags"]] == [ids, [i + 1 for i in ids]]
    assert batch["empty"].shape == (size, 0, 3)
    assert batch["np"].dtype == torch.int16 and batch["np"][:, 0].tolist() == ids


class Five(Dataset):
    """The issue's failure case: 5 tensors of 16 floats per sample."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return tuple(torch.full((16,), float(i + k)) for k in range(5))


class Slow(Dataset):
    """Samples that take a while: a worker can be killed mid-epoch."""

    def __len__(self):
        return 400

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.full((64,), float(i))


def views_collate(batch):
    """A custom collate returning two views of one storage and the pid."""
    x = torch.stack(batch)
    return x, x[1:], os.getpid()


def non_leaf_collate(batch):
    x = torch.stack(batch).requires_grad_()
    return x * 2


def fill_views(q, done):
    """torch's fd_sharing / fs_sharing child: fill [x, x[:, 1]] in place."""
    import vmmipc.torch  # noqa: F401 - installed in every process
    x, col = q.get()
    x.fill_(1)
    col.fill_(2)
    done.set()


def doubled(t):
    """A Pool task: a CPU tensor in, a new one out (each pickled by torch)."""
    import vmmipc.torch  # noqa: F401 - installed in every process
    return t * 2


def fill_inherited(t, value):
    """torch's inherit_tensor: the child fills the tensor it inherited."""
    t.fill_(value)
