"""Training plumbing shared by sft.py and train_grpo.py: flags, packing by token budget, sums over
data-parallel ranks, metrics, and atomic checkpoints (HF weights + optimizer, RNG, data position)."""
import contextlib
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

import convert
import data
import optim
import parallel


def add_train_args(p):
    """Flags both trainers take (named as in slime / miles)."""
    a = p.add_argument
    a("--hf-checkpoint", required=True, help="Hugging Face checkpoint folder to start from")
    a("--prompt-data", required=True, help="training data: hub id, .parquet, .jsonl or folder")
    a("--input-key", default="problem", help="column holding the problem text")
    a("--label-key", default="answer", help="column holding the answer")
    a("--split", default=None, help="split of a hub id or folder (default: train)")
    a("--eval-split", default="test", help="split of --eval-prompt-data when it is a hub id or folder")
    a("--max-bad-frac", type=float, default=0.01, help="stop when more data rows than this are unusable")
    a("--allow-image-urls", action="store_true", help="fetch http(s) images named in data rows "
      "(at most data.URL_MAX_BYTES each); off: such rows are bad rows")
    a("--allow-outside-paths", action="store_true",
      help="let image paths in data rows leave the data set's folder (absolute paths, ..)")
    a("--eval-prompt-data", default=None, help="evaluation data (same forms as --prompt-data)")
    a("--eval-interval", type=int, default=0, help="evaluate every N steps (0: only at the end)")
    a("--eval-samples", type=int, default=64, help="evaluate on the first N eval problems")
    a("--save", required=True, help="run folder: metrics.jsonl, config, checkpoints")
    a("--load", default=None, help="resume from the latest checkpoint in this run folder")
    a("--overwrite", action="store_true", help="start fresh in a --save folder that holds an earlier "
      "run: its checkpoints and metrics are deleted (without it: an error, unless --load resumes)")
    a("--save-interval", type=int, default=50, help="checkpoint every N steps (0: only at the end)")
    a("--save-keep", type=int, default=3, help="keep the newest N checkpoints in --save (0: keep all)")
    a("--global-batch-size", type=int, default=16, help="samples per optimizer step, all ranks")
    a("--max-tokens-per-gpu", type=int, default=4096, help="token budget of one packed micro-batch")
    a("--lr", type=float, default=1e-6, help="peak learning rate")
    a("--min-lr", type=float, default=0.0, help="floor of the cosine decay")
    a("--decoupled-lr", type=float, default=None,
      help="peak lr of the token embedding and output layer (Megatron's flag; default: --lr); "
           "the schedule scales it as it scales --lr")
    a("--lr-warmup-iters", type=int, default=0, help="linear warmup steps")
    a("--lr-decay-style", default="constant", choices=["constant", "cosine"], help="after warmup")
    a("--weight-decay", type=float, default=0.0, help="AdamW weight decay (not on norms/biases)")
    a("--adam-beta1", type=float, default=0.9)
    a("--adam-beta2", type=float, default=0.98)
    a("--clip-grad", type=float, default=1.0, help="clip the global grad norm to this (0: off)")
    a("--tensor-model-parallel-size", type=int, default=1, help="Megatron TP size")
    a("--sequence-parallel", action="store_true", help="split the sequence over TP ranks outside attention "
      "(Megatron's; required for MoE with TP > 1)")
    a("--expert-model-parallel-size", type=int, default=1, help="EP: MoE experts split over this many ranks "
      "(expert-TP 1; expert-DP = world / EP)")
    a("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"],
      help="how tokens reach their experts' ranks (alltoall: GPU only in megatron-core 0.16)")
    a("--moe-router-dtype", default="fp32", choices=["fp32", "fp64"], help="router logits and softmax dtype")
    a("--moe-aux-loss-coeff", type=float, default=0.0, help="load-balancing auxiliary loss weight (0: off)")
    a("--transformer-impl", default=None, choices=["transformer_engine", "local"],
      help="Megatron layer spec (default: transformer_engine on CUDA, an error if it cannot load; local on CPU)")
    a("--distributed-timeout-minutes", type=int, default=60,
      help="collective timeout: rank 0 loads data, starts SGLang and evaluates while the others wait")
    a("--freeze-vit", action="store_true", help="keep the vision tower fixed")
    a("--bf16", action="store_true", help="compute in bf16 with fp32 master weights (optim.py); logprobs and loss in fp32")
    a("--accumulate-allreduce-grads-in-fp32", action="store_true", help="with --bf16: gradients accumulated and reduced in fp32")
    a("--use-distributed-optimizer", action="store_true", help="shard master weights and Adam states over DP ranks")
    a("--recompute-granularity", default=None, choices=["full", "selective"],
      help="recompute activations in backward: whole layers (full) or core attention only (selective)")
    a("--recompute-method", default="uniform", choices=["uniform", "block"],
      help="full: checkpoint every chunk of --recompute-num-layers layers (uniform), or only the first that many (block)")
    a("--recompute-num-layers", type=int, default=1, help="layers per recomputed chunk (uniform) or recomputed layers (block)")
    a("--seed", type=int, default=1234)
    a("--wandb-project", default=None, help="log to wandb too, when it is installed")


