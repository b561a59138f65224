"""Shared fixtures: tiny random Qwen-VL checkpoints (built once a session, offline), the ten
real geo3k problems shipped in tests/data/geo3k_real (README there names their source), and the
rollout tests' tiny model, processor and synthetic problems.

Concurrency: `bash test.sh` runs the suite on four pytest-xdist workers (`-n 4 --dist loadgroup`), each one
torch thread: much of a test's time is waiting (process starts, imports, servers), which the others fill.
What a test must do to run beside another:
- own its files (tmp_path, tmp_path_factory), ports (bind to port 0, as launch.py and the servers do),
  process groups (start_new_session; stop by pid) and environment (monkeypatch, or env= to a child);
- `@pytest.mark.cores`: it runs two or more CPU-bound processes at once (multi-rank runs, the learning check):
  such tests run in two lanes, each lane on one worker one after another, so at most two at once: the longest
  pin theirs (`cores(lane=N)`), the rest alternate in collection order; the lanes start first (they are the
  suite's longest path), then the largest groups;
- the tests that share a module-scoped fixture run on one worker, so it is built once;
- a race is an event the test sets (tests/fake_sglang.py's --fake-hold), never a sleep.
"""
import fcntl
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One torch thread per process: the tiny models' matmuls are far slower with two threads on a
# 2-core machine that also runs torchrun workers (and subprocesses inherit this).
os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GEO3K_REAL = ROOT / "tests" / "data" / "geo3k_real"
LANES = 2  # `cores` tests at once: 2 ranks each on 2 cores, so the suite's waits overlap (bench/RESULTS.md)
GROUPS = "xdist_groups.json"  # nodeid -> group, for the scheduler (pytest_xdist_make_scheduler)
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
from bench import suite_cpu  # noqa: E402  (ROOT on sys.path first)


def pytest_configure(config):
    config.addinivalue_line("markers", "cores: runs two or more CPU-bound processes at once: such tests run on one "
                                       "xdist worker, one after another (tests/conftest.py)")


def pytest_collection_modifyitems(config, items):
    """Under xdist each worker writes the groups (see the module docstring) where the controller's scheduler reads
    them: xdist's own `xdist_group` needs the group in the test's nodeid, which pytest 9 no longer lets it change."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    module, lane = {}, {}  # test module -> whether it has a module-scoped fixture; a `cores` test's lane
    for item in items:  # `cores`: the longest pin their lane (cores(lane=N)), the rest alternate
        if mark := item.get_closest_marker("cores"):
            lane[item.nodeid] = f"cores{mark.kwargs.get('lane', len(lane) % LANES)}"
    groups = {item.nodeid: lane.get(item.nodeid, group(item.module)) for item in items
              if item.nodeid in lane or module.setdefault(group(item.module), any(
                  d.scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs))}
    out = shared_dir(config._tmp_path_factory) / GROUPS
    tmp = out.with_suffix(f".{os.getpid()}")
    tmp.write_text(json.dumps(groups))
    tmp.replace(out)  # both workers write the same groups: either file is whole


def group(module):
    """A module's group: its name, or the XDIST_GROUP it names (a file split from another keeps its group)."""
    return getattr(module, "XDIST_GROUP", module.__name__)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Under bench/suite_cpu.py (SUITE_CPU_DIR): each test's CPU seconds, with what it started, and its wall time."""
    out = os.environ.get("SUITE_CPU_DIR")
    if not out:
        yield
        return
    cpu, t = suite_cpu.cpu_seconds(), time.monotonic()
    yield
    suite_cpu.record(out, item.nodeid, suite_cpu.cpu_seconds() - cpu, time.monotonic() - t)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own (-p no:xdist: not called)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: xdist's scheduling by scope, a scope being a test's group, else the test itself."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling
    path, groups = config._tmp_path_factory.getbasetemp() / GROUPS, {}

    class Groups(LoadScopeScheduling):
        def _split_scope(self, nodeid):  # called once every worker has collected, so has written the groups
            groups or groups.update(json.loads(path.read_text()))
            return groups.get(nodeid, nodeid)

        def _assign_work_unit(self, node):  # a lane of `cores` tests before anything else
            for scope in [s for s in self.workqueue if s.startswith("cores")][:1]:
                self.workqueue.move_to_end(scope, last=False)
            super()._assign_work_unit(node)
    return Groups(config, log)


def shared_dir(tmp_path_factory):
    """A folder of this session that every xdist worker sees (the basetemp itself when serial)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt("qwen3_vl") -> path of a tiny random checkpoint, built once per arch and sizes a session: the
    first worker that asks builds it under a lock, the others wait for it and share it (read-only: copy to change)."""
    from tools import tiny
    made, root = {}, shared_dir(tmp_path_factory) / "tiny"
    root.mkdir(exist_ok=True)

    def get(arch="qwen3_vl", **sizes):
        key = (arch, tuple(sorted(sizes.items())))
        if key not in made:
            out = root / "_".join([arch] + [f"{k}{v}" for k, v in key[1]])
            with open(f"{out}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                if not Path(f"{out}.done").exists():
                    tiny.make_tiny(out, arch, **sizes)
                    Path(f"{out}.done").touch()
            made[key] = out
        return made[key]
    return get


@pytest.fixture(scope="session", autouse=True)
def image_counts():
    """The fake SGLang servers' image pads counted by this process' warm image processor (tests/image_counts.py)."""
    import image_counts
    name = f"fake_sglang_images.{os.getpid()}.{os.urandom(4).hex()}"
    listener = image_counts.serve_image_counts(name)
    os.environ[image_counts.IMAGES_SOCKET] = name
    yield
    os.environ.pop(image_counts.IMAGES_SOCKET)
    listener.close()


@pytest.fixture(scope="session")
def geo3k_real():
    return GEO3K_REAL


# Shared by the rollout and SGLang-engine tests: a tiny Qwen3-VL, its processor, four synthetic problems.
@pytest.fixture(scope="session")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_vl")


@pytest.fixture(scope="session")
def processor(ckpt):
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(ckpt)


@pytest.fixture(scope="session")
def records(tmp_path_factory):
    import data
    from tools import synth
    out = synth.write_synth(tmp_path_factory.mktemp("synth"), n=4, n_test=1, seed=0)
    return data.load_geo3k(out, "train")


def grpo_args(**kw):
    """train_grpo's own flags and defaults (parse_args: one source of defaults) with any `kw` on top; no
    --hf-checkpoint unless given (the env's grounding frame: relative 0-1000, the tiny Qwen3-VL's too)."""
    import train_grpo
    args = train_grpo.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x"])
    for k, v in {"hf_checkpoint": None, **kw}.items():
        if not hasattr(args, k):
            raise AttributeError(f"{k} is not a train_grpo flag")
        setattr(args, k, v)
    return args


def rollout_args(**kw):
    """The rollout's settings as the trainer builds them (rollout.settings of its flags), with the rollout tests'
    small budgets and any `kw` on top. rollout_batch_size None: every record given."""
    import rollout
    small = dict(n_samples_per_prompt=2, rollout_max_response_len=10, rollout_temperature=0.8, rollout_batch_size=None)
    return rollout.settings(grpo_args(**{**small, **kw}))
