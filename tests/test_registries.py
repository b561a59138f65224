"""Every registry entry that exists, each its own case (collected from the registries, so a fork's new entry gets one
with no test of its own), and every entry a user names by path (an env module, a judge, a filter): the examples/
files and those in $OWN_ENTRIES: its flags parsed as the trainer parses them, then run once through the trainer's
path. A loss's flag dropped or renamed, a judge reading a column the data has not, a tool its example cannot run, an
image tool reading the model's frame as pixels: each fails.

    .venv/bin/python -m pytest -q tests/test_registries.py
    OWN_ENTRIES="--custom-rm-path mine.judge --rollout-interaction-env-path mine_env" .venv/bin/python -m pytest -q tests/test_registries.py
"""
import dataclasses
import json
import math
import os
import shlex
import types

import pytest
import torch

import chat
import data
import env_geo3k
import flags as F
import loss as L
import parallel
import reward
import rollout as R
import task
import train_grpo as G
import trainer as T
from fakes import FakeModel, ScriptedEngine, picture
from test_grpo import loss_items

EXAMPLES = ["--custom-rm-path", "examples.exact_judge.exact", "--rollout-interaction-env-path", "examples.env_calc",
            "--dynamic-sampling-filter-path", "examples.std_filter.min_group_std"]
OWN = EXAMPLES + shlex.split(os.environ.get("OWN_ENTRIES", ""))  # a fork's own entries by path, walked with the rest


def by_path(flag):
    return [OWN[i + 1] for i in range(0, len(OWN) - 1, 2) if OWN[i] == flag]


def env_tools():
    """(env module path, tool name) of every tool of every env: env_geo3k's and each by path."""
    return [(e, t) for e in ["env_geo3k", *by_path(task.ENV)] for t in getattr(task.load(task.ENV, e, False), "TOOLS", {})]


def given(flags):
    """An entry's declared flags on the command line, each with a value it takes: its default, else 1 (a term's on)."""
    return [x for n, kw in flags.items() for x in ([n] if kw.get("action") else [n, str(kw.get("default") or 1)])]


def parsed(tmp_path, *argv, tools=None):
    """train_grpo's flags over a one-row jsonl (a picture, the answer 3, `tools`: every tool of env_geo3k unless given)
    -> (args, its record as the trainer loads it: trainer.load_data through the column flags)."""
    picture().save(tmp_path / "p.png")
    row = {"question": "<image>How many triangles?", "label": "3", "image": "p.png",
           "tools": list(env_geo3k.TOOLS) if tools is None else tools}
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
    """--advantage-estimator NAME with its flags given: through Source.take's call, its flags' values by dest."""
    args, _ = parsed(tmp_path, "--advantage-estimator", name, *given(L.ESTIMATORS[name].flags))
    adv = L.advantages([1.0, 0.0, 0.0, 0.5, 2.0, 2.0], [0, 0, 0, 1, 2, 2], args.advantage_estimator,
                       **F.declared(L.ESTIMATORS[name].flags, args))
    assert adv[0] > 0 > adv[1] == adv[2] and adv[3:] == [0.0] * 3, adv


@pytest.mark.parametrize("name", list(reward.REWARDS) + by_path(task.JUDGE))
def test_each_judge_scores_a_loaded_row(name, tmp_path):
    """--rm-type NAME (or --custom-rm-path NAME) on a row as data loading makes it: the judge called as it is (its
    exception seen; score would make it 0.0) and through reward.score, the row's own answer boxed right, another wrong."""
    args, rec = parsed(tmp_path, *(["--rm-type", name] if name in reward.REWARDS else [task.JUDGE, name]))
    judge = reward.REWARDS.get(name) or task.judge(name)
    for response, right in ((f"So \\boxed{{{rec['answer']}}}", True), ("\\boxed{17}", False)):
        assert bool(judge(response, rec)) is right, response
        assert reward.score(args.rm_type, response, rec) == float(right)


