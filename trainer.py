"""Training plumbing shared by sft.py and train_grpo.py: the trainer item, packing by token budget, sums over
data-parallel ranks, metrics, and atomic checkpoints (HF weights + optimizer, RNG, data position)."""
import copy
import dataclasses
import errno
import fcntl
import importlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import console
import convert
import data
import optim
import parallel


@dataclasses.dataclass
class Item:
    """One sequence as a trainer takes it. N = mask.sum(), the tokens the loss scores."""
    ids: torch.Tensor  # (T,) prompt + response token ids
    mask: torch.Tensor  # (T,) bool; mask[0] is False (token 0 has no logits before it)
    pixel_values: torch.Tensor | None = None  # its images as the processor encodes them, or None
    image_grid_thw: torch.Tensor | None = None
    adv: float = 0.0  # GRPO: the sample's advantage
    rollout_logprobs: torch.Tensor | None = None  # (N,) the engine's, as it sampled
    recomputed_logprobs: torch.Tensor | None = None  # (N,) --recompute-logprobs: the trainer's, before the update
    ref_logprobs: torch.Tensor | None = None  # (N,) the reference model's (the KL term)
    routed_experts: torch.Tensor | None = None  # (T, layers, k) int16: the engine's experts, -1: none (R3)
    same_version: torch.Tensor | None = None  # (N,) bool: written by the weights being trained (not older ones)

    @property
    def old(self):
        """(N,) the PPO ratio's denominator: the trainer's own logprobs when recomputed, else the engine's."""
        return self.rollout_logprobs if self.recomputed_logprobs is None else self.recomputed_logprobs


def start(args, kind, fixed=()):
    """A training job's first call: (the parallel context, its seeded RNGs, the run folder). `fixed`: the
    trainer's flags of its data position, which a resume may not change (compare)."""
    if args.optimizer_cpu_offload and not args.use_distributed_optimizer:
        raise SystemExit("--optimizer-cpu-offload needs --use-distributed-optimizer (megatron-core's CPU Adam)")
    ckpt = Path(args.hf_checkpoint)  # said before anything loads; the trainers download nothing
    if not ckpt.is_dir():
        raise SystemExit(f"--hf-checkpoint {ckpt}: no such folder (a hub id: download it, e.g. hf download ID "
                         "--local-dir DIR, and pass the folder)")
    if not (ckpt / "config.json").is_file():
        raise SystemExit(f"--hf-checkpoint {ckpt}: no config.json in it")
    convert.family(ckpt)  # a text-only Qwen2 is named here, not by the processor's traceback
    par = parallel.init_distributed(args.tensor_model_parallel_size, args.seed, args.distributed_timeout_minutes,
                                    args.expert_model_parallel_size, cp=args.context_parallel_size,
                                    pp=args.pipeline_model_parallel_size)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    return par, Run(args, kind, par, fixed)


