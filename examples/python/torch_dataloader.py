# torch's DataLoader with its CPU batches built in memory the main process
# owns and crossing through vmmipc: no descriptor per batch, nothing in
# /dev/shm. Runs on the CPU; needs torch:
#
#   python3 examples/python/torch_dataloader.py

# readme-snippet: python-dataloader
import torch
from torch.utils.data import DataLoader, Dataset
import vmmipc.torch


class Squares(Dataset):                     # any Dataset
    def __len__(self):
        return 256

    def __getitem__(self, i):
        return torch.full((64,), float(i * i)), i


def make_loader():
    return DataLoader(Squares(), batch_size=64, num_workers=4,
                      **vmmipc.torch.loader_options())
# end readme-snippet


if __name__ == "__main__":
    loader = make_loader()
    for epoch in range(2):
        for values, index in loader:
            assert torch.equal(values[:, 0], (index * index).float()), "a batch's values"
    print("torch_dataloader: 2 epochs, every batch's values checked;", vmmipc.torch.arena_info())
