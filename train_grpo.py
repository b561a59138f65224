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

One step: README, "The algorithm" (a group of equal rewards gets exactly 0 advantage, the clip is asymmetric,
old logprobs are the engine's own unless --recompute-logprobs).
"""
import argparse
import collections
import dataclasses
import math
import random
import statistics
import sys
import time

import torch
from transformers import AutoProcessor

import chat
import cluster
import console
import flags as F
import loss as L
import model as M
import optim
import parallel
import pipeline
import reward
import rollout as R
import routing
import sglang_engine
import task
import trainer as T


def build_parser(argv=()):
    """The parser for `argv`: the env module and the filter it names bring their own flags (task.chosen)."""
    # allow_abbrev: no --sglang-* flag may pass as an abbreviation
    p = argparse.ArgumentParser(description=__doc__, formatter_class=F.HelpFormatter, allow_abbrev=False,
                                fromfile_prefix_chars="@")  # `train_grpo.py @RUN/args.txt` replays a run
    F.add_train_args(p)
    try:  # a user's module that is missing is named here, before any model loads
        R.add_args(p, task.chosen(argv))
    except ValueError as e:
        p.error(str(e))
    a = p.add_argument_group("GRPO").add_argument
    a("--num-rollout", type=F.COUNT, default=100, help="GRPO steps (rollout + update); 0: evaluate only")
    a("--advantage-estimator", default="grpo", choices=[*L.ESTIMATORS, *L.LOSSES], help="a --policy-loss: grpo with it")
    a("--policy-loss", default="ppo_clip", choices=list(L.LOSSES), help="loss.py (verl's policy_loss.loss_mode)")
    for name, kw in {**F.own_flags(L.ESTIMATORS), **F.own_flags(L.LOSSES)}.items():  # each one's own (SAPO's temperatures)
        a(name, **kw)
    a("--eps-clip", type=F.at_least(0.0), default=0.2, help="PPO clip below 1")
    a("--eps-clip-high", type=F.at_least(0.0), default=0.28, help="PPO clip above 1")
    a("--kl-loss-coef", type=F.at_least(0.0), default=0.0, help="KL to the initial policy (0: no reference model)")
    a("--kl-loss-type", default="low_var_kl", choices=list(L.KL))
    a("--entropy-coef", type=F.at_least(0.0), default=0.0, help="entropy bonus")
    a("--loss-agg", default="token", choices=["token", "sequence"], help="mean over tokens or over sequences")
    a("--recompute-logprobs", action="store_true", help="old logprobs from the trainer, not the engine")
    a("--use-rollout-routing-replay", action="store_true", help="R3: the routers replay the engine's experts (MoE)")
    a("--tis-cap", type=F.at_least(0.0), default=0.0, help="with --recompute-logprobs: TIS's cap (0: off)")
    a("--default-tools", nargs="+", metavar="TOOL", help="multi-turn: the tools a row with no `tools` gets (default: the env's)")
    a("--dynamic-sampling-max-prompts", type=F.POSITIVE, default=None, help="prompts a step draws at most (4 x B)")
    g = p.add_argument_group("engine placement")
    a = g.add_mutually_exclusive_group().add_argument  # one or the other: argparse names both
    a("--async-rollout", action="store_true", help="step k+1's rollout runs while step k trains. Not with --colocate")
    a("--fully-async", action="store_true", help="generation never waits for training: a step takes the first "
      "--rollout-batch-size complete groups; what a weight update cuts goes on with the new weights. Not with --colocate")
    a = g.add_argument
    a("--rollout-engine", default="auto", choices=["auto", "sglang", "local"], help="auto: SGLang on CUDA, else local")
    a("--sglang-server-timeout", type=F.at_least(1.0), default=900.0, help="seconds to wait for a server's /health")
    a("--sglang-launch-cmd", default=None, help="what starts a server before its --model-path (python -m sglang.launch_server)")
    a("--sglang-router-args", default=None, help="SGLang's router's flags, e.g. \"--balance-abs-threshold 16\"")
    a("--max-weight-staleness", type=F.COUNT, default=None, metavar="K", help="with --partial-rollout or --fully-async: "
      "drop a group with a token over K weight versions old (default: none dropped)")
    a("--colocate", action="store_true", help="SGLang shares the training GPUs, released while training")
    a("--offload-train", action=argparse.BooleanOptionalAction, default=None,
      help="the trainer's state waits in host memory while SGLang generates (default: --colocate on CUDA)")
    a("--rollout-num-gpus", type=F.COUNT, default=0, help="SGLang on N GPUs of its own, after a node's training GPUs")
    a("--rollout-num-gpus-per-engine", type=F.POSITIVE, default=None, help="K GPUs a server (default: one a node)")
    a("--weight-sync", default="auto", choices=["auto", "tensor", "distributed", "disk"],
      help="how new weights reach SGLang (docs/sglang.md); auto: tensor colocated, distributed on own GPUs, else disk")
    p.set_defaults(global_batch_size=0)
    return p


def parse_args(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    p = build_parser(argv)
    args, unknown = p.parse_known_args(argv)
    if bad := [u for u in unknown if u.startswith("--") and not u.startswith("--sglang-")]:
        p.error(f"unrecognized arguments: {' '.join(bad)}")
    args.sglang_args = sglang_engine.sglang_server_args(unknown)
    args.argv = F.expand(argv)  # what args.txt keeps
    args.derived = [k for k, unset in (("global_batch_size", args.global_batch_size == 0),  # flags set from others
                                       ("offload_train", args.offload_train is None)) if unset]
    args.global_batch_size = args.global_batch_size or args.rollout_batch_size * args.n_samples_per_prompt
    args.rm_type = args.custom_rm_path or args.rm_type  # reward.score finds a judge by its name or its path
    args.dynamic_sampling = args.dynamic_sampling or args.dynamic_sampling_filter_path is not None
    if args.offload_train is None:
        args.offload_train = args.colocate and torch.cuda.is_available()
    if args.advantage_estimator in L.LOSSES:  # as slime's `--advantage-estimator gspo`, and this trainer's before
        if args.policy_loss not in ("ppo_clip", args.advantage_estimator):
            p.error(f"--advantage-estimator {args.advantage_estimator} names a loss: give it as --policy-loss")
        args.advantage_estimator, args.policy_loss = "grpo", args.advantage_estimator
    if args.num_rollout and (args.n_samples_per_prompt == 1 or args.rollout_temperature == 0):
        p.error("--n-samples-per-prompt 1: a group of one response has zero advantage, so GRPO would learn nothing"
                if args.n_samples_per_prompt == 1 else "--rollout-temperature 0: greedy sampling gives every response "
                "of a group the same tokens, so each has zero advantage and GRPO would learn nothing")
    if args.default_tools and args.max_turns == 1:
        p.error("--default-tools: a single-turn run (--max-turns 1) offers no tools")
    if not (args.num_rollout or args.eval_prompt_data):
        p.error("--num-rollout 0 only evaluates: give --eval-prompt-data (or steps to train)")
    if (args.fully_async or args.async_rollout) and (args.colocate or args.offload_train):
        p.error(f"{'--fully-async' if args.fully_async else '--async-rollout'}: the rollout runs beside training, so "
                "the engine needs GPUs of its own (--rollout-num-gpus N), not --colocate or --offload-train")
    if not (args.partial_rollout or args.fully_async) and (args.over_sampling_batch_size or args.max_weight_staleness
                                                           is not None or args.mask_offpolicy_in_partial_rollout):
        p.error("--over-sampling-batch-size, --max-weight-staleness and --mask-offpolicy-in-partial-rollout need "
                "--partial-rollout or --fully-async")
    if args.use_rollout_routing_replay and (args.partial_rollout or args.fully_async):  # docs/rollout.md, "R3"
        p.error(f"--use-rollout-routing-replay with {'--fully-async' if args.fully_async else '--partial-rollout'}: a "
                "continued sample's prefill routes its prefix anew at the new weights; one forward replays one route")
    if (args.over_sampling_batch_size or args.rollout_batch_size) < args.rollout_batch_size:
        p.error(f"--over-sampling-batch-size {args.over_sampling_batch_size}: at least --rollout-batch-size "
                f"{args.rollout_batch_size} (the groups a step trains on come from those it samples)")
    if args.colocate and args.weight_sync == "distributed":  # rank 0 and the server's TP rank 0 share GPU 0
        p.error("--colocate --weight-sync distributed: NCCL refuses a communicator that holds one GPU twice; "
                "colocated weights go by --weight-sync tensor (the default) or disk")
    placing = [k for k, on in {"--colocate": args.colocate, "--rollout-num-gpus": args.rollout_num_gpus, "--weight-sync":
               args.weight_sync != "auto", "--rollout-num-gpus-per-engine": args.rollout_num_gpus_per_engine}.items() if on]
    if sglang_engine.engine_kind(args) == "local" and placing + args.sglang_args:  # in rank 0's process: nothing to place
        p.error(f"{' '.join(placing + args.sglang_args)}: they place or set up an SGLang server, but the rollout engine "
                "is local (--rollout-engine sglang, or auto on CUDA with SGLang installed)")
    chosen_filter = {args.dynamic_sampling_filter_path or "nonzero_std": task.group_filter(args)}
    own = {"LOSSES": L.LOSSES, "ESTIMATORS": L.ESTIMATORS, "SHAPING": reward.SHAPING, "FILTERS": chosen_filter,
           "TOOLS": getattr(task.env(args), "TOOLS", {})}
    for kind, reg in own.items():  # every entry's own flags, the env's tools' and the filter's included
        for name, flag in ((n, f) for n, e in reg.items() for f in e.flags if not hasattr(args, f[2:].replace("-", "_"))):
            p.error(f"{kind} entry {name!r} declares {flag}, which args lacks: add flags.own_flags({kind}) to the parser")
    return args


def to_item(sample, processor, adv, encoded=None, step=None):
    """A sample as trainer input, at `step` (the version of the weights trained). `encoded` caches image encodings by
    the images' identity: a group's samples share their prompt's images, encoded once and pickled once in rank 0's
    broadcast (one copy of a shared tensor)."""
    key, encoded = tuple(map(id, sample.images)), {} if encoded is None else encoded
    pv, grid = encoded[key] if key in encoded else encoded.setdefault(key, chat.encode_images(processor, sample.images))
    mask = [0] * len(sample.prompt_ids) + list(sample.loss_mask)
    routes = sample.routed_experts  # (T - 1, layers, k): the last token no engine forward saw
    if routes is not None:
        routes = torch.cat([torch.as_tensor(routes, dtype=torch.int16),
                            torch.full((len(sample.tokens) - len(routes), *routes.shape[1:]), -1, dtype=torch.int16)])
    return T.Item(ids=torch.tensor(sample.tokens), mask=torch.tensor(mask, dtype=torch.bool),
                  pixel_values=pv, image_grid_thw=grid, adv=adv, routed_experts=routes, same_version=None
                  if step is None else torch.tensor([v == step for v, m in zip(sample.versions, sample.loss_mask) if m]),
                  rollout_logprobs=torch.tensor([o for o, m in zip(sample.rollout_logprobs, sample.loss_mask) if m],
                                                dtype=torch.float32))


def policy_loss(model, ref, par, items, args, measure):
    """The --policy-loss (loss.py) with its statistics over a global batch held as this rank's `items`, through
    the pipeline schedule (backward per micro-batch; under PP the loss is the last stage's, its stats reach every
    rank), with the KL, entropy and TIS terms, each token weighted by --loss-agg."""
    n_tok, n_seq = T.global_sum(sum(int(it.mask.sum()) for it in items), par), T.global_sum(len(items), par)
    fn = L.LOSSES[args.policy_loss]
    if ref is not None:  # forward-only, before the policy's passes: under PP both are whole schedules
        logprobs_into(ref, items, args, "ref_logprobs", replay=False)  # the initial policy routes as it would
    replay = measure and args.use_rollout_routing_replay
    if replay:
        routing.take_mismatch(model.replays)  # from here: the mismatch at the weights the engine sampled with

    def loss_of(mb, out):
        logp, ent = out
        dev, lens = logp.device, [len(it.old) for it in mb]  # everything below on the model's device (CUDA under NCCL)
        n = torch.tensor(lens, device=dev)

        def cat(field):  # (N,) the micro-batch's per-token `field` of its items
            return torch.cat([getattr(it, field) for it in mb]).to(dev)
        adv = torch.tensor([float(it.adv) for it in mb], device=dev).repeat_interleave(n)
        w = (torch.full_like(logp, 1.0 / n_tok) if args.loss_agg == "token"  # token weights: mean over the batch's tokens,
             else (1.0 / n.clamp(min=1) / n_seq).repeat_interleave(n))  # or per-sequence mean then mean
        pg, stat = fn.policy(logp, cat("old"), adv, lens, args.eps_clip, args.eps_clip_high, **F.declared(fn.flags, args))
        if args.tis_cap and mb[0].recomputed_logprobs is not None:  # truncated importance sampling
            pg = pg * L.tis(cat("old"), cat("rollout_logprobs"), args.tis_cap)
        loss_tok = pg - args.entropy_coef * ent if args.entropy_coef else pg  # without: no entropy backward
        kl = torch.zeros_like(logp) if ref is None else L.KL[args.kl_loss_type](logp, cat("ref_logprobs"))
        loss = ((loss_tok + args.kl_loss_coef * kl) * w).sum()
        s = {"loss": loss.item(), "kl": (kl.detach() * w).sum().item(), "entropy": (ent.detach() * w).sum().item(),
             **{k: (stat[k].float() * w).sum().item() for k in fn.stats}}  # clipfrac: the clip cut it
        if measure:  # weights are still those the engine sampled with: logprobs must agree on the tokens they wrote
            diff = (logp.detach() - cat("rollout_logprobs")).abs()
            same = torch.ones_like(diff) if mb[0].same_version is None else cat("same_version").to(diff.dtype)
            s.update(diff_sum=diff.sum().item(), diff_max=diff.max().item() if len(diff) else 0.0,
                     same_sum=(diff * same).sum().item(), same_n=same.sum().item())
        return loss, s
    per_mb = pipeline.run(model, T.micro_batches(items, args.max_tokens_per_gpu, par, args.use_rollout_routing_replay),
                          lambda m, x: m(**x, temperature=args.rollout_temperature, with_entropy=True), loss_of)
    out = {k: T.global_sum(sum(s[k] for s in per_mb), par) for k in ("loss", "kl", "entropy", *fn.stats)}
    out["packing_fill"] = sum(len(it.ids) for it in items) / max(1, len(per_mb) * args.max_tokens_per_gpu)  # rank 0's
    if measure:
        out["logprob_diff_mean"] = T.global_sum(sum(s["diff_sum"] for s in per_mb), par) / n_tok
        out["logprob_diff_max"] = T.global_sum(max([s["diff_max"] for s in per_mb], default=0.0), par,
                                               op=torch.distributed.ReduceOp.MAX)
        same_sum, same_n = (T.global_sum(sum(s[k] for s in per_mb), par) for k in ("same_sum", "same_n"))
        if same_n:  # off-policy sources: the engine check apart from the drift of the policy since older tokens
            out["logprob_diff_mean_same_version"] = same_sum / same_n
    if replay:  # R3: (token, layer) pairs whose trainer top-k differed from the engine's, before replay
        differ, replayed = parallel.all_reduce(routing.take_mismatch(model.replays).to(par.device), None).tolist()
        out["routing_mismatch"] = differ / max(replayed, 1)
    return out


def logprobs_into(model, items, args, field, replay=True):
    """Each item's `field` = `model`'s logprobs of its scored tokens (N,), forward only, at the rollout temperature (PP:
    on the last stage, where the loss reads them); replay: the routers replay the engine's experts (R3)."""
    def keep(mb, out):
        for it, part in zip(mb, out[0].detach().cpu().split([int(it.mask.sum()) for it in mb])):
            setattr(it, field, part)
        return out[0].detach().sum(), {}
    with torch.no_grad():
        pipeline.run(model, T.micro_batches(items, args.max_tokens_per_gpu, model.par,
                                             replay and args.use_rollout_routing_replay),
                     lambda m, x: m(**x, temperature=args.rollout_temperature), keep, forward_only=True)


def evaluate(engine, processor, records, args, step, run):
    """Correctness, never a reward: pass@1 (greedy), pass@K, single-, multi-turn on settings(args, evaluation=True)."""
    out, rows = {}, []
    for name, turns in [("eval", 1)] + ([("eval_multi_turn", args.max_turns)] if args.max_turns > 1 else []):
        for n in sorted({1, args.n_samples_per_eval_prompt}):
            key, temperature = (f"{name}_accuracy", 0.0) if n == 1 else (f"{name}_pass@{n}", args.rollout_temperature)
            cfg = R.settings(args, True, n_samples_per_prompt=n, max_turns=turns, rollout_temperature=temperature)
            samples = R.generate_group_samples(engine, processor, records, cfg)
            out[key] = sum(any(s.correct for s in samples if s.group == g) for g in range(len(records))) / len(records)
            for k, v in reward.fault_counts(samples).items():  # eval_<rm>_errors, eval_<rm>_timeouts: over its samples
                out[f"{name}_{k}"] = out.get(f"{name}_{k}", 0) + v
            if n == 1:  # greedy multi-turn: the tools' use beside it (eval_multi_turn_tool_calls_<tool>, ..._crop_hit_frac)
                env = task.env(args)
                out.update({f"{name}_{k}": v for k, v in task.metrics(
                    env, [s.metadata.get("steps", []) for s in samples], [s.correct for s in samples],
                    sorted({t for r in records for t in task.tools(env, r)})).items()})
            rows += [dict(mode=key, index=s.group, problem=records[s.group]["problem"], answer=s.label,
                          correct=s.correct, status=s.status, response=s.response_text,
                          judge_error=reward.fault(s.metadata, args.rm_type)) for s in samples]
    path = run.write_rows(f"eval_{step:07d}.jsonl", rows)
    run.log(step, out)
    console.say(f"[eval] step {step}: {', '.join(f'{k} {v:.3f}' for k, v in out.items())} (each response: {path})")


Batch = collections.namedtuple("Batch", ["items", "metrics"])  # a rank's items of each update (None: no sample)


class Source:
    """A step's rollout source (grpo_step's next and settle), on every rank. Rank 0 holds the rollout.Rollout over the
    step's prompts (trainer.draw, or the data stream's next), takes B complete groups, their advantages, and hands each
    DP rank its share (where it pauses: docs/rollout.md); settle() ends with a barrier, after the rollout has paused."""

    def __init__(self, engine, processor, records, args, updates, par, state=None):
        self.processor, self.records, self.args, self.updates, self.par = processor, records, args, updates, par
        self.ahead, self.fully, self.trained = args.async_rollout, args.fully_async, 0.0
        B, self.stream = args.rollout_batch_size, args.partial_rollout or args.fully_async
        self.cap, self.rollout = max(args.over_sampling_batch_size or B, B), None  # groups open or kept at once
        if par.rank == 0:
            self.rollout = R.Rollout(engine, processor, R.settings(args), None if args.fully_async else B, self.cap,
                                     args.max_weight_staleness)
            self.env = task.env(args)
            self.tools = sorted({t for r in records if args.max_turns > 1 for t in task.tools(self.env, r)})
            self.rollout.drawn, self.rollout.groups = state or (0, {})

    def state(self):
        """What a resumed run starts from (rank 0): None when the rollout keeps nothing."""
        keep = self.rollout is not None and (self.stream or self.rollout.groups)
        return (self.rollout.drawn, self.rollout.groups) if keep else None

    def next(self, step):
        """-> this rank's Batch: its share of the groups rank 0 took (a group's images encoded once on each rank)."""
        t, shares, metrics = time.perf_counter(), None, {}
        if self.par.rank == 0:
            self.resume(step, step)  # the engine holds the weights of `step` updates
            shares, metrics = self.take(step)
            if not self.fully:
                self.rollout.pause()
            if self.ahead and step + 1 < self.args.num_rollout:
                self.resume(step, step + 1)
            self.trained = time.perf_counter()
        h, encoded = time.perf_counter(), {}
        items = [None if part is None else [to_item(s, self.processor, a, encoded, step) for s, a in part]
                 for part in T.hand_out(shares, self.par)]
        return Batch(items, dict(metrics, handoff_s=time.perf_counter() - h, rollout_s=time.perf_counter() - t))

    def settle(self):
        """Before the engine takes the step's new weights: the rollout pauses. -> metrics"""
        ran = self.rollout.pause() if self.par.rank == 0 else None  # (start, end) when it ran beside this step's training
        out = {"rollout_ahead_overlap_s": max(0.0, min(ran[1], time.perf_counter()) - max(ran[0], self.trained))} if ran else {}
        if self.par.world > 1:
            torch.distributed.barrier()
        return out

    def resume(self, version, step):
        """The rollout goes on (a no-op while it runs) with the engine's weights of `version` updates, from step's
        prompts or the data stream."""
        args = self.args
        if self.stream:
            extra = (args.dynamic_sampling_max_prompts or 4 * args.rollout_batch_size) if args.dynamic_sampling else 0
            batch = T.stream(self.records, self.rollout.drawn, self.cap + args.rollout_batch_size + extra, args.seed)
        else:
            batch = T.draw(self.records, step, args)
        self.rollout.resume(batch, version)

    def take(self, step):
        """-> (each DP rank's (sample, advantage) pairs of each update, metrics): the first B complete groups. A
        token of an older version than `step`'s policy is off-policy."""
        args = self.args
        samples = self.rollout.take(args.rollout_batch_size)
        metrics = rollout_metrics(samples, self.tools, self.env)
        metrics["context_cap_frac"] = sum(len(s.prompt_ids) + args.rollout_max_response_len > args.max_context_len
                                          for s in samples) / max(1, len(samples))  # --max-context-len cuts these first
        good = [s for s in samples if s.status not in ("failed", "aborted") and any(s.loss_mask)]
        if args.mask_offpolicy_in_partial_rollout:  # tokens written before the sample's last abort: no loss
            for s in good:
                s.loss_mask = [m and v >= max(s.versions) for m, v in zip(s.loss_mask, s.versions)]
        trained = [v for s in good for m, v in zip(s.loss_mask, s.versions) if m]
        metrics.update(tokens=sum(len(s.tokens) for s in good),
                       offpolicy_token_frac=sum(v < step for v in trained) / max(1, len(trained)))
        if trained:  # the weights of the newest and of the oldest trained token
            metrics.update(rollout_policy_version=max(trained), oldest_token_version=min(trained),
                           staleness_max=step - min(trained))
        failed = sorted({s.fail_reason for s in samples if s.status == "failed"})
        if failed and good:  # counted in failed_frac; say why, once a step
            print(f"[grpo] step {step + 1}: {sum(s.status == 'failed' for s in samples)} of {len(samples)} samples "
                  f"failed: {'; '.join(r[:200] for r in failed[:3])}", flush=True)
        if not good:
            reasons = sorted({s.fail_reason or s.status for s in samples if s.status != "completed"})
            print(f"[grpo] step {step + 1}: no trainable sample among {len(samples)} "
                  f"({', '.join(reasons[:3]) or 'no response tokens'}): update skipped", flush=True)
        adv = L.advantages([s.reward for s in good], [s.group for s in good], args.advantage_estimator,
                           **F.declared(L.ESTIMATORS[args.advantage_estimator].flags, args))
        metrics["zero_adv_frac"] = sum(a == 0 for a in adv) / max(1, len(adv))
        rng = random.Random(args.seed + step)
        return split_batch(good, adv, rng, args.global_batch_size, self.updates, self.par.dp), metrics


def rollout_metrics(samples, tools=(), env=None):
    """Means over samples; reward and accuracy (correctness) over the ones not failed, each SHAPING term's mean and the
    share it touched; multi-turn, the env module's metrics of `tools` (those some row of the run is offered; env None:
    the default env's)."""
    n, ok = max(len(samples), 1), [s for s in samples if s.status != "failed"] or [R.Sample(prompt_ids=[])]
    m = {"reward": sum(s.reward for s in ok) / len(ok), "accuracy": sum(s.correct for s in ok) / len(ok),
         "response_len": sum(sum(s.loss_mask) for s in ok) / len(ok),
         **{f"{k}_frac": sum(s.status == k for s in samples) / n for k in ("truncated", "aborted", "failed")},
         "turns": sum(s.turns for s in samples) / n, "tool_calls": sum(s.tool_calls for s in samples) / n,
         "format_ok_frac": sum(bool(s.metadata.get("format_ok")) for s in samples) / n, "samples": len(samples)}
    for k in {k for s in ok for k in s.metadata.get("shaping", {})}:  # overlong_penalty_mean, overlong_penalty_frac
        v = [s.metadata.get("shaping", {}).get(k, 0.0) for s in ok]
        m.update({f"{k}_mean": sum(v) / len(v), f"{k}_frac": sum(x != 0 for x in v) / len(v)})
    m.update(reward.fault_counts(samples))
    m.update(task.metrics(env or task.env(None), [s.metadata.get("steps", []) for s in samples],  # multi-turn: tool use
                          [None if s.status == "failed" else s.correct for s in samples], tools))
    if samples and "rollout" in samples[0].metadata:  # where the rollout's time went, what it cut and dropped
        ends, stats = [s.metadata["end_s"] for s in samples], samples[0].metadata["rollout"]
        if stats["dropped"] is not None:  # --dynamic-sampling: the share of complete groups kept
            m["ds_keep_frac"] = len({s.group for s in samples}) / (len({s.group for s in samples}) + stats["dropped"])
        m.update({f"rollout_{k}": v for k, v in stats.items() if k != "dropped"},
                 rollout_critical_path_s=max(s.metadata["engine_s"] for s in samples),
                 rollout_own_s_per_sample=sum(s.metadata["own_s"] for s in samples) / n,
                 rollout_tail_s=max(ends) - statistics.median(ends))
    return m


def split_batch(good, adv, rng, global_batch_size, updates, dp):
    """rank 0: [for each DP rank: its (sample, advantage) pairs of each update (None: no sample)], shuffled by `rng`,
    each update's global batch strided over the ranks; a sample keeps only what to_item reads."""
    pairs = [(R.Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, loss_mask=s.loss_mask,
                       rollout_logprobs=s.rollout_logprobs, images=s.images, routed_experts=s.routed_experts,
                       versions=s.versions), a) for s, a in zip(good, adv)]
    rng.shuffle(pairs)
    chunks = [pairs[u * global_batch_size:(u + 1) * global_batch_size] for u in range(updates)]
    return [[c[r::dp] if c else None for c in chunks] for r in range(dp)]


