"""bench/device_check.sh --dry-run (issue 59): the GPU machine's check at tiny sizes on the CPU, through the same
script and code, so that it cannot rot between the loans of a GPU. Each check runs and PASSes (the CUDA-only parts,
FLA's kernels and the CUDA cache, say they did not run) and reports the numbers RESULTS.md's "GPU" section takes.
Its setup runs once a session through the script (--only setup); each other check is a test of its own, so they
spread over the workers, each through the script's driver (device_checks.drive) on that one setup (issue 70)."""
import fcntl
import json
import os

import pytest

import launch
from conftest import ROOT, shared_dir

from bench import device_checks

A, D = device_checks.ARCHS, ("fp32", "bf16")
WANT = {  # check -> what its row must hold besides PASS
    "parity": lambda r: {f"{a}_{d}" for a in A for d in D} <= r.keys() and all(
        r[f"{a}_fp32"]["logits"] <= 1e-4 and r[f"{a}_bf16"]["logits"] > 0 for a in A),
    "gdn": lambda r: r["torch_fp32"]["passed"] and r["fla_fp32"] == "not run: CPU",
    "grpo": lambda r: r["steps"] == 2 and min(r["rollout_tokens_per_s"], r["train_tokens_per_s"], r["train_tflops_per_s"],
                                             r["estimate_train_gib"]) > 0,
    "offload": lambda r: r["exact"] and r["freed_frac"] >= 0.9,
    "ckpt": lambda r: r["exact"] and r["max_abs_logit_diff"] <= 1e-4,
    "preempt": lambda r: r["stopped_after"] > 0 and r["steps_after_resume"] == r["stopped_after"] + 1,
}


def rows(out):
    path = out / "checks.jsonl"
    return {x["check"]: x for x in map(json.loads, path.read_text().splitlines())} if path.exists() else {}


def real_config():
    """The real config device_checks.main takes: bench/device_wheels' (device_bundle.sh), else ../shared's."""
    real = ROOT / "bench" / "device_wheels" / "Qwen3-VL-2B-Instruct"
    real = real if (real / "config.json").exists() else ROOT.parent / "shared" / "real_models" / real.name
    if not (real / "config.json").exists():
        pytest.skip("../shared/real_models not beside the repo")
    return real


@pytest.fixture(scope="session")
def device_setup(tmp_path_factory):
    """-> (work, setup's row, the script's output): `bash bench/device_check.sh --dry-run --only setup`, run by the
    first worker that asks, under a lock; the others wait for it and share its work folder (read-only)."""
    root = shared_dir(tmp_path_factory) / "device_check"
    root.mkdir(exist_ok=True)
    real_config()
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
    assert row["missing"].keys() >= {"transformer_engine", "sglang"}


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
