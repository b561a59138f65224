"""Two GRPO updates on fixed samples, for tests/test_grpo.py: run as one process or under
torchrun (TP, DP, CP or PP: --flags); rank 0 writes each update's loss, grad_norm, clipfrac and kl to <save>/updates.json
and saves the weights after them to <save>/final (decoupled lr on the split embedding and output
layer, so the sharded AdamW update is compared too).

    python tests/_grpo_worker.py CKPT GEO3K_PARQUET --save DIR [--tp N] [--ref CKPT] [--items N] [--agg sequence] [--flags='--bf16 ...']
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import convert  # noqa: E402
import data  # noqa: E402
import model as M  # noqa: E402
import optim  # noqa: E402
import chat  # noqa: E402
import rollout as R  # noqa: E402
import train_grpo as G  # noqa: E402
import trainer as T  # noqa: E402


def samples(ckpt, source):
    """Eight fixed samples: real prompts, two responses each, known advantages."""
    from transformers import AutoProcessor
    proc = AutoProcessor.from_pretrained(ckpt)
    items = []
    for k, rec in enumerate(data.load_geo3k(source)[:4]):
        prompt = chat.encode_prompt(proc, data.prompt_messages(rec), rec["images"])
        for j, reply in enumerate((data.sft_target(rec["answer"]), "I think it is \\boxed{7}.")):
            resp = proc.tokenizer.encode(reply + "<|im_end|>", add_special_tokens=False)
            s = R.Sample(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * len(resp),
                         rollout_logprobs=[0.0] * len(resp),
                         images=rec["images"], group=k)
            items.append(G.to_item(s, proc, adv=(1.0 if j == 0 else -1.0) * (k + 1) / 4))
    return items


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("source")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ref", default=None, help="reference checkpoint: adds the KL term")
    p.add_argument("--save", required=True)
    p.add_argument("--items", type=int, default=8, help="train on the first N samples (1: a DP rank gets none)")
    p.add_argument("--agg", default="token", help="--loss-agg")
    p.add_argument("--flags", default="", help="more trainer flags, e.g. --flags='--bf16 --use-distributed-optimizer'")
    a = p.parse_args()
    args = G.parse_args(["--hf-checkpoint", a.ckpt, "--prompt-data", a.source, "--save", a.save,
                         "--tensor-model-parallel-size", str(a.tp), "--max-tokens-per-gpu", "700",
                         "--entropy-coef", "0.01", "--eps-clip", "0.2", "--eps-clip-high", "0.28",
                         "--lr", "1e-3", "--decoupled-lr", "1e-2", "--loss-agg", a.agg]
                        + (["--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl"] if a.ref else [])
                        + a.flags.split())
    par, _ = T.start(args, "test")
    model = M.load_model(a.ckpt, M.ModelOptions.from_args(args), par)
    ref = M.load_model(a.ref, M.ModelOptions.from_args(args), par).eval() if a.ref else None
    opt, sched = optim.build_optimizer(model, args, 2)
    items = samples(a.ckpt, a.source)[:a.items]
    G.logprobs_into(model, items, args, "recomputed_logprobs")  # old logprobs: the model's own, then moved so the clip engages
    g = torch.Generator().manual_seed(0)
    for it in items:  # PP: only the last stage holds them
        if it.recomputed_logprobs is not None:
            it.recomputed_logprobs = it.recomputed_logprobs + 0.3 * torch.randn(len(it.old), generator=g)
    updates = []
    for update in range(2):
        stats = G.policy_loss(model, ref, par, T.dp_shard(items, par), args, measure=False)
        stats.update(optim.optimizer_step(model, opt, sched, par, args))
        updates.append({k: float(stats[k]) for k in ("loss", "grad_norm", "clipfrac", "kl")})
    if par.rank == 0:
        (Path(a.save) / "updates.json").write_text(json.dumps(updates))
    convert.save_hf(model, Path(a.save) / "final")


if __name__ == "__main__":
    main()
