"""train_grpo.py's flags: each registry entry's own flags reach it, a flag an entry declares but the parser lacks
is refused naming the entry, and each sampling flag is bounded at parse time."""
import math
import sys
from pathlib import Path

import pytest
import torch

import loss as L
import task
import train_grpo as G
from fakes import FakeModel

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
from test_grpo import loss_items


def test_each_entrys_own_flags_reach_it(monkeypatch, ckpt):
    """A registry entry declares its flags with it; the parser takes them and the plumbing hands them over: a loss's
    to its policy through policy_loss (its statistic reported by its name), a reward term's in the rollout's settings,
    a tool's in env.flags; SAPO's temperatures, by hand through policy_loss."""
    import types
    import env_geo3k
    import loss as L
    import parallel
    import reward
    import rollout
    seen = {}

    def spy(logp, old, adv, lens, eps_low, eps_high, spy_x):
        seen["loss"] = spy_x
        return -logp * adv, {"spied": torch.full_like(logp, 0.5), "clipfrac": torch.zeros_like(logp)}

    def spy_tool(env, arguments):
        seen["tool"] = env.flags["spy_size"]
        return "ok", [], {}
    monkeypatch.setitem(L.LOSSES, "spy", L.Loss(spy, ("spied", "clipfrac"), {"--spy-x": dict(type=float)}))
    monkeypatch.setitem(reward.SHAPING, "spy", reward.Shaping(lambda s, rec, cfg: cfg.spy_bonus,
                                                              {"--spy-bonus": dict(type=float, default=0.0)}))
    monkeypatch.setitem(env_geo3k.TOOLS, "spy", env_geo3k.Tool(spy_tool, "spy", "spy", {"n": {"type": "integer"}},
                                                               {"n": 1}, flags={"--spy-size": dict(type=int)}))
    base = ["--hf-checkpoint", str(ckpt), "--prompt-data", "x", "--save", "x", "--max-turns", "2"]  # the env reads it
    args = G.parse_args(base + ["--policy-loss", "spy", "--spy-x", "3.5", "--spy-bonus", "0.25",
                                "--spy-size", "7"])
    parallel.init_distributed(1)
    par = types.SimpleNamespace(dp=1, cp=1, ep=1, pp=1, dp_group=None, device=torch.device("cpu"))

    def stats(args):
        items = loss_items([[-1.0, -0.5], [-2.0]], [1.0, -1.0])
        model = FakeModel([-0.6, -0.7, -2.0], par)
        return G.policy_loss(model, None, par, items, args, measure=False)
    assert stats(args)["spied"] == pytest.approx(0.5) and stats(args)["clipfrac"] == 0.0 and seen["loss"] == 3.5
    cfg = rollout.settings(args)
    assert reward.rewarded(rollout.Sample(prompt_ids=[]), {"answer": "1"}, cfg) == 0.25
    env = env_geo3k.build_env({"answer": "1", "images": [], "tools": ["spy"]}, cfg)
    assert env.step('<tool_call>{"name": "spy", "arguments": {"n": 1}}</tool_call>')[2]["ran"] and seen["tool"] == 7
    # SAPO: -4 / tau sigmoid(tau (r - 1)) A a token, tau 2 where A > 0 (A's tokens), 3 where not (B's, r = 1)
    sapo = stats(G.parse_args(base + ["--policy-loss", "sapo", "--sapo-tau-pos", "2", "--sapo-tau-neg", "3"]))
    p = [1 / (1 + math.exp(-2 * (r - 1))) for r in (math.exp(0.4), math.exp(-0.2))]
    assert sapo["loss"] == pytest.approx((-2 * p[0] - 2 * p[1] + 4 / 3 * 0.5) / 3)
    assert sapo["gate"] == pytest.approx((4 * p[0] * (1 - p[0]) + 4 * p[1] * (1 - p[1]) + 1) / 3) and "clipfrac" not in sapo


