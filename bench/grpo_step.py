"""Seconds per GRPO phase, tokens/s and packing efficiency for a fixed tiny config (CPU).

    .venv/bin/python bench/grpo_step.py [--steps 3] [--rollout-batch-size 8] [--n-samples-per-prompt 8]

Builds a tiny Qwen3-VL and a synthetic set in a temporary folder, runs train_grpo.py for a few
steps with the local engine and prints the mean of each phase over the steps after the first
(the first pays for start-up). Every figure printed is read from the run's metrics.jsonl or the
checkpoint's config.json: packing_fill = real tokens / what the micro-batches could hold at
--max-tokens-per-gpu, as train_grpo.py measures it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rollout-batch-size", type=int, default=8)
    p.add_argument("--n-samples-per-prompt", type=int, default=8)
    p.add_argument("--max-tokens-per-gpu", type=int, default=2048)
    p.add_argument("--response-len", type=int, default=32)
    a = p.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from tools import synth
    from tools import tiny
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tiny.make_tiny(tmp / "ckpt", "qwen3_vl")
        synth.write_synth(tmp / "data", 256, n_test=8, seed=0)
        cmd = [sys.executable, str(ROOT / "train_grpo.py"), "--hf-checkpoint", str(ckpt),
               "--prompt-data", str(tmp / "data"), "--save", str(tmp / "run"), "--rollout-engine", "local",
               "--num-rollout", str(a.steps), "--rollout-batch-size", str(a.rollout_batch_size),
               "--n-samples-per-prompt", str(a.n_samples_per_prompt), "--rollout-max-response-len",
               str(a.response_len), "--max-tokens-per-gpu", str(a.max_tokens_per_gpu), "--lr", "1e-4"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if "rollout_s" in r]
        warm = rows[1:] or rows
        text = json.loads((ckpt / "config.json").read_text())["text_config"]
        print(f"config: tiny qwen3_vl (hidden {text['hidden_size']}, {text['num_hidden_layers']} layers, "
              f"vocabulary {text['vocab_size']}), {a.rollout_batch_size} prompts x {a.n_samples_per_prompt} "
              f"samples, response <= {a.response_len} tokens, {os.cpu_count()} CPU cores; mean of "
              f"{len(warm)} step(s) after the first")
        for k in ("rollout_s", "train_s", "sync_s", "tokens", "tokens_per_s", "response_len", "packing_fill"):
            print(f"{k:>14}: {sum(r[k] for r in warm) / len(warm):10.3f}")


if __name__ == "__main__":
    main()
