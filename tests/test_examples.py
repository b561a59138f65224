"""The examples/ files, a user's own task beside the project (docs/extending.md, "Your own task"): each with the
by-hand table a user writes beside their file; tests/test_registries.py walks them with every other entry.

    .venv/bin/python -m pytest -q tests/test_examples.py
"""
import json

import pytest

import reward
import rollout as R
import task
import train_grpo as G
import trainer as T
from examples import env_calc, exact_judge, std_filter
from fakes import ScriptedEngine


@pytest.mark.parametrize("response,answer,right", [
    ("\\boxed{1517}", "1517", True), ("so \\boxed{ 15 17 }", "1517", True), ("\\boxed{1/2}", "0.5", False),
    ("\\boxed{1517.0}", "1517", False), ("1517", "1517", False), ("\\boxed{12} then \\boxed{1517}", "1517", True)])
def test_exact_judge_table(response, answer, right):
    assert exact_judge.exact(response, {"answer": answer}) is right
    assert reward.score("examples.exact_judge.exact", response, {"answer": answer}) == float(right)


def group(rewards, correct):
    return [R.Sample(prompt_ids=[], reward=r, correct=c) for r, c in zip(rewards, correct)]


@pytest.mark.parametrize("rewards,correct,keep", [
    ([1.0, 1.0, 1.0, 1.0], [True] * 4, False),
    ([1.0, 0.0, 1.0, 0.0], [True, False] * 2, True),
    ([0.0, -0.5, 0.0, -0.5], [False] * 4, True),       # all wrong, the overlong penalty apart: its reward spreads
    ([1.0, 0.95, 1.0, 0.95], [True] * 4, False)])       # a spread under --min-group-std 0.1
def test_std_filter_table(rewards, correct, keep):
    args = R.settings(G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x",
                                    task.FILTER, "examples.std_filter.min_group_std", "--min-group-std", "0.1"]))
    assert std_filter.min_group_std(group(rewards, correct), args) is keep
    assert task.FILTERS["nonzero_std"].keep(group(rewards, correct), args) is (len(set(correct)) > 1)


@pytest.mark.parametrize("expression,text", [("37 * 41", "37 * 41 = 1517"), ("(1 + 2) / 4", "= 0.75"),
                                             ("-3 + 5", "= 2"), ("__import__('os')", "Error: cannot evaluate"),
                                             ("1 / 0", "Error:")])
def test_calculator_table(expression, text):
    env = env_calc.build_env({"answer": "1517"}, G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x",
                                                               "--max-turns", "3"]))
    call = {"name": "calculate", "arguments": {"expression": expression}}
    obs, done, info = env.step(f"<tool_call>{json.dumps(call)}</tool_call>")
    assert text in obs["text"] and not done and info["ran"] == (not text.startswith("Error"))
    assert env.step("\\boxed{1517}")[1]  # no call: the episode ends


def test_a_text_only_task_runs_as_the_trainer_loads_it(tmp_path, processor):
    """Rows with no image column load (a text-only task on a VL checkpoint) and run multi-turn through the user's env:
    its tool in the prompt and none of geo3k's, the call's observation in the tokens, the exact judge's verdict."""
    rows = [{"problem": "A crate holds 37 boxes of 41 pens. How many pens?", "answer": "1517"}] * 2
    (tmp_path / "calc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", str(tmp_path / "calc.jsonl"), "--save", "x",
                         "--max-turns", "3", "--n-samples-per-prompt", "2", task.ENV, "examples.env_calc",
                         task.JUDGE, "examples.exact_judge.exact"])
    records = T.load_data(args, verbose=False)
    assert records[0]["images"] == []
    script = ['<tool_call>\n{"name": "calculate", "arguments": {"expression": "37 * 41"}}\n</tool_call>', "\\boxed{1517}"]
    samples = R.generate_group_samples(ScriptedEngine(processor, script), processor, records[:1], R.settings(args))
    text = processor.tokenizer.decode(samples[0].tokens)
    assert "calculate" in text and "image_zoom_in_tool" not in text and "37 * 41 = 1517" in text
    assert all(s.correct and s.tool_calls == 1 and s.images == [] for s in samples)
    assert G.rollout_metrics(samples, ["calculate"], env_calc)["tool_calls_calculate"] == 1.0