def test_a_declared_flag_args_lacks_is_an_error_naming_the_entry(monkeypatch, capsys):
    """An entry's flag that the parser did not take is an error at start naming the entry and the flag (train_grpo's
    parse_args checks every registry's), never its default in silence; a tool's where build_env's args lack it too."""
    import argparse
    import env_geo3k
    import flags as F
    import reward
    own = F.own_flags
    monkeypatch.setattr(F, "own_flags", lambda registry: {} if registry is reward.SHAPING else own(registry))
    with pytest.raises(SystemExit):  # a parser that did not take SHAPING's flags
        G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x"])
    assert ("error: SHAPING entry 'overlong_penalty' declares --overlong-buffer-len, which args lacks: add "
            "flags.own_flags(SHAPING) to the parser") in capsys.readouterr().err
    monkeypatch.setitem(env_geo3k.TOOLS, "spy", env_geo3k.Tool(None, "spy", "spy", {}, {}, flags={"--spy-size": {}}))
    with pytest.raises(AttributeError, match="spy_size"):
        env_geo3k.build_env({"answer": "1", "images": []}, argparse.Namespace(max_turns=2))


@pytest.mark.parametrize("kind,name", [("LOSSES", "ppo_clip"), ("ESTIMATORS", "grpo"), ("SHAPING", "overlong_penalty"),
                                       ("FILTERS", "nonzero_std"), ("TOOLS", "calc_score")])
def test_an_entry_of_each_registry_whose_flag_the_parser_lacks_is_refused_at_start(kind, name, monkeypatch, capsys):
    """Issue 75: the check walked the losses and shaping terms only, so a tool's flag args lacked was not refused at
    start. Each registry's entry (the env's TOOLS, the chosen filter too) that declares a flag the parser never took
    (gained after it was built) is the parser's error naming the registry, the entry and the flag."""
    import dataclasses
    import env_geo3k
    import reward
    registry = {"LOSSES": L.LOSSES, "ESTIMATORS": L.ESTIMATORS, "SHAPING": reward.SHAPING, "FILTERS": task.FILTERS,
                "TOOLS": env_geo3k.TOOLS}[kind]
    entry = registry[name]
    late = {"--late-size": dict(type=int, default=1)}
    late = dataclasses.replace(entry, flags=late) if dataclasses.is_dataclass(entry) else entry._replace(flags=late)
    build = G.build_parser

    def built_before_the_flag(argv=()):
        parser = build(argv)
        monkeypatch.setitem(registry, name, late)
        return parser
    monkeypatch.setattr(G, "build_parser", built_before_the_flag)
    with pytest.raises(SystemExit):
        G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x"])
    assert (f"error: {kind} entry {name!r} declares --late-size, which args lacks: add flags.own_flags({kind}) to the "
            "parser") in capsys.readouterr().err


@pytest.mark.parametrize("flag,bad,good", [
    ("--rollout-top-p", ["0", "-0.1", "1.5", "nan"], ["1e-3", "1"]),  # SGLang's (0, 1]; 0 crashed the local sampler
    ("--rollout-top-k", ["0", "-2", "1.5"], ["-1", "1", "50"]),      # SGLang's: -1 (off) or at least 1
    ("--rollout-temperature", ["-1", "nan", "inf"], ["0.01", "0.7"]),  # 0: GRPO refuses it (no advantage)
    ("--rm-timeout", ["0", "-1", "nan"], ["0.05", "30"]),
])
def test_every_sampling_flag_is_bounded_at_parse_time_naming_the_flag(flag, bad, good, capsys):
    """Issue 75: `--rollout-top-p 0` crashed deep in sampling (index 152576 is out of bounds). Each sampling flag's
    bad value is the parser's error naming the flag and the value, before any work; its good values pass."""
    base = ["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x"]
    for value in bad:
        with pytest.raises(SystemExit):
            G.parse_args(base + [flag, value])
        assert f"argument {flag}: " in capsys.readouterr().err
    for value in good:
        assert getattr(G.parse_args(base + [flag, value]), flag[2:].replace("-", "_")) == float(value)
