"""tests/python/torch_venv.py, which `make test-torch` uses to install torch: its batches, and
its refusal where the disk is too small (which the Makefile reports as the torch tests skipped)."""

import os
import subprocess
import sys

import torch_venv

HERE = os.path.dirname(os.path.abspath(__file__))


def test_batches_hold_at_most_batch_bytes_of_wheels():
    mib = 1 << 20
    pins = [("torch==2", 514 * mib), ("nvidia-cudnn==9", 495 * mib), ("numpy==2", 16 * mib),
            ("pytest==9", mib // 2), ("odd==1", None), ("sympy==1", 6 * mib)]
    groups = list(torch_venv.batches(pins))
    assert sorted(p for g in groups for p in g) == sorted(p for p, _ in pins)
    size = dict(pins)
    for group in groups:
        weights = [torch_venv.BATCH_BYTES if size[p] is None else size[p] for p in group]
        assert len(group) == 1 or sum(weights) <= torch_venv.BATCH_BYTES, group
    assert ["odd==1"] in groups  # a wheel of unknown size goes alone


def test_too_little_disk_makes_nothing_and_says_why(tmp_path):
    target = tmp_path / "venv"
    env = dict(os.environ, VMMIPC_TORCH_VENV_GIB="1000000")
    done = subprocess.run([sys.executable, os.path.join(HERE, "torch_venv.py"), str(target),
                           "torch"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == torch_venv.TOO_SMALL, done
    assert "needs about 1000000 GiB of disk" in done.stdout
    assert not target.exists()
