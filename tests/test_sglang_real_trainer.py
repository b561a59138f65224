"""The trainer against the real SGLang server on CPU (opt-in, as tests/test_sglang_real.py, whose harness and marks
it shares): two GRPO steps single- and multi-turn, a killed server restarted once, two nodes behind the router."""
import json
import os
import re
import signal
import time

import pytest

import launch
from test_sglang_real import FLAGS, PY, ROOT, harness_env, pytestmark  # noqa: F401 (a fixture; the marks)

XDIST_GROUP = "test_sglang_real"  # on one worker with its real servers (tests/conftest.py)


# ---------------------------------------------------------------------------------- the trainer
def geo3k_parquet():
    for folder in (ROOT / "tests" / "data" / "geo3k_real", ROOT.parent / "shared" / "geo3k_real"):
        if (folder / "test.parquet").exists():
            return folder / "test.parquet"
    pytest.skip("no geo3k_real/test.parquet")


def test_trainer_single_turn(harness_env, ckpt, tmp_path):
    trainer_two_steps(harness_env, ckpt, tmp_path, turns=1)


def test_trainer_multi_turn(harness_env, ckpt, tmp_path):
    trainer_two_steps(harness_env, ckpt, tmp_path, turns=3)


def trainer_two_steps(harness_env, ckpt, tmp_path, turns):
    """train_grpo.py --rollout-engine sglang, run by the harness python, on the ten real geo3k
    rows: two GRPO steps, no failed sample in either. (A random tiny model never writes a tool
    call, so its multi-turn episodes end after one turn; test_multi_turn_crop_sends_two_images
    covers later turns.)"""
    flags = []
    for a in FLAGS:
        flags.append("--sglang-" + a[2:] if a.startswith("--") else a)
    cmd = [str(PY), "train_grpo.py", "--hf-checkpoint", str(ckpt), "--prompt-data", str(geo3k_parquet()),
           "--rollout-engine", "sglang", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
           "--rollout-max-response-len", "24", "--max-turns", str(turns), "--num-rollout", "2",
           "--lr", "1e-4", "--max-tokens-per-gpu", "4096", "--save", str(tmp_path / "run"), *flags]
    t = time.time()
    r = launch.run(cmd, timeout=1800, env=dict(os.environ, **harness_env))
    took = time.time() - t
    assert r.returncode == 0, r.stderr[-4000:]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [m for m in map(json.loads, lines) if "reward" in m]
    keys = ("failed_frac", "turns", "truncated_frac", "logprob_diff_mean", "logprob_diff_max", "rollout_s", "sync_s")
    for m in steps:
        print(f"\n[sglang_real] trainer max_turns={turns} step {m['step']}: "
              + " ".join(f"{k}={m.get(k)}" for k in keys))
    print(f"[sglang_real] trainer max_turns={turns}: 2 steps in {took:.0f}s")
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["failed_frac"] == 0 for m in steps), steps
    assert "sglang.launch_server" in (tmp_path / "run" / "sglang.log").read_text()  # the real server ran


def kill_mid_rollout(save, log_name, step):
    """A thread: once step `step` - 1 is in metrics.jsonl and the server logging to `log_name` starts a
    prefill of rollout requests after that (SGLang's "Prefill batch" line with more than the one
    token of a health check), SIGKILL its process group (its pid: the log's last "=== pid" line)
    while they decode. -> the list that gets the killed pid."""
    import threading
    killed, prefill = [], re.compile(r"Prefill batch, #new-seq: \d+, #new-token: (\d+)")

    def run():
        metrics, log = save / "metrics.jsonl", save / log_name
        deadline = time.time() + 1800
        while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= step - 1):
            time.sleep(0.2)
        seen = len(log.read_text(errors="replace"))
        while time.time() < deadline and not any(
                int(n) > 1 for n in prefill.findall(log.read_text(errors="replace")[seen:])):
            time.sleep(0.1)
        if time.time() >= deadline:  # the run ended without that rollout: kill nothing (the pid may be reused)
            return
        pid = int(re.findall(r"=== pid (\d+)", log.read_text(errors="replace"))[-1])
        os.killpg(pid, signal.SIGKILL)
        killed.append(pid)
    threading.Thread(target=run, daemon=True).start()
    return killed


