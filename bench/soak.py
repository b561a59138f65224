"""Soak: N GRPO steps of the tiny model with periodic checkpoints, SIGKILLed at random moments and
resumed with --load each time. Prints the resident memory per step, the steps lost (a resumed run
must start exactly at the last checkpoint written before the kill: 0 lost), the steps redone
(logged after that checkpoint, so trained again), whether redone steps reproduce their first
numbers, and whether metrics.jsonl ends as steps 1..N, each once.

    python bench/soak.py --steps 300 --out /tmp/soak          # ~30 min on 2 busy cores
    python bench/soak.py --steps 40 --kill-max 15 --out /tmp/s # a quick look

Every figure printed is measured here; nothing is a literal.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SAME = ("reward", "loss", "grad_norm", "entropy")  # numbers a redone step must reproduce


def metrics(path):
    """{step: line} of the training steps in metrics.jsonl (a torn last line is skipped)."""
    out = {}
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                m = json.loads(line)
            except ValueError:
                continue
            if "reward" in m:
                out[m["step"]] = m
    return out


def rss_mb(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None


def latest_step(run):
    try:
        return int((run / "latest").read_text().strip().split("_")[1])
    except (OSError, IndexError, ValueError):
        return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--save-interval", type=int, default=10)
    p.add_argument("--kill-max", type=int, default=40, help="a life trains 1..kill-max steps before its SIGKILL")
    p.add_argument("--out", required=True)
    p.add_argument("--root", default=str(ROOT), help="the trainer's folder (e.g. a frozen copy)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng, out, root = random.Random(a.seed), Path(a.out), Path(a.root)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    py = sys.executable
    if not (out / "tiny" / "config.json").exists():
        subprocess.run([py, root / "model.py", "tiny", "--arch", "qwen3_vl", "--out", out / "tiny"], check=True, env=env)
        subprocess.run([py, root / "data.py", "synth", "--n", "64", "--n-test", "8", "--size", "64",
                        "--kinds", "sides", "--out", out / "data"], check=True, env=env)
    run = out / "run"
    cmd = [py, root / "train_grpo.py", "--hf-checkpoint", out / "tiny", "--prompt-data", out / "data",
           "--save", run, "--load", run, "--rollout-engine", "local", "--rollout-batch-size", "2",
           "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--lr", "1e-3",
           "--num-rollout", str(a.steps), "--save-interval", str(a.save_interval), "--save-keep", "2"]
    first, rss, lives, mismatched = {}, {}, [], []
    t0 = time.time()
    while True:
        log = out / f"life_{len(lives):03d}.log"
        ckpt_before = latest_step(run)
        target = rng.randint(1, a.kill_max)
        with open(log, "w") as f:
            proc = subprocess.Popen(list(map(str, cmd)), cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT)
        start, seen, killed, kill_at, max_step = None, set(), False, None, 0
        life_rss = []
        while proc.poll() is None:
            time.sleep(0.2)
            if start is None:  # the trainer trims metrics.jsonl to its checkpoint, then says so
                m = re.search(r"resumed from .* at step (\d+)|starting fresh", log.read_text(errors="replace"))
                start = int(m.group(1) or 0) if m else None
                seen = {s for s in metrics(run / "metrics.jsonl") if s <= (start or 0)}
                continue
            now = metrics(run / "metrics.jsonl")
            r = rss_mb(proc.pid)
            for s in sorted(set(now) - seen):
                seen.add(s)
                rss.setdefault(s, r)
                life_rss.append(r)
                max_step = max(max_step, s)
                if s in first and any(first[s].get(k) != now[s].get(k) for k in SAME):
                    mismatched.append(s)
                first.setdefault(s, now[s])
            if kill_at is None and max_step - start >= target and max_step < a.steps:
                kill_at = time.time() + rng.uniform(0, 1.5)  # anywhere in the next step or save
            if kill_at and time.time() >= kill_at:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                killed = True
        ckpt_after = latest_step(run)
        lives.append(dict(start=start, ckpt_before=ckpt_before, last_logged=max_step, ckpt_at_end=ckpt_after,
                          killed=killed, rc=proc.returncode, rss=life_rss))
        if start is not None and start != ckpt_before:
            print(f"[soak] life {len(lives) - 1} resumed at {start}, last checkpoint was {ckpt_before}", flush=True)
        if not killed:
            break
        print(f"[soak] life {len(lives) - 1}: steps {start}->{max_step}, SIGKILL; checkpoint {ckpt_after}, "
              f"{time.time() - t0:.0f} s", flush=True)
    final = metrics(run / "metrics.jsonl")
    lines = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if "reward" in x]
    lost = sum(max(0, b["ckpt_at_end"] - n["start"]) for b, n in zip(lives, lives[1:]))
    redone = sum(max(0, b["last_logged"] - n["start"]) for b, n in zip(lives, lives[1:]))
    print(f"\nsoak: {a.steps} GRPO steps, {len(lives) - 1} SIGKILLs, {len(lives)} lives, {time.time() - t0:.0f} s")
    print(f"last life exit code {lives[-1]['rc']}; steps lost beyond the last checkpoint: {lost}; "
          f"steps redone after a kill: {redone}")
    print(f"redone steps whose {'/'.join(SAME)} differ from their first run: {len(mismatched)} {mismatched[:10]}")
    print(f"metrics.jsonl training lines: {len(lines)}; steps 1..{a.steps} each once, in order: "
          f"{lines == list(range(1, a.steps + 1))}; {len(final)} distinct")
    print(f"left-over .tmp_* folders: {len(list(run.glob('.tmp_*')))}; checkpoints kept: "
          f"{sorted(x.name for x in run.glob('iter_*'))}")
    print("RSS (MB) of the trainer when each step was logged:")
    for s in sorted(rss)[::max(1, len(rss) // 12)] + [max(rss)]:
        print(f"  step {s:4d}: {rss[s]:7.0f}")
    growth = [b["rss"][-1] - b["rss"][0] for b in lives if len(b["rss"]) > 1 and None not in b["rss"]]
    print(f"RSS growth within a life (first to last step logged): max {max(growth, default=0):.0f} MB "
          f"over {len(growth)} lives; overall min {min(rss.values()):.0f} max {max(rss.values()):.0f} MB")


if __name__ == "__main__":
    main()
