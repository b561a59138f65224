"""train_grpo.py: GRPO on geo3k, single-turn or multi-turn with tools.

    # one process, CPU, tiny model (what run.sh does)
    python train_grpo.py --hf-checkpoint runs/demo/sft/iter_0000100 --prompt-data runs/demo/data \\
        --save runs/demo/grpo --rollout-batch-size 8 --n-samples-per-prompt 8 --lr 1e-4
    # one node, 4 GPUs shared by training and SGLang (released while training); TP x DP = 4
    torchrun --nproc_per_node 4 train_grpo.py --rollout-engine sglang --colocate --tensor-model-parallel-size 2 ...
    # one node: train on 6 GPUs, SGLang on the other 2
    torchrun --nproc_per_node 6 train_grpo.py --rollout-engine sglang --rollout-num-gpus 2 ...
    # several nodes: torchrun --nnodes 2 --node-rank $R --master-addr $HOST --nproc_per_node 8 ...
    # multi-turn with the calc_score and crop tools
    python train_grpo.py ... --max-turns 3
    # unknown `--sglang-<name> <value>` flags go to the SGLang server as `--<name> <value>`

One step (README, "The algorithm"): rank 0 samples and scores --n-samples-per-prompt responses to
each of --rollout-batch-size prompts; every rank trains on them with the PPO-clip loss. Unlike
textbook GRPO: a group of equal rewards gets exactly 0 advantage, the clip is asymmetric
(--eps-clip / --eps-clip-high), and old logprobs are the engine's own unless --recompute-logprobs.
"""
import argparse
import dataclasses
import math
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm
from transformers import AutoProcessor

import cluster
import flags as F
import model as M
import offload
import optim
import parallel
import pipeline
import reward
import rollout as R
import sglang_engine
import trainer as T


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)  # no --sglang-* flag may pass as an abbreviation
    F.add_train_args(p)
    F.add_rollout_args(p)
    a = p.add_argument_group("GRPO").add_argument
    a("--num-rollout", type=F.COUNT, default=100, help="GRPO steps (rollout + update); 0: evaluate only")
    a("--advantage-estimator", default="grpo", choices=["grpo", "dr_grpo"], help="dr_grpo: no std division")
    a("--eps-clip", type=F.at_least(0.0), default=0.2, help="PPO clip below 1")
    a("--eps-clip-high", type=F.at_least(0.0), default=0.28, help="PPO clip above 1")
    a("--kl-loss-coef", type=F.at_least(0.0), default=0.0, help="KL to the initial policy (0: no reference model)")
    a("--kl-loss-type", default="low_var_kl", choices=["k1", "k2", "k3", "low_var_kl"])
    a("--entropy-coef", type=F.at_least(0.0), default=0.0, help="entropy bonus")
    a("--loss-agg", default="token", choices=["token", "sequence"], help="mean over tokens or over sequences")
    a("--recompute-logprobs", action="store_true", help="old logprobs from the trainer, not the engine")
    a("--use-rollout-routing-replay", action="store_true",
      help="MoE (R3): the trainer's routers take the experts the engine chose for each token (SGLang starts "
           "with --enable-return-routed-experts); metric routing_mismatch: the share that differed before")
    a("--tis-cap", type=F.at_least(0.0), default=0.0,
      help="with --recompute-logprobs: cap on the trainer/rollout ratio (TIS; 0: off)")
    a("--dynamic-sampling-max-prompts", type=F.POSITIVE, default=None,
      help="with --dynamic-sampling: prompts drawn at most in a step, the batch's own included "
           "(default 4 x --rollout-batch-size)")
    a = p.add_argument_group("engine placement").add_argument
    a("--async-rollout", action="store_true",
      help="the rollout of step k+1 runs while step k trains (one step off-policy: the PPO ratio's old logprobs "
           "are the engine's); the engine takes new weights once it is done. Not with --colocate")
    a("--colocate", action="store_true",
      help="SGLang shares the training GPUs: started with its memory saver, released while training")
    a("--offload-train", action=argparse.BooleanOptionalAction, default=None,
      help="while SGLang generates, the trainer's parameters, gradients and optimizer states wait in host "
           "memory (offload.py), and a colocated server gets --mem-fraction-static 0.7; default: on with "
           "--colocate on CUDA")
    a("--rollout-num-gpus", type=F.COUNT, default=0,
      help="SGLang on N GPUs of its own on each node, after the node's training GPUs (disaggregated)")
    a("--rollout-num-gpus-per-engine", type=F.POSITIVE, default=None,
      help="K GPUs a server: each node runs its serving GPUs / K SGLang servers (TP K), all behind SGLang's "
           "router; default: one server over all of them. On CPU (the test harness): a server per K ranks")
    a("--weight-sync", default="auto", choices=["auto", "tensor", "distributed", "disk"],
      help="how new weights reach SGLang: tensor (CUDA IPC, colocated), distributed (an NCCL group, "
           "--rollout-num-gpus), disk (safetensors + /update_weights_from_disk); auto picks by placement")
    p.set_defaults(global_batch_size=0)
    return p


