"""train_grpo.py: advantages and KL estimators (tables), one update equal at TP=1/TP=2/DP=2,
and a short CPU run: metrics, train-vs-rollout logprobs, checkpoints, SIGKILL + --load."""
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import train_grpo as G

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


@pytest.mark.parametrize("rewards,groups,est,want", [
    ([1, 1, 1, 1], [0, 0, 0, 0], "grpo", [0.0, 0.0, 0.0, 0.0]),          # equal rewards: exactly 0
    ([0.9] * 8, [0] * 8, "grpo", [0.0] * 8),                                # even where fp32 mean is not exact
    ([0, 0, 0, 0], [0, 0, 1, 1], "dr_grpo", [0.0] * 4),
    ([1, 0, 1, 0], [0, 0, 1, 1], "dr_grpo", [0.5, -0.5, 0.5, -0.5]),
    ([1, 0], [0, 0], "grpo", [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)]),
    ([1, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1], "grpo", None),
    ([1], [3], "grpo", [0.0]),                                              # a group of one learns nothing
])
def test_advantages(rewards, groups, est, want):
    got = G.advantages(rewards, groups, est)
    if want is None:  # per group: zero mean, unit (sample) std
        for g in set(groups):
            a = torch.tensor([x for x, k in zip(got, groups) if k == g], dtype=torch.float64)
            assert abs(a.mean().item()) < 1e-12 and abs(a.std().item() - 1) < 1e-5
    else:
        assert got == pytest.approx(want, abs=1e-12)
        assert all(x == 0.0 for x, w in zip(got, want) if w == 0.0)  # exact zeros, no residue


@pytest.mark.parametrize("kind,fn", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (ref - lp) ** 2),
    ("k3", lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1),
    ("low_var_kl", lambda lp, ref: min(10.0, math.exp(ref - lp) - (ref - lp) - 1)),
])
def test_kl_estimators(kind, fn):
    lp = torch.tensor([-0.1, -2.0, -5.0, -0.7, -30.0])
    ref = torch.tensor([-0.3, -1.0, -5.0, -3.0, -0.1])
    got = G.kl_term(lp, ref, kind)
    assert got.tolist() == pytest.approx([fn(a, b) for a, b in zip(lp.tolist(), ref.tolist())], rel=1e-5)
    assert got[2] == 0.0  # identical policies: no KL


def worker(ckpt, source, save, nproc=1, tp=1, ref=None):
    launcher = [PY] if nproc == 1 else [PY, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                        "--master_port", str(29600 + os.getpid() % 1000)]
    cmd = launcher + [str(ROOT / "tests" / "_grpo_worker.py"), str(ckpt), str(source), "--save", str(save),
                      "--tp", str(tp)] + (["--ref", str(ref)] if ref else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return {k: float(v) for k, v in re.findall(r"(\w+)=([-\d.e+]+)", r.stdout.strip().splitlines()[-1])}


@pytest.mark.parametrize("kl", [False, True])
def test_one_update_equal_at_tp2_and_dp2(tiny_ckpt, geo3k_real, tmp_path, kl):
    ckpt, src = tiny_ckpt("qwen3_vl"), geo3k_real / "test.parquet"
    ref = tiny_ckpt("qwen3_vl", seed=1) if kl else None  # another policy, so the KL is not 0
    one = worker(ckpt, src, tmp_path / "one", ref=ref)
    assert 0 < one["clipfrac"] < 1 and one["grad_norm"] > 0 and (one["kl"] > 0) == kl, one
    for name, got in (("tp2", worker(ckpt, src, tmp_path / "tp2", nproc=2, tp=2, ref=ref)),
                      ("dp2", worker(ckpt, src, tmp_path / "dp2", nproc=2, ref=ref))):
        for k in ("loss", "grad_norm", "clipfrac", "kl"):
            assert abs(got[k] - one[k]) <= 1e-5 * max(1.0, abs(one[k])), (name, k, got, one)


def grpo(*args, wait=True):
    cmd = [PY, str(ROOT / "train_grpo.py"), *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


def metrics(run):
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def test_short_run_logs_syncs_and_resumes_after_sigkill(tiny_ckpt, tmp_path):
    """Three steps, checkpoint every step; a run SIGKILLed after step 2's checkpoint resumes
    with --load and logs the same steps as the uninterrupted run: none lost or repeated."""
    import data
    data.write_synth(tmp_path / "d", 64, n_test=8, seed=0, kinds=("sides",))
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_vl"), "--prompt-data", tmp_path / "d", "--rollout-engine",
              "local", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-max-response-len",
              "12", "--num-rollout", "3", "--lr", "1e-3", "--save-interval", "1", "--max-tokens-per-gpu", "512"]
    grpo(*common, "--save", tmp_path / "full", "--eval-prompt-data", tmp_path / "d", "--eval-samples", "4")
    full = metrics(tmp_path / "full")
    steps = [m for m in full if "reward" in m]
    assert [m["step"] for m in steps] == [1, 2, 3]
    want = {"reward", "accuracy", "response_len", "truncated_frac", "failed_frac", "turns", "tool_calls",
            "clipfrac", "kl", "entropy", "grad_norm", "logprob_diff_mean", "logprob_diff_max", "rollout_s",
            "train_s", "sync_s", "tokens_per_s"}
    assert want <= set(steps[0]), want - set(steps[0])
    for m in steps:  # the trainer computes what the engine sampled with: fp32 CPU agreement
        assert m["logprob_diff_mean"] <= 1e-5 and m["logprob_diff_max"] <= 1e-4, m
    assert [m["step"] for m in full if "eval_accuracy" in m] == [0, 3]
    from transformers import AutoModelForImageTextToText
    AutoModelForImageTextToText.from_pretrained(tmp_path / "full" / "iter_0000003")  # loads as it is

    crash = tmp_path / "crash"
    proc = grpo(*common, "--save", crash, wait=False)
    deadline = time.time() + 600
    while not (crash / "iter_0000002").exists():
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read().decode()[-2000:]
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    grpo(*common, "--save", crash, "--load", crash)
    resumed = [m for m in metrics(crash) if "reward" in m]
    assert [m["step"] for m in resumed] == [1, 2, 3]
    for a, b in zip(resumed, steps):  # same prompts, same RNG: the same rollouts
        assert a["reward"] == b["reward"] and a["response_len"] == b["response_len"], (a, b)
