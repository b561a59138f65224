"""Gradient parity of model.py vs transformers at TP = world size (used by tests/test_model.py).

    torchrun --standalone --nproc_per_node 2 tests/_model_tp_worker.py CKPT [CKPT ...]

Rank 0 prints `grads params=<ours>/<transformers'> max_rel_err=<x> worst=<name> logprob_diff=<y>`
per checkpoint.
"""
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import convert  # noqa: E402
import model as M  # noqa: E402
import parallel  # noqa: E402


def canonical(name):
    """Checkpoint keys and transformers' module names differ by family and version (Qwen2.5-VL
    files say `model.layers.`, `visual.`): compare on `L.` (language model) / `V.` (vision)."""
    for a, b in (("model.language_model.", "L."), ("model.visual.", "V."), ("visual.", "V."), ("model.", "L.")):
        if name.startswith(a):
            return b + name[len(a):]
    return name


def grad_errors(model, hf, seqs, pv, grid, temp=0.7):
    """Backprop one token-level loss (random weights on logprobs at `temp`, plus an entropy bonus)
    through both models. Returns ({canonical name: ||g - g_hf|| / ||g_hf||} over Megatron's tensors
    gathered to HF layout, {canonical name: g_hf}, max |logprob or entropy diff|, whether every
    replicated tensor (vision tower, norms) has the same gradient on every TP rank)."""
    model.zero_grad(set_to_none=True)
    hf.zero_grad(set_to_none=True)
    masks = [torch.arange(len(s)) >= 5 for s in seqs]
    w = torch.randn(sum(int(m.sum()) for m in masks), generator=torch.Generator().manual_seed(0))
    lp, ent = model(seqs, pv, grid, masks, temperature=temp, with_entropy=True)
    ((lp * w).sum() + 0.3 * ent.sum()).backward()
    logp = [F.log_softmax(z[:-1] / temp, -1)[m[1:]] for z, m in zip(M.hf_logits(hf, seqs, pv, grid), masks)]
    ref_lp = torch.cat([x.gather(1, s[1:][m[1:], None])[:, 0] for x, s, m in zip(logp, seqs, masks)])
    ref_ent = torch.cat([-(x.exp() * x).sum(-1) for x in logp])
    ((ref_lp * w).sum() + 0.3 * ref_ent.sum()).backward()
    ref = {canonical(n): p.grad for n, p in hf.named_parameters()}
    rel = {canonical(n): ((g - ref[canonical(n)]).norm() / ref[canonical(n)].norm()).item()
           for n, g in convert.hf_tensors(model, grad=True)}
    agree = all(torch.equal(parallel.all_reduce(p.grad.clone(), model.tp_group, torch.distributed.ReduceOp.MAX), p.grad)
                for p in model.parameters() if not getattr(p, "tensor_model_parallel", False))
    model.zero_grad(set_to_none=True)
    return rel, ref, max((lp - ref_lp).abs().max().item(), (ent - ref_ent).abs().max().item()), agree


if __name__ == "__main__":
    from transformers import AutoModelForImageTextToText
    rank, world, _ = parallel.init_distributed(int(os.environ.get("WORLD_SIZE", 1)))
    for d in sys.argv[1:]:
        hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
        rel, ref, lp_diff, agree = grad_errors(M.load_model(d), hf, *M.check_inputs(d))
        worst = max(rel, key=rel.get)
        if rank == 0:
            print(f"grads tp={world} params={len(rel)}/{len(ref)} max_rel_err={rel[worst]:.3g} worst={worst} "
                  f"logprob_diff={lp_diff:.3g} replicas_agree={agree}", flush=True)