def parse_args(argv=None):
    p = build_parser()
    args, unknown = p.parse_known_args(argv)
    bad = [u for u in unknown if u.startswith("--") and not u.startswith("--sglang-")]
    if bad:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    args.sglang_args = sglang_engine.sglang_server_args(unknown)
    args.global_batch_size = args.global_batch_size or args.rollout_batch_size * args.n_samples_per_prompt
    if args.offload_train is None:
        args.offload_train = args.colocate and torch.cuda.is_available()
    if args.rm_type not in reward.REWARDS:
        p.error(f"--rm-type {args.rm_type}: choose one of {', '.join(sorted(reward.REWARDS))}")
    if args.n_samples_per_prompt == 1 and args.num_rollout:
        p.error("--n-samples-per-prompt 1: a group of one has zero advantage, GRPO would learn nothing")
    if args.sglang_args and args.rollout_engine == "local":
        p.error(f"{' '.join(args.sglang_args)}: SGLang flags, but --rollout-engine local")
    if args.async_rollout and (args.colocate or args.offload_train):
        p.error("--async-rollout: the next rollout runs while this step trains, so the engine needs GPUs of its "
                "own (--rollout-num-gpus N; not --colocate) and the trainer stays on them (no --offload-train)")
    if args.colocate and args.weight_sync == "distributed":  # rank 0 and the server's TP rank 0 share GPU 0
        p.error("--colocate --weight-sync distributed: NCCL refuses a communicator that holds one GPU twice; "
                "colocated weights go by --weight-sync tensor (the default) or disk")
    return args


def advantages(rewards, groups, estimator):
    """Group-normalised advantages; exactly 0.0 for a group whose rewards are all equal."""
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        if len(idx) < 2 or bool((r == r[0]).all()):
            continue
        a = r - r.mean()
        if estimator == "grpo":
            a = a / (r.std() + 1e-6)
        for i, v in zip(idx, a.tolist()):
            out[i] = v
    return out


def kl_term(logp, ref, kind):
    """Per-token KL estimate of the policy from the reference (Schulman's k1/k2/k3)."""
    d = ref - logp
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "low_var_kl":  # k3, clamped for stability
        d = d.clamp(-20, 20)
        return (torch.exp(d) - d - 1).clamp(max=10)
    return torch.exp(d) - d - 1


def prompt_tokens(processor, record, args):
    """The length of a record's prompt as a rollout encodes it (the processor checks its images)."""
    messages, tools = R.chat_prompt(processor, record, args.max_turns > 1)
    return len(R.encode_prompt(processor, messages, record["images"], tools))


def to_item(sample, processor, adv, encoded=None):
    """A sample as trainer input. `encoded` caches image encodings by the images' identity: a
    group's samples share their prompt's images, so those are encoded once, and pickled once
    when rank 0 broadcasts the step (pickle keeps one copy of a shared tensor)."""
    encoded = {} if encoded is None else encoded
    key = tuple(map(id, sample.images))
    if key not in encoded:
        encoded[key] = R.encode_images(processor, sample.images)
    pv, grid = encoded[key]
    mask = [0] * len(sample.prompt_ids) + list(sample.loss_mask)
    old = [0.0] * len(sample.prompt_ids) + list(sample.rollout_logprobs)
    routes = sample.routed_experts  # (T - 1, layers, k): the last token no engine forward saw
    if routes is not None:
        routes = torch.cat([torch.as_tensor(routes, dtype=torch.int16),
                            torch.full((len(sample.tokens) - len(routes), *routes.shape[1:]), -1, dtype=torch.int16)])
    return T.Item(ids=torch.tensor(sample.tokens), mask=torch.tensor(mask, dtype=torch.bool),
                  pixel_values=pv, image_grid_thw=grid, adv=adv, routed_experts=routes,
                  rollout_logprobs=torch.tensor([o for o, m in zip(old, mask) if m], dtype=torch.float32))


