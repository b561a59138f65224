"""Learning on CPU. The slow checks run on request (`bash test.sh -m slow tests/test_learning.py`,
~35-50 min on 2 cores); one fast GRPO check (last in this file, ~4 min) runs with the suite.

SFT: the tiny random Qwen3-VL learns to read the synthetic "how many sides?" pictures with
sft.py (two epochs, a fast embedding/output layer and a slow body), while the control, the
same run with images shuffled between problems, stays at chance.

GRPO: started from that control after one epoch (it has learnt the answer format, and the
answer was never tied to the picture), GRPO lifts the reward from chance to >= 0.8 single-turn
and >= 0.5 multi-turn (which starts later) over 120 steps, while the same GRPO run on shuffled
images stays at chance: the policy learns to use the picture from the reward alone.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

import launch as tests_launch
from tools import report

ROOT = Path(__file__).resolve().parents[1]
SFT = ["--lr", "1e-4", "--decoupled-lr", "1e-2", "--lr-decay-style", "constant", "--lr-warmup-iters", "3",
       "--global-batch-size", "16", "--num-epoch", "2", "--max-tokens-per-gpu", "1024", "--save-interval", "64"]
GRPO = ["--rollout-engine", "local", "--rollout-batch-size", "8", "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "16", "--rollout-temperature", "1.0", "--lr", "1e-4",
        "--decoupled-lr", "3e-3", "--max-tokens-per-gpu", "1024", "--save-interval", "1000"]
STEPS = 120
# the slow runs' seeds (the data keep theirs): LEARNING_SEED=1 bash test.sh -m slow ... reruns the GRPO
# arms at seed 1, LEARNING_SFT_SEED=1 the two SFT runs they and the SFT check start from (1234: --seed's default)
SLOW_GRPO_SEED = os.environ.get("LEARNING_SEED", "1234")
SLOW_SFT_SEED = os.environ.get("LEARNING_SFT_SEED", "1234")


def setting(flags, **values):
    """FLAGS with some values replaced: setting(GRPO, lr=3e-4) is GRPO with --lr 3e-4."""
    flags = list(flags)
    for name, value in values.items():
        flags[flags.index("--" + name.replace("_", "-")) + 1] = str(value)
    return flags


# The fast check: 64-pixel pictures (4 image tokens, the tiny processor's floor), one SFT epoch
# (32 steps) on shuffled images for the format, then 60 GRPO steps of 8 prompts x 4 samples with the
# body at 3e-4 (the slow test's 1e-4 needs ~80 steps of 8 x 8; at 8 x 4, 5e-4 left GRPO seed 1
# at chance after 60 steps, collapsed onto one answer, and 1e-3 broke the answer format).
FAST_SFT = setting(SFT, num_epoch=1)
FAST_GRPO = setting(GRPO, n_samples_per_prompt=4, lr=3e-4)
FAST_STEPS, FAST_SEED = 60, 0
# GRPO's seed: seed 1 rose 0.19-0.36 over four machines or dates (first -> last 10 steps), seed 2 0.24 (2026-12-07),
# while seed 0 rose 0.21 -> 0.42 on one machine and only 0.28 -> 0.35 on another (2026-12-01: the check failed)
FAST_GRPO_SEED = 1


def launch(script, out, *args):
    """Start `script` with `--save OUT` (tests/launch.py)."""
    out.mkdir(parents=True, exist_ok=True)
    return tests_launch.start(ROOT / script, "--save", out, *args, env=dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1"))


def finish(*jobs, timeout=3600):
    try:
        for job in jobs:
            r = job.wait(timeout)
            assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-3000:]
    finally:  # a timed-out or failed run, and the one beside it, must not outlive the test
        for job in jobs:
            job.kill()


def metrics(run):
    return [json.loads(x) for x in (Path(run) / "metrics.jsonl").read_text().splitlines()]


def mean(xs):
    return sum(xs) / len(xs)


def accuracy(ckpt, data, out):
    """Greedy pass@1 on the first 64 test problems (train_grpo.py's eval-only mode)."""
    finish(launch("train_grpo.py", out, "--hf-checkpoint", ckpt, "--prompt-data", data, "--eval-prompt-data",
                  data, "--num-rollout", 0, "--rollout-engine", "local"))
    return metrics(out)[-1]["eval_accuracy"]


def shuffled_twin(real, out, seed=0):
    """The control's data: REAL's training problems with their images shuffled between them
    (same questions, answers and pictures; a picture no longer tells the answer) -> OUT."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq
    out.mkdir(parents=True)
    rows = pq.read_table(real / "train.parquet").to_pylist()
    images = [r["images"] for r in rows]
    random.Random(seed).shuffle(images)
    pq.write_table(pa.Table.from_pylist([{**r, "images": im} for r, im in zip(rows, images)]), out / "train.parquet")
    return out


@pytest.fixture(scope="module")
def warm(tiny_ckpt, tmp_path_factory):
    """SFT on the synthetic set and on its shuffled-image twin -> (data, shuffled data, root)."""
    from tools import synth
    root = tmp_path_factory.mktemp("learning")
    real = synth.write_synth(root / "data", 1024, n_test=64, seed=0, kinds=("sides",))
    shuffled = shuffled_twin(real, root / "shuffled")
    base = tiny_ckpt("qwen3_vl")
    common = ["--hf-checkpoint", base, "--seed", SLOW_SFT_SEED, *SFT]
    finish(launch("sft.py", root / "sft", *common, "--prompt-data", real),
           launch("sft.py", root / "sft_shuffled", *common, "--prompt-data", shuffled))
    return real, shuffled, root


@pytest.mark.slow
def test_sft_reads_the_picture_and_the_shuffled_control_does_not(warm):
    real, _, root = warm
    got = accuracy(root / "sft" / "iter_0000128", real, root / "eval")
    ctrl = accuracy(root / "sft_shuffled" / "iter_0000128", real, root / "eval_shuffled")
    print(f"greedy accuracy after SFT: right images {got:.3f}, shuffled images {ctrl:.3f}")
    assert got >= 0.9 and ctrl <= 0.4, (got, ctrl)


@pytest.mark.slow
@pytest.mark.parametrize("turns", [1, 3])
def test_grpo_learns_the_picture_from_chance_and_the_shuffled_control_does_not(warm, tmp_path, turns):
    real, shuffled, root = warm
    start = root / "sft_shuffled" / "iter_0000064"  # one epoch: the format, never the picture
    common = ["--hf-checkpoint", start, "--num-rollout", STEPS, "--max-turns", turns, "--eval-prompt-data", real,
              "--eval-interval", STEPS, "--seed", SLOW_GRPO_SEED, *GRPO]
    runs = tmp_path / "real", tmp_path / "shuffled"
    finish(launch("train_grpo.py", runs[0], *common, "--prompt-data", real),
           launch("train_grpo.py", runs[1], *common, "--prompt-data", shuffled))
    key = "eval_multi_turn_accuracy" if turns > 1 else "eval_accuracy"

    def curve(run):  # (reward per step, greedy accuracy per eval)
        rows = metrics(run)
        return [m["reward"] for m in rows if "reward" in m], [m[key] for m in rows if key in m]
    (got, evals), (ctrl, ctrl_evals) = map(curve, runs)
    for name, xs, ev in (("real", got, evals), ("shuffled", ctrl, ctrl_evals)):
        print(f"turns={turns} {name}: reward per 10 steps",
              [round(mean(xs[i:i + 10]), 2) for i in range(0, len(xs), 10)], "greedy accuracy", ev)
    assert len(got) == len(ctrl) == STEPS
    # Bounds from issue 31's seeds (bench/RESULTS.md, "Slow learning checks"): single-turn's last 10
    # steps 0.89 and 0.97 (rise 0.62, 0.70; greedy 1.0); multi-turn learns later and was still rising
    # at step 120: last 10 steps 0.59-0.80 (rise >= 0.30; greedy 0.70-1.0); controls 0.16-0.30 (greedy <= 0.30)
    bar, rise, greedy = (0.8, 0.4, 0.8) if turns == 1 else (0.5, 0.2, 0.6)
    assert mean(got[-10:]) >= bar and mean(got[-10:]) - mean(got[:10]) >= rise, got
    assert mean(got[-10:]) >= mean(ctrl[-10:]) + rise, (got, ctrl)
    assert mean(ctrl[-10:]) <= 0.4 and mean(ctrl[-10:]) - mean(ctrl[:10]) < 0.2, ctrl
    assert evals[-1] >= greedy > ctrl_evals[-1], (evals, ctrl_evals)


# Issue 43, the crop task (tools/synth.py kind "crop"): two polygons on a 1024-px canvas, the question names
# one's box; the whole canvas reaches the model at 256 px, the env's crop of the box at its own 128 px. From
# the `sides` reader above, an SFT warm start (192 steps) on episodes of which 30% crop the named box, then
# multi-turn GRPO with the real crop and with bench/blank_crop.py's white one (the control). Measured at GRPO
# seeds 1234 and 1 (bench/RESULTS.md, "Tool learning"), per-10-step means first -> last: crop calls an episode
# 0.38-0.40 -> 0.90-0.94 (blank 0.20-0.21 -> 0.00), reward 0.35-0.36 -> 0.58-0.61 (blank 0.23-0.24 -> 0.19-0.29),
# greedy multi-turn 0.27 -> 0.56 at both (blank 0.27 -> 0.25). The bounds leave a margin below those.
CROP_CALLS, CROP_RISE, CROP_GAP, REWARD_GAP, BLANK_REWARD, GREEDY_GAP = 0.7, 0.3, 0.5, 0.15, 0.35, 0.15
CROP_WARM = setting(SFT, num_epoch=3, lr_warmup_iters=10)
CROP_GRPO = setting(GRPO, rollout_max_response_len=192) + ["--max-turns", "3", "--lr-warmup-iters", "10"]
CROP_STEPS = 40


@pytest.mark.slow
def test_grpo_learns_to_call_crop_and_the_blank_crop_control_does_not(warm, tmp_path):
    """Tool use learnt from the reward (~40 min on 2 cores): with the real crop GRPO calls it more and on the
    named box, and reward and greedy multi-turn accuracy rise; with a crop that shows a blank image the same
    recipe stops calling it and gains nothing."""
    from tools import synth
    _, _, root = warm
    task = synth.write_synth(tmp_path / "crop", 512, n_test=64, seed=0, kinds=("crop",))  # 3 MB a canvas in memory
    episodes = synth.write_synth(tmp_path / "warm", 1024, n_test=8, seed=1, kinds=("crop",), warm=0.3)
    finish(launch("sft.py", tmp_path / "sft", "--hf-checkpoint", root / "sft" / "iter_0000128", "--prompt-data",
                  episodes, "--seed", SLOW_SFT_SEED, *CROP_WARM))
    common = ["--hf-checkpoint", tmp_path / "sft" / "iter_0000192", "--prompt-data", task, "--eval-prompt-data", task,
              "--num-rollout", CROP_STEPS, "--eval-interval", CROP_STEPS, "--seed", SLOW_GRPO_SEED, *CROP_GRPO]
    runs = tmp_path / "real", tmp_path / "blank"
    finish(launch("train_grpo.py", runs[0], *common), launch("bench/blank_crop.py", runs[1], *common))

    def per10(rows, key):
        xs = [m.get(key, 0.0) for m in rows if "reward" in m]
        return [round(mean(xs[i:i + 10]), 2) for i in range(0, len(xs), 10)]
    (real, blank) = (metrics(r) for r in runs)
    for name, rows in (("real", real), ("blank", blank)):
        print(f"{name}: crop calls/episode", per10(rows, "tool_calls_image_zoom_in_tool"), "reward", per10(rows, "reward"),
              "greedy multi-turn", [m["eval_multi_turn_accuracy"] for m in rows if "eval_multi_turn_accuracy" in m])
    calls, ctrl_calls = per10(real, "tool_calls_image_zoom_in_tool"), per10(blank, "tool_calls_image_zoom_in_tool")
    reward, ctrl_reward = per10(real, "reward"), per10(blank, "reward")
    greedy, ctrl_greedy = ([m["eval_multi_turn_accuracy"] for m in rows if "eval_multi_turn_accuracy" in m]
                           for rows in (real, blank))
    assert calls[-1] >= CROP_CALLS and calls[-1] - calls[0] >= CROP_RISE, (calls, ctrl_calls)
    assert calls[-1] >= ctrl_calls[-1] + CROP_GAP, (calls, ctrl_calls)
    assert reward[-1] >= ctrl_reward[-1] + REWARD_GAP and ctrl_reward[-1] <= BLANK_REWARD, (reward, ctrl_reward)
    assert greedy[-1] >= ctrl_greedy[-1] + GREEDY_GAP, (greedy, ctrl_greedy)


def fast_grpo_check(ckpt, out, *flags, grpo_flags=(), sft_timeout=900, grpo_timeout=1800):
    """The fast check on the tiny checkpoint CKPT, runs under OUT, FLAGS added to every run: one SFT
    epoch on shuffled 64-pixel pictures (the answer format only), then FAST_STEPS GRPO steps on the
    right pictures and on the shuffled ones. Asserts that the reward rises off chance on the right
    pictures and not on the shuffled ones; returns each GRPO run's step rows (real, shuffled)."""
    from tools import synth
    real = synth.write_synth(out / "data", 512, n_test=8, seed=FAST_SEED, kinds=("sides",), size=64)
    shuffled = shuffled_twin(real, out / "shuffled", seed=FAST_SEED)
    finish(launch("sft.py", out / "sft", "--hf-checkpoint", ckpt, "--prompt-data", shuffled,
                  "--seed", FAST_SEED, *FAST_SFT, *flags), timeout=sft_timeout)
    common = ["--hf-checkpoint", out / "sft" / "iter_0000032", "--num-rollout", FAST_STEPS,
              "--seed", FAST_GRPO_SEED, *FAST_GRPO, *flags, *grpo_flags]
    runs = out / "real", out / "shuffled_run"
    finish(launch("train_grpo.py", runs[0], *common, "--prompt-data", real),
           launch("train_grpo.py", runs[1], *common, "--prompt-data", shuffled), timeout=grpo_timeout)
    rows = [[m for m in metrics(run) if "reward" in m] for run in runs]
    got, ctrl = ([m["reward"] for m in r] for r in rows)
    for name, xs in (("real", got), ("shuffled", ctrl)):
        print(f"{name}: reward per 10 steps", [round(mean(xs[i:i + 10]), 3) for i in range(0, len(xs), 10)])
    assert len(got) == len(ctrl) == FAST_STEPS
    rise, ctrl_rise = mean(got[-10:]) - mean(got[:10]), mean(ctrl[-10:]) - mean(ctrl[:10])
    assert rise >= 0.15 and mean(got[-10:]) >= mean(ctrl[-10:]) + 0.1, (got, ctrl)
    assert ctrl_rise < 0.12, ctrl
    return rows


@pytest.mark.cores(lane=0)  # the longest two: one a lane
def test_grpo_reward_rises_from_a_picture_blind_start_and_the_shuffled_control_does_not(tiny_ckpt, tmp_path):
    """The fast learning check (~245 CPU s: SFT 24, each GRPO arm 110-120): SFT on shuffled images
    teaches the answer format only; from there GRPO on the right images lifts the reward off chance
    (1 in 4) within 60 steps, and the same GRPO on the shuffled images does not move. Measured (means
    of the first and last 10 steps), GRPO seed 1 on four machines or dates: 0.25-0.28 -> 0.47-0.61
    (rise 0.19-0.36); seed 2: 0.23 -> 0.48; seed 0: 0.21 -> 0.42 and 0.28 -> 0.35 (failed); a
    seed-1234 SFT 0.21 -> 0.57; controls rose at most 0.10. The reward leaves chance late (steps
    30-50), so the margins are small: the runs are deterministic for a given seed and machine only.
    Shorter (the first N steps of the 60-step runs, 2026-12-07): at 40 steps seed 2 rose 0.13 (fails
    the 0.15); at 50 seeds 1 and 2 rose 0.20 and 0.25, the seed-2 control 0.08: margins under the
    machines' spread at seed 1 (0.17), for 15% of the CPU, so 60 steps stay (bench/RESULTS.md, "Test
    suite"). A planted defect, the trainer's pixel values zeroed (the update blind to the picture the
    rollout saw): 0.22 -> 0.30, a rise of 0.08, fails (test_grpo's logprob match catches it first)."""
    fast_grpo_check(tiny_ckpt("qwen3_vl"), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("data_seed", ["0", "1"])
def test_demo_stages_keep_what_the_last_taught_and_the_multi_turn_stage_learns_to_crop(data_seed, tmp_path):
    """`bash run.sh` (the CPU demo; its time: bench/RESULTS.md) at data seeds 0 and 1, SEED 1234: demo_claims, issue
    76's bounds. Measured at 3 GRPO x these 2 data seeds (bench/RESULTS.md, "Issue 76"): the crop stage's greedy hit
    0.000 -> 1.000 and multi-turn 0.188-0.312 -> 1.000 from its step-10 eval on; single-turn (whole canvas) 0.00-0.30."""
    r = subprocess.run(["bash", ROOT / "run.sh"], cwd=ROOT, capture_output=True, text=True, timeout=3600,
                       env=dict(os.environ, DATA_SEED=data_seed, RUN=str(tmp_path / "demo")))
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-3000:]
    demo_claims(tmp_path / "demo")


HIT, MULTI, TOOL_GAP = 0.8, 0.7, 0.4  # issue 76's bounds on the crop stage's greedy evals (bench/RESULTS.md)


def demo_claims(run):
    """The demo test's assertions on a finished run.sh folder RUN (tests/test_crop_task.py tries them on made-up
    folders): the sides stages end no worse than they began (within one problem in 64), the single-turn one >= 0.8;
    the crop stage, greedy on its test set, evaluated within the stage (every 10 steps), not only at its ends: the
    share whose crop hits the named box ends >= HIT from below it (the SFT warm start alone misses it: GRPO does a
    visible share), multi-turn accuracy ends >= MULTI, and >= TOOL_GAP above the same policy's single-turn accuracy
    on the whole canvas (the tool stays necessary)."""
    rows, _, _ = report.stage_rows(Path(run))
    assert [title for title, *_ in rows] == ["SFT", "GRPO single-turn", "SFT crop calls", "GRPO crop task"]
    ev = {title: evals for title, _, _, _, evals, _ in rows}  # eval key -> [label, before, after, [(step, value)]]
    for title in ("SFT", "GRPO single-turn"):
        _, before, after, _ = ev[title]["eval_accuracy"]
        assert before is None or after >= before - 1 / 64, (title, before, after)
    assert ev["GRPO single-turn"]["eval_accuracy"][2] >= 0.8, ev
    crop = ev["GRPO crop task"]
    _, before, after, seen = crop["eval_multi_turn_crop_hit_frac"]
    assert len(seen) >= 3 and seen[0][0] == 0, f"the crop stage's evals: {seen}"
    assert before < HIT <= after, f"greedy crop hit share {before} -> {after} (the bound {HIT}, from below it)"
    multi, single = crop["eval_multi_turn_accuracy"][2], crop["eval_accuracy"][2]
    assert multi >= MULTI and multi - single >= TOOL_GAP, f"multi-turn {multi}, single-turn on the whole canvas {single}"


@pytest.mark.slow
def test_grpo_learns_one_step_off_policy_with_async_rollout(tiny_ckpt, tmp_path):
    """The fast check with --async-rollout: every step trains on samples of the weights before the
    previous update (rollout_policy_version = step - 1 after the first), and the reward still rises
    off chance on the right pictures and not on the shuffled ones."""
    real, _ = fast_grpo_check(tiny_ckpt("qwen3_vl"), tmp_path, grpo_flags=["--async-rollout"])
    assert [m["rollout_policy_version"] for m in real[1:]] == list(range(len(real) - 1))


@pytest.mark.slow
def test_grpo_learns_with_partial_rollout(tiny_ckpt, tmp_path):
    """The fast check with --partial-rollout at 1.5x over-sampling: each step samples 12 groups and trains on
    the first 8 complete (buffered ones first), the other 4 (complete too: the local engine answers a round at
    once) wait for the next step, half of whose samples are then one policy version old; the reward still
    rises off chance on the right pictures and not on the shuffled ones."""
    real, _ = fast_grpo_check(tiny_ckpt("qwen3_vl"), tmp_path,
                              grpo_flags=["--partial-rollout", "--over-sampling-batch-size", "12"])
    assert all(m["rollout_buffer_groups"] == 4 for m in real)
    assert all(0.4 <= m["offpolicy_token_frac"] <= 0.6 for m in real[1:])


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["1", "2"])
def test_grpo_learns_fully_async(tiny_ckpt, tmp_path, seed):
    """The fast check with --fully-async --max-weight-staleness 2 (the local engine's episodes on threads of their own
    beside training, 12 groups generating at once): each step trains the first 8 complete groups, much of them
    written while earlier steps trained, none more than 2 versions old; the reward still rises off chance on the
    right pictures and not on the shuffled ones, at both GRPO seeds (bench/RESULTS.md, "Fully async")."""
    real, _ = fast_grpo_check(tiny_ckpt("qwen3_vl"), tmp_path, grpo_flags=[
        "--fully-async", "--max-weight-staleness", "2", "--over-sampling-batch-size", "12", "--seed", seed])
    assert all(m["staleness_max"] <= 2 for m in real) and max(m["offpolicy_token_frac"] for m in real) > 0, real
