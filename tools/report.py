"""report.py: the summary of a run folder (run.sh's stages, or one run of train_grpo.py or sft.py) as summary.md and a
PNG: training reward (SFT: loss), greedy accuracy before and after (single-turn; multi-turn, oracle off), crop calls.

    python tools/report.py runs/cpu-demo            # or any run's folder (its metrics.jsonl)
"""
import argparse
import json
from pathlib import Path
from statistics import fmean

from matplotlib.figure import Figure

STAGES = [("sft", "SFT"), ("grpo", "GRPO single-turn"), ("sft_crop", "SFT crop calls"), ("grpo_mt", "GRPO crop task")]
EVALS = [("eval_accuracy", "single-turn"), ("eval_multi_turn_accuracy", "multi-turn")]
TOOL_CURVES = {"tool_calls_crop": "crop calls / episode", "crop_hit_frac": "share whose crop hit the box"}


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def stage_rows(run):
    """[(title, first reward, last 5's mean, {eval key: [before, after]})], [(title, rewards, {tool curve: points})]."""
    last = dict((read(run / "base_eval" / "metrics.jsonl") or [{}])[0])  # each eval's latest value
    rows, curves = [], []
    one = [(".", f"{run.name} ({kind})") for kind in ("grpo", "sft") if (run / f"config_{kind}.json").exists()]
    for name, title in one[:1] if (run / "metrics.jsonl").exists() else STAGES:  # one run, or run.sh's stages
        m = read(run / name / "metrics.jsonl")
        if not m:
            continue
        key = "reward" if any("reward" in x for x in m) else "loss"  # the curve: GRPO's reward, or SFT's loss
        curve = [(x["step"], x[key]) for x in m if key in x]
        if not any(k.startswith("eval_") for x in m for k in x):
            last = {}  # a stage with no eval set (the crop SFT) has no before; it ends where the next begins
        acc = {}
        for k, _ in EVALS:
            seen = [x for x in m if k in x]
            before = seen[0][k] if seen and seen[0]["step"] == 0 else last.get(k)
            acc[k] = [before, seen[-1][k] if seen else None]
            if rows and rows[-1][3][k][1] is None and seen and seen[0]["step"] == 0:
                rows[-1][3][k][1] = before  # a stage without this eval (SFT) ends where the next begins
            last[k] = acc[k][1] if acc[k][1] is not None else before
        rows.append((title, curve[0][1] if curve else None, fmean(r for _, r in curve[-5:]) if curve else None, acc))
        if curve and key == "reward":  # with a multi-turn stage's tool curves
            curves.append((title, curve, {k: [(x["step"], x[k]) for x in m if k in x] for k in TOOL_CURVES}))
    return rows, curves


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", default="runs/cpu-demo", help="a run folder")
    run = Path(p.parse_args(argv).run)
    rows, curves = stage_rows(run)
    if not rows:
        p.error(f"no metrics.jsonl in {run}, nor in its stage folders ({', '.join(n for n, _ in STAGES)})")
    fmt = lambda v: "  -  " if v is None else f"{v:5.3f}"  # noqa: E731
    per10 = lambda pts: ", ".join(f"{fmean(y for _, y in pts[i:i + 10]):.2f}" for i in range(0, len(pts), 10))  # noqa
    lines = ["| stage | train reward (SFT: loss) first step | last 5 steps | greedy single-turn before | after "
             "| greedy multi-turn before | after |", "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {t} | {fmt(a)} | {fmt(b)} | " + " | ".join(fmt(v) for k, _ in EVALS for v in acc[k]) + " |"
              for t, a, b, acc in rows]
    lines += [f"\n{t}, per 10 steps: " + "; ".join(f"{TOOL_CURVES[k]} {per10(pts)}" for k, pts in tools.items() if pts)
              for t, _, tools in curves if any(tools.values())]
    (run / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if curves:
        ax, acc = Figure(figsize=(11, 4)).subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})  # no pyplot: no GUI
        for i, (*_, a) in enumerate(rows):  # each stage's before -> after, on its own eval set
            for (k, label), colour in zip(EVALS, ("tab:blue", "tab:orange")):
                acc.plot([i, i + 1], a[k], marker="o", color=colour, label=None if i else label)
        acc.set_xticks(range(len(rows) + 1), ["start"] + [t.replace(" ", "\n", 1) for t, *_ in rows], fontsize=7)
        acc.set(ylabel="greedy eval accuracy", ylim=(-0.02, 1.02), title="each stage, before -> after")
        for title, pts, tools in curves:
            line, = ax.plot(*zip(*pts), marker=".", label=title)
            for (k, got), style in zip(tools.items(), ("--", ":")):  # none in a single-turn stage: no line
                ax.plot(*zip(*got), ls=style, color=line.get_color(), label=f"{title}: {TOOL_CURVES[k]}")
        ax.set(xlabel="GRPO step", ylabel="reward; crop calls, hits", ylim=(-0.02, 1.02), title=f"{run.name}: reward")
        for a in (ax, acc):
            a.grid(alpha=0.3)
            a.legend(fontsize=8)
        ax.figure.savefig(run / "reward_curve.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
