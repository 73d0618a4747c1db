# A model's weights on the GPU, shared with a spawned process through
# vmmipc.torch: under expandable segments (CUDA VMM memory), with no
# pidfd_getfd, which containers refuse. The child computes the model's
# output from the received tensors; the parent checks it against its own.
# Needs a CUDA GPU and torch; run on a GPU machine:
#
#   python3 examples/python/torch_state_dict.py
import sys

# readme-snippet: python-torch
import os
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch
import torch.multiprocessing as mp
import vmmipc.torch  # noqa: F401  (installs the reducers)

def child(q, results):
    state, x = q.get()                      # tensors on the sender's GPU, zero-copy
    y = torch.nn.functional.linear(x, state["weight"], state["bias"])
    results.put(y.cpu().numpy())            # plain data: this child may exit at once

if __name__ == "__main__":
    model = torch.nn.Linear(4096, 4096).cuda()
    x = torch.randn(64, 4096, device="cuda")
    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, results))
    p.start()
    q.put((model.state_dict(), x))          # may be freed now: the child holds the memory
    got = torch.from_numpy(results.get())
    p.join()
# end readme-snippet
    want = model(x).detach().cpu()
    ok = p.exitcode == 0 and torch.allclose(got, want)
    print(f"torch_state_dict: the child's output {'matches' if ok else 'DIFFERS from'} the parent's "
          f"(max difference {(got - want).abs().max().item():.3g})")
    sys.exit(0 if ok else 1)