class Run:
    """The distributed context, the run folder, metrics and checkpoints of one training job."""

    def __init__(self, args, kind):
        self.args, self.kind = args, kind
        self.rank, self.world, self.device = parallel.init_distributed(
            args.tensor_model_parallel_size, args.seed, args.distributed_timeout_minutes, args.expert_model_parallel_size)
        self.dp_rank, self.dp = parallel.dp_rank_size()
        self.tp_rank, self.tp = parallel.tp_rank_size()
        self.dp_group, self.tp_group = parallel.dp_group(), parallel.tp_group()
        self.save = Path(args.save)
        random.seed(args.seed)
        torch.manual_seed(args.seed)
        self.wandb, self.lock = None, None
        if self.rank == 0:
            self.save.mkdir(parents=True, exist_ok=True)
            self.lock = lock_folder(self.save)
        self.ckpt = self.find_checkpoint()  # the checkpoint to resume from, or None: a fresh start
        if self.rank == 0 and self.ckpt is None:
            self.start_fresh()
        if self.rank == 0:
            config = dict(vars(args), kind=kind, world_size=self.world, versions=versions())
            print(json.dumps(config, indent=1, default=str), flush=True)
            (self.save / f"config_{kind}.json").write_text(json.dumps(config, indent=1, default=str))
            if args.wandb_project:
                try:
                    import wandb
                    self.wandb = wandb.init(project=args.wandb_project, config=config)
                except ImportError:
                    print("[run] wandb is not installed; logging to metrics.jsonl only", file=sys.stderr)

    def log(self, step, metrics):
        """One JSON line a step, flushed and synced: nothing is lost on a crash."""
        if self.rank != 0:
            return
        with open(self.save / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def save_checkpoint(self, model, opt, sched, step):
        """<save>/iter_NNNNNNN (HF weights + train_state/), written as .tmp_<name> and renamed: a
        half-written checkpoint is never visible. Then only the newest --save-keep stay."""
        name = f"iter_{step:07d}"
        tmp, final = self.save / f".tmp_{name}", self.save / name
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                (tmp / "train_state").mkdir(parents=True)
            dist.barrier()
            convert.save_hf(model, tmp, src_dir=self.args.hf_checkpoint)  # not a checkpoint pruning may remove
            names = [None] * self.world  # ranks whose state_name is the same hold the same state:
            dist.all_gather_object(names, state_name(self, opt))  # the first of them writes it
            if names.index(names[self.rank]) == self.rank:
                state = {"optimizer": optim.state_of(opt), "scheduler": sched.state_dict(), "rng": rng_state()}
                torch.save(state, tmp / "train_state" / state_name(self, opt))
            dist.barrier()
            if self.rank == 0:
                (tmp / "train_state" / "meta.json").write_text(json.dumps({"step": step, "tp": self.tp}))
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
                atomic_write(self.save / "latest", name)
        except Exception as e:  # noqa: BLE001 - a full disk shows as OSError, torch's RuntimeError, safetensors'...
            shutil.rmtree(tmp, ignore_errors=True)
            raise SystemExit(f"[run] checkpoint {final} could not be written ({type(e).__name__}: {e}); "
                             f"removed {tmp.name}; {self.save / 'latest'} still names the last complete "
                             f"checkpoint. Free space in --save and resume with --load {self.save}") from None
        if self.rank == 0:
            print(f"[run] saved checkpoint {final}", flush=True)
            done = sorted(p for p in self.save.glob("iter_*") if (p / "train_state" / "meta.json").exists())
            if self.args.save_keep > 0:
                for old in done[:-self.args.save_keep]:
                    shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
        return final

    def maybe_save(self, model, opt, sched, step, total):
        """Every --save-interval steps, and always after the last."""
        periodic = self.args.save_interval and step % self.args.save_interval == 0
        if periodic or step == total:
            self.save_checkpoint(model, opt, sched, step)

    def find_checkpoint(self):
        """The checkpoint --load points at: its `latest`, else (latest lost) its newest complete
        iter_*; None when --load is --save and holds none yet (slime's habit). Else an error."""
        if not self.args.load:
            return None
        load, done = Path(self.args.load), []
        if (load / "latest").exists():
            load = load / (load / "latest").read_text().strip()
        elif not (load / "train_state" / "meta.json").exists():
            done = sorted(p for p in load.glob("iter_*") if (p / "train_state" / "meta.json").exists())
            load = done[-1] if done else load
        if not (load / "train_state" / "meta.json").exists():
            if Path(self.args.load).resolve() == self.save.resolve() and not done:
                return None
            raise SystemExit(f"--load {self.args.load}: no checkpoint there (expected a 'latest' "
                             f"file or an iter_* folder with train_state/meta.json)")
        return load

    def start_fresh(self):
        """A fresh start may not mix with an earlier run's checkpoints: those need --load (resume)
        or --overwrite (deleted). Metrics of a run that died before its first checkpoint go."""
        old = sorted(self.save.glob("iter_*")) + sorted(self.save.glob("latest"))
        if old and not self.args.overwrite:
            raise SystemExit(f"--save {self.save} holds checkpoints of an earlier run ({old[0].name}...): "
                             f"resume with --load {self.save}, or pass --overwrite to delete them and start fresh")
        for p in old:
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        if self.args.overwrite or self.args.load:
            self.trim_metrics(0)
        elif (self.save / "metrics.jsonl").exists() and (self.save / "metrics.jsonl").stat().st_size:
            raise SystemExit(f"--save {self.save} holds metrics.jsonl of an earlier run: resume with "
                             f"--load {self.save}, or pass --overwrite to start fresh")
        print(f"[run] starting fresh in {self.save}", flush=True)

    def trim_metrics(self, step):
        """Keep metrics.jsonl up to `step` (what a killed run logged after its checkpoint goes),
        dropping, with a note, lines a crash or a full disk tore."""
        log = self.save / "metrics.jsonl"
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
            print(f"[run] {log}: dropped unreadable line(s) {torn[:5]} (torn by a crash or a full disk)",
                  file=sys.stderr, flush=True)
        atomic_write(log, "".join(line + "\n" for line in keep))

    def load_state(self, ckpt, opt, sched):
        """Optimizer, schedule and RNG of this rank; returns the meta dict (step, data position)."""
        meta = read_state(ckpt / "train_state" / "meta.json", lambda f: json.loads(f.read_text()))
        if meta.get("tp", self.tp) != self.tp:
            raise SystemExit(f"--load {ckpt}: saved at --tensor-model-parallel-size {meta['tp']}, "
                             f"resumed at {self.tp}; resume at the same TP size")
        state = read_state(ckpt / "train_state" / state_name(self, opt),
                           lambda f: torch.load(f, weights_only=False))
        optim.load_state(opt, state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        if self.rank == 0:
            self.trim_metrics(meta["step"])
            print(f"[run] resumed from {ckpt} at step {meta['step']}", flush=True)
        return meta


def load_data(args, evaluation=False, verbose=True, measure=None, limit=None):
    """The training (or evaluation) records named by the flags; [] when no eval data is given.
    `measure(record)` -> its tokens, through the processor: a row it refuses (an image's aspect
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
        records = data.load_geo3k(source, args.eval_split if evaluation else args.split, args.input_key,
                                  args.label_key, args.max_bad_frac, verbose=verbose, check=measure and check,
                                  allow_urls=args.allow_image_urls, allow_outside=args.allow_outside_paths)
    except data.DataError as e:
        raise SystemExit(f"--{'eval-' if evaluation else ''}prompt-data: {e}") from None
    return records[:args.eval_samples] if evaluation else records


# flag -> lowest value: checked at parse time, so a bad value fails before any work
POSITIVE = {"rollout_batch_size": 1, "n_samples_per_prompt": 1, "global_batch_size": 1, "max_tokens_per_gpu": 1,
            "tensor_model_parallel_size": 1, "num_epoch": 1, "rollout_max_response_len": 1,
            "max_context_len": 2, "max_turns": 1, "num_rollout": 0, "save_interval": 0, "save_keep": 0,
            "eval_interval": 0, "eval_samples": 0, "lr_warmup_iters": 0, "lr": 0, "min_lr": 0, "clip_grad": 0,
            "weight_decay": 0, "rollout_temperature": 0, "eps_clip": 0, "eps_clip_high": 0,
            "kl_loss_coef": 0, "entropy_coef": 0, "tis_cap": 0, "rollout_num_gpus": 0,
            "distributed_timeout_minutes": 1, "sglang_server_timeout": 1, "dynamic_sampling_max_prompts": 1,
            "decoupled_lr": 0}
FRACTIONS = ("max_bad_frac", "adam_beta1", "adam_beta2", "rollout_top_p")  # in [0, 1]


def check_args(p, args):
    """Numeric flags in range, or the parser's error naming the flag and its value."""
    for name, low in POSITIVE.items():
        v = getattr(args, name, None)
        if v is not None and not v >= low:  # NaN fails too
            p.error(f"--{name.replace('_', '-')} {v}: must be >= {low}")
    for name in FRACTIONS:
        v = getattr(args, name, None)
        if v is not None and not 0 <= v <= 1:
            p.error(f"--{name.replace('_', '-')} {v}: must be in [0, 1]")
    return args


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


def read_state(path, read):
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


def state_name(run, opt):
    """This rank's train_state file: one per TP rank, or per (TP, DP) rank when the optimizer
    is sharded over DP (--use-distributed-optimizer: each rank saves only its shard)."""
    dp = f"_dp_{run.dp_rank:03d}" if getattr(opt, "sharded", False) else ""
    ep = f"_ep_{parallel.ep_rank():02d}" if parallel.ep_size() > 1 else ""  # MoE: each EP rank holds other experts
    return f"tp_{run.tp_rank:02d}{ep}{dp}.pt"


def rng_state():
    s = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        s["cuda"] = torch.cuda.get_rng_state_all()
    return s


def set_rng_state(s):
    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    if "cuda" in s and torch.cuda.is_available():
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


def global_sum(value, run, op=dist.ReduceOp.SUM):
    """Sum a number over data-parallel ranks (e.g. loss tokens of the global batch); or max, by op.
    The tensor lives on run.device: NCCL has no CPU tensors."""
    t = torch.tensor(float(value), dtype=torch.float64, device=run.device)
    return parallel.all_reduce(t, run.dp_group, op).item()


def pack(lengths, max_tokens):
    """Indices grouped into micro-batches of at most `max_tokens` tokens (first-fit
    decreasing; a single longer sequence gets a micro-batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins, room = [], []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def micro_batches(items, max_tokens, models, backward=False):
    """-> (items, model inputs) of each packed micro-batch of this rank's `items` (dicts of ids and
    mask 1-D tensors, pixel_values and image_grid_thw or None); with EP, then idle() ones up to the
    busiest rank's count: MoE layers run collectives in forward and backward (README, "Qwen3.5")."""
    bins = pack([len(it["ids"]) for it in items], max_tokens)
    n = 0  # idle micro-batches to run, agreed before any runs: MoE collectives must not cross this reduce
    if parallel.ep_size() > 1:
        dev = "cuda" if torch.cuda.is_available() else "cpu"  # NCCL: the current device
        n = int(parallel.all_reduce(torch.tensor(len(bins), device=dev), None, dist.ReduceOp.MAX)) - len(bins)
    for idx in bins:
        mb = [items[i] for i in idx]
        pv = [it["pixel_values"] for it in mb if it.get("pixel_values") is not None]
        grid = [it["image_grid_thw"] for it in mb if it.get("image_grid_thw") is not None]
        yield mb, dict(seqs=[it["ids"] for it in mb], loss_masks=[it["mask"] for it in mb],
                       pixel_values=torch.cat(pv) if pv else None, image_grid_thw=torch.cat(grid) if grid else None)
    for _ in range(n):
        idle(models, backward)


def idle(models, backward):
    """An empty micro-batch's share of the EP collectives: each model's forward (and the first's
    backward) on two pad tokens that score nothing, in the order a real micro-batch runs them."""
    seq, mask = torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.bool)
    lp, _ = models[0]([seq], loss_masks=[mask])
    with torch.no_grad():
        for m in models[1:]:
            m([seq], loss_masks=[mask])
    if backward:
        lp.sum().backward()  # zero gradients, but every layer's backward collectives run


def expert_load(model, run):
    """MoE metrics of the step: expert_load (each expert's share of routed tokens, mean over
    layers, all ranks) and expert_load_max (the busiest expert's share x experts; 1.0 is even)."""
    load = model.expert_load()
    if load is None:
        return {}
    load = parallel.all_reduce(load, None)
    share = load / load.sum(1, keepdim=True).clamp(min=1)  # (layers, experts)
    return {"expert_load": [round(x, 4) for x in share.mean(0).tolist()],
            "expert_load_max": round(float(share.max(1).values.mean() * share.shape[1]), 3)}


def epoch_order(n, seed, epoch):
    """The data order of an epoch: a function of (seed, epoch) only, so a resumed run sees the same."""
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    return order


def dp_shard(items, run):
    """This data-parallel rank's share of a global batch (strided, so lengths stay balanced)."""
    return items[run.dp_rank::run.dp]


@contextlib.contextmanager
def timed(seconds, name):
    """seconds[name] = the block's wall time: `t = {}`, `with timed(t, "train"): ...`, then t["train"]."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = time.perf_counter() - start
