"""Make a virtual environment with torch, numpy and pytest for `make test-torch`, in little disk.

Usage: python torch_venv.py VENV REQUIREMENT...

PyPI's torch for Linux brings its CUDA libraries: 2.8 GiB of wheels (torch 2.15) that unpack
to 5.4 GiB. One `pip install` keeps every wheel it downloaded until it has installed them all:
8.2 GiB at the peak, and CI once ran out of disk half way through. Here pip resolves the whole
set once (`--dry-run --report`: metadata, no wheel), then installs it in batches of at most
BATCH_BYTES of wheels, without its cache and without LEFT_OUT, so the disk holds what is
installed so far plus one batch: 5.8 GiB at the peak with triton, 4.6 GiB without (4.4 GiB
installed). All three measured with `df` every second on this project's CI kind, 2026-12-06,
torch 2.15.

Exit status: 0 made; 3 not made because the disk is too small (the reason is printed, and
nothing is left behind: the Makefile reports the torch tests as skipped); 1 anything else
(also removed, so that a later run starts clean).
"""

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import venv

GIB = 1 << 30
# The measured peak (above) and some room for what the tests write.
NEEDED_BYTES = int(os.environ.get("VMMIPC_TORCH_VENV_GIB", "6")) * GIB
BATCH_BYTES = 600 << 20
TOO_SMALL = 3
# Dependencies of torch that its CPU tests never load: triton is torch.compile's GPU compiler
# (1 GiB installed), imported only when something compiles.
LEFT_OUT = {"triton"}


def free_bytes(path):
    while not os.path.exists(path):
        path = os.path.dirname(path) or "."
    return shutil.disk_usage(path).free


def wheel_size(url):
    """The download's size from a HEAD request, or None where the index does not say."""
    try:
        req = urllib.request.Request(url, method="HEAD")
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.headers["Content-Length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resolve(pip, requirements):
    """[(pin, size)] of everything pip would install, from its report (no wheel downloaded)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        subprocess.run(pip + ["install", "--quiet", "--dry-run", "--ignore-installed",
                              "--report", report] + requirements, check=True)
        with open(report) as f:
            items = json.load(f)["install"]
    pins = []
    for item in items:
        meta = item["metadata"]
        if meta["name"].lower() in LEFT_OUT:
            continue
        size = wheel_size(item["download_info"]["url"])
        pins.append((f"{meta['name']}=={meta['version']}", size))
    return pins


def batches(pins):
    """Pins grouped so that each group's wheels total at most BATCH_BYTES (unknown sizes alone)."""
    group, total = [], 0
    for pin, size in sorted(pins, key=lambda p: -(p[1] or BATCH_BYTES)):
        weight = BATCH_BYTES if size is None else size
        if group and total + weight > BATCH_BYTES:
            yield group
            group, total = [], 0
        group.append(pin)
        total += weight
    if group:
        yield group


class OutOfDisk(Exception):
    pass


def install(pip, pins):
    """pip install PINS without their dependencies or pip's cache; OutOfDisk where it ran out."""
    done = subprocess.run(pip + ["install", "--quiet", "--no-deps", "--no-cache-dir"] + pins,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sys.stdout.write(done.stdout)
    if done.returncode != 0:
        failed = f"pip install {' '.join(pins)} exited with {done.returncode}"
        if "No space left on device" in done.stdout or "[Errno 28]" in done.stdout:
            raise OutOfDisk(failed)
        raise subprocess.CalledProcessError(done.returncode, failed)


def make(target, requirements):
    venv.create(target, with_pip=True)
    pip = [os.path.join(target, "bin", "python"), "-m", "pip"]
    for group in batches(resolve(pip, requirements)):
        install(pip, group)


def main():
    target, requirements = sys.argv[1], sys.argv[2:]
    free = free_bytes(target)
    if free < NEEDED_BYTES:
        print(f"torch_venv: not making {target}: torch with its CUDA libraries needs about "
              f"{NEEDED_BYTES / GIB:.0f} GiB of disk, and {free / GIB:.1f} GiB is free there")
        return TOO_SMALL
    try:
        make(target, requirements)
        return 0
    except (OutOfDisk, subprocess.CalledProcessError, OSError) as exc:
        free = free_bytes(target)
        shutil.rmtree(target, ignore_errors=True)
        print(f"torch_venv: making {target} failed ({exc}) with {free / GIB:.1f} GiB of disk "
              f"free; removed it")
        out_of_disk = isinstance(exc, OutOfDisk) or getattr(exc, "errno", None) == errno.ENOSPC
        return TOO_SMALL if out_of_disk else 1


if __name__ == "__main__":
    sys.exit(main())
