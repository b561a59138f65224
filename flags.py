"""The flags both trainers take, in groups, each with its bound (named as in slime / Megatron): a value
out of bounds (at_least, fraction) is the parser's error naming the flag and the value, before any work. A registry
entry's own flags (a loss's, a reward term's, a tool's) are declared with it: own_flags, declared."""
import argparse
import dataclasses
import json
import math
import re
from pathlib import Path


class FromArgs:
    """A frozen dataclass of flag values (model.ModelOptions): each field args has."""
    @classmethod
    def from_args(cls, args):
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


def at_least(low, high=math.inf, above=False):
    """argparse type: a finite number (int when `low` is an int, else float) in [low, high], (low, high] if `above`."""
    kind = type(low)
    bound = f"{'>' if above else '>='} {low}" if high == math.inf else f"in {'(' if above else '['}{low}, {high}]"

    def parse(text):
        v = kind(text)
        if not low <= v <= high or v == math.inf or (above and v == low):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{text}: must be a finite number {bound}")
        return v
    parse.__name__ = kind.__name__  # argparse's "invalid int value" wording for a non-number
    return parse


def top_k(text):
    """argparse type of a top-k: -1 (off) or at least 1, SGLang's bound (sglang/srt/sampling/sampling_params.py, verify)."""
    v = int(text)
    if v < 1 and v != -1:
        raise argparse.ArgumentTypeError(f"{text}: must be -1 (off) or at least 1")
    return v


# shares; steps, sizes; intervals where 0 means "off" or "only at the end"
fraction, POSITIVE, COUNT = at_least(0.0, 1.0), at_least(1), at_least(0)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """--help: the entry's docstring as written, each flag with its default (unless unset, off, or already said:
    argparse's ArgumentDefaultsHelpFormatter would add "(default: None)" after "default: --lr")."""

    def _get_help_string(self, action):
        said = action.default in (None, argparse.SUPPRESS) or action.default is False or "default" in (action.help or "")
        return action.help if said else f"{action.help or ''} (default: %(default)s)"


MIN_PIXELS, MAX_PIXELS = 0, 1 << 20  # the model's view of an image: no floor (a zoom's sides >= 56 all the same), 1 Mpx
INSTRUCTION = "Solve the geometry problem shown in the diagram. Think briefly, then give the final answer as \\boxed{<answer>}."


def add_column_args(a):
    """The flags of how rows read (data.load_geo3k; `a`: a parser's or group's add_argument): show's, the trainers'."""
    a("--split", default=None, help="split of a hub id or folder (default: train)")
    a("--input-key", default="problem", help="column holding the problem text")
    a("--label-key", default="answer", help="column holding the answer")
    # slime's flag and form (THUDM/slime 624b824: slime/utils/arguments.py:661-668 `type=json.loads`, a map from
    # media type to column; slime/utils/data.py:152-160 reads each type's column, one value or a list)
    a("--multimodal-keys", type=json.loads, default=None,
      help="""slime's JSON map from media type to column, '{"image": "COLUMN"}' (default: images, else image)""")
    a("--max-pixels", type=POSITIVE, default=MAX_PIXELS, help="the model's view of an image (a row's, a zoom's): "
      "downscaled to at most this many pixels (EasyR1's, verl's name); the zoom reads the original (docs/data.md)")
    a("--min-pixels", type=COUNT, default=MIN_PIXELS, help="the model's view of an image: upscaled to at least this many "
      "pixels (0: as it is)")
    a("--allow-image-urls", action="store_true", help="fetch http(s) images of data rows (off: such rows are bad)")
    a("--allow-outside-paths", action="store_true", help="let data rows' image paths leave the data set's folder")
    a("--max-bad-frac", type=fraction, default=0.01, help="stop when more data rows than this are unusable")
    a("--rollout-interaction-env-path", default="env_geo3k", help="the env module, dotted and importable (miles' name): "
      "its build_env(sample, args) runs multi-turn episodes, its tools reach the prompt (docs/extending.md)")
    a("--prompt-instruction", default=INSTRUCTION, help="what every prompt's user turn ends with (default: geo3k's; '': none)")


