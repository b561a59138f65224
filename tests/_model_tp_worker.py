"""Gradient parity of model.py vs transformers at TP = world size (used by tests/test_model.py).

    torchrun --standalone --nproc_per_node 2 tests/_model_tp_worker.py --out grads.json CKPT [CKPT ...]
    torchrun --standalone --nproc_per_node 4 tests/_model_tp_worker.py --out grads.json --tp 2 --ep 2 --sp CKPT   # MoE

Rank 0 prints `grads params=<ours>/<transformers'> max_rel_err=<x> worst=<name> logprob_diff=<y>
grad_norm_rel_err=<z>` per checkpoint. Every rank runs the same inputs, so with DP > 1 the trainer's
reduction (optim.allreduce_grads: DP group, experts over expert-DP) divided by DP is the reference.
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import convert  # noqa: E402
import model as M  # noqa: E402
from tools import check  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402


def canonical(name):
    """Checkpoint keys and transformers' module names differ by family and version (Qwen2.5-VL
    files say `model.layers.`, `visual.`): compare on `L.` (language model) / `V.` (vision)."""
    for a, b in (("model.language_model.", "L."), ("model.visual.", "V."), ("visual.", "V."), ("model.", "L.")):
        if name.startswith(a):
            return b + name[len(a):]
    return name


def grad_errors(model, hf, seqs, pv, grid, temp=0.7, reduce=None):
    """Backprop one token-level loss (random weights on logprobs at `temp`, plus an entropy bonus)
    through both models. Returns ({canonical name: ||g - g_hf|| / ||g_hf||} over Megatron's tensors
    gathered to HF layout, {canonical name: g_hf}, max |logprob or entropy diff|, whether every
    replicated tensor (vision tower, norms) has the same gradient on every TP rank).
    reduce(model): applied to our gradients after backward (the trainer's DP reduction)."""
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    masks = [torch.arange(len(s), device=s.device) >= 5 for s in seqs]
    w = torch.randn(sum(int(m.sum()) for m in masks), generator=torch.Generator().manual_seed(0)).to(seqs[0].device)
    lp, ent = model(seqs, pv, grid, masks, temperature=temp, with_entropy=True)
    ((lp * w).sum() + 0.3 * ent.sum()).backward()
    if reduce is not None:
        reduce(model)
    logp = [F.log_softmax(z[:-1] / temp, -1)[m[1:]] for z, m in zip(check.hf_logits(hf, seqs, pv, grid), masks)]
    ref_lp = torch.cat([x.gather(1, s[1:][m[1:], None])[:, 0] for x, s, m in zip(logp, seqs, masks)])
    ref_ent = torch.cat([-(x.exp() * x).sum(-1) for x in logp])
    ((ref_lp * w).sum() + 0.3 * ref_ent.sum()).backward()
    ref = {canonical(n): p.grad for n, p in hf.named_parameters()}
    rel = {canonical(n): ((g - ref[canonical(n)]).norm() / ref[canonical(n)].norm()).item()
           for n, g in convert.hf_tensors(model, grad=True)}
    agree = all(torch.equal(parallel.all_reduce(p.grad.clone(), model.par.tp_group, torch.distributed.ReduceOp.MAX), p.grad)
                for p in model.parameters()
                if not getattr(p, "tensor_model_parallel", False) and getattr(p, "allreduce", True))
    model.zero_grad(set_to_none=True)
    return rel, ref, max((lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item()), agree


def dp_reduce(model, run, norms):
    """optim.allreduce_grads over every parameter, / DP (each DP replica ran the same batch); the
    trainer's grad norm, and the norm of the gathered full gradients, appended to `norms`."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    optim.allreduce_grads([(p, p.grad) for p in params], run)
    for p in params:
        p.grad /= run.dp
    full = sum(g.double().pow(2).sum() for _, g in convert.hf_tensors(model, grad=True)).sqrt().item()
    norms.append((optim.grad_norm_and_clip([(p, p.grad) for p in params], run, 0), full))


if __name__ == "__main__":
    from transformers import AutoModelForImageTextToText
    p = argparse.ArgumentParser()
    p.add_argument("ckpts", nargs="+")
    p.add_argument("--tp", type=int, default=None, help="default: the world size")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--sp", action="store_true")
    p.add_argument("--out", required=True, help="rank 0 writes a JSON list here, one dict a checkpoint")
    a = p.parse_args()
    rows = []
    tp = a.tp or int(os.environ.get("WORLD_SIZE", 1))
    par = parallel.init_distributed(tp, ep=a.ep)
    rank, world, device = par.rank, par.world, par.device
    for d in a.ckpts:
        hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
        norms = []
        model = M.load_model(d, M.ModelOptions(sequence_parallel=a.sp), par)
        rel, ref, lp_diff, agree = grad_errors(model, hf, *check.check_inputs(d), reduce=lambda m: dp_reduce(m, par, norms))
        decay = {n: e for n, e in rel.items() if n.endswith(("A_log", "dt_bias"))}  # Qwen3.5's GDN decay:
        rel = {n: e for n, e in rel.items() if n not in decay}  # ill-conditioned in fp32 (tests/test_qwen3_5.py)
        worst = max(rel, key=rel.get)
        ours, full = norms[0]
        rows.append(dict(tp=tp, ep=a.ep, sp=a.sp, params=len(rel) + len(decay), hf_params=len(ref),
                         max_rel_err=float(rel[worst]), worst=worst, decay_rel_err=float(max(decay.values(), default=0.0)),
                         logprob_diff=float(lp_diff), replicas_agree=bool(agree), grad_norm_rel_err=abs(ours - full) / full))
        if rank == 0:
            print(rows[-1], flush=True)
    if rank == 0:
        Path(a.out).write_text(json.dumps(rows))
