"""The console and the training loop's ends (issue 50; issue 49's preemption), through the processes' own
output: what a run prints from its first line to its last, Ctrl-C, SIGTERM with --exit-signal-handler,
--exit-duration-in-mins, and resuming after each with no step lost or repeated."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import launch
from tools import synth

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def d(tmp_path_factory):
    return synth.write_synth(tmp_path_factory.mktemp("console") / "d", 16, n_test=4, seed=0, kinds=("sides",), size=64)


def steps(save):
    return [json.loads(x)["step"] for x in (Path(save) / "metrics.jsonl").read_text().splitlines() if "loss" in x]


def test_a_grpo_run_prints_one_line_a_fact(ckpt, d, tmp_path):
    """A fresh interpreter, stdout and stderr together as a terminal shows them: no warning before the first
    line, the config in its file (one line says where), why nothing is learnt (every response truncated),
    each evaluation with its per-problem file, checkpoint lines that do not splice into the progress bar,
    no empty `rollout: 0it` bar, and a summary last."""
    save = tmp_path / "run"
    cmd = [sys.executable, ROOT / "train_grpo.py", "--hf-checkpoint", ckpt, "--prompt-data", d, "--save", save,
           "--rollout-engine", "local", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
           "--rollout-max-response-len", "3", "--num-rollout", "3", "--save-interval", "2", "--eval-prompt-data", d,
           "--eval-samples", "2", "--n-samples-per-eval-prompt", "2"]
    r = launch.run(["bash", "-c", 'exec "$@" 2>&1', "bash", *cmd], timeout=600, env=ENV)
    out = r.stdout
    assert r.returncode == 0, out[-3000:]
    lines = [x for x in re.split(r"[\r\n]", out) if x.strip()]
    assert lines[0] == f"[run] starting fresh in {save}", lines[:5]
    assert lines[1] == f"[run] config (flags, versions): {save / 'config_grpo.json'}" and "{" not in lines
    assert "[grpo] steps 1-3 learnt nothing: every response was cut at --rollout-max-response-len 3" in out
    assert f"[eval] step 0: eval_accuracy 0.000, eval_pass@2 0.000 (each response: {save / 'eval_0000000.jsonl'})" in out
    rows = [json.loads(x) for x in (save / "eval_0000003.jsonl").read_text().splitlines()]
    assert [(x["mode"], x["index"]) for x in rows] == [("eval_accuracy", 0), ("eval_accuracy", 1)] + [
        ("eval_pass@2", i) for i in (0, 0, 1, 1)]
    assert {"problem", "answer", "reward", "status", "response"} <= set(rows[0]) and rows[0]["status"] == "truncated"
    saved = [m.start() for m in re.finditer(r"\[run\] saved checkpoint", out)]
    assert len(saved) == 2 and all(out[i - 1] in "\r\n" for i in saved), [out[i - 60:i + 30] for i in saved]
    assert "rollout: 0it" not in out
    assert re.search(rf"\n\[run\] done: steps 0 -> 3 in [0-9.]+ min; last reward 0.000, eval_accuracy 0.000, "
                     rf"eval_pass@2 0.000; checkpoint {save / 'iter_0000003'}\n$", out), out[-500:]


def test_ctrl_c_ends_with_the_command_that_resumes(ckpt, d, tmp_path):
    """SIGINT, as a terminal's Ctrl-C sends it (the process's SIGINT at its default even where the test runner
    ignores it), at step 1, before any checkpoint: exit 130, one line saying the run starts over and the command
    that does it, no traceback."""
    save = tmp_path / "run"
    cmd = [sys.executable, ROOT / "sft.py", "--hf-checkpoint", ckpt, "--prompt-data", d, "--save", save,
           "--global-batch-size", "4", "--num-epoch", "50", "--overwrite"]
    p = subprocess.Popen(list(map(str, cmd)), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.time() + 300
        while not (save / "metrics.jsonl").exists():
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=120)
    finally:
        p.kill()
    assert p.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.rstrip().splitlines()[-1] == (f"[run] interrupted; no checkpoint yet, start over: {sys.executable} "
                                             f"{ROOT / 'sft.py'} --hf-checkpoint {ckpt} --prompt-data {d} --save {save} "
                                             f"--global-batch-size 4 --num-epoch 50 --load {save}")


def test_preemption_saves_the_step_in_flight_and_resumes_with_none_lost(ckpt, d, tmp_path):
    """Two ranks (DP 2) with --exit-signal-handler, each SIGTERMed during a step, as a cluster's scheduler
    does: the step finishes, its checkpoint is written, both ranks exit 0. Resumed with --load and
    --exit-duration-in-mins (its time up after one more step): the same, saying why. Resumed again: it
    ends. Every step logged once, in order."""
    save = tmp_path / "run"
    common = [ROOT / "sft.py", "--hf-checkpoint", ckpt, "--prompt-data", d, "--save", save, "--global-batch-size",
              "4", "--num-epoch", "2", "--save-interval", "0", "--exit-signal-handler"]
    job = launch.start(*common, nproc=2, env=ENV)
    deadline = time.time() + 300
    while not (save / "metrics.jsonl").exists():
        assert job.poll() is None and time.time() < deadline, job.wait(5).stderr[-3000:]
        time.sleep(0.1)
    job.kill(signal.SIGTERM)
    r = job.wait(300)
    assert r.returncode == 0, r.stderr[-3000:]
    done = steps(save)
    k = done[-1]
    assert done == list(range(1, k + 1)) and k < 8 and (save / "latest").read_text() == f"iter_{k:07d}", (done, r.stdout)
    assert f"[run] SIGTERM: stopped after step {k} of 8, saved {save / f'iter_{k:07d}'}; resume: " in r.stdout
    r = launch.python(*common, "--load", save, "--exit-duration-in-mins", "1e-6", nproc=2, env=ENV, timeout=300)
    assert r.returncode == 0 and steps(save) == list(range(1, k + 2)), r.stderr[-3000:]
    assert f"[run] --exit-duration-in-mins 1e-06: stopped after step {k + 1} of 8" in r.stdout, r.stdout
    r = launch.python(*common, "--load", save, nproc=2, env=ENV, timeout=300)
    assert r.returncode == 0 and steps(save) == list(range(1, 9)), r.stderr[-3000:]
    assert f"[run] done: steps {k + 1} -> 8 in" in r.stdout and (save / "latest").read_text() == "iter_0000008"
