"""Pipeline parallelism: `model.py check --pipeline-model-parallel-size 2` against transformers through
the user's command (the batch as one packed micro-batch, then each sequence as one, through
megatron's 1F1B schedule), the export gathered from both stages, and the layouts refused with their
rule. SFT steps at PP2 (tied head, even and uneven splits): test_sft.py; GRPO's: test_grpo.py, and its
gradients parameter by parameter: test_layouts.py."""
import os
import sys
from pathlib import Path

import pytest

import launch
from test_model import torchrun2

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def test_pp2_check_command(tiny_ckpt, arch):
    """Qwen3-VL with a tied head (the last stage's copy) and deepstack on the first stage; Qwen3.5's
    stages split between Gated DeltaNet and attention layers; Qwen3.5-MoE with the alltoall dispatcher
    (megatron's rule under PP). Qwen2.5-VL, TP2 x PP2, PP2 x CP2, PP2 x EP2: bench/RESULTS.md, "Layouts"."""
    lines = torchrun2("model.py", "check", "--hf-checkpoint", tiny_ckpt(arch, layers=4, tie=arch == "qwen3_vl"),
                      "--pipeline-model-parallel-size", "2")
    assert "export_exact=True" in lines[-2] and "tp=1 cp=1 pp=2" in lines[-2]
    assert lines[-1].startswith("max_abs_logit_diff=") and float(lines[-1].split("=")[1]) <= 1e-4


def test_layouts_pp_cannot_split_are_refused_with_the_rule(tiny_ckpt):
    """2 Qwen3-VL layers with deepstack features after both: a first stage of one layer cannot hold them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = launch.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "model.py", "check", "--hf-checkpoint", str(tiny_ckpt("qwen3_vl")),
                    "--pipeline-model-parallel-size", "2"], timeout=300, env=env)
    assert r.returncode != 0
    assert "the first stage holds 1 layers, fewer than the 2 Qwen3-VL adds deepstack features to" in r.stderr

