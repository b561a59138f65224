"""Did it learn? tools/report.py on a run folder (every eval listed and drawn, the 95% band of its start for its n eval
problems, the chance level tools/synth.py writes beside its data, train reward as the mean of the first and last five
steps, one line when it did not learn), and the trainers' `[run] done` line (each eval, first -> last)."""
import json
import random
from types import SimpleNamespace

import pytest
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure

import console
from tools import report, synth

STEPS = [0, 10, 20, 30, 40]
REWARDS = [0.0, 0.2, 0.1, 0.3, 0.0] + [0.5] * 30 + [0.9, 0.7, 0.8, 1.0, 0.6]  # first five's mean 0.12, last five's 0.8


def grpo_run(folder, evals, data):
    """A train_grpo run folder: its config naming `data` as its eval set, 40 steps of REWARDS, an eval (eval_accuracy)
    at each of STEPS with its rows: 64 problems, greedy's one row and pass@4's four rows each (issue 75: the band
    counted the file's lines, 320, not its problems)."""
    folder.mkdir(parents=True)
    (folder / "config_grpo.json").write_text(json.dumps({"eval_prompt_data": str(data)}))
    rows = []
    for step in range(41):
        if step:
            rows.append({"step": step, "reward": REWARDS[step - 1]})
        if step in STEPS:
            rows.append({"step": step, "eval_accuracy": evals[STEPS.index(step)]})
            modes = ["eval_accuracy"] + ["eval_pass@4"] * 4
            (folder / f"eval_{step:07d}.jsonl").write_text("".join(json.dumps({"mode": mode, "index": i}) + "\n"
                                                                   for mode in modes for i in range(64)))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_the_report_lists_and_draws_every_eval_with_its_band_and_chance_and_says_when_a_run_did_not_learn(
        tmp_path, monkeypatch, capsys):
    data = synth.write_synth(tmp_path / "data", 2, n_test=2, seed=0, kinds=("sides",), size=32)
    assert json.loads((data / "synth.json").read_text()) == {"kinds": ["sides"], "chance": 0.25}
    figures = []

    def figure(**kw):  # the report's picture, kept to read what it drew
        figures.append(Figure(**kw))
        return figures[-1]
    monkeypatch.setattr(report, "Figure", figure)
    rising = grpo_run(tmp_path / "rising", [0.3, 0.55, 0.11, 0.8, 0.95], data)  # a dip at step 20
    report.main([str(rising)])
    summary = (rising / "summary.md").read_text()
    assert "| rising (grpo) | - | 0.120 -> 0.800 | single-turn accuracy 0.300 -> 0.950 |" in summary, summary
    assert ("rising (grpo) learnt: single-turn accuracy 0.300 -> 0.950, above the 95% band of its start "
            "(0.202 to 0.421 for 64 problems; chance 0.250)") in summary, summary  # Wilson's, z 1.96
    assert ("- rising (grpo), single-turn accuracy at each greedy eval (step value): 0 0.300, 10 0.550, 20 0.110, "
            "30 0.800, 40 0.950") in summary, summary
    acc = figures[0].axes[1]  # every eval drawn, the start's band shaded, chance dashed
    assert [list(line.get_ydata()) for line in acc.lines] == [[0.3, 0.55, 0.11, 0.8, 0.95]]
    assert list(acc.lines[0].get_xdata()) == STEPS and acc.get_xlabel() == "step"  # a run's evals at their steps
    (band,) = [c for c in acc.collections if isinstance(c, PolyCollection)]
    (chance,) = [c for c in acc.collections if isinstance(c, LineCollection)]
    assert sorted({round(float(y), 3) for path in band.get_paths() for _, y in path.vertices}) == [0.202, 0.421]
    assert [[tuple(map(float, xy)) for xy in s] for s in chance.get_segments()] == [[(0, 0.25), (40, 0.25)]]

    flat = grpo_run(tmp_path / "flat", [0.3, 0.28, 0.33, 0.25, 0.31], data)
    report.main([str(flat)])
    verdicts = [x for x in (flat / "summary.md").read_text().splitlines() if "learn" in x]
    assert verdicts == ["flat (grpo) did not learn: single-turn accuracy 0.300 -> 0.310, within the 95% band of its "
                        "start (0.202 to 0.421 for 64 problems; chance 0.250)"], verdicts
    capsys.readouterr()


