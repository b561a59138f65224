"""Importing a core module changes nothing in the process (style practice 17, issue 26): no CUDA
patch, no sys.unraisablehook / excepthook, no warning filter, no logger level, no thread, no signal
handler, no at-fork or atexit hook, no reward warm-up. Patches, hooks and warm-ups belong in the
init function that needs them (parallel.init_distributed, reward.init).

    .venv/bin/pytest -q tests/test_imports.py      # ~30 s on 2 shared cores: one subprocess

The subprocess (this file run as a script) imports the third-party packages first, since their own
import-time changes are not ours to test, then forks once per core module: each child imports one
module and reports what changed, so no module is measured after another one has already imported
its dependencies. A fork of that process costs milliseconds where a fresh interpreter costs ~10 s.
"""
import atexit
import importlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in ROOT.glob("*.py"))  # every top-level file: imported, never run
# What the core modules import from other packages: imported before anything is measured.
THIRD_PARTY = ["torch", "torch.distributed", "torch.multiprocessing", "torch.nn.functional",
               "torch.nn.utils.rnn", "sympy", "math_verify", "PIL.Image", "pyarrow.parquet",
               "safetensors.torch", "tqdm", "transformers", "transformers.models.auto.modeling_auto",
               "transformers.models.auto.processing_auto", "transformers.generation",
               "megatron.core.parallel_state", "megatron.core.tensor_parallel",
               "megatron.core.models.gpt", "megatron.core.packed_seq_params",
               "megatron.core.transformer", "megatron.core.transformer.moe.moe_utils",
               "megatron.core.transformer.transformer_block"]
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1]


def _counting(calls, name, fn):
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return counted


def _state(torch, calls):
    """What an import must leave as it was."""
    loggers = {name: lg.level for name, lg in logging.root.manager.loggerDict.items()
               if isinstance(lg, logging.Logger)}
    return {"torch.cuda.current_device": torch.cuda.current_device,
            "sys.unraisablehook": sys.unraisablehook, "sys.excepthook": sys.excepthook,
            "warnings.filters": list(warnings.filters),
            "threads": sorted(t.name for t in threading.enumerate()),
            "root logger": (logging.root.level, list(logging.root.handlers)),
            "logger levels": loggers,
            "signal handlers": {s.name: signal.getsignal(s) for s in SIGNALS},
            **calls}


def _changes(before, after):
    """{what: how it changed}; empty when nothing did."""
    out = {}
    for key, was in before.items():
        now = after[key]
        if isinstance(was, dict):  # loggers, signals: the old keys (a logger created since is at NOTSET)
            diff = {k: [repr(v), repr(now[k])] for k, v in was.items() if now[k] != v}
        elif isinstance(was, list):  # warning filters, threads: what came and what went
            diff = {"added": [repr(x) for x in now if x not in was],
                    "removed": [repr(x) for x in was if x not in now]} if now != was else {}
        else:
            diff = [repr(was), repr(now)] if now != was else {}
        if diff:
            out[key] = diff
    return out


def probe(out_path):
    """Write {module: {"changes": {what: [before, after]}, "import_s": s}} to out_path."""
    sys.path.insert(0, str(ROOT))
    for name in THIRD_PARTY:
        importlib.import_module(name)
    import math_verify
    import torch
    calls = {"os.register_at_fork calls": 0, "atexit.register calls": 0, "math_verify.parse calls": 0,
             "math_verify.verify calls": 0}
    os.register_at_fork = _counting(calls, "os.register_at_fork calls", os.register_at_fork)
    atexit.register = _counting(calls, "atexit.register calls", atexit.register)
    math_verify.parse = _counting(calls, "math_verify.parse calls", math_verify.parse)  # reward binds these
    math_verify.verify = _counting(calls, "math_verify.verify calls", math_verify.verify)
    logging.getLogger("math_verify")  # so that its level is compared even if nothing created it yet
    report = {}
    for name in MODULES:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: import one module, report, leave without running exit hooks
            os.close(read)
            try:
                before, t = _state(torch, calls), time.perf_counter()
                importlib.import_module(name)
                result = {"import_s": round(time.perf_counter() - t, 2),
                          "changes": _changes(before, _state(torch, calls)), "core": sorted(set(MODULES) & set(sys.modules))}
            except BaseException as e:  # noqa: B036 (a failed import is a result too)
                result = {"changes": {"import failed": repr(e)}}
            with os.fdopen(write, "w") as f:
                json.dump(result, f)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            text = f.read()
        os.waitpid(pid, 0)
        report[name] = json.loads(text) if text else {"changes": {"child died": "no report"}}
    Path(out_path).write_text(json.dumps(report, indent=1))


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("imports") / "report.json"
    run = subprocess.run([sys.executable, __file__, str(out)], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("name", MODULES)
def test_import_changes_nothing(report, name):
    assert report[name]["changes"] == {}, json.dumps(report[name]["changes"], indent=1)


def test_rewards_need_no_env(report):
    """A reward or shaping term reads the tools a row is offered from its sample (rollout.Sample.tools): reward.py
    imports no env_geo3k, even through another module (env_geo3k imports reward: a circle)."""
    assert "env_geo3k" not in report["reward"]["core"] and "reward" in report["env_geo3k"]["core"]


# In a fresh process: the first scoring calls, with reward._judge wrapped to record what it imports
# while a time limit is armed; then a fork, whose child must get a watchdog of its own.
FIRST_CALLS = r"""
import json, logging, os, sys, threading, time
import reward
judge, imported = reward._judge, []
def recording_judge(*args):
    timed, before = threading.get_ident() in reward._ARMED, set(sys.modules)
    try:
        return judge(*args)
    finally:
        if timed:
            imported.extend(sorted(set(sys.modules) - before))
reward._judge = recording_judge
cases = [("x = 13", "13"), ("8.66", "5\\sqrt{3}"), ("x<3", "3>x"), ("(1,2]", "\\{1,2\\}")]
out = {"scores": [reward.score("geo3k", "\\boxed{%s}" % a, {"answer": label}) for a, label in cases],
       "imported under a time limit": imported, "unraisablehook": sys.unraisablehook.__qualname__,
       "math_verify level": logging.getLogger("math_verify").level}
read, write = os.pipe()
if os.fork() == 0:
    t, watchdog = time.perf_counter(), reward._WATCHDOG[0]
    slow = reward.score("math", "\\boxed{%s}" % ("x^" * 400 + "2"), {"answer": "13"})  # cut by the time limit
    os.write(write, json.dumps([watchdog, slow, time.perf_counter() - t]).encode())
    os._exit(0)
os.close(write)
out["forked child: watchdog flag, slow score, seconds"] = json.loads(os.read(read, 1000))
os.wait()
print(json.dumps(out))
"""


def test_reward_init_runs_on_first_use():
    """reward.init, which import no longer runs, runs on the first scoring call: the hook and the
    logger level are in place after it, sympy's lazy imports happen before the time limit is
    armed (a cold first call can time out on a busy machine and flip its verdict), and a forked
    child starts its own watchdog."""
    run = subprocess.run([sys.executable, "-c", FIRST_CALLS], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["scores"] == [1.0, 1.0, 1.0, 0.0], out
    assert out["imported under a time limit"] == [], out
    assert out["unraisablehook"] == "_drop_timeouts.<locals>.drop" and out["math_verify level"] == logging.ERROR
    watchdog, slow, seconds = out["forked child: watchdog flag, slow score, seconds"]
    assert watchdog is False and slow == 0.0 and seconds < 3.0, out


if __name__ == "__main__":
    probe(sys.argv[1])
