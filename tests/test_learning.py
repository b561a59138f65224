"""Learning on CPU (slow; on request: `bash test.sh -m slow tests/test_learning.py`, ~8 min).

The tiny random Qwen3-VL learns to read the synthetic "how many sides?" pictures with sft.py
(two epochs, a fast embedding/output layer and a slow body), while the control, the same run
with images shuffled between problems, stays at chance. GRPO, single-turn and multi-turn, then
keeps what SFT taught (no collapse, no format drift). What is not shown here: GRPO itself
lifting the reward from chance (see README, "Known limits").
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SFT = ["--lr", "1e-4", "--decoupled-lr", "1e-2", "--lr-decay-style", "constant", "--lr-warmup-iters", "3",
       "--global-batch-size", "16", "--num-epoch", "2", "--max-tokens-per-gpu", "1024"]
GRPO = ["--rollout-engine", "local", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "16", "--rollout-temperature", "1.0", "--lr", "1e-4",
        "--decoupled-lr", "1e-3", "--max-tokens-per-gpu", "1024", "--save-interval", "1000"]
STEPS = 10


def launch(script, out, *args):
    """Start `script` with its output in OUT/run.log (a pipe could fill up and stall it)."""
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "run.log", "w")
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return subprocess.Popen([sys.executable, str(ROOT / script), "--save", str(out), *map(str, args)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(*procs, timeout=3600):
    for p in procs:
        rc = p.wait(timeout=timeout)
        log = Path(p.args[p.args.index("--save") + 1]) / "run.log"
        assert rc == 0, log.read_text()[-3000:]


def rewards(run):
    rows = [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    return [r["reward"] for r in rows if "reward" in r]


def mean(xs):
    return sum(xs) / len(xs)


def accuracy(ckpt, data, out, turns=1):
    """Greedy pass@1 on the first 64 test problems (train_grpo.py's eval-only mode)."""
    finish(launch("train_grpo.py", out, "--hf-checkpoint", ckpt, "--prompt-data", data, "--eval-prompt-data",
                  data, "--num-rollout", 0, "--rollout-engine", "local", "--max-turns", turns))
    row = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    return row["eval_multi_turn_accuracy" if turns > 1 else "eval_accuracy"]


def latest(run):
    return run / (run / "latest").read_text().strip()


@pytest.fixture(scope="module")
def warm(tiny_ckpt, tmp_path_factory):
    """SFT on the synthetic set and on its shuffled-image twin -> (data, root, their checkpoints)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    import data
    root = tmp_path_factory.mktemp("learning")
    real = data.write_synth(root / "data", 1024, n_test=64, seed=0, kinds=("sides",))
    shuffled = root / "shuffled"
    shuffled.mkdir()
    rows = pq.read_table(real / "train.parquet").to_pylist()
    images = [r["images"] for r in rows]
    random.Random(0).shuffle(images)
    pq.write_table(pa.Table.from_pylist([{**r, "images": im} for r, im in zip(rows, images)]),
                   shuffled / "train.parquet")
    base = tiny_ckpt("qwen3_vl")
    finish(launch("sft.py", root / "sft", "--hf-checkpoint", base, "--prompt-data", real, *SFT),
           launch("sft.py", root / "sft_shuffled", "--hf-checkpoint", base, "--prompt-data", shuffled, *SFT))
    return real, root, latest(root / "sft"), latest(root / "sft_shuffled")


@pytest.mark.slow
def test_sft_reads_the_picture_and_the_shuffled_control_does_not(warm):
    real, root, ckpt, control = warm
    got, ctrl = accuracy(ckpt, real, root / "eval"), accuracy(control, real, root / "eval_shuffled")
    print(f"greedy accuracy after SFT: right images {got:.3f}, shuffled images {ctrl:.3f}")
    assert got >= 0.9 and ctrl <= 0.4, (got, ctrl)


@pytest.mark.slow
def test_grpo_keeps_what_sft_taught_single_and_multi_turn(warm, tmp_path):
    real, _, ckpt, _ = warm
    common = ["--hf-checkpoint", ckpt, "--prompt-data", real, "--num-rollout", STEPS, *GRPO]
    runs = tmp_path / "single", tmp_path / "multi"
    finish(launch("train_grpo.py", runs[0], *common), launch("train_grpo.py", runs[1], *common, "--max-turns", 3))
    for run in runs:
        got = rewards(run)
        print(run.name, [round(r, 2) for r in got])
        assert len(got) == STEPS and mean(got[-5:]) >= 0.8, got
    assert accuracy(latest(runs[1]), real, tmp_path / "eval_mt", turns=3) >= 0.9