TRAIN = [{"step": s, "reward": 0.5} for s in range(1, 6)]


@pytest.mark.parametrize("kind,rows,said", [  # a user's own data: chance unknown
    ("grpo", [{"step": 0, "eval_accuracy": 0.3}, *TRAIN, {"step": 5, "eval_accuracy": 0.9}],
     "run (grpo) learnt: single-turn accuracy 0.300 -> 0.900, above the 95% band of its start (0.202 to 0.421 for 64 "
     "problems; chance unknown)"),
    ("grpo", [{"step": 0, "eval_accuracy": 0.3, "eval_multi_turn_accuracy": 0.3}, *TRAIN,  # multi-turn: its own accuracy
              {"step": 5, "eval_accuracy": 0.9, "eval_multi_turn_accuracy": 0.31}],
     "run (grpo) did not learn: multi-turn accuracy 0.300 -> 0.310, within"),
    ("sft", [{"step": 0, "eval_loss": 2.5}, *[{"step": s, "loss": 2.0 / s} for s in range(1, 6)], {"step": 5, "eval_loss": 1.25}],
     "run (sft) learnt: eval loss 2.500 -> 1.250, below its start"),
    ("grpo", TRAIN, None),
], ids=["own data", "multi-turn", "sft", "no eval"])
def test_the_verdict_reads_each_kind_of_run_its_own_eval_and_draws_it(kind, rows, said, tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / f"config_{kind}.json").write_text(json.dumps({"eval_prompt_data": str(tmp_path / "mine.jsonl")}))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if kind == "grpo" and rows != TRAIN:  # its eval rows: 64 problems
        (folder / "eval_0000000.jsonl").write_text("".join(json.dumps({"index": i}) + "\n" for i in range(64)))
    report.main([str(folder)])
    text = (folder / "summary.md").read_text().splitlines()
    verdicts = [x for x in text if x.startswith("run (")]
    assert verdicts[0].startswith(said) if said else "| run (grpo) | - | 0.500 -> 0.500 | no eval |" in text, text
    assert (folder / "reward_curve.png").exists()


def test_synths_chance_is_one_over_the_answers_each_kinds_question_can_have(tmp_path):
    """CHOICES, the report's chance, against what each kind draws: its distinct answers per question."""
    for kind, make in synth.KINDS.items():
        rng, answers = random.Random(0), {}
        for _ in range(400):
            question, answer, *_ = make(rng, 16)
            answers.setdefault(question.split("[")[0], set()).add(answer)  # crop: the box apart
        assert {len(a) for a in answers.values()} == {synth.CHOICES[kind]}, (kind, answers)
    out = synth.write_synth(tmp_path, 1, n_test=1, kinds=("sides", "triangle"), size=16)
    assert json.loads((out / "synth.json").read_text())["chance"] == pytest.approx((1 / 4 + 1 / 10) / 2)


def test_the_done_line_says_each_eval_first_to_last(tmp_path, capsys):
    (tmp_path / "latest").write_text("iter_0000002")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 0, "eval_accuracy": 0.25}, {"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.75},
        {"step": 2, "eval_accuracy": 0.5}]))
    run = SimpleNamespace(kind="grpo", rank=0, args=SimpleNamespace(exit_signal_handler=False), stopping=None,
                          save=tmp_path, last={"reward": 0.75, "eval_accuracy": 0.5})
    for _ in console.steps(run, 0, 2):
        pass
    out = capsys.readouterr().out
    assert f"; last reward 0.750, eval_accuracy 0.250 -> 0.500; checkpoint {tmp_path / 'iter_0000002'}\n" in out, out
