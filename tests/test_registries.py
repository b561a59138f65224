"""Every registry entry that exists, each its own case (collected from the registries, so a fork's new entry gets one
with no test of its own): its flags parsed as the trainer parses them, then run once through the trainer's path. A
loss's flag dropped or renamed, a judge reading a column the data has not, a tool its example cannot run: each fails.

    .venv/bin/python -m pytest -q tests/test_registries.py
"""
import json
import math
import types

import pytest
import torch

import chat
import env_geo3k
import flags as F
import loss as L
import parallel
import reward
import rollout as R
import train_grpo as G
import trainer as T
from fakes import FakeModel, picture
from test_grpo import loss_items


def given(flags):
    """An entry's declared flags on the command line, each with a value it takes: its default, else 1 (a term's on)."""
    return [x for n, kw in flags.items() for x in ([n] if kw.get("action") else [n, str(kw.get("default") or 1)])]


def parsed(tmp_path, *argv):
    """train_grpo's flags over a one-row jsonl (a picture, the answer 3, `tools`: every tool) -> (args, its record as
    the trainer loads it: trainer.load_data through the column flags)."""
    picture().save(tmp_path / "p.png")
    row = {"question": "<image>How many triangles?", "label": "3", "image": "p.png", "tools": list(env_geo3k.TOOLS)}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "ckpt").mkdir(exist_ok=True)  # the env reads the family's grounding frame from it (0-1000)
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    args = G.parse_args(["--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data", str(tmp_path / "rows.jsonl"), "--save", "x",
                         "--input-key", "question", "--label-key", "label", "--max-turns", "2", *argv])
    return args, T.load_data(args, verbose=False)[0]


@pytest.mark.parametrize("name", list(L.LOSSES))
def test_each_policy_loss_trains_through_policy_loss(name, tmp_path):
    """--policy-loss NAME with its flags: a step of train_grpo.policy_loss, a finite loss, a gradient, and every
    statistic it declares (its metrics) and no other."""
    entry = L.LOSSES[name]
    args, _ = parsed(tmp_path, "--policy-loss", name, *given(entry.flags))
    parallel.init_distributed(1)
    par = types.SimpleNamespace(dp=1, cp=1, ep=1, pp=1, dp_group=None, device=torch.device("cpu"))
    model = FakeModel([-0.6, -0.7, -2.0], par)
    stats = G.policy_loss(model, None, par, loss_items([[-1.0, -0.5], [-2.0]], [1.0, -1.0]), args, measure=True)
    assert set(entry.stats) <= set(stats) and all(math.isfinite(v) for v in stats.values()), stats
    assert model.logp.grad is not None and torch.isfinite(model.logp.grad).all() and model.logp.grad.abs().sum() > 0
    logp = torch.tensor([-0.6, -0.7, -2.0])
    _, per_token = entry.policy(logp, logp, torch.ones(3), [2, 1], args.eps_clip, args.eps_clip_high,
                                **F.declared(entry.flags, args))
    assert sorted(per_token) == sorted(entry.stats) and all(v.shape == (3,) for v in per_token.values())


@pytest.mark.parametrize("name", list(L.ESTIMATORS))
def test_each_advantage_estimator_through_the_trainers_call(name, tmp_path):
    args, _ = parsed(tmp_path, "--advantage-estimator", name)
    adv = L.advantages([1.0, 0.0, 0.0, 0.5, 2.0, 2.0], [0, 0, 0, 1, 2, 2], args.advantage_estimator)
    assert adv[0] > 0 > adv[1] == adv[2] and adv[3:] == [0.0] * 3, adv


@pytest.mark.parametrize("name", list(reward.REWARDS))
def test_each_judge_scores_a_loaded_row(name, tmp_path):
    """--rm-type NAME on a row as data loading makes it: the judge called as it is (its exception seen; score would
    make it 0.0) and through reward.score, the row's own answer boxed right, another one wrong."""
    args, rec = parsed(tmp_path, "--rm-type", name)
    for response, right in ((f"So \\boxed{{{rec['answer']}}}", True), ("\\boxed{17}", False)):
        assert bool(reward.REWARDS[name](response, rec)) is right, response
        assert reward.score(args.rm_type, response, rec) == float(right)


@pytest.mark.parametrize("name", list(reward.SHAPING))
def test_each_shaping_term_rewards_a_sample_as_the_rollout_builds_it(name, processor, tmp_path):
    """NAME's flags on (each given), a multi-turn sample made by rollout.new_episode and closed by the rollout's
    _close (reward.rewarded): it carries the tools its row is offered; the term itself runs without an exception."""
    args, rec = parsed(tmp_path, *given(reward.SHAPING[name].flags))
    cfg = R.settings(args)
    ep = R.new_episode(processor, rec, cfg, chat.prompt(processor, rec, multi_turn=True))
    s = ep.sample
    s.response_ids, s.loss_mask, s.response_text = [11] * 5, [1] * 5, f"\\boxed{{{rec['answer']}}}"
    R._close(ep, rec, processor, cfg)
    assert s.tools == list(env_geo3k.TOOLS) and s.status == "completed" and s.correct
    value = reward.SHAPING[name].term(s, rec, cfg)
    assert value is None or math.isfinite(value)
    assert s.reward == 1.0 + (value or 0.0) and s.metadata["shaping"] == ({} if value is None else {name: value})


@pytest.mark.parametrize("name", list(env_geo3k.TOOLS))
def test_each_tool_runs_its_example(name, tmp_path):
    """The env as the rollout builds it (build_env of the loaded row, the rollout's settings with the tool's flags)
    runs the tool's own example call, and its metrics take the step."""
    tool = env_geo3k.TOOLS[name]
    args, rec = parsed(tmp_path, *given(tool.flags))
    env = env_geo3k.build_env(rec, R.settings(args))
    _, _, info = env.step("<tool_call>" + json.dumps({"name": name, "arguments": tool.example}) + "</tool_call>")
    assert info["ran"] and info["error"] is None and info["tool"] == name, info
    m = env_geo3k.tool_metrics([[info]], [True], [name])
    assert m[f"tool_calls_{name}"] == 1.0 and all(math.isfinite(v) for v in m.values())