def policy_loss(model, ref, par, items, args, measure):
    """PPO-clip loss over a global batch held as this rank's `items`, through the pipeline schedule
    (backward per micro-batch; under PP the loss is the last stage's, its stats reach every rank)."""
    n_tok = T.global_sum(sum(int(it.mask.sum()) for it in items), par)
    n_seq = T.global_sum(len(items), par)
    temp = args.rollout_temperature or 1.0  # logprobs under the distribution the engine sampled from
    if ref is not None:  # forward-only, before the policy's passes: under PP both are whole schedules
        logprobs_into(ref, items, args, "ref_logprobs", replay=False)  # the initial policy routes as it would
    replay = measure and args.use_rollout_routing_replay
    if replay:
        model.routing_mismatch()  # from here: the mismatch at the weights the engine sampled with

    def loss_of(mb, out):
        logp, ent = out
        dev = logp.device  # everything below on the model's device (CUDA under NCCL)
        old = torch.cat([it.old for it in mb]).to(dev)
        adv = torch.cat([torch.full((len(it.old),), float(it.adv)) for it in mb]).to(dev)
        # token weights: token-level mean over the global batch, or per-sequence mean then mean
        if args.loss_agg == "token":
            w = torch.full_like(logp, 1.0 / n_tok)
        else:
            w = torch.cat([torch.full((len(it.old),), 1.0 / max(1, len(it.old)) / n_seq) for it in mb]).to(dev)
        ratio = torch.exp(logp - old)
        clipped = ratio.clamp(1 - args.eps_clip, 1 + args.eps_clip_high)
        pg = -torch.minimum(ratio * adv, clipped * adv)
        if args.tis_cap and mb[0].recomputed_logprobs is not None:  # truncated importance sampling: trainer / rollout
            roll = torch.cat([it.rollout_logprobs for it in mb]).to(dev)
            pg = pg * torch.exp(old - roll).clamp(max=args.tis_cap)
        loss_tok = pg - args.entropy_coef * ent if args.entropy_coef else pg  # without: no entropy backward
        s = dict(kl=0.0)
        if ref is not None:
            kl = kl_term(logp, torch.cat([it.ref_logprobs for it in mb]).to(dev), args.kl_loss_type)
            loss_tok = loss_tok + args.kl_loss_coef * kl
            s["kl"] = (kl.detach() * w).sum().item()
        loss = (loss_tok * w).sum()
        s.update(loss=loss.item(), clipfrac=((clipped * adv < ratio * adv).float() * w).sum().item(),  # clip cut the gradient
                 entropy=(ent.detach() * w).sum().item(), diff_sum=0.0, diff_max=0.0)
        if measure:  # weights are still those the engine sampled with: logprobs must agree
            diff = (logp.detach() - torch.cat([it.rollout_logprobs for it in mb]).to(dev)).abs()
            s.update(diff_sum=diff.sum().item(), diff_max=diff.max().item() if len(diff) else 0.0)
        return loss, s
    per_mb = pipeline.run(model, T.micro_batches(items, args.max_tokens_per_gpu, par, args.use_rollout_routing_replay),
                          lambda m, x: m(**x, temperature=temp, with_entropy=True), loss_of)
    out = {k: T.global_sum(sum(s[k] for s in per_mb), par) for k in ("loss", "clipfrac", "kl", "entropy")}
    # packing_fill (rank 0's): real tokens / the budget of its micro-batches
    out["packing_fill"] = sum(len(it.ids) for it in items) / max(1, len(per_mb) * args.max_tokens_per_gpu)
    if measure:
        out["logprob_diff_mean"] = T.global_sum(sum(s["diff_sum"] for s in per_mb), par) / n_tok
        out["logprob_diff_max"] = T.global_sum(max([s["diff_max"] for s in per_mb], default=0.0), par,
                                               op=torch.distributed.ReduceOp.MAX)
    if replay:  # R3: (token, layer) pairs whose trainer top-k differed from the engine's, before replay
        differ, replayed = parallel.all_reduce(model.routing_mismatch().to(par.device), None).tolist()
        out["routing_mismatch"] = differ / max(replayed, 1)
    return out


