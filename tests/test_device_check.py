"""bench/device_check.sh --dry-run (issue 59): the GPU machine's check at tiny sizes on the CPU, through the same
script and code, so that it cannot rot between the loans of a GPU. Each check runs and PASSes (the CUDA-only parts,
FLA's kernels and the CUDA cache, say they did not run) and reports the numbers RESULTS.md's "GPU" section takes.
Its setup runs once a session through the script (--only setup); each other check is a test of its own, so they
spread over the workers, each through the script's driver (device_checks.drive) on that one setup (issue 70)."""
import fcntl
import inspect
import json
import os
from pathlib import Path

import pytest

import launch
from conftest import ROOT, shared_dir

from bench import device_checks

A, D = device_checks.ARCHS, ("fp32", "bf16")
WANT = {  # check -> what its row must hold besides PASS (in CHECKS' order: grpo, then the cheap ones)
    "grpo": lambda r: r["steps"] == 2 and min(r["rollout_tokens_per_s"], r["train_tokens_per_s"], r["train_tflops_per_s"],
                                             r["estimate_train_gib"]) > 0,
    "preempt": lambda r: r["stopped_after"] > 0 and r["steps_after_resume"] == r["stopped_after"] + 1,
    "ckpt": lambda r: r["exact"] and r["max_abs_logit_diff"] <= 1e-4,
    "offload": lambda r: r["exact"] and r["freed_frac"] >= 0.9,
    "parity": lambda r: {f"{a}_{d}" for a in A for d in D} <= r.keys() and all(
        r[f"{a}_fp32"]["logits"] <= 1e-4 and r[f"{a}_bf16"]["logits"] > 0 for a in A),
    "gdn": lambda r: r["torch_fp32"]["passed"] and r["fla_fp32"] == "not run: CPU",
    "gdn_tf32": lambda r: r["fla_bf16"] == "not run: CPU",
}