class Policy:
    """Every rank's trainer: the model, the KL term's reference, the optimizer and its schedule; train(): a step."""

    def __init__(self, model, ref, opt, sched, args, updates):
        self.model, self.ref, self.opt, self.sched, self.args, self.updates = model, ref, opt, sched, args, updates

    def train(self, batch):
        """One optimizer step per update of this rank's items; one with no sample (None on every rank alike) is skipped
        in lockstep. -> the last update's stats (logprob_diff_* from the first: the weights the engine sampled with)."""
        t, model, par, args = time.perf_counter(), self.model, self.model.par, self.args
        model.train()
        if args.recompute_logprobs:
            logprobs_into(model, [it for part in batch.items if part for it in part], args, "recomputed_logprobs")
        stats = {"updates_skipped": batch.items.count(None)}
        for part in (p for p in batch.items if p is not None):  # the loss and its backward, then the step
            stats.update(policy_loss(model, self.ref, par, part, args, measure="logprob_diff_mean" not in stats),
                         **optim.optimizer_step(model, self.opt, self.sched, par, args))
        t = time.perf_counter() - t
        return dict(stats, **T.expert_load(model), train_s=t, tokens_per_s=batch.metrics.get("tokens", 0) / max(t, 1e-9))


def grpo_step(step, policy, source, servers, run):
    """One step in slime's order: generate, the engine steps aside, train, it comes back and takes the new
    weights (its update flushes its caches), log. The variants (one step ahead, partial, fully async, colocated,
    offload) live in the objects: source (Source), servers (cluster.Servers)."""
    t = time.perf_counter()
    servers.to_rollout()                 # --offload-train: the trainer parks; a colocated server takes all back
    batch = source.next(step)            # rank 0 takes B complete groups from the rollout; each rank its share
    servers.step_aside()                 # colocated: the server frees the GPUs; the trainer returns from host memory
    stats = policy.train(batch)          # every rank: the PPO-clip updates on its share
    stats.update(source.settle())        # the rollout pauses before the weights change (one step ahead: once made)
    stats.update(servers.step_back())    # colocated: the server takes its memory back
    stats.update(servers.sync(policy.model))  # new weights to every server
    metrics = {**batch.metrics, **stats, "step_s": time.perf_counter() - t}
    run.log(step + 1, metrics)
    return metrics