def logprobs_into(model, items, args, field, replay=True):
    """Each item's `field` = `model`'s logprobs of its scored tokens (N,), forward only, at the rollout
    temperature; under PP set on the last stage, where the loss reads them. replay: the routers replay
    the engine's experts (--use-rollout-routing-replay)."""
    def keep(mb, out):
        for it, part in zip(mb, out[0].detach().cpu().split([int(it.mask.sum()) for it in mb])):
            setattr(it, field, part)
        return out[0].detach().sum(), {}
    with torch.no_grad():
        pipeline.run(model, T.micro_batches(items, args.max_tokens_per_gpu, model.par,
                                             replay and args.use_rollout_routing_replay),
                     lambda m, x: m(**x, temperature=args.rollout_temperature or 1.0), keep, forward_only=True)


def recompute_old(model, items, args):
    logprobs_into(model, items, args, "recomputed_logprobs")


def evaluate(engine, processor, records, args, step, run):
    """Greedy pass@1: single-turn, and multi-turn with the calc_score oracle off."""
    out = {}
    modes = [("eval", 1)] + ([("eval_multi_turn", args.max_turns)] if args.max_turns > 1 else [])
    for name, turns in modes:
        greedy = dataclasses.replace(R.RolloutConfig.from_args(args), n_samples_per_prompt=1, rollout_temperature=0.0,
                                     max_turns=turns, oracle=False, dynamic_sampling=False)
        samples = R.generate_group_samples(engine, processor, records, greedy)
        out[f"{name}_accuracy"] = sum(s.reward for s in samples) / max(1, len(samples))
    run.log(step, out)
    print(f"[eval] step {step}: {out}", flush=True)
    return out


def rollout_step(step, par, engine, processor, records, args, updates=1):
    """Rank 0 draws the step's prompts, samples and scores them (sample); each rank receives only its
    share of the usable samples and builds its trainer items itself (deal). -> (this rank's items of each
    update, None for an update with no sample; metrics, rank 0's). Failed and aborted samples are
    counted in the metrics and never trained on."""
    shares, metrics = sample(step, engine, processor, records, args, updates, par.dp) if par.rank == 0 else (None, {})
    metrics.pop("_ran", None)
    return deal(shares, metrics, par, processor)


def sample(step, engine, processor, records, args, updates, dp):
    """rank 0: step `step`'s samples -> (each DP rank's (sample, advantage) pairs, metrics, with the
    wall-clock interval it ran in as "_ran")."""
    t0 = time.perf_counter()
    batch = T.draw(records, step, args)
    samples = R.generate_group_samples(engine, processor, batch, R.RolloutConfig.from_args(args))
    metrics = R.rollout_metrics(samples)
    good = [s for s in samples if s.status not in ("failed", "aborted") and any(s.loss_mask)]
    adv = advantages([s.reward for s in good], [s.group for s in good], args.advantage_estimator)
    metrics["tokens"] = sum(len(s.tokens) for s in good)
    failed = sorted({s.fail_reason for s in samples if s.status == "failed"})
    if failed and good:  # counted in failed_frac; say why, once a step
        print(f"[grpo] step {step + 1}: {sum(s.status == 'failed' for s in samples)} of {len(samples)} samples "
              f"failed: {'; '.join(r[:200] for r in failed[:3])}", flush=True)
    if not good:
        reasons = sorted({s.fail_reason or s.status for s in samples if s.status != "completed"})
        print(f"[grpo] step {step + 1}: no trainable sample among {len(samples)} "
              f"({', '.join(reasons[:3]) or 'no response tokens'}): update skipped", flush=True)
    metrics["_ran"] = (t0, time.perf_counter())
    return split_batch(good, adv, random.Random(args.seed + step), args.global_batch_size, updates, dp), metrics