def rows(out):
    path = out / "checks.jsonl"
    return {x["check"]: x for x in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def real_config():
    """The real config device_checks.main takes: bench/device_wheels' (device_bundle.sh), else ../shared's; without
    either (a fork's CI) the checks run on the tiny Qwen3-VL and say so (device_checks.setup)."""
    real = ROOT / "bench" / "device_wheels" / "Qwen3-VL-2B-Instruct"
    return real if (real / "config.json").exists() else ROOT.parent / "shared" / "real_models" / real.name


@pytest.fixture(scope="session")
def device_setup(tmp_path_factory):
    """-> (work, setup's row, the script's output): `bash bench/device_check.sh --dry-run --only setup`, run by the
    first worker that asks, under a lock; the others wait for it and share its work folder (read-only)."""
    root = shared_dir(tmp_path_factory) / "device_check"
    root.mkdir(exist_ok=True)
    with open(root / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "said").exists():
            env = dict(os.environ, OUT=str(root / "out"), DEVICE_WORK=str(root / "work"))
            r = launch.run(["bash", ROOT / "bench" / "device_check.sh", "--dry-run", "--only", "setup"], timeout=600, env=env)
            (root / "said").write_text(f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}")
    return root / "work", rows(root / "out").get("setup", {}), (root / "said").read_text()


def test_dry_run_setup_passes_and_says_what_is_missing(device_setup):
    _, row, said = device_setup
    assert row.get("status") == "PASS" and said.startswith("exit 0\n"), (row, said)
    assert row["missing"].keys() >= {"transformer_engine", "sglang"} and row["sdpa"] == "not run: CPU"


def test_every_check_has_its_test():
    assert ["setup", *WANT] == list(device_checks.CHECKS)


@pytest.mark.parametrize("name", list(WANT))
def test_dry_run_check_passes_with_its_numbers(name, device_setup, tmp_path):
    work, _, said = device_setup
    code = device_checks.drive(tmp_path, work, True, {name}, real_config())
    row, log = rows(tmp_path)[name], (tmp_path / "device_check.log").read_text()
    assert code == 0 and row["status"] == "PASS", (row, log[-5000:], said[-2000:])
    assert WANT[name](row), row
    assert f"===== {name} (PASS" in log


def test_the_most_useful_checks_run_first_and_the_outer_limit_is_the_budget_and_a_margin(tmp_path):
    """The checks past the budget are the last ones: setup (with the SDPA answer) and grpo, the one full-size step
    (MFU, memory against the estimate), come first and always get their limits (issue 75: last, grpo was skipped);
    device_check.sh's own limit is the driver's budget plus MARGIN_S, which covers the driver's start (~15 s) and its
    last check's end (launch's SIGTERM, KILL_GRACE_S, SIGKILL, 5 s), before timeout's SIGKILL; with the wheels a GPU
    run ends within 8 minutes, and a task's device time (a machine's start, the whole check, then a rerun of setup
    and grpo) within its 15 minutes."""
    import re
    import subprocess
    D = device_checks
    assert list(D.CHECKS)[:2] == ["setup", "grpo"] and "sdpa" in inspect.getsource(D.setup)
    assert "sdpa" not in inspect.getsource(D.parity)
    assert set(D.LIMITS) == set(D.CHECKS) == set(D.device_verdicts.VERDICTS)
    assert D.LIMITS["setup"] + D.LIMITS["grpo"] <= D.BUDGET_S
    assert D.MARGIN_S >= 15 + launch.KILL_GRACE_S + 5 and D.BUDGET_S + D.MARGIN_S + D.WHEELS_S <= 8 * 60
    rerun = D.LIMITS["setup"] + D.LIMITS["grpo"] + D.MARGIN_S + D.WHEELS_S
    assert D.DEVICE_S == 15 * 60 and D.START_S + D.BUDGET_S + D.MARGIN_S + D.WHEELS_S + rerun <= D.DEVICE_S
    r = subprocess.run(["bash", ROOT / "bench" / "device_check.sh", "--dry-run"], capture_output=True, text=True,
                       env=dict(os.environ, PY="true", OUT=str(tmp_path)), timeout=60)
    assert r.stdout.strip().endswith(f"limit {D.DRY_SCALE * D.BUDGET_S + D.MARGIN_S} s"), r.stdout + r.stderr
    kill_after = int(re.search(r"timeout -k (\d+) ", (ROOT / "bench" / "device_check.sh").read_text()).group(1))
    assert kill_after > launch.KILL_GRACE_S + 5


def test_a_check_in_flight_dies_with_the_driver(tmp_path):
    """device_check.sh's outer limit SIGTERMs the driver: the check it runs (a process group of its own, as launch
    starts it) dies too, not left holding the GPU into a rerun."""
    import signal
    import time
    pid_file = tmp_path / "pid"
    (tmp_path / "driver.py").write_text(f"""import sys
sys.path.insert(0, {str(ROOT / 'bench')!r})
import device_checks, launch
device_checks.stop_with_me()
launch.run(['bash', '-c', 'sleep 600 & echo $! > {pid_file}; wait'], timeout=600)
""")
    driver = launch.start(tmp_path / "driver.py", cwd=ROOT / "bench")  # a process of its own, forked warm
    pid = None
    try:
        deadline = time.monotonic() + 300  # a worker whose forkserver starts here: ~10 s at load 5, 115 s seen
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            assert driver.poll() is None, driver.wait().stderr
            time.sleep(0.1)
        pid = int(pid_file.read_text())
        os.kill(driver.pid, signal.SIGTERM)
        said = driver.wait(60).stderr
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z", "the check's process lives on"
        assert "the check in flight and its processes stopped" in said
    finally:
        driver.kill()
        if pid is not None and Path(f"/proc/{pid}").exists():
            os.kill(pid, signal.SIGKILL)


def test_each_checks_verdict_fails_on_a_planted_mismatch():
    """Each device check seen to FAIL: its verdict (bench/device_verdicts.py) on numbers that pass, then on each with
    one mismatch planted; a comparison of several tensors reports and judges the WORST (a check that looked at the
    best one passed everything)."""
    V = device_checks.device_verdicts
    bound = device_checks.BOUNDS["fp32"]
    rel = {"embedding": 1e-6, "layers.0.mlp": 0.5, "layers.0.A_log": 1e-7}  # one tensor's gradient far off
    row = V.parity_row(1e-5, rel, 1e-5, bound)
    assert row["worst"] == "layers.0.mlp" and row["grad"] == 0.5 and not row["passed"]
    assert not V.parity_row(1e-5, dict(rel, **{"layers.0.mlp": 1e-6, "layers.1.dt_bias": 0.1}), 1e-5, bound)["passed"]
    assert V.parity_row(1e-5, dict(rel, **{"layers.0.mlp": 1e-6}), 1e-5, bound)["passed"]
    gdn = dict(out=1e-5, dq=1e-5, dk=1e-5, dv=1e-5, dg=1e-5, dbeta=1e-5)
    assert V.gdn_row(gdn, device_checks.GDN_BOUNDS["fp32"])["passed"]
    for k in gdn:
        assert not V.gdn_row(dict(gdn, **{k: 0.5}), device_checks.GDN_BOUNDS["fp32"])["passed"], k
    rows = dict(qwen3_vl_fp32={"passed": True}, qwen3_vl_bf16={"passed": True}, bounds={}, dry=False)
    good = {"setup": dict(gpu="H100", dry=False, sdpa={"passed": True}),
            "preempt": dict(said=True, stopped_after=2, steps=[1, 2], latest="iter_0000002", resume_exit=0,
                            resumed_steps=[1, 2, 3]),
            "ckpt": dict(exact=True, max_abs_logit_diff=1e-4, logit_scale=2.0),
            "offload": dict(freed_frac=0.95, exact=True, pinned=True, returned_frac=0.92),
            "parity": rows, "gdn": dict(rows, fla_fp32={"passed": True}),
            "gdn_tf32": dict(fla_bf16={"passed": True}, dry=False),
            "grpo": dict(steps=2, failed_frac=0, grad_norm=0.3, logprob_diff_mean=0.01, trainer_peak_over_estimate=1.1)}
    planted = {"setup": [dict(gpu=None), dict(sdpa={"passed": False}), dict(sdpa="not run: CPU"),
                         dict(sdpa={"passed": False, "error": "ImportError: attention"})],
               "preempt": [dict(said=False), dict(stopped_after=0, steps=[], latest=None, resumed_steps=[1]),
                           dict(steps=[1, 1]), dict(latest="iter_0000001"), dict(resume_exit=1),
                           dict(resumed_steps=[1, 2, 3, 4]), dict(resumed_steps=[3])],
               "ckpt": [dict(exact=False), dict(max_abs_logit_diff=3e-4)],
               "offload": [dict(freed_frac=0.5), dict(exact=False), dict(pinned=False), dict(returned_frac=0.1)],
               "parity": [dict(qwen3_vl_bf16={"passed": False}), dict(qwen3_vl_fp32="not run: CPU")],
               "gdn": [dict(fla_fp32={"passed": False}), dict(fla_fp32="not run: FLA missing")],
               "gdn_tf32": [dict(fla_bf16={"passed": False}), dict(fla_bf16="not run: FLA missing")],
               "grpo": [dict(steps=1), dict(failed_frac=0.1), dict(grad_norm=float("nan")), dict(grad_norm=0.0),
                        dict(logprob_diff_mean=0.2), dict(trainer_peak_over_estimate=1.5)]}
    assert set(good) == set(planted) == set(device_checks.CHECKS)  # a new check comes with its planted failures
    for name, row in good.items():
        assert V.VERDICTS[name](row), name
        for bad in planted[name]:
            assert not V.VERDICTS[name](dict(row, **bad)), (name, bad)
    assert V.VERDICTS["gdn"](dict(good["gdn"], fla_fp32="not run: CPU", dry=True))  # a dry run says it, passes
    assert V.VERDICTS["setup"](dict(good["setup"], gpu=None, sdpa="not run: CPU", dry=True))


def test_the_checks_skipped_or_cut_short_for_time_are_named(tmp_path, monkeypatch):
    """The driver's last row says which checks the budget left out and which it ended before their own limit (a
    time-out at the budget's end is not the check's hang). Each check here runs to its limit on a clock the test
    moves (no process starts): grpo and preempt end at their caps, ckpt gets its own, offload only what is left,
    parity nothing."""
    D = device_checks
    clock = [1000.0]
    monkeypatch.setattr(D.time, "time", lambda: clock[0])

    def start(args, limit, env):  # as launch.run past its limit
        clock[0] += limit
        raise AssertionError(f"{args[1]}: past {limit} s")
    monkeypatch.setattr(D, "start", start)
    (tmp_path / "setup.json").write_text("{}")
    only = {"grpo", "preempt", "ckpt", "offload", "parity"}
    assert D.drive(tmp_path, tmp_path, False, only, real_config()) == 1
    got = rows(tmp_path)
    assert [got[c]["status"] for c in ("grpo", "preempt", "ckpt", "offload", "parity")] == ["FAIL"] * 4 + ["SKIP"]
    assert "why" not in got["ckpt"] and got["offload"]["why"].startswith("cut short at the budget's end")
    assert D.LIMITS["grpo"] + D.LIMITS["preempt"] + D.LIMITS["ckpt"] < D.BUDGET_S < sum(D.LIMITS[c] for c in only)
    assert got["budget"] == dict(check="budget", budget_s=D.BUDGET_S, spent_s=D.BUDGET_S, skipped_for_time=["parity"],
                                 cut_for_time=["offload"])
