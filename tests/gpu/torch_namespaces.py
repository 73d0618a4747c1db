"""A vmmipc.torch state dict between two processes that share nothing but a
pipe, the socket directory and the GPU: run_namespaces.sh starts each in a
container of its own (with a /dev/shm of its own, as pods have), as

    python3 tests/gpu/torch_namespaces.py send DONE_FIFO | python3 tests/gpu/torch_namespaces.py receive DONE_FIFO

The sender shares a Linear(4096, 4096)'s state dict with
vmmipc.torch.share_tensors and prints the bytes (hex) and what the model
computes for a fixed input; the receiver opens them with open_tensors (zero
copy, on the exporter's GPU), computes the same from the received tensors,
compares, and writes "done" to DONE_FIFO, which the sender waits for (it
must keep its tensors alive until then). Exit status 0 when they match.
"""

import os
import sys

import _gpu_helpers  # noqa: F401  (paths: the checkout's vmmipc and build/)

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch  # noqa: E402

import vmmipc.torch  # noqa: E402

SIZE = 4096


def fixed_input():
    g = torch.Generator().manual_seed(1)
    return torch.randn(64, SIZE, generator=g).cuda()


def sums(weight, y):
    return weight.double().sum().item(), y.double().sum().item(), y.double().abs().sum().item()


def send(done_fifo):
    torch.manual_seed(0)
    model = torch.nn.Linear(SIZE, SIZE).cuda()
    y = model(fixed_input())
    blob = vmmipc.torch.share_tensors(model.state_dict())
    print("blob", blob.hex(), flush=True)
    print("expect", *sums(model.weight, y), flush=True)
    with open(done_fifo) as f:  # keep the tensors alive until the receiver has them
        return 0 if f.readline().strip() == "done" else 1


def receive(done_fifo):
    lines = dict(sys.stdin.readline().rstrip("\n").split(" ", 1) for _ in range(2))  # blob, expect
    try:
        state = vmmipc.torch.open_tensors(bytes.fromhex(lines["blob"]))
        y = torch.nn.functional.linear(fixed_input(), state["weight"], state["bias"])
        got = sums(state["weight"], y)
        want = tuple(float(v) for v in lines["expect"].split())
        ok = all(abs(g - w) <= 1e-6 * max(1.0, abs(w)) for g, w in zip(got, want))
        print(f"torch_namespaces: {len(state)} tensors opened on {state['weight'].device}; the "
              f"received model's output {'matches' if ok else 'DIFFERS from'} the sender's "
              f"(weight sum, output sum, output |sum|: {got} against {want})", flush=True)
        del state, y
        return 0 if ok else 1
    finally:
        try:  # the sender waits there, unless it has died (then nobody reads)
            fd = os.open(done_fifo, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"done\n")
            os.close(fd)
        except OSError as e:
            print(f"torch_namespaces: could not tell the sender ({e})", flush=True)


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("send", "receive"):
        sys.exit(__doc__)
    sys.exit((send if sys.argv[1] == "send" else receive)(sys.argv[2]))
