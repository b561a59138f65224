"""Smokes of the bench scripts cheap enough for the suite (issue 68): each runs as its RESULTS.md command does, at a
toy size (well under a second), so a bench whose code moved under it fails here, not on the day it is rerun."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


@pytest.mark.parametrize("script,args", [
    ("partial_rollout.py", ["--steps", "4", "--warm", "2", "--over", "1.5"]),
    ("fully_async.py", ["--steps", "5", "--warm", "2", "--train", "1", "--over", "1.5"]),
])
def test_the_simulated_engine_benches_run(script, args, tmp_path):
    text = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, vocab_size=1000, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)  # the fields the roofline reads (partial_rollout.model)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": text, "tie_word_embeddings": True}))
    r = subprocess.run([sys.executable, ROOT / "bench" / script, "--config", tmp_path / "config.json", "--prompts", "4",
                        "--samples", "2", "--turns", "2", *args], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and ("x sync" in r.stdout or "speed-up" in r.stdout), r.stdout + r.stderr[-2000:]


def test_each_planted_defect_is_found_once_in_its_file_and_names_tests_that_exist():
    import planted_defects
    for key, (_, f, old, new, tests) in planted_defects.DEFECTS.items():
        assert (ROOT / f).read_text().count(old) == 1 and old != new, key
        assert all((ROOT / t).exists() for t in tests), key


def test_each_bench_script_backs_a_result():
    """A bench script backs a RESULTS.md number with its command, or goes (git keeps it): issue 68 found two cited
    nowhere (grpo_step.py, reward_bench.py)."""
    results = (ROOT / "bench" / "RESULTS.md").read_text()
    assert not [f.name for f in sorted((ROOT / "bench").glob("*.*")) if f.suffix in (".py", ".sh") and
                f"bench/{f.name}" not in results]
