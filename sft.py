"""sft.py: supervised warm start on geo3k-style data (target `Answer: \\boxed{<answer>}`).

    # one process, CPU
    python sft.py --hf-checkpoint ckpt/tiny --prompt-data data/synth --save runs/sft --lr 2e-3
    # N processes on one node (gloo on CPU, NCCL on GPU); TP x DP = N
    torchrun --nproc_per_node 2 sft.py --tensor-model-parallel-size 2 ...
    # several nodes: torchrun's own flags
    torchrun --nnodes 2 --node-rank $R --master-addr $HOST --nproc_per_node 8 sft.py ...

The loss covers the assistant tokens only (the target and its <|im_end|>), summed over the
global batch and divided by its token count, so any TP x DP split gives the same step. The
image goes through the vision tower into the loss; `--freeze-vit` keeps the tower fixed.
"""
import argparse
import json
import math
import sys
import time

import torch
from transformers import AutoProcessor

import console
import data
import flags as F
import model as M
import optim
import pipeline
import chat
import task
import trainer as T


def build_parser():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=F.HelpFormatter, fromfile_prefix_chars="@")
    F.add_train_args(p)
    p.add_argument_group("SFT").add_argument("--num-epoch", type=F.POSITIVE, default=1, help="passes over the training data")
    p.set_defaults(lr=1e-5, lr_decay_style="cosine")
    return p


def parse_args(argv=None):
    p = build_parser()
    args = p.parse_args(argv)
    args.argv = F.expand(sys.argv[1:] if argv is None else argv)  # args.txt's: `sft.py @RUN/args.txt` replays the run
    try:  # a missing env module is named before any model loads
        task.env(args)
    except ValueError as e:
        p.error(str(e))
    return args


def _parts(content):
    """A message's content: a string, or its parts with the None-valued keys parquet gives them dropped."""
    return content if isinstance(content, str) else [{k: v for k, v in p.items() if v is not None} for p in content]


def _n_images(messages):
    return sum(p.get("type") == "image" for m in messages if not isinstance(m["content"], str) for p in m["content"])


def encode(processor, record, instruction=data.INSTRUCTION, env=None):
    """-> the trainer's Item, tokens exactly as a rollout of the same conversation makes them (assistant turns:
    loss mask 1; tool turns: 0). The conversation: the record's `messages` (slime's SFT form, a list or its JSON;
    docs/data.md), with the tools `env` (the env module: --rollout-interaction-env-path's) offers the row, else the
    prompt (ending with `instruction`: --prompt-instruction's) and `Answer: \\boxed{..}`."""
    images, messages, tools, target = list(record["images"]), record.get("messages"), None, data.sft_target(record["answer"])
    if messages is None:
        messages = data.prompt_messages(record, instruction=instruction) + [{"role": "assistant", "content": target}]
    else:
        messages = json.loads(messages) if isinstance(messages, str) else messages
        messages = [{"role": m["role"], "content": _parts(m["content"])} for m in messages]
        tools = chat.template_tools(processor, record, env or task.env(None))
    roles = [m["role"] for m in messages]
    if "assistant" not in roles or roles[-1] != "assistant" or not set(roles) <= {"system", "user", "assistant", "tool"}:
        raise ValueError(f"messages with roles {roles}: want system, user, assistant and tool turns, the last an assistant's")
    history = messages[:roles.index("assistant")]  # the prompt
    seen = _n_images(history)
    ids = chat.encode_prompt(processor, history, images[:seen], tools)
    mask, opener = [False] * len(ids), chat.assistant_opener(processor, history, tools)
    stops = processor.tokenizer.convert_tokens_to_ids([chat.IM_END, chat.ENDOFTEXT])
    for m in messages[len(history):]:
        if m["role"] == "assistant":  # a rollout keeps what the model wrote after the opener, decoded
            text = m["content"] if isinstance(m["content"], str) else "".join(p.get("text", "") for p in m["content"])
            turn = chat.encode_target(processor, history, text, tools)
            said = processor.tokenizer.decode([t for t in turn if t not in stops], skip_special_tokens=False)
            history = history + [{"role": "assistant", "content": opener + said}]
        else:
            n = _n_images([m])
            turn = chat.encode_observation(processor, history, m, images[seen:seen + n], tools)
            history, seen = history + [m], seen + n
        ids += turn
        mask += [m["role"] == "assistant"] * len(turn)
    if seen != len(images):
        raise ValueError(f"messages show {seen} images, the row has {len(images)}")
    pixel_values, grid = chat.encode_images(processor, images)
    return T.Item(ids=torch.tensor(ids), mask=torch.tensor(mask), pixel_values=pixel_values, image_grid_thw=grid)


