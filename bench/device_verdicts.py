"""How each device check (bench/device_checks.py) is judged: a function of the numbers it reports (and whether the
run was dry), so that tests/test_device_check.py can plant a mismatch in each and see it FAIL."""
import math


def parity_row(logits, rel, logprob, bound):
    """One family and dtype's numbers against `bound`: the logits' and logprobs' gaps, the WORST tensor's relative
    gradient error (rel: {name: error}) and the worst of Gated DeltaNet's decay parameters'."""
    decay = {n: e for n, e in rel.items() if n.endswith(("A_log", "dt_bias"))}
    worst = max((n for n in rel if n not in decay), key=rel.get)
    got = dict(logits=logits, grad=rel[worst], decay=max(decay.values(), default=0.0), logprob=logprob)
    return dict(got, worst=worst, tensors=len(rel), passed=all(got[k] <= bound[k] for k in got))


def gdn_row(errs, bound):
    """One path and dtype's relative errors (out, dq, dk, dv, dg, dbeta) against `bound` (GDN_BOUNDS')."""
    passed = errs["out"] <= bound["out"] and errs["dg"] <= bound["dg"] and all(
        errs[n] <= bound["grad"] for n in ("dq", "dk", "dv", "dbeta"))
    return dict(errs, passed=passed)


def grpo_passed(r):
    """Two steps, no failed sample, a finite gradient, the logprob gap of a bf16 trainer vs the fp32 engine within
    twice tools/check.BF16_TOL, x2; on CUDA the estimate is what a user plans with: the peak not 20% over it."""
    ok = r["steps"] == 2 and r["failed_frac"] == 0 and 0 < r["grad_norm"] < math.inf and r["logprob_diff_mean"] <= 0.08
    return ok and ("trainer_peak_over_estimate" not in r or r["trainer_peak_over_estimate"] <= 1.2)


def preempt_passed(r):
    """Stopped after a step k (0 < k < 200) and said so, iter_k the latest, steps 1..k once each; the resume ran
    exactly one step more."""
    k = r["stopped_after"]
    return (r["said"] and 0 < k < 200 and r["steps"] == list(range(1, k + 1)) and r["latest"] == f"iter_{k:07d}"
            and r["resume_exit"] == 0 and r["resumed_steps"] == list(range(1, k + 2)))


def rows_passed(r):
    """Every row of a check that compares several (a family and dtype, a path and dtype) passed; one that did not
    run only on a dry run (on CPU: FLA, the CUDA-only SDPA kernels)."""
    rows = [v for v in r.values() if isinstance(v, dict) and "passed" in v]
    skipped = [v for v in r.values() if isinstance(v, str) and v.startswith("not run")]
    return all(v["passed"] for v in rows) and (r["dry"] or bool(rows) and not skipped)


def offload_passed(r):
    import offload_check
    return offload_check.passed(r)


def setup_passed(r):
    """A GPU, and a fused SDPA kernel (flash, cuDNN or efficient) took the local attention; a dry run: neither."""
    return r["dry"] or (r["gpu"] is not None and isinstance(r["sdpa"], dict) and r["sdpa"]["passed"])


# each check's verdict from its numbers alone (and `dry`): tests/test_device_check.py plants a mismatch in each
VERDICTS = {"setup": setup_passed, "preempt": preempt_passed,
            "ckpt": lambda r: r["exact"] and r["max_abs_logit_diff"] <= 1e-4 * r["logit_scale"],
            "offload": offload_passed, "parity": rows_passed, "gdn": rows_passed, "gdn_tf32": rows_passed,
            "grpo": grpo_passed}
