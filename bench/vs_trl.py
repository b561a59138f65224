"""Our GRPO step against TRL's GRPOTrainer on the same work, on this machine, interleaved.

    # TRL in a venv of its own (nothing goes into the project's .venv), once:
    python3.11 -m venv /tmp/trl-venv && /tmp/trl-venv/bin/pip install trl==1.16.0 transformers==5.19.0 \\
        torch==2.14.1 torchvision==0.29.1 math-verify==0.9.0
    .venv/bin/python bench/vs_trl.py --trl-python /tmp/trl-venv/bin/python [--prompts 4 --group 8 --new-tokens 32]

Both sides get the same tiny random Qwen3-VL (hidden 64, 2 layers, the real 151,665-token
vocabulary), the same synthetic polygon parquet (64 rows), prompts x group samples a step, at
most --new-tokens new tokens at temperature 1 (top-p 1, no top-k), fp32 on CPU, the same torch
threads, lr 1e-6, PPO clip 0.2 / 0.28, no KL (no reference model), no entropy bonus, one
optimizer step a rollout, no gradient checkpointing, and the same reward (reward.math_reward).
Rounds alternate, ours then TRL's, each a fresh process running --steps steps; each process's
first step (start-up, first-call allocations) is dropped, so noise from other work on the machine
falls on both sides alike. Printed: the median of each phase over the kept steps, and our
median step / TRL's.

What each side's phases hold:
  ours (train_grpo.py --rollout-engine local, from its metrics.jsonl):
    rollout = LocalEngine generation (HF generate, KV cache, our Sampler) + rewards + trainer items
    train   = Megatron forward (LM head on response tokens only) + backward + optimizer step
    sync    = the weights copied into the engine (HF names)
  TRL (GRPOTrainer, transformers generation, a timing callback in this file):
    rollout = _generate_and_score_completions: generation (`generate` inside it: HF generate,
              multinomial sampling) + rewards + advantages (no old-logprob forward: one update a
              rollout, so TRL reuses the loss forward's detached logprobs)
    train   = the rest of the trainer step: loss forward (full logits) + backward + optimizer step
"""
import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def ours(ckpt, data_dir, out, a):
    """-> [{phase: seconds}] of our steps after the first, from metrics.jsonl."""
    cmd = [sys.executable, str(ROOT / "train_grpo.py"), "--hf-checkpoint", str(ckpt), "--prompt-data", str(data_dir),
           "--save", str(out), "--rollout-engine", "local", "--num-rollout", str(a.steps),
           "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.group),
           "--rollout-max-response-len", str(a.new_tokens), "--rollout-temperature", "1.0", "--lr", "1e-6",
           "--eps-clip", "0.2", "--eps-clip-high", "0.28", "--kl-loss-coef", "0", "--entropy-coef", "0",
           "--rm-type", "math", "--save-interval", "0", "--seed", str(a.seed)]
    run(cmd, out)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rollout_s" in r][1:]
    return [{"rollout": r["rollout_s"], "train": r["train_s"], "sync": r["sync_s"],
             "step": r["rollout_s"] + r["train_s"] + r["sync_s"], "response_len": r["response_len"]} for r in rows]


def trl(ckpt, data_dir, out, a):
    cmd = [a.trl_python, str(Path(__file__).resolve()), "--trl-worker", "--ckpt", str(ckpt), "--data", str(data_dir),
           "--out", str(out), "--steps", str(a.steps), "--prompts", str(a.prompts), "--group", str(a.group),
           "--new-tokens", str(a.new_tokens), "--seed", str(a.seed)]
    run(cmd, out)
    return [json.loads(x) for x in (out / "steps.jsonl").read_text().splitlines()][1:]


def run(cmd, out):
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode:
            sys.exit(f"vs_trl: {cmd[1]} failed; its output is in {out / 'log.txt'}:\n"
                     + (out / "log.txt").read_text()[-3000:])