def main(argv=None):
    args = parse_args(argv)
    par, run = T.start(args, "grpo", fixed=("rollout_batch_size", "partial_rollout", "fully_async"))  # fix a step's prompts
    run.nothing_left(args.num_rollout, "--num-rollout")
    processor = AutoProcessor.from_pretrained(args.hf_checkpoint)
    records = eval_records = None
    if par.rank == 0:  # rank 0 owns the data (checked here, before any model: docs/data.md) and the rewards
        reward.init()  # its one-off warm-up here, not in the first rollout
        env = task.env(args) if args.max_turns > 1 else None
        try:  # what a row with no `tools` is offered, multi-turn: --default-tools, checked now, else the env's own
            offered = task.tools(env, {"tools": args.default_tools}) if env is not None else []
        except ValueError as e:
            raise SystemExit(f"--default-tools: {e}") from None
        lengths = []  # each prompt's tokens: console.room says those a response's room is cut for

        def measure(r):
            lengths.append(len(chat.prompt(processor, r, env, args.prompt_instruction)[2]))
            return lengths[-1]
        fit = dict(measure=measure, limit=(args.max_context_len - 1, f"--max-context-len {args.max_context_len} with room "
                                                                     "for a response"))
        records = T.load_data(args, **fit) if args.num_rollout else []  # --num-rollout 0: evaluate only
        eval_records = T.load_data(args, evaluation=True, **fit)
        console.room(lengths, args)
        bare = [r for r in records + eval_records if offered and r.get("tools") is None]
        for r in bare:
            r["tools"] = offered
        if bare:
            console.say(f"[grpo] {len(bare)} rows have no `tools`: each is offered {', '.join(offered)} (--default-tools)")
        if args.num_rollout and len(records) < args.rollout_batch_size:  # a step's groups: distinct prompts
            raise SystemExit(f"--rollout-batch-size {args.rollout_batch_size}: --prompt-data has {len(records)} usable "
                             "prompts, so a step would sample some twice; lower it or add data")
    ckpt, opts = run.ckpt, M.ModelOptions.from_args(args)
    model = M.load_model(ckpt or args.hf_checkpoint, opts, par)
    if args.use_rollout_routing_replay and not getattr(model.hf_config.text_config, "num_experts", None):
        raise SystemExit(f"--use-rollout-routing-replay: {args.hf_checkpoint} is not a MoE model (no num_experts)")
    frozen = dataclasses.replace(opts, freeze_vit=True)  # the KL term's reference model
    ref = M.load_model(args.hf_checkpoint, frozen, par).eval().requires_grad_(False) if args.kl_loss_coef else None
    updates = math.ceil(args.rollout_batch_size * args.n_samples_per_prompt / args.global_batch_size)
    opt, sched = optim.build_optimizer(model, args, args.num_rollout * updates)
    start = run.load_state(ckpt, opt, sched)["step"] if ckpt else 0
    policy = Policy(model, ref, opt, sched, args, updates)
    servers = cluster.Servers(args, par, model, opt, ref, str(ckpt or args.hf_checkpoint), str(run.save), processor)
    source = Source(servers.engine, processor, records, args, updates, par, run.load_rollout())
    evals, quiet = servers.agree(bool(eval_records)), 0  # quiet: steps in a row with nothing to learn (rank 0)
    try:
        if par.rank == 0 and eval_records and (start == 0 or not args.num_rollout):
            evaluate(servers.engine, processor, eval_records, args, start, run)
        for step in console.steps(run, start, args.num_rollout):
            metrics = grpo_step(step, policy, source, servers, run)
            quiet = console.no_signal(metrics, args, step, quiet) if par.rank == 0 else 0
            # before the trainer is parked; colocated, --offload-train parked the optimizer states at the sync
            run.maybe_save(model, opt, sched, step + 1, args.num_rollout, prepare=servers.for_checkpoint,
                           rollout=source.state())
            if evals and run.eval_due(step + 1, args.num_rollout):
                servers.to_rollout()
                if par.rank == 0:
                    evaluate(servers.engine, processor, eval_records, args, step + 1, run)
    finally:
        servers.shutdown()


if __name__ == "__main__":
    console.entry(main, parse_args)