def deal(shares, metrics, par, processor):
    """Every rank: its DP rank's share of rank 0's `shares` -> (its trainer items of each update, metrics)."""
    t = time.perf_counter()
    encoded = {}  # a group's images, shared in the payload, are encoded once on each rank
    items = [None if part is None else [to_item(s, processor, a, encoded) for s, a in part]
             for part in T.hand_out(shares, par)]
    metrics["handoff_s"] = time.perf_counter() - t
    return items, metrics


def split_batch(good, adv, rng, global_batch_size, updates, dp):
    """rank 0: [for each DP rank: its (sample, advantage) pairs of each update (None: an update with
    no sample)], shuffled by `rng`, each update's global batch strided over the DP ranks. A sample
    keeps only what to_item reads: token ids, masks, logprobs, routes (R3) and its images (decoded, uint8)."""
    pairs = [(R.Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, loss_mask=s.loss_mask,
                       rollout_logprobs=s.rollout_logprobs, images=s.images, routed_experts=s.routed_experts), a)
             for s, a in zip(good, adv)]
    rng.shuffle(pairs)
    chunks = [pairs[u * global_batch_size:(u + 1) * global_batch_size] for u in range(updates)]
    return [[c[r::dp] if c else None for c in chunks] for r in range(dp)]


def train_step(model, ref, opt, sched, par, items, args, updates):
    """One optimizer step per update over this rank's `items` of it; an update with no sample
    (None on every rank alike) is skipped on every rank in lockstep."""
    model.train()
    if args.recompute_logprobs:
        recompute_old(model, [it for part in items if part for it in part], args)
    stats = {"updates_skipped": 0}
    for part in items:
        if part is None:
            stats["updates_skipped"] += 1
            continue
        s = policy_loss(model, ref, par, part, args, measure="logprob_diff_mean" not in stats)
        s.update(optim.optimizer_step(model, opt, sched, par, args))
        stats.update(s)  # the last update's stats; logprob_diff_* from the first
    return stats


def grpo_step(step, par, run, engine, plan, processor, records, model, ref, opt, sched, args, updates, off=None,
              ahead=None):
    """One step in slime's order: generate, release the engine's GPU memory (colocated), train,
    take the memory back, update the engine's weights (its update flushes its caches). `plan`:
    the engine's sync_plan(), known to every rank. `off`: --offload-train's Offload. `ahead`
    (--async-rollout, rank 0): {"pool": a one-thread executor[, "next": the future of this step's
    rollout, started while the last step trained]}; this step's starts the next one before training."""
    secs, t0 = {}, time.perf_counter()
    cluster.to_rollout(par, engine, off, args)
    with T.timed(secs, "rollout"):
        shares, metrics, version = None, {}, step  # the updates the engine's weights had when it sampled
        if par.rank == 0:
            if ahead and "next" in ahead:
                (shares, metrics), version = ahead.pop("next").result(), step - 1
            else:
                shares, metrics = sample(step, engine, processor, records, args, updates, par.dp)
            if ahead and step + 1 < args.num_rollout:  # runs while this step trains: one step off-policy
                ahead["next"] = ahead["pool"].submit(sample, step + 1, engine, processor, records, args, updates, par.dp)
            metrics.pop("_ran")
            metrics["rollout_policy_version"] = version
        items, metrics = deal(shares, metrics, par, processor)
    if args.colocate:
        cluster.step_aside(par, engine, off)
    elif off is not None:
        off.restore()
    with T.timed(secs, "train"):
        trained = time.perf_counter()
        stats = train_step(model, ref, opt, sched, par, items, args, updates)
        trained = (trained, time.perf_counter())
    with T.timed(secs, "sync"):
        if ahead and "next" in ahead:  # the next rollout ends before the engine takes new weights
            ran = ahead["next"].result()[1]["_ran"]
            metrics["rollout_ahead_overlap_s"] = max(0.0, min(ran[1], trained[1]) - max(ran[0], trained[0]))
        if args.async_rollout and par.world > 1:  # every node's server too: rank 0's rollout has ended
            torch.distributed.barrier()
        if args.colocate:
            metrics.update(cluster.step_back(par, engine, off))
        cluster.sync_weights(model, engine, par, plan)
    if off is not None:
        metrics["offload_host_gib"] = off.host_bytes() / 2**30
    metrics.update(stats, **T.expert_load(model))
    metrics.update(rollout_s=secs["rollout"], train_s=secs["train"],
                   sync_s=secs["sync"], tokens_per_s=metrics.get("tokens", 0) / max(1e-9, secs["train"]),
                   step_s=time.perf_counter() - t0)
    run.log(step + 1, metrics)
    return metrics