@pytest.mark.parametrize("name", list(task.FILTERS) + by_path(task.FILTER))
def test_each_filter_drops_a_group_with_nothing_to_learn_and_keeps_one_with(name, tmp_path):
    """--dynamic-sampling-filter-path NAME with its flags, through the rollout's settings (turned on by the path): a
    group all wrong at reward 0 is dropped, one half right (reward 1 and 0) kept, the answer a bool; the rollout's
    _complete asks it."""
    args, rec = parsed(tmp_path, task.FILTER, name, *given(task.group_filter(types.SimpleNamespace(
        dynamic_sampling_filter_path=name)).flags))
    cfg = R.settings(args)
    keep = task.group_filter(cfg).keep
    assert cfg.dynamic_sampling
    same = [R.Sample(prompt_ids=[], reward=0.0, correct=False) for _ in range(4)]
    mixed = [R.Sample(prompt_ids=[], reward=float(j % 2), correct=bool(j % 2)) for j in range(4)]
    assert keep(same, cfg) is False and keep(mixed, cfg) is True


@pytest.mark.parametrize("name", list(reward.SHAPING))
def test_each_shaping_term_rewards_a_sample_as_the_rollout_builds_it(name, processor, tmp_path):
    """NAME's flags on (each given), a multi-turn sample made by rollout.new_episode and closed by the rollout's
    _close (reward.rewarded): it carries the tools its row is offered; the term itself runs without an exception."""
    args, rec = parsed(tmp_path, *given(reward.SHAPING[name].flags))
    cfg = R.settings(args)
    ep = R.new_episode(processor, rec, cfg, chat.prompt(processor, rec, env_geo3k))
    s = ep.sample
    s.response_ids, s.loss_mask, s.response_text = [11] * 5, [1] * 5, f"\\boxed{{{rec['answer']}}}"
    R._close(ep, rec, processor, cfg)
    assert s.tools == list(env_geo3k.TOOLS) and s.status == "completed" and s.correct
    value = reward.SHAPING[name].term(s, rec, cfg)
    assert value is None or math.isfinite(value)
    assert s.reward == 1.0 + (value or 0.0) and s.metadata["shaping"] == ({} if value is None else {name: value})


@pytest.mark.parametrize("env,name", env_tools())
def test_each_tool_runs_its_example(env, name, tmp_path):
    """The env as the rollout builds it (build_env of the loaded row, the rollout's settings with the tool's flags)
    runs the tool's own example call (an image tool's in the 0-1000 frame), and its metrics take the step."""
    module = task.load(task.ENV, env, False)
    tool = module.TOOLS[name]
    args, rec = parsed(tmp_path, task.ENV, env, *given(tool.flags), tools=[name])
    env = module.build_env(rec, R.settings(args))
    _, _, info = env.step("<tool_call>" + json.dumps({"name": name, "arguments": tool.example}) + "</tool_call>")
    assert info["ran"] and info["error"] is None and info["tool"] == name, info
    m = task.metrics(module, [[info]], [True], [name])
    assert m[f"tool_calls_{name}"] == 1.0 and all(math.isfinite(v) for v in m.values())


def coordinates(example):
    """The arguments of a call that look like grounding coordinates: a list of 2 (a point) or 4 (a box) numbers."""
    return {k: len(v) for k, v in example.items() if isinstance(v, list) and len(v) in (2, 4) and all(
        isinstance(x, (int, float)) for x in v)}


@pytest.mark.parametrize("large", [False, True], ids=["small", "large"])
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
@pytest.mark.parametrize("env,name", [(e, t) for e, t in env_tools() if coordinates(
    task.load(task.ENV, e, False).TOOLS[t].example)])