def add_train_args(p):
    """The groups both trainers share; train_grpo.py adds rollout.add_args and its own."""
    # `--lr -1e-4` is the value, not an option: Python 3.11's argparse.py:1381 takes only -1 / -1.5 as numbers
    p._negative_number_matcher = re.compile(r"^-(\.?\d|inf$|nan$)")
    g = p.add_argument_group("data and evaluation").add_argument
    g("--prompt-data", required=True, help="training data: hub id, .parquet, .jsonl or folder")
    add_column_args(g)
    g("--eval-prompt-data", default=None, help="evaluation data (same forms as --prompt-data)")
    g("--eval-split", default="test", help="split of --eval-prompt-data when it is a hub id or folder")
    g("--eval-input-key", default=None, help="--eval-prompt-data's column of the problem text (default: --input-key)")
    g("--eval-label-key", default=None, help="--eval-prompt-data's column of the answer (default: --label-key)")
    g("--eval-interval", type=COUNT, default=0, help="evaluate every N steps (0: only at the end)")
    g("--eval-samples", type=COUNT, default=64, help="evaluate on the first N eval problems (0: all)")
    g = p.add_argument_group("model and parallelism").add_argument
    g("--hf-checkpoint", required=True, help="Hugging Face checkpoint folder to start from")
    g("--freeze-vit", action="store_true", help="keep the vision tower fixed")
    g("--tensor-model-parallel-size", type=POSITIVE, default=1, help="Megatron TP size")
    g("--sequence-parallel", action="store_true", help="split the sequence over TP ranks (Megatron's; MoE at TP > 1)")
    g("--context-parallel-size", type=POSITIVE, default=1, help="CP: each sequence split over this many ranks (zigzag)")
    g("--pipeline-model-parallel-size", type=POSITIVE, default=1, help="PP: decoder layers split over this many stages")
    g("--decoder-first-pipeline-num-layers", type=POSITIVE, default=None, help="PP: layers of the first stage")
    g("--decoder-last-pipeline-num-layers", type=POSITIVE, default=None, help="PP: layers of the last stage")
    g("--expert-model-parallel-size", type=POSITIVE, default=1, help="EP: MoE experts split over this many ranks")
    g("--moe-token-dispatcher-type", default="allgather", choices=["allgather", "alltoall"],
      help="how tokens reach their experts' ranks (alltoall: GPU only in megatron-core 0.16)")
    g("--moe-router-dtype", default="fp32", choices=["fp32", "fp64"], help="router logits and softmax dtype")
    g("--moe-aux-loss-coeff", type=at_least(0.0), default=0.0, help="load-balancing auxiliary loss weight (0: off)")
    g("--transformer-impl", default=None, choices=["transformer_engine", "local"],
      help="Megatron layer spec (default: transformer_engine on CUDA, an error if it cannot load; local on CPU)")
    g("--distributed-timeout-minutes", type=POSITIVE, default=60, help="collective timeout (rank 0 sets up meanwhile)")
    g = p.add_argument_group("precision and memory").add_argument
    g("--bf16", action="store_true", help="compute in bf16 with fp32 master weights (optim.py); logprobs and loss in fp32")
    g("--accumulate-allreduce-grads-in-fp32", action="store_true", help="with --bf16: gradients accumulated and reduced in fp32")
    g("--use-distributed-optimizer", action="store_true", help="shard master weights and Adam states over DP ranks")
    g("--optimizer-cpu-offload", action="store_true", help="with --use-distributed-optimizer: Adam on the CPU (CUDA)")
    g("--optimizer-offload-fraction", type=fraction, default=1.0, help="with --optimizer-cpu-offload: the share on the CPU")
    g("--overlap-cpu-optimizer-d2h-h2d", action="store_true", help="with --optimizer-cpu-offload: overlap its copies")
    g("--recompute-granularity", default=None, choices=["full", "selective"],
      help="recompute activations in backward: whole layers (full) or core attention only (selective)")
    g("--recompute-method", default="uniform", choices=["uniform", "block"],
      help="full: checkpoint every chunk of --recompute-num-layers layers (uniform), or only the first that many (block)")
    g("--recompute-num-layers", type=POSITIVE, default=1, help="layers per recomputed chunk (uniform) or recomputed layers (block)")
    g("--max-tokens-per-gpu", type=POSITIVE, default=4096, help="one packed micro-batch's tokens on a GPU (CP: x CP in all)")
    g = p.add_argument_group("optimizer").add_argument
    g("--global-batch-size", type=POSITIVE, default=16, help="samples per optimizer step, all ranks")
    g("--lr", type=at_least(0.0), default=1e-6, help="peak learning rate")
    g("--min-lr", type=at_least(0.0), default=0.0, help="floor of the cosine decay")
    g("--decoupled-lr", type=at_least(0.0), default=None, help="peak lr of embedding and output layer (default: --lr)")
    g("--lr-warmup-iters", type=COUNT, default=0, help="linear warmup steps")
    g("--lr-decay-style", default="constant", choices=["constant", "cosine"], help="after warmup")
    g("--weight-decay", type=at_least(0.0), default=0.0, help="AdamW weight decay (not on norms/biases)")
    g("--adam-beta1", type=fraction, default=0.9, help="Adam's decay of the gradient's running mean")
    g("--adam-beta2", type=fraction, default=0.98, help="Adam's decay of the squared gradient's running mean")
    g("--clip-grad", type=at_least(0.0), default=1.0, help="clip the global grad norm to this (0: off)")
    g("--seed", type=int, default=1234, help="the data order, initial RNG state and sampling: a run is a function of it")
    g = p.add_argument_group("run folder").add_argument
    g("--save", required=True, help="run folder: metrics.jsonl, config, checkpoints")
    g("--load", default=None, help="resume from the latest checkpoint in this run folder")
    g("--overwrite", action="store_true", help="start fresh in a --save folder with an earlier run (deletes its files)")
    g("--save-interval", type=COUNT, default=50, help="checkpoint every N steps (0: only at the end)")
    g("--save-keep", type=COUNT, default=3, help="keep the newest N checkpoints in --save (0: keep all)")
    g("--wandb-project", default=None, help="log to wandb too, when it is installed")
    g("--use-tensorboard", action="store_true", help="write the metrics as TensorBoard events too, in <save>/tensorboard")
    g("--exit-signal-handler", action="store_true", help="on SIGTERM (a cluster's preemption), finish the step, "
      "save a checkpoint and exit 0 on every rank (Megatron's flag)")
    g("--exit-duration-in-mins", type=at_least(0.0), default=None, help="save, exit 0 after a step ending past N min")


def expand(argv):
    """argv with each @FILE's lines in its place (argparse's fromfile_prefix_chars="@": one argument a line): args.txt."""
    return [x for a in argv for x in (Path(a[1:]).read_text().splitlines() if a.startswith("@") else [a])]


def own_flags(registry):
    """The flags the entries of `registry` declare (their `flags`: {"--name": add_argument's keywords}), each once."""
    return {n: kw for entry in registry.values() for n, kw in entry.flags.items()}


def declared(flags, args):
    """Declared `flags` as {dest: args' value}, each on args (train_grpo.parse_args checks: never a default in silence)."""
    return {n[2:].replace("-", "_"): getattr(args, n[2:].replace("-", "_")) for n in flags}