def trl_worker(a):
    """Runs inside the TRL python: GRPOTrainer on the parquet; one JSON line of phase seconds a step."""
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForImageTextToText, AutoProcessor, TrainerCallback

    import data
    import reward

    records = data.load_geo3k(a.data, "train", verbose=False)
    ds = Dataset.from_list([{"prompt": data.prompt_messages(r), "image": r["images"][0].view(), "answer": str(r["answer"])}
                            for r in records])

    def math_reward(completions, answer, **_):
        return [reward.math_reward(c[0]["content"], lab) for c, lab in zip(completions, answer)]

    @contextlib.contextmanager
    def clock(name):  # seconds of the block into trainer.phase[name]
        start = time.perf_counter()
        try:
            yield
        finally:
            trainer.phase[name] = time.perf_counter() - start

    class Timed(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            with clock("rollout"):
                return super()._generate_and_score_completions(inputs)

        def _generate(self, prompts):
            with clock("generate"):
                return super()._generate(prompts)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            trainer.phase, self.start = {}, time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            p = dict(trainer.phase, step=time.perf_counter() - self.start)
            p["train"] = p["step"] - p["rollout"]
            with open(Path(a.out) / "steps.jsonl", "a") as f:
                f.write(json.dumps(p) + "\n")

    cfg = trl.GRPOConfig(
        output_dir=str(Path(a.out) / "trl"), per_device_train_batch_size=a.prompts * a.group,
        num_generations=a.group, gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
        max_completion_length=a.new_tokens, temperature=1.0, top_p=1.0, beta=0.0, epsilon=0.2,
        epsilon_high=0.28, learning_rate=1e-6, lr_scheduler_type="constant", max_steps=a.steps,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=False, dataloader_num_workers=0, seed=a.seed, loss_type="dapo",
        log_completions=False, disable_tqdm=True)
    model = AutoModelForImageTextToText.from_pretrained(a.ckpt, dtype=torch.float32)
    trainer = Timed(model=model, reward_funcs=math_reward, args=cfg, train_dataset=ds,
                    processing_class=AutoProcessor.from_pretrained(a.ckpt), callbacks=[Clock()])
    trainer.phase = {}
    print(f"trl {trl.__version__}, transformers {transformers.__version__}, torch {torch.__version__}", flush=True)
    trainer.train()


def median(rows, key):
    vals = [r[key] for r in rows if key in r]
    return statistics.median(vals) if vals else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trl-python", default=None, help="a python with trl installed (see above); default: this one")
    p.add_argument("--rounds", type=int, default=2, help="ours + TRL runs, alternating")
    p.add_argument("--steps", type=int, default=4, help="steps a run; the first is dropped")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="samples a prompt")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt")
    p.add_argument("--data")
    p.add_argument("--out")
    a = p.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    if a.trl_worker:
        return trl_worker(a)
    a.trl_python = a.trl_python or sys.executable
    probe = subprocess.run([a.trl_python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if probe.returncode:
        sys.exit(f"vs_trl: {a.trl_python} cannot import trl; install it in a venv of its own (see --help) "
                 f"and pass --trl-python")
    from tools import synth
    from tools import tiny
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tiny.make_tiny(tmp / "ckpt", "qwen3_vl")
        synth.write_synth(tmp / "data", 64, n_test=8, seed=0)
        mine, theirs, load = [], [], []
        for r in range(a.rounds):
            mine += ours(ckpt, tmp / "data", tmp / f"ours{r}", a)
            load.append(os.getloadavg()[0])
            theirs += trl(ckpt, tmp / "data", tmp / f"trl{r}", a)
            load.append(os.getloadavg()[0])
    print(f"vs_trl: trl {probe.stdout.strip()}, {a.prompts} prompts x {a.group} samples, <= {a.new_tokens} new tokens, "
          f"T=1, fp32, {os.environ.get('OMP_NUM_THREADS', 'all')} threads on {os.cpu_count()} cores, "
          f"{a.rounds} rounds x {a.steps - 1} kept steps; load average {min(load):.1f}-{max(load):.1f}")
    print(f"ours: median response {median(mine, 'response_len'):.1f} tokens")
    for phase in ("rollout", "train", "sync", "step"):
        print(f"  {phase:>8}: {median(mine, phase):7.2f} s  (steps: {' '.join(f'{x[phase]:.2f}' for x in mine)})")
    print("TRL:")
    for phase in ("generate", "rollout", "train", "step"):
        print(f"  {phase:>8}: {median(theirs, phase):7.2f} s  (steps: {' '.join(f'{x[phase]:.2f}' for x in theirs)})")
    print(f"ratio ours / TRL, median step: {median(mine, 'step') / median(theirs, 'step'):.3f}  "
          f"(rollout {median(mine, 'rollout') / median(theirs, 'rollout'):.3f}, "
          f"train {median(mine, 'train') / median(theirs, 'train'):.3f})")


if __name__ == "__main__":
    main()