def items(args, processor, verbose=True, evaluation=False):
    """The training (evaluation: --eval-prompt-data's) rows as trainer Items, encoded alike: each prompt ends with
    --prompt-instruction, the env's tools; a row over --max-tokens-per-gpu is skipped, counted (trainer.load_data)."""
    env = task.env(args)
    fit = dict(verbose=verbose, measure=lambda r: len(encode(processor, r, args.prompt_instruction, env).ids),
               limit=(args.max_tokens_per_gpu, f"--max-tokens-per-gpu {args.max_tokens_per_gpu}"))
    return [encode(processor, r, args.prompt_instruction, env) for r in T.load_data(args, evaluation=evaluation, **fit)]


def batch_loss(model, par, items, max_tokens, backward):
    """Token-mean NLL of a global batch (this rank holds `items`); backward when asked."""
    n_tokens = T.global_sum(sum(int(it.mask.sum()) for it in items), par)

    def nll(_, out):  # on the last PP stage
        loss = -out[0].sum() / n_tokens
        return loss, {"loss": loss.item()}
    stats = pipeline.run(model, T.micro_batches(items, max_tokens, par), lambda m, x: m(**x), nll, forward_only=not backward)
    return T.global_sum(sum(s["loss"] for s in stats), par), n_tokens


def evaluate(model, par, evals, args, run, step):
    """eval_loss: the token-mean NLL of the encoded eval rows `evals` at `step`, logged and said."""
    model.eval()
    with torch.no_grad():
        loss, _ = batch_loss(model, par, T.dp_shard(evals, par), args.max_tokens_per_gpu, False)
    model.train()
    run.log(step, {"eval_loss": loss})
    if par.rank == 0:
        console.say(f"[eval] step {step}: eval_loss {loss:.4f}")


def main(argv=None):
    args = parse_args(argv)
    par, run = T.start(args, "sft", fixed=("global_batch_size",))  # a step's data: step x the batch
    processor = AutoProcessor.from_pretrained(args.hf_checkpoint)
    train = items(args, processor, par.rank == 0)
    evals = items(args, processor, par.rank == 0, evaluation=True)
    per_epoch = math.ceil(len(train) / args.global_batch_size)
    total = per_epoch * args.num_epoch
    run.nothing_left(total, "--num-epoch")

    ckpt = run.ckpt
    model = M.load_model(ckpt or args.hf_checkpoint, M.ModelOptions.from_args(args), par)
    opt, sched = optim.build_optimizer(model, args, total)
    start = run.load_state(ckpt, opt, sched)["step"] if ckpt else 0
    model.train()
    if evals and start == 0:  # the start, which the done line and tools/report.py compare with the end
        evaluate(model, par, evals, args, run, 0)
    for step in console.steps(run, start, total):
        epoch, pos = divmod(step, per_epoch)
        order = T.epoch_order(len(train), args.seed, epoch)
        batch = [train[i] for i in order[pos * args.global_batch_size:(pos + 1) * args.global_batch_size]]
        t = time.perf_counter()
        loss, n_tokens = batch_loss(model, par, T.dp_shard(batch, par), args.max_tokens_per_gpu, True)
        stats = optim.optimizer_step(model, opt, sched, par, args)
        t = time.perf_counter() - t
        run.log(step + 1, {"loss": loss, **stats, **T.expert_load(model), "epoch": epoch, "tokens": n_tokens,
                           "tokens_per_s": n_tokens / t, "step_s": t})
        run.maybe_save(model, opt, sched, step + 1, total)
        if evals and run.eval_due(step + 1, total):
            evaluate(model, par, evals, args, run, step + 1)


if __name__ == "__main__":
    console.entry(main, parse_args)
