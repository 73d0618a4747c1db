# The README's Python quick start: a parent shares 16 MiB of host memory, in
# 4096 chunks, with a child started by multiprocessing; the child writes
# into it and the parent sees the write. Prints b'HELLO'.
#
#   pip install ./python && python3 examples/python/quickstart.py

# readme-snippet: python-quickstart
import multiprocessing as mp
import vmmipc

def child(q):
    hb = q.get()                   # maps the sender's memfd: one descriptor, closed at once
    hb[:5] = b"HELLO"              # same memory as the parent's

if __name__ == "__main__":
    ctx = mp.get_context("spawn")  # or "forkserver"; "fork" raises VmmipcForkError
    hb = vmmipc.HostBuffer(4096 * 4096, chunk_size=4096)
    q = ctx.Queue()
    p = ctx.Process(target=child, args=(q,))
    p.start()
    q.put(hb)                      # registers; opens no descriptor
    p.join()
    print(bytes(hb[:5]))           # b'HELLO'
# end readme-snippet
