"""Pipeline parallelism: `tools/check.py --pipeline-model-parallel-size 2` against transformers through
the user's command (the batch as one packed micro-batch, then each sequence as one, through
megatron's 1F1B schedule), the export gathered from both stages, and the layouts refused with their
rule. SFT steps at PP2 (tied head, even and uneven splits): test_sft.py; GRPO's: test_grpo.py, and its
gradients parameter by parameter: test_layouts.py."""
import os
from pathlib import Path

import pytest

import launch
from test_model import torchrun2

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.cores
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen3_5", "qwen3_5_moe"])
def test_pp2_check_command(tiny_ckpt, arch):
    """Qwen3-VL with a tied head (the last stage's copy) and deepstack on the first stage; Qwen3.5's
    stages split between Gated DeltaNet and attention layers; Qwen3.5-MoE with the alltoall dispatcher
    (megatron's rule under PP). Qwen2.5-VL, TP2 x PP2, PP2 x CP2, PP2 x EP2: bench/RESULTS.md, "Layouts"."""
    lines = torchrun2("tools/check.py", "--hf-checkpoint", tiny_ckpt(arch, layers=4, tie=arch == "qwen3_vl"),
                      "--pipeline-model-parallel-size", "2")
    assert "export_exact=True" in lines[-2] and "tp=1 cp=1 pp=2" in lines[-2]
    assert lines[-1].startswith("max_abs_logit_diff=") and float(lines[-1].split("=")[1]) <= 1e-4


@pytest.mark.cores
def test_layouts_pp_cannot_split_are_refused_with_the_rule(tiny_ckpt):
    """2 Qwen3-VL layers with deepstack features after both: a first stage of one layer cannot hold them."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = launch.python("tools/check.py", "--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--pipeline-model-parallel-size", "2",
                      nproc=2, timeout=300, env=env)
    assert r.returncode != 0
    assert "the first stage holds 1 layers, fewer than the 2 Qwen3-VL adds deepstack features to" in r.stderr


def test_pp_export_broadcasts_from_the_device(monkeypatch):
    """Under PP each stage's tensors reach the others by dist.broadcast over the PP group, NCCL on GPUs,
    which refuses CPU tensors: the `mtp.*` tensors export reads from the file (on the CPU) go from
    par.device too. The meta device stands in for CUDA, a stage's generator and the collectives for PP2."""
    import types
    import torch
    import convert
    par = types.SimpleNamespace(pp=2, pp_rank=0, pp_group=None, device=torch.device("meta"))
    monkeypatch.setattr(convert, "_stage_tensors", lambda model, grad: iter([("mtp.fc.weight", torch.ones(2, 2))]))
    monkeypatch.setattr(convert.dist, "get_global_rank", lambda group, r: r)
    monkeypatch.setattr(convert.dist, "broadcast_object_list", lambda head, src, group: None)
    sent = []
    monkeypatch.setattr(convert.dist, "broadcast", lambda x, src, group: sent.append((src, x.device)))
    assert [n for n, _ in convert.hf_tensors(types.SimpleNamespace(par=par))] == ["mtp.fc.weight"]
    assert sent == [(0, torch.device("meta"))]


def test_expert_load_adds_each_layers_counts_to_its_own(monkeypatch):
    """Uneven PP (3 + 1 MoE layers): stage 0 routes layers 0-2, stage 1 layer 3. Each counts its layers
    in their rows of one (4 layers, experts) table, so the all-reduce over every rank adds tables of one
    shape (NCCL checks no sizes: 3 x E elements against E hangs or reads garbage) and each layer's
    share comes from its own tokens."""
    import types
    import torch
    import routing
    import trainer as T

    class TopKRouter(torch.nn.Module):  # Megatron's, as the counter's hook sees it: -> (probs, routing_map)
        def forward(self, routing_map):
            return None, routing_map

    def stage(first, n):  # layer L sends L + 1 tokens to expert 0 and one to expert 1
        lm = torch.nn.Module()
        lm.decoder = torch.nn.Module()
        lm.decoder.layers = torch.nn.ModuleList(torch.nn.Module() for _ in range(n))
        for layer in lm.decoder.layers:
            layer.mlp = torch.nn.Module()
            layer.mlp.router = TopKRouter()
        counter = routing.RouteCounter(lm, first, 4)
        for i, layer in enumerate(lm.decoder.layers):
            layer.mlp.router(torch.eye(2, dtype=torch.bool)[[0] * (first + i + 1) + [1]])
        return counter.take()
    loads = [stage(0, 3), stage(3, 1)]
    monkeypatch.setattr(T.parallel, "all_reduce", lambda t, group: loads[0] + loads[1])
    got = T.expert_load(types.SimpleNamespace(expert_load=lambda: loads[0]))
    share = sum((L + 1) / (L + 2) for L in range(4)) / 4  # expert 0's, mean over the layers
    assert got["expert_load"] == [round(share, 4), round(1 - share, 4)]


def test_a_moe_rank_that_ran_no_forward_still_joins_the_expert_load_reduce(monkeypatch):
    """MoE, DP > 1: a rank with no items (a short last SFT batch, fewer GRPO samples than ranks) ran no forward,
    so its routers counted nothing; its table is zeros of the one shape, and it joins the all-reduce the other
    ranks run (skipping it would hang them). A dense model has no table on any rank."""
    import types
    import torch
    import model as M
    import trainer as T
    calls = []

    def all_reduce(t, group):  # the other rank's counts: layer 1 sent 3 tokens to expert 0, 1 to expert 2
        calls.append(tuple(t.shape))
        return t + torch.tensor([[0.0] * 4, [3, 0, 1, 0]], dtype=t.dtype)
    monkeypatch.setattr(T.parallel, "all_reduce", all_reduce)
    for experts, want in ((4, {"expert_load": [0.75, 0, 0.25, 0], "expert_load_max": 3.0}), (None, {})):
        config = types.SimpleNamespace(num_layers=2, num_moe_experts=experts)
        idle = types.SimpleNamespace(language_model=types.SimpleNamespace(config=config), par=types.SimpleNamespace(
            device="cpu"), routes=types.SimpleNamespace(take=lambda: None))  # take: nothing counted
        assert T.expert_load(types.SimpleNamespace(expert_load=lambda: M.MegatronVLM.expert_load(idle))) == want
    assert calls == [(2, 4)]
