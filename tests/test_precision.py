"""--bf16 (fp32 master weights, optim.MasterAdamW on CPU), --use-distributed-optimizer (Adam
states sharded over DP) and --recompute-*: each checked against the plain fp32 path."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model as M
import optim
import parallel
import sft as S

ROOT = Path(__file__).resolve().parents[1]
# bf16 keeps 8 mantissa bits: a relative rounding of up to 2^-9 per operation. Through the tiny
# model (vision tower + two layers) the logits moved by 7.9e-3 of their largest magnitude
# (measured); the bound is 2e-2, 2.5x that and well under the 1.0 a wrong computation gives.
LOGIT_BOUND = 2e-2
GRPO_LOSS_BOUND = 1e-2  # absolute, on GRPO losses of ~0.1-1


def inputs(ckpt):
    seqs, pv, grid = M.check_inputs(ckpt)
    masks = [torch.arange(len(s)) > len(s) // 2 for s in seqs]  # score the second half of each
    return seqs, pv, grid, masks


def loss_of(model, batch):
    seqs, pv, grid, masks = batch
    lp, _ = model(seqs, pv, grid, masks)
    return -lp.mean()


def args_for(ckpt, *flags):
    return S.parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", "x", "--save", "x", "--lr", "1e-3",
                         "--decoupled-lr", "1e-2", "--clip-grad", "1.0", *flags])


class Run:  # what optimizer_step reads of trainer.Run, for a one-process world
    def __init__(self):
        parallel.init_distributed()
        self.device, self.dp, self.tp = torch.device("cpu"), 1, 1
        self.dp_group, self.tp_group = parallel.dp_group(), parallel.tp_group()


def one_update(ckpt, *flags):
    """(loss before, loss after) one optimizer step on the same batch."""
    args = args_for(ckpt, *flags)
    model, batch = M.load_model(ckpt, options=vars(args)), inputs(ckpt)
    opt, sched = optim.build_optimizer(model, args, 10)
    before = loss_of(model, batch)
    before.backward()
    optim.optimizer_step(model, opt, sched, Run(), args)
    with torch.no_grad():
        return before.item(), loss_of(model, batch).item(), model


def test_bf16_logits_within_bound_of_fp32(tiny_ckpt):
    ck = tiny_ckpt("qwen3_vl")
    seqs, pv, grid, _ = inputs(ck)
    with torch.no_grad():
        f32 = M.load_model(ck).logits(seqs, pv, grid)
        b16_model = M.load_model(ck, options={"bf16": True})
        b16 = b16_model.logits(seqs, pv, grid)
    assert next(b16_model.parameters()).dtype == torch.bfloat16
    assert b16_model.inv_freq.dtype == torch.float32  # RoPE angles stay fp32
    scale = max(x.abs().max().item() for x in f32)
    diff = max((x - y).abs().max().item() for x, y in zip(f32, b16))
    print(f"bf16 vs fp32 logits: max diff {diff:.3g}, relative {diff / scale:.3g}")
    assert 0 < diff <= LOGIT_BOUND * scale


def test_bf16_update_equals_fp32_within_bf16_bounds(tiny_ckpt):
    """One SFT step at TP=1: bf16 with fp32 masters and fp32 grads lands where fp32 does."""
    ck = tiny_ckpt("qwen3_vl")
    b0, b1, _ = one_update(ck)
    h0, h1, model = one_update(ck, "--bf16", "--accumulate-allreduce-grads-in-fp32")
    print(f"fp32 loss {b0:.5f} -> {b1:.5f}; bf16 {h0:.5f} -> {h1:.5f}")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert b0 - b1 > 0.05  # the step moved the loss far more than the tolerance below
    assert abs(h0 - b0) < 0.01 * b0 and abs(h1 - b1) < 0.01 * b1


def test_master_adamw_at_dp1_is_plain_adamw(tiny_ckpt):
    """The CPU distributed-optimizer path (fp32 masters, one shard at DP=1) takes torch AdamW's step."""
    ck = tiny_ckpt("qwen3_vl")
    _, plain, m1 = one_update(ck)
    _, sharded, m2 = one_update(ck, "--use-distributed-optimizer")
    assert abs(plain - sharded) < 1e-6
    for (n, p), q in zip(m1.named_parameters(), m2.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0), n


@pytest.mark.parametrize("flags", [["--recompute-granularity", "full"],
                                   ["--recompute-granularity", "full", "--recompute-num-layers", "2"],
                                   ["--recompute-granularity", "full", "--recompute-method", "block"]])
def test_recompute_gives_the_same_gradients(tiny_ckpt, flags):
    ck = tiny_ckpt("qwen3_vl")
    batch = inputs(ck)
    grads = []
    for opts in (vars(args_for(ck)), vars(args_for(ck, *flags))):
        model = M.load_model(ck, options=opts)
        loss_of(model, batch).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], atol=1e-6, rtol=0), n


def test_selective_recompute_on_cpu_is_a_clear_error(tiny_ckpt):
    ck = tiny_ckpt("qwen3_vl")
    with pytest.raises(SystemExit, match="selective.*needs CUDA"):
        M.load_model(ck, options={"recompute_granularity": "selective"})


def test_recompute_plan():
    m = M.MegatronVLM.__new__(M.MegatronVLM)
    torch.nn.Module.__init__(m)
    m.language_model = torch.nn.Module()
    m.language_model.decoder = torch.nn.Module()
    m.language_model.decoder.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(5)])
    for recompute, want in [((None, "uniform", 1), [(0, 5, False)]),
                            (("selective", "uniform", 1), [(0, 5, False)]),
                            (("full", "uniform", 2), [(0, 2, True), (2, 4, True), (4, 5, True)]),
                            (("full", "block", 2), [(0, 1, True), (1, 2, True), (2, 5, False)])]:
        m.recompute = recompute
        assert m._chunks() == want, recompute

