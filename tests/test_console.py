"""The console and the training loop's ends (issue 50; issue 49's preemption), through the processes' own
output: what a run prints from its first line to its last, Ctrl-C, SIGTERM with --exit-signal-handler (to the
ranks, and to run.sh's torchrun), --exit-duration-in-mins, and resuming after each with no step lost or repeated."""
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
    assert {"problem", "answer", "correct", "status", "response"} <= set(rows[0]) and rows[0]["status"] == "truncated"
    saved = [m.start() for m in re.finditer(r"\[run\] saved checkpoint", out)]
    assert len(saved) == 2 and all(out[i - 1] in "\r\n" for i in saved), [out[i - 60:i + 30] for i in saved]
    assert "rollout: 0it" not in out
    assert re.search(rf"\n\[run\] done: steps 0 -> 3 in [0-9.]+ min; last reward 0.000, eval_accuracy 0.000 -> 0.000, "
                     rf"eval_pass@2 0.000 -> 0.000; checkpoint {save / 'iter_0000003'}\n$", out), out[-500:]


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


# sft.py as each rank runs it, with the test's event: ONE rank (ALONE) SIGTERMs itself as step SIGNAL_AT begins, or
# is the only one whose --exit-duration-in-mins (LATE) is up; the other rank's is a day
ONE_RANK = """
import os, runpy, signal, sys
sys.path.insert(0, os.environ["ROOT"])
import console
alone, plain = os.environ["RANK"] == os.environ["ALONE"], console.steps
if os.environ.get("LATE"):
    sys.argv += ["--exit-duration-in-mins", os.environ["LATE"] if alone else "1440"]

def steps(run, start, total):
    for step in plain(run, start, total):
        if alone and str(step) == os.environ.get("SIGNAL_AT"):
            os.kill(os.getpid(), signal.SIGTERM)  # its handler marks the run; the step goes on
        yield step
console.steps = steps
sys.argv[0] = os.environ["SFT"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.cores
def test_preemption_of_one_rank_stops_every_rank_after_the_same_step_and_resumes_with_none_lost(ckpt, d, tmp_path):
    """Two ranks (DP 2) with --exit-signal-handler, rank 1 alone SIGTERMed during step 2, as a cluster's scheduler
    may: the stop is one decision for both ranks, so both finish step 2, its checkpoint is written once, both exit 0.
    Resumed with --load and --exit-duration-in-mins, its time up on rank 1 alone (rank 0's a day): the same after
    one more step, saying why. Resumed again: it ends. Every step logged once, in order; no other checkpoint.
    A stop decided per rank leaves the other rank in the next step's collectives (a hang); one that needs every
    rank's mark runs on."""
    save, script = tmp_path / "run", tmp_path / "one_rank.py"
    script.write_text(ONE_RANK)
    common = [script, "--hf-checkpoint", ckpt, "--prompt-data", d, "--save", save, "--global-batch-size",
              "4", "--num-epoch", "2", "--save-interval", "0", "--exit-signal-handler"]
    env = dict(ENV, ROOT=str(ROOT), SFT=str(ROOT / "sft.py"), ALONE="1")
    r = launch.python(*common, nproc=2, env=dict(env, SIGNAL_AT="1"), timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert steps(save) == [1, 2] and (save / "latest").read_text() == "iter_0000002", (steps(save), r.stdout)
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002"]
    assert f"[run] SIGTERM: stopped after step 2 of 8, saved {save / 'iter_0000002'}; resume: " in r.stdout
    r = launch.python(*common, "--load", save, nproc=2, env=dict(env, LATE="1e-6"), timeout=300)
    assert r.returncode == 0 and steps(save) == [1, 2, 3], r.stderr[-3000:]
    assert sorted(p.name for p in save.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert "[run] --exit-duration-in-mins 1440.0: stopped after step 3 of 8" in r.stdout, r.stdout
    r = launch.python(*common, "--load", save, nproc=2, env=env, timeout=300)
    assert r.returncode == 0 and steps(save) == list(range(1, 9)), r.stderr[-3000:]
    assert "[run] done: steps 3 -> 8 in" in r.stdout and (save / "latest").read_text() == "iter_0000008"


RUN_SH_TORCHRUN = "sed -n '/^TORCHRUN=/,/^exec /{/^exec /!p}' run.sh"  # the lines run.sh builds its torchrun with


@pytest.mark.parametrize("has_flag", [True, False])
def test_run_shs_torchrun_line_works_on_a_torchrun_with_and_without_shutdown_timeout(tmp_path, has_flag):
    """torch < 2.12's torchrun has no --shutdown-timeout (argparse exits 2 on it): run.sh passes it only where
    `torchrun --help` lists it, and says what the other gives (30 s); TORCH_ELASTIC_SHUTDOWN_TIMEOUT, which 2.12's
    launcher reads where no flag is given (launcher/api.py:144-147), says the same. A fake .venv/bin/torchrun of
    each kind."""
    fake = tmp_path / ".venv" / "bin" / "torchrun"
    fake.parent.mkdir(parents=True)
    flag = "[--shutdown-timeout SHUTDOWN_TIMEOUT] " if has_flag else ""
    fake.write_text(f'#!/bin/bash\n[[ $1 == --help ]] && {{ echo "usage: torchrun [-h] {flag}[--standalone]"; exit 0; }}\n'
                    f'[[ " $* " == *" --shutdown-timeout "* && -z "{flag}" ]] && {{ echo "unrecognized arguments" >&2; exit 2; }}\n'
                    'echo "ran: $* (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT)"\n')
    fake.chmod(0o755)
    r = subprocess.run(["bash", "-c", f'eval "$({RUN_SH_TORCHRUN.replace("run.sh", str(ROOT / "run.sh"))})"; '
                        '"${TORCHRUN[@]}" --standalone x.py'], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    said = "ran: --shutdown-timeout 600 --standalone x.py" if has_flag else "ran: --standalone x.py"
    assert r.stdout == f"{said} (TORCH_ELASTIC_SHUTDOWN_TIMEOUT=600)\n", r.stdout
    assert ("no --shutdown-timeout (torch < 2.12): a preempted step has 30 s" in r.stderr) != has_flag, r.stderr


@pytest.mark.cores(lane=1)  # the longest two: one a lane
def test_preemption_through_run_shs_torchrun_saves_the_step_and_the_same_command_resumes(ckpt, d, tmp_path):
    """run.sh's torchrun SIGTERMed (its pid, not the ranks'), as a scheduler preempts a job: torchrun passes the
    signal on and SIGKILLs its workers a shutdown timeout later (torch's default 30 s, launcher/api.py:148-151 and
    elastic/multiprocessing/api.py:1023-1053; 2 s in the caller's TORCH_ELASTIC_SHUTDOWN_TIMEOUT here), while the
    step in flight takes 4 s more once signalled (tests/_slow_stop.py). run.sh's own (its --shutdown-timeout, and the
    variable it exports) wins: the step's
    checkpoint is written and torchrun exits 1, as run.sh says (its agent re-raises the signal once the workers
    are done: elastic/agent/server/api.py:752-756). The same command again resumes: no step lost or repeated."""
    save = tmp_path / "run"
    cmd = [ROOT / "tests" / "_slow_stop.py", ROOT / "sft.py", "--hf-checkpoint", ckpt, "--prompt-data", d, "--save",
           save, "--load", save, "--global-batch-size", "4", "--num-epoch", "1", "--exit-signal-handler"]
    recipe = f'eval "$({RUN_SH_TORCHRUN})"; "${{TORCHRUN[@]}}" --standalone --nproc-per-node 2 "$@"'
    env = dict(ENV, TORCH_ELASTIC_SHUTDOWN_TIMEOUT="2", SLOW_STOP_S="4")
    r = launch.run(["bash", "-c", f"{recipe} & until [ -s {save}/metrics.jsonl ]; do sleep 0.1; done; kill -TERM $!; "
                    'wait $!; echo "torchrun exit $?"', "bash", *cmd], timeout=600, env=env)
    done = steps(save)
    k = done[-1] if done else 0
    assert r.stdout.endswith("torchrun exit 1\n") and f"[run] SIGTERM: stopped after step {k} of 4" in r.stdout, (
        r.stdout[-2000:], r.stderr[-3000:])
    assert done == list(range(1, k + 1)) and k < 4 and (save / "latest").read_text() == f"iter_{k:07d}", done
    r = launch.run(["bash", "-c", recipe, "bash", *cmd], timeout=600, env=env)
    assert r.returncode == 0 and steps(save) == [1, 2, 3, 4], r.stderr[-3000:]
    assert f"[run] done: steps {k} -> 4 in" in r.stdout


@pytest.mark.parametrize("entry", ["train_grpo", "sft"])
def test_use_tensorboard_writes_each_steps_numbers_as_events_and_overwrite_removes_them(entry, tmp_path):
    """--use-tensorboard (slime's flag, issue 75 6j): a step's numbers (not its text) as TensorBoard scalars in
    <save>/tensorboard, readable by TensorBoard's own reader, for both trainers; --overwrite removes them with the run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    import trainer
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data", "x", "--save", str(tmp_path / "run"),
            "--use-tensorboard"]
    _, run = trainer.start(__import__(entry).parse_args(argv), entry)
    run.log(1, {"reward": 0.5, "loss": 2.0, "hint": "text"})
    run.log(2, {"reward": 0.75})
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["loss", "reward"]
    assert [(e.step, e.value) for e in events.Scalars("reward")] == [(1, 0.5), (2, 0.75)]
    run.lock.close()
    trainer.start(__import__(entry).parse_args(argv[:-1] + ["--overwrite"]), entry)
    assert not (tmp_path / "run" / "tensorboard").exists()
