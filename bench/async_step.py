"""GRPO step time with and without --async-rollout, at the recipes' rollout shape, against a
simulated engine on GPUs of its own (a disaggregated layout).

    .venv/bin/python bench/async_step.py [--steps 4] [--prompts 64] [--samples 8] [--token-ms 10]

Two runs of train_grpo.py's own main, one with --async-rollout, on a tiny Qwen3-VL and synthetic
problems. The engine is rollout_pipeline.SimEngine (every request in flight at once, answered after
--prefill-ms + --token-ms a token, long-tailed response lengths), standing in for SGLang on GPUs
the trainer does not use: its time is sleep, not this machine's cores. Everything else is ours and
real: the rollout's templates, image processor and reward on rank 0, the trainer's update on the
tiny model, the export each weight sync makes. Prints each run's mean step_s, rollout_s, train_s and
sync_s over the steps after the first (the first pays for start-up; an async run's first rollout
has nothing to overlap), the async run's rollout_ahead_overlap_s, and the speed-up.
On a CPU machine the rollout's CPU work and the update share the same cores, which a GPU run does not.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("step_s", "rollout_s", "train_s", "sync_s", "rollout_ahead_overlap_s")


def child(sim, rest):
    """One run: train_grpo.main with cluster.start handing rank 0 a SimEngine (its settings: `sim`)."""
    import types
    a = types.SimpleNamespace(**json.loads(sim))
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import cluster
    import train_grpo
    from rollout_pipeline import SimEngine
    from transformers import AutoProcessor

    class Sim(SimEngine):
        def update_weights(self, buckets):
            return sum(len(b) for b in buckets)  # the export runs in full, as for a real engine

        def sync_plan(self):
            return 1, None

        def shutdown(self):
            pass

    def start(args, par, hf_dir, run_dir):
        return Sim(AutoProcessor.from_pretrained(hf_dir), a) if par.rank == 0 else None
    cluster.start = start
    train_grpo.main(rest)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--prefill-ms", type=float, default=30.0)
    p.add_argument("--token-ms", type=float, default=10.0)
    p.add_argument("--median-tokens", type=float, default=120.0)
    p.add_argument("--max-tokens", type=int, default=1024)
    p.add_argument("--max-tokens-per-gpu", type=int, default=8192)
    if sys.argv[1:2] == ["--child"]:
        return child(sys.argv[2], sys.argv[3:])
    a = p.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, str(ROOT))
    from tools import synth
    from tools import tiny
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tiny.make_tiny(tmp / "ckpt", "qwen3_vl")
        synth.write_synth(tmp / "data", a.prompts * a.steps, n_test=0, seed=0)
        sim = json.dumps({k: getattr(a, k) for k in ("turns", "prefill_ms", "token_ms", "median_tokens", "max_tokens")})
        for mode in ("sync", "async"):
            run = tmp / mode
            cmd = [sys.executable, __file__, "--child", sim, "--hf-checkpoint", str(ckpt), "--prompt-data",
                   str(tmp / "data"), "--save", str(run), "--num-rollout", str(a.steps), "--rollout-engine", "sglang",
                   "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.samples),
                   "--max-turns", str(a.turns), "--rollout-max-response-len", str(a.max_tokens + 16),
                   "--max-tokens-per-gpu", str(a.max_tokens_per_gpu), "--lr", "1e-5", "--save-interval", "1000"]
            cmd += ["--async-rollout"] if mode == "async" else []
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           env=dict(os.environ, HF_HUB_OFFLINE="1"))
            got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
            got = [r for r in got if "step_s" in r][1:]
            rows[mode] = {k: sum(r.get(k, 0.0) for r in got) / len(got) for k in KEYS}
            print(f"{mode:>5}: " + "  ".join(f"{k} {v:.2f}" for k, v in rows[mode].items()), flush=True)
    print(f"{a.prompts} x {a.samples} samples, {a.turns} turn(s), {a.token_ms:g} ms a token, {os.cpu_count()} cores, "
          f"mean of {a.steps - 1} steps after the first: step {rows['sync']['step_s']:.2f} s -> "
          f"{rows['async']['step_s']:.2f} s with --async-rollout ({rows['sync']['step_s'] / rows['async']['step_s']:.2f}x)")


if __name__ == "__main__":
    main()
