# A model allocated in vmmipc's sharing pool (1 GiB chunks), shared with a
# spawned process through vmmipc.torch: the receiver maps a handful of
# chunks instead of hundreds of torch's 20 MiB ones. The child checks every
# weight against the values it regenerates. Needs a CUDA GPU and torch; run
# on a GPU machine:
#
#   python3 examples/python/torch_sharing_pool.py
import sys

# readme-snippet: python-sharing-pool
import torch
import torch.multiprocessing as mp
import vmmipc
import vmmipc.torch

def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(16)]).cuda()

def child(q, results):
    state = q.get()                                  # views into a few mapped chunks
    want = build().state_dict()                      # same seed: the same weights
    same = all(torch.equal(state[k], want[k]) for k in want)
    results.put((same, vmmipc.cache_info().misses))  # misses: imports, one a run of chunks

if __name__ == "__main__":
    with vmmipc.torch.sharing_pool() as pool:        # 1 GiB chunks on the current GPU
        model = build()                              # 1 GiB of weights in 2 chunks
    ctx = mp.get_context("spawn")
    q, results = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=child, args=(q, results))
    p.start()
    q.put(model.state_dict())                        # may be freed now: the child holds it
    same, imports = results.get()
    p.join()
    print(f"{pool.info().mapped_bytes >> 20} MiB in {pool.info().mapped_bytes // pool.chunk_size} "
          f"chunks; the child imported {imports} time(s); weights equal: {same}")
# end readme-snippet
    sys.exit(0 if same and p.exitcode == 0 else 1)
