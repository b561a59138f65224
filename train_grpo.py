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
import pickle
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from tqdm import tqdm
from transformers import AutoProcessor

import chat
import cluster
import flags as F
import loss as L
import model as M
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
    a("--advantage-estimator", default="grpo", choices=list(L.ESTIMATORS), help="loss.py; README, \"The algorithm\"")
    a("--eps-clip", type=F.at_least(0.0), default=0.2, help="PPO clip below 1")
    a("--eps-clip-high", type=F.at_least(0.0), default=0.28, help="PPO clip above 1")
    a("--kl-loss-coef", type=F.at_least(0.0), default=0.0, help="KL to the initial policy (0: no reference model)")
    a("--kl-loss-type", default="low_var_kl", choices=list(L.KL))
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
    if args.n_samples_per_prompt == 1 and args.num_rollout:
        p.error("--n-samples-per-prompt 1: a group of one has zero advantage, GRPO would learn nothing")
    if sglang_engine.engine_kind(args) == "local" and args.sglang_args:  # engine_kind: is sglang installed?
        p.error(f"{' '.join(args.sglang_args)}: SGLang flags, but the rollout engine is local")
    if args.async_rollout and (args.colocate or args.offload_train):
        p.error("--async-rollout: the next rollout runs while this step trains, so the engine needs GPUs of its "
                "own (--rollout-num-gpus N; not --colocate) and the trainer stays on them (no --offload-train)")
    if not args.partial_rollout and (args.over_sampling_batch_size or args.mask_offpolicy_in_partial_rollout):
        p.error("--over-sampling-batch-size and --mask-offpolicy-in-partial-rollout need --partial-rollout")
    if (args.over_sampling_batch_size or args.rollout_batch_size) < args.rollout_batch_size:
        p.error(f"--over-sampling-batch-size {args.over_sampling_batch_size}: at least --rollout-batch-size "
                f"{args.rollout_batch_size} (the groups a step trains on come from those it samples)")
    if args.colocate and args.weight_sync == "distributed":  # rank 0 and the server's TP rank 0 share GPU 0
        p.error("--colocate --weight-sync distributed: NCCL refuses a communicator that holds one GPU twice; "
                "colocated weights go by --weight-sync tensor (the default) or disk")
    return args


def to_item(sample, processor, adv, encoded=None):
    """A sample as trainer input. `encoded` caches image encodings by the images' identity: a
    group's samples share their prompt's images, so those are encoded once, and pickled once
    when rank 0 broadcasts the step (pickle keeps one copy of a shared tensor)."""
    encoded = {} if encoded is None else encoded
    key = tuple(map(id, sample.images))
    if key not in encoded:
        encoded[key] = chat.encode_images(processor, sample.images)
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
    """The --advantage-estimator's policy loss (loss.py) over a global batch held as this rank's `items`, through
    the pipeline schedule (backward per micro-batch; under PP the loss is the last stage's, its stats reach every
    rank), with the KL, entropy and TIS terms, each token weighted by --loss-agg."""
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
        dev, lens = logp.device, [len(it.old) for it in mb]  # everything below on the model's device (CUDA under NCCL)
        n = torch.tensor(lens, device=dev)

        def cat(field):  # (N,) the micro-batch's per-token `field` of its items
            return torch.cat([getattr(it, field) for it in mb]).to(dev)
        adv = torch.tensor([float(it.adv) for it in mb], device=dev).repeat_interleave(n)
        # token weights: token-level mean over the global batch, or per-sequence mean then mean
        w = (torch.full_like(logp, 1.0 / n_tok) if args.loss_agg == "token"
             else (1.0 / n.clamp(min=1) / n_seq).repeat_interleave(n))
        pg, clipped = L.ESTIMATORS[args.advantage_estimator].policy(logp, cat("old"), adv, lens, args.eps_clip,
                                                                     args.eps_clip_high)
        if args.tis_cap and mb[0].recomputed_logprobs is not None:  # truncated importance sampling
            pg = pg * L.tis(cat("old"), cat("rollout_logprobs"), args.tis_cap)
        loss_tok = pg - args.entropy_coef * ent if args.entropy_coef else pg  # without: no entropy backward
        kl = torch.zeros_like(logp) if ref is None else L.KL[args.kl_loss_type](logp, cat("ref_logprobs"))
        loss = ((loss_tok + args.kl_loss_coef * kl) * w).sum()
        s = dict(loss=loss.item(), kl=(kl.detach() * w).sum().item(), clipfrac=(clipped.float() * w).sum().item(),
                 entropy=(ent.detach() * w).sum().item(), diff_sum=0.0, diff_max=0.0)  # clipfrac: the clip cut it
        if measure:  # weights are still those the engine sampled with: logprobs must agree
            diff = (logp.detach() - cat("rollout_logprobs")).abs()
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


