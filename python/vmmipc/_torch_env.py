"""What every vmmipc.torch module shares: torch itself, imported lazily with
an error that says what is missing, which tensors vmmipc may send
(plain_cuda), and the names of CUDA's handle types for messages."""

from __future__ import annotations

POSIX_FD_HANDLE = 0x1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
HANDLE_TYPE_NAMES = {  # the Go table, cuda/handletypes.go (test_architecture.py checks it)
    0x1: "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR",
    0x2: "CU_MEM_HANDLE_TYPE_WIN32",
    0x4: "CU_MEM_HANDLE_TYPE_WIN32_KMT",
    0x8: "CU_MEM_HANDLE_TYPE_FABRIC",
}


_modules: list = []  # [torch, torch.multiprocessing.reductions] once imported


def torch_module():
    """The torch module, or an ImportError that says what is missing."""
    if _modules:
        return _modules[0]
    try:
        import torch
        import torch.multiprocessing.reductions as reductions
    except ImportError as e:
        raise ImportError("vmmipc.torch needs PyTorch (pip install torch); it could not be "
                          f"imported: {e}") from e
    _modules[:] = [torch, reductions]
    return torch


def torch_mp_reductions():
    """torch.multiprocessing.reductions: torch's own reducers, which every
    tensor and storage vmmipc does not send keeps."""
    torch_module()
    return _modules[1]


def plain_cuda(torch, tensor) -> bool:
    """Whether tensor is a CUDA tensor vmmipc may send: strided, neither
    nested nor quantized (sparse and the others keep torch's reducer)."""
    return (tensor.is_cuda and tensor.layout == torch.strided and not tensor.is_nested
            and not tensor.is_quantized)


def handle_type_names(bits: int) -> str:
    """CU_MEM_HANDLE_TYPE_* names of a handle-type bit mask, e.g.
    "CU_MEM_HANDLE_TYPE_FABRIC" for 0x8 ("none" for 0)."""
    names = [name for bit, name in sorted(HANDLE_TYPE_NAMES.items()) if bits & bit]
    unknown = bits & ~sum(HANDLE_TYPE_NAMES)
    if unknown:
        names.append(f"unknown bits {unknown:#x}")
    return " | ".join(names) or "none"
