"""One GRPO update on fixed samples, for tests/test_grpo.py: run as one process or under
torchrun (TP or DP); prints `loss=<x> grad_norm=<y> clipfrac=<z>` on rank 0.

    python tests/_grpo_worker.py CKPT GEO3K_PARQUET --save DIR [--tp N] [--ref CKPT]
"""
import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import model as M  # noqa: E402
import rollout as R  # noqa: E402
import train_grpo as G  # noqa: E402
import trainer as T  # noqa: E402


def samples(ckpt, source):
    """Eight fixed samples: real prompts, two responses each, known advantages."""
    from transformers import AutoProcessor
    proc = AutoProcessor.from_pretrained(ckpt)
    items = []
    for k, rec in enumerate(data.load_geo3k(source)[:4]):
        prompt = R.encode_prompt(proc, data.prompt_messages(rec), rec["images"])
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
    a = p.parse_args()
    args = G.parse_args(["--hf-checkpoint", a.ckpt, "--prompt-data", a.source, "--save", a.save,
                         "--tensor-model-parallel-size", str(a.tp), "--max-tokens-per-gpu", "700",
                         "--entropy-coef", "0.01", "--eps-clip", "0.2", "--eps-clip-high", "0.28"]
                        + (["--kl-loss-coef", "0.1", "--kl-loss-type", "low_var_kl"] if a.ref else []))
    run = T.Run(args, "test")
    model = M.load_model(a.ckpt)
    ref = M.load_model(a.ref).eval() if a.ref else None
    opt, sched = T.build_optimizer(model, args, 1)
    items = samples(a.ckpt, a.source)
    G.recompute_old(model, items, args)  # old logprobs: the model's own, then moved so the clip engages
    g = torch.Generator().manual_seed(0)
    for it in items:
        it["old"] = it["old"] + 0.3 * torch.randn(len(it["old"]), generator=g)
    stats = G.policy_loss(model, ref, run, T.dp_shard(items, run), args, measure=False)
    stats.update(T.optimizer_step(model, opt, sched, run, args))
    if run.rank == 0:
        print(f"loss={stats['loss']!r} grad_norm={stats['grad_norm']!r} clipfrac={stats['clipfrac']!r} "
              f"kl={stats['kl']!r}")


if __name__ == "__main__":
    main()