class Sampler:
    """Rank 0's half of a step's rollout: the step's prompts (trainer.draw: a function of seed and step;
    --partial-rollout: the next ones of the data stream, after the buffer's groups), sampled and scored
    through the engine, their advantages, each DP rank's share. --partial-rollout keeps the buffer of
    groups a rollout stopped and the data position, and what both were when a step's rollout began
    (state): a checkpoint holds the state its resumed run starts from."""

    def __init__(self, engine, processor, records, args, updates, dp):
        self.engine, self.processor, self.records, self.args, self.updates, self.dp = engine, processor, records, args, updates, dp
        self.partial = R.Partial() if args.partial_rollout else None
        self.cursor, self.began = 0, None  # prompts the stream gave so far; (step, state) at that rollout's start

    def state(self, step):
        """What a run resumed at `step` starts from: None without --partial-rollout."""
        if self.partial is None:
            return None
        return pickle.loads(self.began[1]) if self.began and self.began[0] == step else (self.cursor, self.partial.groups)

    def load(self, state):
        if state is not None and self.partial is not None:
            self.cursor, self.partial.groups = state

    def __call__(self, step, version):
        """-> (each DP rank's (sample, advantage) pairs of each update, metrics). `version`: the updates the
        engine's weights have had; a token of an older version than `step`'s policy is off-policy."""
        t0, args = time.perf_counter(), self.args
        if self.partial is None:
            batch = T.draw(self.records, step, args)
        else:
            self.began = (step, pickle.dumps((self.cursor, self.partial.groups)))
            extra = (args.dynamic_sampling_max_prompts or 4 * args.rollout_batch_size) if args.dynamic_sampling else 0
            batch = T.stream(self.records, self.cursor, self.partial.cap(args) - len(self.partial.groups) + extra, args.seed)
        samples = R.generate_group_samples(self.engine, self.processor, batch, R.RolloutConfig.from_args(args),
                                           partial=self.partial, version=version)
        metrics = R.rollout_metrics(samples)
        if self.partial is not None:
            self.cursor += self.partial.drawn
            metrics["partial_buffer_groups"] = len(self.partial.groups)
        good = [s for s in samples if s.status not in ("failed", "aborted") and any(s.loss_mask)]
        if args.mask_offpolicy_in_partial_rollout:  # tokens written before the sample's last abort: no loss
            for s in good:
                s.loss_mask = [m and v >= max(s.versions) for m, v in zip(s.loss_mask, s.versions)]
        trained = [v for s in good for m, v in zip(s.loss_mask, s.versions) if m]
        metrics.update(tokens=sum(len(s.tokens) for s in good), rollout_policy_version=version,
                       offpolicy_token_frac=sum(v < step for v in trained) / max(1, len(trained)))
        if trained:
            metrics["oldest_token_version"] = min(trained)
        failed = sorted({s.fail_reason for s in samples if s.status == "failed"})
        if failed and good:  # counted in failed_frac; say why, once a step
            print(f"[grpo] step {step + 1}: {sum(s.status == 'failed' for s in samples)} of {len(samples)} samples "
                  f"failed: {'; '.join(r[:200] for r in failed[:3])}", flush=True)
        if not good:
            reasons = sorted({s.fail_reason or s.status for s in samples if s.status != "completed"})
            print(f"[grpo] step {step + 1}: no trainable sample among {len(samples)} "
                  f"({', '.join(reasons[:3]) or 'no response tokens'}): update skipped", flush=True)
        adv = L.advantages([s.reward for s in good], [s.group for s in good], args.advantage_estimator)
        metrics["_ran"] = (t0, time.perf_counter())
        return split_batch(good, adv, random.Random(args.seed + step), args.global_batch_size, self.updates, self.dp), metrics


