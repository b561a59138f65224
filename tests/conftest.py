"""Shared fixtures: tiny random Qwen-VL checkpoints (built once a session, offline) and the
ten real geo3k problems in ../shared/geo3k_real."""
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process: the tiny models' matmuls are far slower with two threads on a
# 2-core machine that also runs torchrun workers (and subprocesses inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GEO3K_REAL = ROOT.parent / "shared" / "geo3k_real"
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt("qwen3_vl") -> path of a tiny random checkpoint, built once per arch."""
    import tiny
    made = {}

    def get(arch="qwen3_vl", **sizes):
        key = (arch, tuple(sorted(sizes.items())))
        if key not in made:
            made[key] = tiny.make_tiny(tmp_path_factory.mktemp(arch), arch, **sizes)
        return made[key]
    return get


@pytest.fixture(scope="session")
def geo3k_real():
    if not GEO3K_REAL.exists():
        pytest.skip(f"{GEO3K_REAL} not found")
    return GEO3K_REAL
