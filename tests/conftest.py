"""Shared fixtures: tiny random Qwen-VL checkpoints (built once a session, offline), the ten
real geo3k problems shipped in tests/data/geo3k_real (README there names their source), and the
rollout tests' tiny model, processor and synthetic problems."""
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
GEO3K_REAL = ROOT / "tests" / "data" / "geo3k_real"
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt("qwen3_vl") -> path of a tiny random checkpoint, built once per arch."""
    from tools import tiny
    made = {}

    def get(arch="qwen3_vl", **sizes):
        key = (arch, tuple(sorted(sizes.items())))
        if key not in made:
            made[key] = tiny.make_tiny(tmp_path_factory.mktemp(arch), arch, **sizes)
        return made[key]
    return get


@pytest.fixture(scope="session")
def geo3k_real():
    return GEO3K_REAL


# Shared by the rollout and SGLang-engine tests: a tiny Qwen3-VL, its processor, four synthetic problems.
@pytest.fixture(scope="session")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_vl")


@pytest.fixture(scope="session")
def processor(ckpt):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="session")
def records(tmp_path_factory):
    import data
    from tools import synth
    out = synth.write_synth(tmp_path_factory.mktemp("synth"), n=4, n_test=1, seed=0)
    return data.load_geo3k(out, "train")


def grpo_args(**kw):
    """train_grpo's own flags and defaults (parse_args: one source of defaults) with any `kw` on top."""
    import train_grpo
    args = train_grpo.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x"])
    for k, v in kw.items():
        if not hasattr(args, k):
            raise AttributeError(f"{k} is not a train_grpo flag")
        setattr(args, k, v)
    return args


def rollout_args(**kw):
    """The rollout's settings as the trainer builds them (rollout.settings of its flags), with the rollout tests'
    small budgets and any `kw` on top. rollout_batch_size None: every record given."""
    import rollout
    small = dict(n_samples_per_prompt=2, rollout_max_response_len=10, rollout_temperature=0.8, rollout_batch_size=None)
    return rollout.settings(grpo_args(**{**small, **kw}))