@dataclasses.dataclass
class Batch:
    """A step's rollout on one rank: its items of each update (None: an update with no sample) and
    metrics (rank 0's)."""
    items: list
    metrics: dict


class Sync:
    """The rollout source of a step: rank 0 samples it (Sampler) with the weights the step trains, then
    every rank receives its share (deal)."""

    def __init__(self, sampler, par, processor):
        self.sampler, self.par, self.processor = sampler, par, processor

    def next(self, step):
        t = time.perf_counter()
        shares, metrics = self.sampler(step, step) if self.par.rank == 0 else (None, {})
        metrics.pop("_ran", None)
        return self.deal(shares, metrics, t)

    def deal(self, shares, metrics, t):
        """Every rank: its DP rank's share of rank 0's `shares` -> Batch (a group's images, shared in the
        payload, encoded once on each rank)."""
        h, encoded = time.perf_counter(), {}
        items = [None if part is None else [to_item(s, self.processor, a, encoded) for s, a in part]
                 for part in T.hand_out(shares, self.par)]
        return Batch(items, dict(metrics, handoff_s=time.perf_counter() - h, rollout_s=time.perf_counter() - t))

    def settle(self):
        """Before the engine takes the step's new weights; -> metrics."""
        return {}


class Ahead(Sync):
    """--async-rollout: rank 0 starts step k+1's rollout in a thread once step k's is dealt out, so that it
    runs while step k trains, with the weights before step k's update (one step off-policy); settle() waits
    for it to end before the engine takes new weights (every node's server too: a barrier)."""

    def __init__(self, sampler, par, processor, steps):
        super().__init__(sampler, par, processor)
        self.steps, self.pool, self.next_rollout = steps, ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead"), None

    def next(self, step):
        t, version = time.perf_counter(), step
        if self.par.rank != 0:
            return self.deal(None, {}, t)
        if self.next_rollout is not None:  # started while the last step trained
            (shares, metrics), version = self.next_rollout.result(), step - 1
        else:
            shares, metrics = self.sampler(step, step)
        self.next_rollout = self.pool.submit(self.sampler, step + 1, step) if step + 1 < self.steps else None
        metrics.pop("_ran")
        self.trained = time.perf_counter()
        return self.deal(shares, dict(metrics, rollout_policy_version=version), t)

    def settle(self):
        out = {}
        if self.next_rollout is not None:  # how long the next rollout ran beside this step's training
            ran, now = self.next_rollout.result()[1]["_ran"], time.perf_counter()
            out["rollout_ahead_overlap_s"] = max(0.0, min(ran[1], now) - max(ran[0], self.trained))
        if self.par.world > 1:
            torch.distributed.barrier()
        return out

    def close(self):  # a rollout still running is not waited for
        self.pool.shutdown(wait=False, cancel_futures=True)


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


class Policy:
    """The trainer of every rank: the model, the reference model of the KL term, the optimizer and its
    schedule; train() runs a step's updates on this rank's share."""

    def __init__(self, model, ref, opt, sched, args, updates):
        self.model, self.ref, self.opt, self.sched, self.args, self.updates = model, ref, opt, sched, args, updates

    def train(self, batch):
        """One optimizer step per update over this rank's items of it; an update with no sample (None on
        every rank alike) is skipped on every rank in lockstep. -> the last update's stats (logprob_diff_*
        from the first: the weights the engine sampled with)."""
        t, model, par, args = time.perf_counter(), self.model, self.model.par, self.args
        model.train()
        if args.recompute_logprobs:
            recompute_old(model, [it for part in batch.items if part for it in part], args)
        stats = {"updates_skipped": 0}
        for part in batch.items:
            if part is None:
                stats["updates_skipped"] += 1
                continue
            s = policy_loss(model, self.ref, par, part, args, measure="logprob_diff_mean" not in stats)
            s.update(optim.optimizer_step(model, self.opt, self.sched, par, args))
            stats.update(s)
        t = time.perf_counter() - t
        return dict(stats, **T.expert_load(model), train_s=t, tokens_per_s=batch.metrics.get("tokens", 0) / max(t, 1e-9))


