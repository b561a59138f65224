"""The GRPO gradient of fixed samples, term by term, for tests/test_layouts.py, at several layouts in one launch: run
as one process or under torchrun (TP, DP, CP, EP, PP). Each LAYOUT is NAME or NAME=FLAGS (FLAGS: its parallel sizes
and options, below); for each, in turn, the worker sets up Megatron's parallel state anew, loads the model (and the
--ref model) on it, and for each term (pg: advantages only; entropy: --entropy-coef alone; kl: --kl-loss-coef alone
against --ref; gspo, with --gspo: pg under --policy-loss gspo) runs train_grpo.policy_loss over this rank's
share, sums the gradients over data-parallel ranks as the optimizer step does, and rank 0 writes every parameter's
full gradient under its HF name to <out>/NAME/<term>.safetensors, with the loss in <out>/NAME/<term>.json, and the
layout it ran (each parallel size) in <out>/NAME/layout.json. The samples come made (SAMPLES: torch.save of samples()'s
list, which tests/test_layouts.py makes once for every launch).

    python tests/_grad_worker.py CKPT SAMPLES --out DIR [--ref CKPT] LAYOUT...
    LAYOUT flags: [--tp N [--sp]] [--cp N] [--ep N] [--pp N [--first-stage-layers K]] [--freeze-vit] [--replay] [--gspo]
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from megatron.core import parallel_state as ps
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import convert  # noqa: E402
import data  # noqa: E402
import model as M  # noqa: E402
import optim  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402
import chat  # noqa: E402
import rollout as R  # noqa: E402
import train_grpo as G  # noqa: E402
import trainer as T  # noqa: E402


def samples(proc, source, n_prompts=4, group=4, seed=0):
    """n_prompts x group samples of real prompts with images: responses of 3-40 tokens drawn from the
    ordinary vocabulary, mixed advantages, engine logprobs off by a little (so the clip engages)."""
    g = torch.Generator().manual_seed(seed)
    items = []
    for k, rec in enumerate(data.load_geo3k(source)[:n_prompts]):
        prompt = chat.encode_prompt(proc, data.prompt_messages(rec), rec["images"])
        for j in range(group):
            n = int(torch.randint(3, 41, (1,), generator=g))
            resp = torch.randint(0, 151_000, (n,), generator=g).tolist()
            s = R.Sample(prompt_ids=prompt, response_ids=resp, loss_mask=[1] * n, rollout_logprobs=[0.0] * n,
                         images=rec["images"], group=k)
            items.append(G.to_item(s, proc, adv=float(torch.randn((), generator=g))))
    return items


def routes(items, tc, seed=2):
    """R3's engine routes on each item: at a random half of its tokens, for every layer, top-k distinct
    experts drawn at random (not the router's own: the replay changes the forward); -1 elsewhere."""
    g = torch.Generator().manual_seed(seed)
    for it in items:
        n, layers = len(it.ids), tc.num_hidden_layers
        r = torch.rand(n, layers, tc.num_experts, generator=g).argsort(-1)[..., :tc.num_experts_per_tok]
        r[torch.rand(n, generator=g) < 0.5] = -1
        it.routed_experts = r.to(torch.int16)


def layout_flags():
    p = argparse.ArgumentParser(prog="LAYOUT")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--cp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--first-stage-layers", default=None, help="--decoder-first-pipeline-num-layers")
    p.add_argument("--sp", action="store_true", help="--sequence-parallel (Qwen3.5 on CPU: its norms allow it)")
    p.add_argument("--freeze-vit", action="store_true")
    p.add_argument("--max-tokens-per-gpu", default="700")
    p.add_argument("--replay", action="store_true", help="R3: the routers replay fixed random experts at half the tokens")
    p.add_argument("--gspo", action="store_true", help="also the term gspo: --policy-loss gspo's "
                   "gradient (one ratio a sequence: under CP its tokens are on two ranks)")
    return p


def gradients(a, lay, base, out):
    """One layout `lay`: its parallel state, models and terms -> <out>/<term>.safetensors (rank 0)."""
    args = G.parse_args(["--hf-checkpoint", a.ckpt, "--prompt-data", a.samples, "--save", str(out / "run"),
                         "--tensor-model-parallel-size", str(lay.tp), "--expert-model-parallel-size", str(lay.ep),
                         "--context-parallel-size", str(lay.cp), "--pipeline-model-parallel-size", str(lay.pp),
                         "--max-tokens-per-gpu", lay.max_tokens_per_gpu]
                        + (["--sequence-parallel"] if lay.sp else [])
                        + (["--decoder-first-pipeline-num-layers", lay.first_stage_layers] if lay.first_stage_layers else [])
                        + (["--moe-token-dispatcher-type", "alltoall"] if lay.pp > 1 else [])  # PP's (model.py)
                        + (["--use-rollout-routing-replay"] if lay.replay else []))
    if ps.model_parallel_is_initialized():  # the last layout's groups go; this one's are made as a fresh run's
        ps.destroy_model_parallel()
    par = parallel.init_distributed(lay.tp, args.seed, ep=lay.ep, cp=lay.cp, pp=lay.pp)
    torch.manual_seed(args.seed)
    opts = M.ModelOptions.from_args(args)
    model = M.load_model(a.ckpt, dataclasses.replace(opts, freeze_vit=lay.freeze_vit), par)
    ref = M.load_model(a.ref, dataclasses.replace(opts, freeze_vit=True), par).eval() if a.ref else None
    items = [dataclasses.replace(it) for it in base]  # each layout sets their logprobs (and routes) anew
    if lay.replay:
        routes(items, model.hf_config.text_config)
    G.logprobs_into(model, items, args, "recomputed_logprobs")
    g = torch.Generator().manual_seed(1)
    for it in items:  # the engine's logprobs a little off the trainer's: some ratios clip (PP: the last stage's)
        if it.recomputed_logprobs is not None:
            it.recomputed_logprobs = it.recomputed_logprobs + 0.3 * torch.randn(len(it.old), generator=g)
    terms = {"pg": {}, "entropy": dict(entropy_coef=1.0)}
    if ref is not None:
        terms["kl"] = dict(kl_loss_coef=1.0)
    if lay.gspo:
        terms["gspo"] = dict(policy_loss="gspo")
    if par.rank == 0:
        out.mkdir(parents=True)
        sizes = {k: getattr(par, k) for k in ("tp", "cp", "pp", "ep", "dp")}
        (out / "layout.json").write_text(json.dumps(dict(sizes, sp=args.sequence_parallel)))
    for term, coefs in terms.items():
        targs = argparse.Namespace(**{**vars(args), **coefs})
        mine = [dataclasses.replace(it, adv=it.adv if term in ("pg", "gspo") else 0.0) for it in T.dp_shard(items, par)]
        model.zero_grad(set_to_none=True)
        stats = G.policy_loss(model, ref if term == "kl" else None, par, mine, targs, measure=False)
        params = [q for q in model.parameters() if q.requires_grad]
        for q in params:
            if q.grad is None:
                q.grad = torch.zeros_like(q)
        pipeline.sum_tied_grads(model, [(q, q.grad) for q in params])
        optim.allreduce_grads([(q, q.grad) for q in params], par)
        grads = {n: t.detach().cpu().contiguous() for n, t in convert.hf_tensors(model, grad=True)}
        if par.rank == 0:
            frozen = {n for n in grads if lay.freeze_vit and n.startswith(model.names.vis_prefix)}
            save_file({n: t for n, t in grads.items() if n not in frozen}, str(out / f"{term}.safetensors"))
            (out / f"{term}.json").write_text(json.dumps({k: stats[k] for k in ("loss", "entropy", "kl", "clipfrac")}))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("ckpt")
    p.add_argument("samples")
    p.add_argument("--out", required=True)
    p.add_argument("--ref", default=None, help="reference checkpoint of the KL term (default: no KL term)")
    p.add_argument("layouts", nargs="+", help="NAME or NAME=FLAGS (layout_flags)")
    a = p.parse_args()
    items = torch.load(a.samples, weights_only=False)
    for spec in a.layouts:
        name, _, flags = spec.partition("=")
        gradients(a, layout_flags().parse_args(flags.split()), items, Path(a.out) / name)


if __name__ == "__main__":
    main()
