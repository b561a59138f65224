"""The rollout at the recipes' shape against a simulated continuous-batching engine.

    .venv/bin/python bench/rollout_pipeline.py [--prompts 64] [--samples 8] [--turns 3] [--busy 0]
    .venv/bin/python bench/rollout_pipeline.py --code DIR    # the same against another checkout's rollout.py

The engine's side is simulated (SimEngine: every request in flight at once, each answered after
--prefill-ms + --token-ms a token, response lengths long-tailed: lognormal with median
--median-tokens, capped at --max-tokens); everything of ours runs for real: the chat template, the
image processor, the env with the crop tool on the ten real geo3k diagrams in tests/data, the
reward. Multi-turn episodes crop, then answer. Prints the rollout's wall time over the longest
episode's own engine time (the critical path: nothing can finish sooner), and rank 0's own time per
sample. --busy N runs N CPU-bound processes beside it (a machine shared with other work).
"""
import argparse
import math
import os
import pickle
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CROP = '<tool_call>\n{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 100, 100]}}\n</tool_call>'


class SimEngine:
    """Answers like an engine that batches continuously: a request's latency does not depend on the
    others in flight. Turn 1 of a multi-turn episode is a crop call, the last an answer; each
    response opens with `ep<serial>` so later turns name their episode (for the critical path)."""
    concurrent = True

    def __init__(self, processor, a):
        self.tok, self.a, self.lock, self.rng = processor.tokenizer, a, threading.Lock(), random.Random(0)
        self.serial, self.path = 0, {}  # episode serial -> its engine seconds so far
        self.filler = self.tok.encode(" so")
        self.im_end = self.tok.convert_tokens_to_ids("<|im_end|>")

    def _answer(self, item):
        text = self.tok.decode(item["input_ids"])
        seen = re.findall(r"ep(\d+)x", text)
        with self.lock:
            if seen:
                ep = int(seen[-1])
            else:
                ep, self.serial = self.serial, self.serial + 1
            n = min(self.a.max_tokens, int(math.exp(math.log(self.a.median_tokens) + 0.8 * self.rng.gauss(0, 1))))
        last = len(seen) + 1 >= self.a.turns
        head = self.tok.encode(f"ep{ep}x") if not seen else []
        tail = self.tok.encode(" \\boxed{3}" if last else "\n" + CROP)
        ids = (head + self.filler * max(0, n - len(head) - len(tail)) + tail)[:item["max_new_tokens"] - 1]
        secs = (self.a.prefill_ms + self.a.token_ms * len(ids)) / 1000
        with self.lock:
            self.path[ep] = self.path.get(ep, 0.0) + secs
        return secs, {"ids": ids + [self.im_end], "logprobs": [-0.5] * (len(ids) + 1), "finish": "stop",
                      "prompt_tokens": len(item["input_ids"])}

    def generate(self, batch, sampling):  # a batch (a lockstep caller) returns with its slowest request
        answers = [self._answer(dict(item, max_new_tokens=item.get("max_new_tokens", sampling["max_new_tokens"])))
                   for item in batch]
        time.sleep(max(s for s, _ in answers))
        return [out for _, out in answers]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=3, help="1: single-turn")
    p.add_argument("--prefill-ms", type=float, default=30.0)
    p.add_argument("--token-ms", type=float, default=10.0)
    p.add_argument("--median-tokens", type=float, default=120.0)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--busy", type=int, default=0, help="CPU-bound processes to run beside the rollout")
    p.add_argument("--code", default=str(ROOT), help="the checkout whose rollout.py runs")
    p.add_argument("--dp", type=int, default=0, help="also measure the bytes each of DP ranks receives")
    a = p.parse_args()
    sys.path.insert(0, a.code)
    sys.path.append(str(ROOT))  # tools/ (the tiny checkpoint) from this checkout, whatever --code is
    os.environ["HF_HUB_OFFLINE"] = "1"
    import data
    import rollout
    from tools import tiny
    import train_grpo
    from transformers import AutoProcessor
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(a.busy)]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = tiny.make_tiny(Path(tmp) / "tiny", "qwen3_vl")
            processor = AutoProcessor.from_pretrained(ckpt)
            real = data.load_geo3k(str(ROOT / "tests" / "data" / "geo3k_real" / "test.parquet"))
            records = [dict(real[i % len(real)], index=i) for i in range(a.prompts)]
            args = train_grpo.parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", "x", "--save", "x",
                                          "--max-turns", str(a.turns), "--n-samples-per-prompt", str(a.samples),
                                          "--rollout-batch-size", str(a.prompts), "--rollout-max-response-len", "4096"])
            engine = SimEngine(processor, a)
            t = time.perf_counter()
            samples = rollout.generate_group_samples(engine, processor, records, rollout.settings(args))
            wall = time.perf_counter() - t
            if a.dp:  # what the old broadcast sent every rank, and what a scatter sends each one now
                adv = [float(i % 3 - 1) for i in range(len(samples))]
                enc = {}  # a group's prompt image encoded and pickled once, as rank 0 did
                every = len(pickle.dumps([train_grpo.to_item(s, processor, x, enc) for s, x in zip(samples, adv)]))
                shares = train_grpo.split_batch(samples, adv, random.Random(0), len(samples), 1, a.dp)
                each = [len(pickle.dumps(share)) for share in shares]
                print(f"hand-off: all items to every rank {every / 2**20:.1f} MB; each of {a.dp} DP ranks' share "
                      f"{min(each) / 2**20:.1f}-{max(each) / 2**20:.1f} MB")
    finally:
        for b in burners:
            b.kill()
    m = train_grpo.rollout_metrics(samples)
    crit = max(engine.path.values())
    print(f"{a.prompts} x {a.samples} x {a.turns} turns, {a.token_ms:g} ms a token, busy={a.busy}, code={a.code}: "
          f"failed {m['failed_frac']:.2f}, turns {m['turns']:.2f}, tool calls {m['tool_calls']:.2f}, reward {m['reward']:.2f}")
    print(f"wall {wall:.1f} s, longest episode's engine time {crit:.1f} s: ratio {wall / crit:.2f}")
    if "rollout_own_s_per_sample" in m:
        print(f"rank 0's own time {m['rollout_own_s_per_sample'] * 1000:.1f} ms a sample "
              f"({m['rollout_own_s_per_sample'] * len(samples):.1f} s in all), engine busy {m['rollout_engine_busy_s']:.1f} s, "
              f"tail (median episode's end to the last) {m['rollout_tail_s']:.1f} s")


if __name__ == "__main__":
    main()