def grpo_step(step, policy, source, servers, run):
    """One step in slime's order: generate, the engine steps aside, train, it comes back and takes the new
    weights (its update flushes its caches), log. The variants (one step ahead, partial rollout, colocated,
    offload) live in the objects: source (Sync / Ahead, their Sampler), servers (cluster.Servers)."""
    t = time.perf_counter()
    servers.to_rollout()                 # --offload-train: the trainer parks; a colocated server takes all back
    batch = source.next(step)            # rank 0 samples (this step's, or the one made ahead); each rank its share
    servers.step_aside()                 # colocated: the server frees the GPUs; the trainer returns from host memory
    stats = policy.train(batch)          # every rank: the PPO-clip updates on its share
    stats.update(source.settle())        # one step ahead: the next rollout ends before the weights change
    stats.update(servers.step_back())    # colocated: the server takes its memory back
    stats.update(servers.sync(policy.model))  # new weights to every server
    metrics = {**batch.metrics, **stats, "step_s": time.perf_counter() - t}
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
    ref = (M.load_model(args.hf_checkpoint, dataclasses.replace(opts, freeze_vit=True), par).eval().requires_grad_(False)
           if args.kl_loss_coef else None)
    updates = math.ceil(args.rollout_batch_size * args.n_samples_per_prompt / args.global_batch_size)
    opt, sched = optim.build_optimizer(model, args, args.num_rollout * updates)
    start = run.load_state(ckpt, opt, sched)["step"] if ckpt else 0
    policy = Policy(model, ref, opt, sched, args, updates)
    records = eval_records = None
    if par.rank == 0:  # rank 0 owns the data and the rewards; each node's leader its server (cluster.py)
        reward.init()  # its one-off warm-up here, not in the first rollout
        fit = dict(measure=lambda r: len(chat.prompt(processor, r, args.max_turns > 1)[2]),
                   limit=(args.max_context_len - 1, f"--max-context-len {args.max_context_len} with room for a response"))
        records, eval_records = T.load_data(args, **fit), T.load_data(args, evaluation=True, **fit)
    servers = cluster.Servers(args, par, model, opt, ref, str(ckpt or args.hf_checkpoint), str(run.save), processor)
    sampler = Sampler(servers.engine, processor, records, args, updates, par.dp) if par.rank == 0 else None
    if sampler is not None and ckpt:
        sampler.load(run.load_rollout(ckpt))
    source = (Ahead(sampler, par, processor, args.num_rollout) if args.async_rollout else Sync(sampler, par, processor))
    evals = servers.agree(bool(eval_records))
    try:
        if par.rank == 0 and eval_records and start == 0:
            evaluate(servers.engine, processor, eval_records, args, 0, run)
        bar = tqdm(range(start, args.num_rollout), desc="grpo", disable=par.rank != 0,
                   initial=start, total=args.num_rollout)
        for step in bar:
            metrics = grpo_step(step, policy, source, servers, run)
            bar.set_postfix(reward=f"{metrics.get('reward', 0):.3f}")
            # before the trainer is parked; colocated, --offload-train parked the optimizer states at the sync
            run.maybe_save(model, opt, sched, step + 1, args.num_rollout, prepare=servers.for_checkpoint,
                           rollout=sampler and sampler.state(step + 1))
            last = step + 1 == args.num_rollout
            if evals and (last or (args.eval_interval and (step + 1) % args.eval_interval == 0)):
                servers.to_rollout()
                if par.rank == 0:
                    evaluate(servers.engine, processor, eval_records, args, step + 1, run)
    finally:
        getattr(source, "close", lambda: None)()
        servers.shutdown()


if __name__ == "__main__":
    sys.exit(main())
