"""train_grpo.py's evaluation: correctness on its own sampling settings, and its judge's faults counted and kept."""
import sys
from pathlib import Path

import pytest

import train_grpo as G
import fakes

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def test_evaluation_reports_correctness_on_its_own_settings(monkeypatch):
    """evaluate: pass@1 greedy and pass@K at the rollout temperature, oracle and shaping off, and its numbers and rows
    are correctness, never the reward (here a sample rewarded 1.0 but wrong); training's accuracy reads it too."""
    import types
    import rollout as R
    seen = []

    def samples(engine, processor, records, cfg):
        seen.append(cfg)
        return [R.Sample(prompt_ids=[], group=g, reward=1.0, correct=g == 0 and j == 2)
                for g in range(len(records)) for j in range(cfg.n_samples_per_prompt)]
    monkeypatch.setattr(G.R, "generate_group_samples", samples)
    logged, rows = {}, []
    run = types.SimpleNamespace(log=lambda step, m: logged.update(m), write_rows=lambda name, r: rows.extend(r))
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--n-samples-per-eval-prompt",
                         "3", "--rollout-temperature", "0.7", "--max-turns", "2"])
    G.evaluate(None, None, [{"problem": "p"}, {"problem": "q"}], args, 0, run)
    assert logged == {"eval_accuracy": 0.0, "eval_pass@3": 0.5, "eval_multi_turn_accuracy": 0.0,
                      "eval_multi_turn_pass@3": 0.5}
    assert [(c.n_samples_per_prompt, c.max_turns, c.rollout_temperature) for c in seen] == [
        (1, 1, 0.0), (3, 1, 0.7), (1, 2, 0.0), (3, 2, 0.7)]
    assert not any(c.oracle or c.shaping or c.dynamic_sampling for c in seen)
    assert "reward" not in rows[0] and [r["correct"] for r in rows[:2]] == [False, False]
    m = G.rollout_metrics([R.Sample(prompt_ids=[], reward=0.75), R.Sample(prompt_ids=[], reward=1.0, correct=True)])
    assert m["reward"] == 0.875 and m["accuracy"] == 0.5


def test_an_evaluations_judge_faults_are_counted_kept_in_its_rows_and_on_every_row_stop_it(processor, records,
                                                                                            monkeypatch):
    """Issue 75: a judge raising on a third of the rows gave eval 0.375 instead of 0.5, nothing said. Eval metrics carry
    eval_<rm>_errors and eval_<rm>_timeouts (over pass@K's samples too), each row its judge's fault; a judge failing on
    every row stops the evaluation (an evaluation-only run exits non-zero)."""
    import types
    import reward

    def picky(response, record):
        while record.get("slow"):
            pass
        return record["choices"] is not None and "3" in response  # a row without choices: KeyError
    monkeypatch.setattr(reward, "_TOLD", {})
    monkeypatch.setitem(reward.REWARDS, "picky", picky)
    logged, rows = {}, []
    run = types.SimpleNamespace(log=lambda step, m: logged.update(m), write_rows=lambda name, r: rows.extend(r))
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rm-type", "picky",
                         "--rm-timeout", "0.05", "--n-samples-per-eval-prompt", "2"])
    recs = [records[0], dict(records[1], choices=1, slow=True), dict(records[2], choices=1)]
    G.evaluate(fakes.ScriptedEngine(processor, ["\\boxed{3}"]), processor, recs, args, 0, run)
    assert logged == {"eval_accuracy": pytest.approx(1 / 3), "eval_pass@2": pytest.approx(1 / 3),
                      "eval_picky_errors": 3, "eval_picky_timeouts": 3}
    said = {r["index"]: (r["judge_error"] or "")[:14] for r in rows}
    assert said == {0: "picky raised o", 1: "picky ran past", 2: ""} and len(rows) == 9
    with pytest.raises(SystemExit, match="(?s)--rm-type picky raised .* on every sample.*KeyError: 'choices'"):
        G.evaluate(fakes.ScriptedEngine(processor, ["\\boxed{3}"]), processor, records[:2], args, 0, run)
