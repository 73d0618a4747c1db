"""A plain confirmation in a loop: what a cache hit's round trips cost.

    python3 bench/confirmloop.py [--n N] [--warm W] [--hold]

The parent registers a 2 MiB memfd (vmmipc.register_host_file, unlimited
uses; --hold: register_again(hold=True), confirmed with hold=True) and
starts a child (a fresh interpreter, the same library) that calls
vmmipc.confirm(ticket) W times untimed, then N times, each timed on
time.perf_counter_ns from call to return. Prints one JSON line: the
library, median, 10th and 90th percentiles in microseconds.
"""

import argparse
import fcntl
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
os.environ.setdefault("VMMIPC_LIBRARY", os.path.join(ROOT, "build", "libvmmipc.so"))

import vmmipc  # noqa: E402 - after the path set-up above

CHILD = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1])
import vmmipc
t = vmmipc.Ticket(bytes.fromhex(sys.stdin.readline().strip()))
n, warm, hold = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
for _ in range(warm):
    vmmipc.confirm(t, hold=hold)
ts = []
for _ in range(n):
    a = time.perf_counter_ns()
    vmmipc.confirm(t, hold=hold)
    ts.append(time.perf_counter_ns() - a)
ts.sort()
print(json.dumps({"n": n, "median_us": ts[n // 2] / 1e3, "p10_us": ts[n // 10] / 1e3,
                  "p90_us": ts[9 * n // 10] / 1e3}))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--warm", type=int, default=100)
    ap.add_argument("--hold", action="store_true")
    a = ap.parse_args()
    size = 2 << 20
    fd = os.memfd_create("confirmloop", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, 1033, 2)  # F_ADD_SEALS, F_SEAL_SHRINK
    t = vmmipc.register_host_file(fd, size, size, uses=0)
    if a.hold:  # holds are asked for by register_again (hold=True)
        t = vmmipc.register_again(t, uses=0, hold=True)
    child = subprocess.run([sys.executable, "-c", CHILD, os.path.join(ROOT, "python"), str(a.n), str(a.warm),
                            "1" if a.hold else "0"], input=bytes(t).hex() + "\n", capture_output=True, text=True)
    if child.returncode != 0:
        sys.exit("child failed: " + child.stderr)
    r = json.loads(child.stdout)
    r.update(library=os.environ["VMMIPC_LIBRARY"], hold=a.hold)
    print(json.dumps(r))
    vmmipc.unregister(t)


if __name__ == "__main__":
    main()