class Run:
    """The run folder of one training job: its lock, the resume / overwrite policy, metrics, the
    config, checkpoints. Global rank 0 writes; every rank takes part in a checkpoint."""

    def __init__(self, args, kind, par, fixed=()):
        self.args, self.par, self.rank, self.kind, self.save = args, par, par.rank, kind, Path(args.save)
        self.lock, self.last, self.stopping, self.signalled = None, {}, None, False
        self.sinks = []  # wandb's and TensorBoard's log(step, metrics), where asked for
        self.t0 = time.time()  # --exit-duration-in-mins counts from here (console.stop_reason)
        if self.rank == 0:
            try:
                self.save.mkdir(parents=True, exist_ok=True)
            except OSError as e:  # a file on the way, no permission, a read-only disk: one line, not a traceback
                raise SystemExit(f"--save {self.save}: cannot be made ({e.strerror}: {e.filename})") from None
            self.lock = lock_folder(self.save)
        self.ckpt = find_checkpoint(args.load, self.save)  # the checkpoint to resume from, or None: a fresh start
        # the checkpoint's meta.json (step, TP, PP sizes): what nothing_left and load_state read
        self.meta = None if self.ckpt is None else read_state(self.ckpt / "train_state" / "meta.json",
                                                              lambda f: json.loads(f.read_text()))
        if self.rank == 0:
            self.config = dict(vars(args), kind=kind, world_size=par.world, versions=versions())
            if self.ckpt is None:
                start_fresh(self.save, args.overwrite, args.load)
                self.write_config(f"config_{kind}.json")
                atomic_write(self.save / "args.txt", "".join(a + "\n" for a in args.argv))  # `sft.py @args.txt` replays it
            else:  # refused or said now; written as the resume happens (load_state), beside the run's first
                convert.same_architecture(args.hf_checkpoint, self.ckpt)
                compare(self.ckpt.parent / f"config_{kind}.json", self.config, FIXED + fixed)
            if args.wandb_project:
                try:
                    import wandb
                    self.sinks.append(wandb.init(project=args.wandb_project, config=self.config).log)
                except ImportError:
                    print("[run] wandb is not installed; logging to metrics.jsonl only", file=sys.stderr)
            if args.use_tensorboard:
                self.sinks.append(console.tensorboard(self.save / "tensorboard"))

    def write_config(self, name):
        (self.save / name).write_text(json.dumps(self.config, indent=1, default=str))
        print(f"[run] config (flags, versions): {self.save / name}", flush=True)

    def write_rows(self, name, rows):
        """<save>/<name>, one JSON line a row (an evaluation's responses), written whole; -> its path."""
        atomic_write(self.save / name, "".join(json.dumps(r) + "\n" for r in rows))
        return self.save / name

    def log(self, step, metrics):
        """One JSON line a step, flushed and synced: nothing is lost on a crash."""
        if self.rank != 0:
            return
        self.last.update(metrics)  # the latest of each metric: the console's (steps)
        with open(self.save / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        for sink in self.sinks:
            sink(metrics, step=step)

    def save_checkpoint(self, model, opt, sched, step, rollout=None):
        """<save>/iter_NNNNNNN (HF weights, train_state/, `rollout`: rank 0's rollout state to resume with), written
        as .tmp_<name> and renamed, never half-visible; then only the newest --save-keep stay (docs/training.md)."""
        name = f"iter_{step:07d}"
        tmp, final = self.save / f".tmp_{name}", self.save / name
        state_dir = tmp / "train_state"
        finite = torch.stack([torch.isfinite(p).all().to(self.par.device) for p in model.parameters()])  # its shards
        if parallel.all_reduce((~finite).sum(), None, dist.ReduceOp.MAX).item():  # the device read once, not a tensor
            bad = [n for (n, _), ok in zip(model.named_parameters(), finite.tolist()) if not ok]
            raise SystemExit(f"[run] step {step}: weights not finite (NaN or inf{': ' if bad else ''}{', '.join(bad[:3])})"
                             f"; not saved, earlier checkpoints kept: lower --lr and resume with --load {self.save}")
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                state_dir.mkdir(parents=True)
            dist.barrier()
            convert.save_hf(model, tmp, src_dir=self.args.hf_checkpoint)  # not a checkpoint pruning may remove
            mine, names = state_name(self.par, opt), [None] * self.par.world
            dist.all_gather_object(names, mine)  # ranks of the same state_name hold the same state: the first writes
            if names.index(mine) == self.rank:
                state = {"optimizer": optim.state_of(opt), "scheduler": sched.state_dict(), "rng": rng_state()}
                torch.save(state, state_dir / mine)
            dist.barrier()
            if self.rank == 0:
                if rollout is not None:
                    torch.save(rollout, state_dir / "rollout.pt")
                (state_dir / "meta.json").write_text(json.dumps({"step": step, "tp": self.par.tp, "pp": self.par.pp}))
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                atomic_write(self.save / "latest", name)
        except Exception as e:  # noqa: BLE001 - a full disk shows as OSError, torch's RuntimeError, safetensors'...
            shutil.rmtree(tmp, ignore_errors=True)
            full = "no space left on the device of --save: " if disk_full(e) else ""
            raise SystemExit(f"[run] checkpoint {final} could not be written ({full}{type(e).__name__}: {e}); "
                             f"removed {tmp.name}; {self.save / 'latest'} still names the last complete "
                             f"checkpoint. Free space in --save and resume with --load {self.save}") from None
        if self.rank == 0:
            console.say(f"[run] saved checkpoint {final}")
            done = sorted(p for p in self.save.glob("iter_*") if (p / "train_state" / "meta.json").exists())
            if self.args.save_keep > 0:
                for old in done[:-self.args.save_keep]:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def maybe_save(self, model, opt, sched, step, total, prepare=lambda: None, rollout=None):
        """Every --save-interval steps, after the last, and before a stop (console.stop_reason); prepare() first
        when it saves."""
        self.stopping = console.stop_reason(self)
        if (self.args.save_interval and step % self.args.save_interval == 0) or step == total or self.stopping:
            prepare()
            self.save_checkpoint(model, opt, sched, step, rollout)

    def eval_due(self, step, total):
        """An evaluation after `step`: every --eval-interval steps and after the last, not on the way out."""
        return not self.stopping and (step == total or bool(self.args.eval_interval and step % self.args.eval_interval == 0))

    def nothing_left(self, total, flag):
        """A resumed run already at its last step ends here, saying so (exit 0), before any model loads."""
        if self.ckpt and total and self.meta["step"] >= total:
            if self.rank == 0:
                print(f"[run] {self.ckpt} is step {self.meta['step']}; {flag} asks for {total}: nothing to do "
                      f"(raise {flag} to continue)", flush=True)
            raise SystemExit(0)

    def load_rollout(self):
        """The rollout state save_checkpoint kept: rank 0's, None elsewhere or where there is none."""
        f = self.ckpt and self.ckpt / "train_state" / "rollout.pt"
        return read_state(f) if self.rank == 0 and f and f.exists() else None

    def load_state(self, ckpt, opt, sched):
        """Optimizer, schedule and RNG of this rank; returns the meta dict (step, data position)."""
        meta = self.meta
        for flag, key, now in (("--tensor-model-parallel-size", "tp", self.par.tp),
                               ("--pipeline-model-parallel-size", "pp", self.par.pp)):
            if meta.get(key, now) != now:
                raise SystemExit(f"--load {ckpt}: saved at {flag} {meta[key]}, now {now}; resume at the same size")
        state = read_state(ckpt / "train_state" / state_name(self.par, opt))
        # torch.load's tensors are views of the file's records, whose storage cannot be resized: an optimizer
        # state kept as it is (same device and dtype) would stop --offload-train's first park
        optim.load_state(opt, copy.deepcopy(state["optimizer"]))
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        if self.rank == 0:
            trim_metrics(self.save, meta["step"])
            self.write_config(f"config_{self.kind}_resumed_at_{meta['step']:07d}.json")
            print(f"[run] resumed from {ckpt} at step {meta['step']}", flush=True)
        return meta


# What a checkpoint fixes (docs/training.md's table): the data order (the rows and the seed that orders them), the
# optimizer's hyperparameters and schedule, which its state restores (torch keeps the saved param groups; megatron-core
# 0.16.1 optimizer_param_scheduler.py:312-333); + start's `fixed`.
FIXED = ("seed", "prompt_data", "split", "input_key", "label_key", "multimodal_keys", "max_context_len", "allow_image_urls",
         "allow_outside_paths", "max_pixels", "min_pixels", "lr", "min_lr", "decoupled_lr", "lr_warmup_iters", "lr_decay_style", "adam_beta1",
         "adam_beta2", "weight_decay")


def compare(saved_path, config, fixed):
    """A resume's flags against its run's first config: a changed `fixed` flag is refused (it cannot act), each
    other change said, one line each."""
    saved = json.loads(saved_path.read_text()) if saved_path.exists() else {}
    derived = set(config.get("derived", ())) & set(saved.get("derived", ()))  # flags neither run gave: follow others
    changed = {k: f"--{k.replace('_', '-')} {v} (the run: {saved[k]})" for k, v in config.items() if k in saved and
               saved[k] != v and k not in ("load", "overwrite", "argv", "versions", "world_size", "derived", *derived)}
    if bad := [line for k, line in changed.items() if k in fixed]:
        raise SystemExit(f"--load {saved_path.parent}: a resume keeps the run's data order and optimizer state, so "
                         "these cannot change:\n  " + "\n  ".join(bad) + "\nresume with the run's values, or start a new "
                         f"run from a checkpoint's weights (--hf-checkpoint {saved_path.parent}/iter_N)")
    for line in changed.values():
        print(f"[run] resumed with {line}", flush=True)


def find_checkpoint(load_flag, save):
    """The checkpoint --load points at: its `latest`, else its newest complete iter_*; None when --load is
    --save and holds none yet (slime's habit). Else an error."""
    if not load_flag:
        return None
    load, done = Path(load_flag), []
    if (load / "latest").exists():
        load = load / (load / "latest").read_text().strip()
    elif not (load / "train_state" / "meta.json").exists():
        done = sorted(p for p in load.glob("iter_*") if (p / "train_state" / "meta.json").exists())
        load = done[-1] if done else load
    if not (load / "train_state" / "meta.json").exists():
        if Path(load_flag).resolve() == Path(save).resolve() and not done:
            return None
        raise SystemExit(f"--load {load_flag}: no checkpoint there (no 'latest', no iter_* with train_state/meta.json)")
    return load


EARLIER = ("iter_*", "latest", "metrics.jsonl", "eval_*.jsonl", "config_*.json", "args.txt", "sglang*.log", "summary.md",
           "reward_curve.png", "tensorboard")


def start_fresh(save, overwrite, load):
    """A fresh start may not mix with an earlier run: its checkpoints need --load (resume) or --overwrite, its metrics
    too; then every file of it goes, said (EARLIER, tools/report.py's too: a step-0 eval kept would be compared with)."""
    save = Path(save)
    old = sorted(save.glob("iter_*")) + sorted(save.glob("latest"))
    if old and not overwrite:
        raise SystemExit(f"--save {save} holds checkpoints of an earlier run ({old[0].name}...): "
                         f"resume with --load {save}, or pass --overwrite to delete them and start fresh")
    if not (overwrite or load) and (save / "metrics.jsonl").exists() and (save / "metrics.jsonl").stat().st_size:
        raise SystemExit(f"--save {save} holds metrics.jsonl of an earlier run: resume with "
                         f"--load {save}, or pass --overwrite to start fresh")
    gone = sorted({p for pattern in EARLIER for p in save.glob(pattern)})
    for p in gone:
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    removed = f" (removed the earlier run's {len(gone)} file(s): {', '.join(p.name for p in gone)})" if gone else ""
    print(f"[run] starting fresh in {save}{removed}", flush=True)


def trim_metrics(save, step):
    """Keep metrics.jsonl up to `step` (what a killed run logged after its checkpoint goes),
    dropping, with a note, lines a crash or a full disk tore."""
    log = Path(save) / "metrics.jsonl"
    if not log.exists():
        return
    keep, torn = [], []
    for i, line in enumerate(log.read_text(errors="replace").splitlines()):
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            torn.append(i + 1)
    if torn:
        print(f"[run] {log}: dropped unreadable line(s) {torn[:5]} (a crash or a full disk)", file=sys.stderr, flush=True)
    atomic_write(log, "".join(line + "\n" for line in keep))


def load_data(args, evaluation=False, verbose=True, measure=None, limit=None):
    """The training (or evaluation: its first --eval-samples, 0: all) records the flags name; [] when no eval
    data is given. `measure(record)` -> its tokens, through the processor: a row it refuses (an image's aspect
    ratio...) is a bad row, named; one over `limit` = (tokens, "the flag") is skipped, counted."""
    source = args.eval_prompt_data if evaluation else args.prompt_data
    if not source:
        return []

    def check(rec):
        try:
            n = measure(rec)
        except Exception as e:  # noqa: BLE001 - whatever the processor raises, name the row
            raise ValueError(f"the processor refuses it ({type(e).__name__}: {e})") from None
        if n > limit[0]:
            raise data.TooLong(f"{n} tokens, over {limit[1]}")
    try:
        keys = (args.eval_input_key or args.input_key, args.eval_label_key or args.label_key) if evaluation else (
            args.input_key, args.label_key)
        records = data.load_geo3k(source, args.eval_split if evaluation else args.split, *keys, args.max_bad_frac,
                                  args.max_pixels, verbose=verbose, check=measure and check, allow_urls=args.allow_image_urls,
                                  allow_outside=args.allow_outside_paths, multimodal_keys=args.multimodal_keys,
                                  flag="--eval-" if evaluation else "--", min_pixels=args.min_pixels)
    except data.DataError as e:
        raise SystemExit(f"--{'eval-' if evaluation else ''}prompt-data: {e}") from None
    return records[:args.eval_samples or None] if evaluation else records


def lock_folder(folder):
    """Hold <folder>/.lock (an flock) for this process's life: one trainer per run folder (README)."""
    f = open(folder / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise SystemExit(f"--save {folder}: in use by another trainer ({f.read().strip() or 'pid unknown'}); "
                         f"one run folder holds one run at a time") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    return f


def disk_full(e):
    """Whether a checkpoint write failed for want of space: ENOSPC, or torch's zip writer cut short."""
    return getattr(e, "errno", None) == errno.ENOSPC or any(
        s in str(e) for s in ("No space left", "unexpected pos", "PytorchStreamWriter failed"))


def read_state(path, read=lambda f: torch.load(f, weights_only=False)):
    """read(path), or an error naming the checkpoint file that is missing, truncated or corrupt."""
    try:
        return read(path)
    except Exception as e:  # noqa: BLE001 - json, pickle and zip errors alike: name the file
        raise SystemExit(f"--load: {path} is missing, truncated or corrupt ({type(e).__name__}: {e}); "
                         f"resume from an earlier checkpoint: --load {path.parent.parent.parent}/iter_<N>") from None


def atomic_write(path, text):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def state_name(par, opt):
    """This rank's train_state file: one per TP (PP, EP) rank, and per DP rank when the optimizer is sharded."""
    dp = f"_dp_{par.dp_rank:03d}" if getattr(opt, "sharded", False) else ""
    ep = f"_ep_{par.ep_rank:02d}" if par.ep > 1 else ""  # MoE: each EP rank holds other experts
    pp = f"_pp_{par.pp_rank:02d}" if par.pp > 1 else ""  # PP: each stage holds other layers
    return f"tp_{par.tp_rank:02d}{pp}{ep}{dp}.pt"


def rng_state():
    return {"python": random.getstate(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(s):
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if s.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda"])


def versions():
    out = {"python": sys.version.split()[0]}
    for mod in ("torch", "transformers", "megatron.core", "sglang"):
        try:
            out[mod] = importlib.import_module(mod).__version__
        except Exception:  # noqa: BLE001 - absent or broken optional package
            out[mod] = None
    try:
        out["git"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except OSError:
        out["git"] = None
    return out


def global_sum(value, par, op=dist.ReduceOp.SUM):
    """Sum a number over data-parallel ranks (e.g. loss tokens of the global batch); or max, by op."""
    t = torch.tensor(float(value), dtype=torch.float64, device=par.device)
    return parallel.all_reduce(t, par.dp_group, op).item()


def pack(lengths, max_tokens):
    """Indices grouped into micro-batches of at most `max_tokens` tokens, first-fit decreasing (a longer one alone)."""
    bins, room = [], []  # room: each bin's free tokens
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((k for k, free in enumerate(room) if lengths[i] <= free), None)  # the first bin it fits in
        if k is None:
            bins.append([i])
            room.append(max_tokens - lengths[i])
        else:
            bins[k].append(i)
            room[k] -= lengths[i]
    return [sorted(b) for b in bins]


def micro_batches(items, max_tokens, par, replay=True):
    """-> (items, model inputs) of each packed micro-batch of this rank's `items`; with EP, then idle ones
    ([], two pad tokens) up to the busiest rank's count: MoE layers run collectives (docs/training.md).
    replay: pass the items' routed_experts (R3) to the model."""
    bins = pack([len(it.ids) for it in items], max_tokens * par.cp)  # a CP rank holds 1/CP of each
    n = 0  # idle micro-batches to run, agreed before any runs: MoE collectives must not cross this reduce
    if par.ep > 1:
        n = int(parallel.all_reduce(torch.tensor(len(bins), device=par.device), None, dist.ReduceOp.MAX)) - len(bins)
    for idx in bins:
        mb = [items[i] for i in idx]
        pv = [it.pixel_values for it in mb if it.pixel_values is not None]
        grid = [it.image_grid_thw for it in mb if it.image_grid_thw is not None]
        x = dict(seqs=[it.ids for it in mb], loss_masks=[it.mask for it in mb],
                 pixel_values=torch.cat(pv) if pv else None, image_grid_thw=torch.cat(grid) if grid else None)
        if replay and any(it.routed_experts is not None for it in mb):
            x["routed_experts"] = [it.routed_experts for it in mb]
        yield mb, x
    for _ in range(n):
        yield [], dict(seqs=[torch.zeros(2, dtype=torch.long)], loss_masks=[torch.zeros(2, dtype=torch.bool)])


def expert_load(model):
    """MoE metrics of the step: expert_load (each expert's share of routed tokens, mean over
    layers, all ranks) and expert_load_max (the busiest expert's share x experts; 1.0 is even)."""
    load = model.expert_load()
    if load is None:
        return {}
    load = parallel.all_reduce(load, None)  # (layers, experts) on every rank: each stage adds its layers' rows
    load = load[load.sum(1) > 0]  # the MoE layers
    if not len(load):  # no rank ran a forward
        return {}
    share = load / load.sum(1, keepdim=True)
    return {"expert_load": [round(x, 4) for x in share.mean(0).tolist()],
            "expert_load_max": round(float(share.max(1).values.mean() * share.shape[1]), 3)}


def epoch_order(n, seed, epoch):
    """The data order of an epoch: a function of (seed, epoch) only, so a resumed run sees the same."""
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    return order


def stream(records, start, count, seed):
    """Records at positions start .. start + count of the data stream, each epoch in its epoch_order."""
    n, orders, out = len(records), {}, []
    for j in range(start, start + count):
        epoch, pos = divmod(j, n)
        if epoch not in orders:
            orders[epoch] = epoch_order(n, seed, epoch)
        out.append(dict(records[orders[epoch][pos]], index=orders[epoch][pos]))
    return out


def draw(records, step, args):
    """The prompts of a step: the stream's from step x --rollout-batch-size on; with --dynamic-sampling,
    extra ones follow (--dynamic-sampling-max-prompts in all). A function of (seed, step)."""
    k = args.rollout_batch_size
    out = stream(records, step * k, k, args.seed)
    if args.dynamic_sampling:  # the over-sample, drawn from the rest of the data
        cap, taken = args.dynamic_sampling_max_prompts or 4 * k, {r["index"] for r in out}
        pool = [i for i in range(len(records)) if i not in taken]
        extra = random.Random(args.seed * 1_000_003 + step).sample(pool, min(len(pool), max(0, cap - k)))
        out += [dict(records[i], index=i) for i in extra]
    return out


def hand_out(shares, par):
    """Each rank receives its DP rank's share of rank 0's `shares` (a scatter: no rank gets another DP rank's)."""
    if par.world == 1:
        return shares[0]
    mine = [None]
    dist.scatter_object_list(mine, [shares[d] for d in par.dp_ranks] if par.rank == 0 else None, src=0)
    return mine[0]


def dp_shard(items, par):
    """This data-parallel rank's share of a global batch (strided, so lengths stay balanced)."""
    return items[par.dp_rank::par.dp]