def test_trainer_restarts_a_killed_server_once(harness_env, ckpt, tmp_path):
    """The server's process group SIGKILLed during step 2's rollout: the episode whose request failed restarts
    it, and the run ends with that one restart. Started from the episode's thread, the restarted server was
    SIGKILLed at the pause that ends the rollout (PR_SET_PDEATHSIG follows the thread) and the weight sync
    started a third: proc.popen forks every server from one thread that lives as long as the trainer."""
    flags = []
    for a in FLAGS:
        flags.append("--sglang-" + a[2:] if a.startswith("--") else a)
    save = tmp_path / "run"
    cmd = [str(PY), "train_grpo.py", "--hf-checkpoint", str(ckpt), "--prompt-data", str(geo3k_parquet()),
           "--rollout-engine", "sglang", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
           "--rollout-max-response-len", "24", "--num-rollout", "3", "--lr", "1e-4", "--max-tokens-per-gpu", "4096",
           "--save", str(save), *flags]
    t, killed = time.time(), kill_mid_rollout(save, "sglang.log", step=2)
    r = launch.run(cmd, timeout=2400, env=dict(os.environ, **harness_env))
    assert r.returncode == 0, r.stderr[-4000:]
    steps = [m for m in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "reward" in m]
    starts = (save / "sglang.log").read_text().count("starting:")
    print(f"\n[sglang_real] server killed in step 2: {len(steps)} steps in {time.time() - t:.0f}s, {starts} server "
          f"starts; {[line for line in r.stderr.splitlines() if '[sglang] server down' in line]}")
    assert killed and [m["step"] for m in steps] == [1, 2, 3], (killed, steps)
    assert starts == 2, (save / "sglang.log").read_text()[-3000:]

def test_trainer_two_nodes_two_real_servers_behind_the_real_router(harness_env, ckpt, tmp_path):
    """Two nodes simulated here (`torchrun --nnodes 2` on 127.0.0.1, one process each): a real CPU server
    per node behind SGLang's real router, per-run API key, lr 1e-3 so that a server left with old
    weights would show in the trainer-vs-rollout logprob gap; both servers serve. Node 1's
    server is killed mid-way through step 2's rollout: its node restarts it (disk sync: with the weights
    it had), the router retries what it held, every sample of the step is completed or counted failed
    with its reason, and the restarted server takes the next weight syncs."""
    flags = []
    for a in FLAGS:
        flags.append("--sglang-" + a[2:] if a.startswith("--") else a)
    save = tmp_path / "run"
    args = ["--hf-checkpoint", str(ckpt), "--prompt-data", str(geo3k_parquet()), "--rollout-engine", "sglang",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "16",
            "--num-rollout", "3", "--lr", "1e-3", "--max-tokens-per-gpu", "4096", "--save", str(save),
            # the router checks health every 2 s and reopens a circuit after 2 s (defaults: 60 s, 60 s)
            "--sglang-router-args", "--balance-abs-threshold 0 --balance-rel-threshold 1.0 "
            "--health-check-interval-secs 2 --cb-timeout-duration-secs 2", *flags]
    t, killed = time.time(), kill_mid_rollout(save, "sglang_node01.log", step=2)
    runs = launch.torchrun_nodes(2, 1, ["train_grpo.py", *args], timeout=2400, py=PY,
                                 env=dict(os.environ, **harness_env, OMP_NUM_THREADS="1"))
    outs = [r.stdout + r.stderr for r in runs]
    assert [r.returncode for r in runs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    steps = [m for m in map(json.loads, (save / "metrics.jsonl").read_text().splitlines()) if "reward" in m]
    failed = [line for line in outs[0].splitlines() if "samples failed" in line]
    for m in steps:
        print(f"\n[sglang_real] two nodes step {m['step']}: failed_frac={m['failed_frac']} "
              f"logprob_diff_mean={m['logprob_diff_mean']:.2e} logprob_diff_max={m['logprob_diff_max']:.2e}")
    print(f"[sglang_real] two nodes, two real servers, node 1's killed in step 2: {len(steps)} steps in "
          f"{time.time() - t:.0f}s; {failed or 'no sample failed'}")
    assert killed and [m["step"] for m in steps] == [1, 2, 3], (killed, steps)
    assert steps[0]["failed_frac"] == steps[2]["failed_frac"] == 0, (steps, failed)
    assert steps[1]["failed_frac"] == 0 or any("step 2:" in line for line in failed)  # counted, with why
    assert all(m["logprob_diff_mean"] < 1e-3 for m in steps), steps  # fp32 servers: the single-server level
    for node in ("node00", "node01"):
        log = (save / f"sglang_{node}.log").read_text()
        assert "sglang.launch_server" in log and "--api-key ***" in log
        assert len(re.findall(r'POST /generate HTTP', log)) > 0, node  # this server served
    log = (save / "sglang_node01.log").read_text()
    before, restarted = log.split(f"=== pid {killed[0]}")[1].split("starting:")
    assert len(re.findall(r"POST /generate HTTP", before.split("update_weights_from_disk")[-1])) < 4  # in flight
    # it came back with the last synced weights and took the next sync; the router sends to it again
    # once its health checks pass (the fake-server test waits for that; here step 3 may end first)
    assert "POST /update_weights_from_disk HTTP" in restarted
    print(f"[sglang_real] the restarted server answered {restarted.count('POST /generate HTTP')} requests after it")