def test_each_image_tool_gets_the_image_pixels_of_the_models_frame(env, name, arch, large, tmp_path, tiny_ckpt,
                                                                   monkeypatch):
    """An image tool (an argument of 2 or 4 numbers) declares its coordinates (Tool.coords), and run() gets the image's
    pixels of the region the model names in its family's frame (Qwen3-VL 0-1000, Qwen2.5-VL its processor's resized
    view), on a non-square image: a tool that skips the conversion, or reads the frame as pixels, fails here. A large
    one (a row's data.Picture, its view within --max-pixels): the frame is its view's, the pixels its original's."""
    module = task.load(task.ENV, env, False)
    tool = module.TOOLS[name]
    assert tool.coords == coordinates(tool.example), f"{name}: declare its grounding coordinates in Tool.coords"
    seen = []

    def spy(env, arguments):  # what the tool's own function is given
        seen.append(arguments)
        return tool.run(env, arguments)
    monkeypatch.setitem(module.TOOLS, name, dataclasses.replace(tool, run=spy))
    args, rec = parsed(tmp_path, task.ENV, env, "--hf-checkpoint", str(tiny_ckpt(arch)), "--max-pixels", "20000",
                       *given(tool.flags), tools=[name])
    big = data.image_to_data_uri(picture(1800, 1000)) if large else None  # encoded, as a row holds it
    image = data.picture(big, max_pixels=args.max_pixels) if large else picture(900, 500)
    env = module.build_env(dict(rec, images=[image]), R.settings(args))
    size, view = image.size, image.view_size if large else image.size  # the original's, the model's view's
    frame = env_geo3k.frame(env.resize, *view)
    assert (frame == (1000, 1000)) == (arch == "qwen3_vl") and frame != size and (view != size) == large
    region = {4: [450, 100, 870, 460], 2: [610, 333]}  # the original's pixels
    call = {**tool.example, **{k: env_geo3k.scale(region[n], size, frame, outward=False) for k, n in tool.coords.items()}}
    _, _, info = env.step("<tool_call>" + json.dumps({"name": name, "arguments": call}) + "</tool_call>")
    assert info["ran"] and info["error"] is None, info
    for k, n in tool.coords.items():  # within a frame unit's rounding of the region, never the frame's numbers
        assert all(abs(a - b) <= 1 + s / f for a, b, s, f in zip(seen[-1][k], region[n], size * 2, frame * 2)), (k, seen)


@pytest.mark.parametrize("env", ["env_geo3k", *by_path(task.ENV)])
def test_each_env_runs_an_episode_through_the_rollout(env, tmp_path, processor):
    """--rollout-interaction-env-path ENV, multi-turn, through rollout.generate_group_samples: the prompt names exactly the
    tools the env offers the row (none of another env's), the first one's example call runs, the answer is judged, and
    the env's metrics reach the rollout's (train_grpo.rollout_metrics)."""
    module = task.load(task.ENV, env, False)
    args, rec = parsed(tmp_path, task.ENV, env, "--n-samples-per-prompt", "2", tools=None if env == "env_geo3k" else [])
    rec.pop("tools")  # the env's default offer
    cfg = R.settings(args)
    names = task.tools(module, rec)
    script = ["<tool_call>\n" + json.dumps({"name": names[0], "arguments": module.TOOLS[names[0]].example}) + "\n</tool_call>"
              ] if names else []
    samples = R.generate_group_samples(ScriptedEngine(processor, script + [f"\\boxed{{{rec['answer']}}}"]), processor,
                                       [rec], cfg)
    prompt = processor.tokenizer.decode(samples[0].prompt_ids)
    others = {t for e in ["env_geo3k", *by_path(task.ENV)] for t in getattr(task.load(task.ENV, e, False), "TOOLS", {})}
    assert all(t in prompt for t in names) and not any(t in prompt for t in others - set(names)), prompt
    assert all(s.status == "completed" and s.correct and s.tools == names for s in samples), samples
    assert [s.tool_calls for s in samples] == [int(bool(names))] * 2
    m = G.rollout_metrics(samples, names, module)
    assert all(m[f"tool_calls_{t}"] == (t == names[0]) for t in names), m