def main(argv=None):
    args = parse_args(argv)
    par, run = T.start(args, "grpo")
    processor = AutoProcessor.from_pretrained(args.hf_checkpoint)
    ckpt, opts = run.ckpt, M.ModelOptions.from_args(args)
    model = M.load_model(ckpt or args.hf_checkpoint, opts, par)
    if args.use_rollout_routing_replay and not getattr(model.hf_config.text_config, "num_experts", None):
        raise SystemExit(f"--use-rollout-routing-replay: {args.hf_checkpoint} is not a MoE model "
                         "(its text_config has no num_experts): there is no routing to replay")
    ref = None
    if args.kl_loss_coef:
        ref = M.load_model(args.hf_checkpoint, dataclasses.replace(opts, freeze_vit=True), par).eval()
        ref.requires_grad_(False)
    updates = math.ceil(args.rollout_batch_size * args.n_samples_per_prompt / args.global_batch_size)
    opt, sched = optim.build_optimizer(model, args, args.num_rollout * updates)
    start = run.load_state(ckpt, opt, sched)["step"] if ckpt else 0

    off = None
    if args.offload_train:  # parked before the server starts: its --mem-fraction-static counts what is free
        off = offload.Offload(model, opt, ref)
        off.release()
        if par.rank == 0:
            print(f"[offload] --offload-train: {off.host_bytes() / 2**30:.2f} GiB of host memory per rank for the "
                  "trainer's parameters, more once the optimizer states exist (metric offload_host_gib)", flush=True)
    records = eval_records = engine = None
    if par.rank == 0:  # rank 0 owns the data and the rewards; each node's leader its server (cluster.py)
        reward.get_reward_fn(args.rm_type)  # its one-off warm-up here, not in the first rollout
        fit = dict(measure=lambda r: prompt_tokens(processor, r, args),
                   limit=(args.max_context_len - 1, f"--max-context-len {args.max_context_len} with room for a response"))
        records, eval_records = T.load_data(args, **fit), T.load_data(args, evaluation=True, **fit)
    engine = cluster.start(args, par, str(ckpt or args.hf_checkpoint), str(run.save))  # rank 0's, each node's
    plan = [engine.sync_plan() if engine is not None else None, bool(eval_records)]
    if par.world > 1:  # every rank takes part in a sync that serialises on several ranks, and in to_rollout
        torch.distributed.broadcast_object_list(plan, src=0)
    evals = plan[1]
    ahead = {"pool": ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead")} if args.async_rollout else None
    try:
        if par.rank == 0 and eval_records and start == 0:
            evaluate(engine, processor, eval_records, args, 0, run)
        bar = tqdm(range(start, args.num_rollout), desc="grpo", disable=par.rank != 0,
                   initial=start, total=args.num_rollout)
        for step in bar:
            metrics = grpo_step(step, par, run, engine, plan[0], processor, records, model, ref, opt, sched, args,
                                updates, off, ahead if par.rank == 0 else None)
            bar.set_postfix(reward=f"{metrics.get('reward', 0):.3f}")
            # before the trainer is parked; colocated, --offload-train parked the optimizer states at the sync
            run.maybe_save(model, opt, sched, step + 1, args.num_rollout,
                           prepare=None if off is None else lambda: off.restore(("optimizer",)))
            last = step + 1 == args.num_rollout
            if evals and (last or (args.eval_interval and (step + 1) % args.eval_interval == 0)):
                cluster.to_rollout(par, engine, off, args)
                if par.rank == 0:
                    evaluate(engine, processor, eval_records, args, step + 1, run)
    finally:
        if ahead is not None:  # a rollout still running is not waited for
            ahead["pool"].shutdown(wait=False, cancel_futures=True)
        if engine is not None:
            engine.shutdown()


if __name__ == "__main__":
    sys.exit(main())
