# Weight sync, as reinforcement-learning trainers do it: a model's state
# dict re-sent to an inference process after every optimizer step, four
# ways (the README's recipes): a torch.multiprocessing Queue, ForkingPickler
# bytes as SGLang's MultiprocessingSerializer makes them, vLLM's
# reduce_tensor / rebuild handles, and vmmipc.torch's bulk API. Each way
# sends the weights, updates them in place, sends again, and the engine
# checks what it got against the trainer's checksums. Needs a CUDA GPU and
# torch; run on a GPU machine:
#
#   python3 examples/python/torch_weight_sync.py
import pickle
import sys

# readme-snippet: python-weight-sync-imports
import io
import os

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
import torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

import vmmipc.torch  # noqa: F401  (installs the reducers)
# end readme-snippet


def checksum(tensors) -> float:
    return float(sum(t.double().sum() for t in tensors))


# readme-snippet: python-weight-sync-queue
def send_queue(model, q):                       # trainer, after each optimizer step
    torch.cuda.synchronize()                    # the Queue pickles on the default stream
    q.put(model.state_dict())                   # one grant per run of chunks, not per tensor


def receive_queue(q):                           # inference engine
    return q.get()                              # zero-copy; a re-send imports nothing
# end readme-snippet


# readme-snippet: python-weight-sync-sglang
def serialize(obj) -> bytes:                    # SGLang's MultiprocessingSerializer
    buf = io.BytesIO()
    ForkingPickler(buf).dump(obj)               # one pickle: one grant per run
    return buf.getvalue()


def deserialize(data: bytes):
    return ForkingPickler.loads(data)           # vmmipc must be importable here
# end readme-snippet


# readme-snippet: python-weight-sync-vllm
def handles_of(model):                          # vLLM's reduce_tensor pattern
    sd = model.state_dict()
    with vmmipc.torch.batch(sd):                # optional: one grant per run, not per tensor
        return {name: vmmipc.torch.reduce_tensor(t) for name, t in sd.items()}


def weights_from(handles):                      # in the worker: plain data in, tensors out
    return {name: rebuild(*args) for name, (rebuild, args) in handles.items()}
# end readme-snippet


# readme-snippet: python-weight-sync-bulk
def blob_of(model) -> bytes:
    return vmmipc.torch.share_tensors(model.state_dict())   # bytes for one receiver, any transport


def weights_of(blob: bytes):
    return vmmipc.torch.open_tensors(blob)      # a dict of zero-copy tensors
# end readme-snippet


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.Linear(4096, 1024)).cuda()


SEND = {"sglang": lambda m: serialize(m.state_dict()),
        "vllm": lambda m: pickle.dumps(handles_of(m)),
        "bulk": blob_of}
RECEIVE = {"sglang": deserialize, "vllm": lambda h: weights_from(pickle.loads(h)),
           "bulk": weights_of}


def engine(way, q, results):
    model = make_model()
    for _ in range(2):
        sd = receive_queue(q) if way == "queue" else RECEIVE[way](q.get())
        model.load_state_dict(sd, assign=True)
        results.put(checksum(model.state_dict().values()))


def main() -> int:
    ctx = mp.get_context("spawn")
    model = make_model()
    wrong = 0
    for way in ("queue", "sglang", "vllm", "bulk"):
        q, results = ctx.Queue(), ctx.Queue()
        p = ctx.Process(target=engine, args=(way, q, results))
        p.start()
        for _ in range(2):
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1)               # the optimizer step, in place
            torch.cuda.synchronize()
            want = checksum(model.state_dict().values())
            if way == "queue":
                send_queue(model, q)
            else:
                q.put(SEND[way](model))
            got = results.get(timeout=120)
            ok = got == want
            wrong += not ok
            print(f"{way}: engine checksum {got:.6g}, trainer's {want:.6g}: "
                  f"{'ok' if ok else 'WRONG'}")
        p.join(60)
        wrong += p.exitcode != 0
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
