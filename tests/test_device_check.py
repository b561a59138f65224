"""bench/device_check.sh --dry-run (issue 59): the GPU machine's check at tiny sizes on the CPU, through the same
script and code, so that it cannot rot between the loans of a GPU. Each check runs and PASSes (the CUDA-only parts,
FLA's kernels and the CUDA cache, say they did not run) and reports the numbers RESULTS.md's "GPU" section takes."""
import json
import os

import launch
from conftest import ROOT

from bench import device_checks


def test_dry_run_passes_every_check_with_its_numbers(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), DEVICE_WORK=str(tmp_path / "work"))
    r = launch.run(["bash", ROOT / "bench" / "device_check.sh", "--dry-run"], timeout=1400, env=env)
    rows = {x["check"]: x for x in map(json.loads, (out / "checks.jsonl").read_text().splitlines())}
    assert list(rows) == list(device_checks.CHECKS), r.stdout + r.stderr[-3000:]
    failed = {k: v for k, v in rows.items() if v["status"] != "PASS"}
    assert not failed and r.returncode == 0, (failed, (out / "device_check.log").read_text()[-5000:])
    assert rows["setup"]["missing"].keys() >= {"transformer_engine", "sglang"}
    parity = rows["parity"]
    assert {f"{a}_{d}" for a in device_checks.ARCHS for d in ("fp32", "bf16")} <= parity.keys()
    assert all(parity[f"{a}_fp32"]["logits"] <= 1e-4 and parity[f"{a}_bf16"]["logits"] > 0 for a in device_checks.ARCHS)
    assert rows["gdn"]["torch_fp32"]["passed"] and rows["gdn"]["fla_fp32"] == "not run: CPU"
    grpo = rows["grpo"]
    assert grpo["steps"] == 2 and grpo["rollout_tokens_per_s"] > 0 and grpo["train_tokens_per_s"] > 0
    assert grpo["train_tflops_per_s"] > 0 and grpo["estimate_train_gib"] > 0
    assert rows["offload"]["exact"] and rows["offload"]["freed_frac"] >= 0.9
    assert rows["ckpt"]["exact"] and rows["ckpt"]["max_abs_logit_diff"] <= 1e-4
    assert rows["preempt"]["stopped_after"] > 0 and rows["preempt"]["steps_after_resume"] == rows["preempt"]["stopped_after"] + 1
    assert "===== preempt (PASS" in (out / "device_check.log").read_text()
