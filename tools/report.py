"""report.py: the summary of a run folder (run.sh's stages after base_eval, or one run of train_grpo.py or sft.py):
each stage's training reward (SFT: loss), greedy accuracy before and after (single-turn; multi-turn, oracle off), and
a multi-turn stage's crop calls and share whose crop hit the box per 10 steps, as summary.md and a reward-curve PNG.

    python tools/report.py runs/cpu-demo            # or any run's folder (its metrics.jsonl)
"""
import argparse
import json
from pathlib import Path

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
        key = "reward" if any("reward" in x for x in m) else "loss"  # GRPO's, or SFT's
        rewards = [(x["step"], x[key]) for x in m if key in x]
        acc = {k: [None, None] for k, _ in EVALS}
        for k, _ in EVALS:
            seen = [x for x in m if k in x]
            if seen:  # a stage whose eval ran but not at step 0 (SFT) begins where the eval last stood
                acc[k] = [seen[0][k] if seen[0]["step"] == 0 else last.get(k), seen[-1][k]]
                last[k] = seen[-1][k]
        tail = [r for _, r in rewards[-5:]]
        rows.append((title, rewards[0][1] if rewards else None, sum(tail) / len(tail) if tail else None, acc))
        if rewards and key == "reward":  # with a multi-turn stage's tool curves
            curves.append((title, rewards, {k: [(x["step"], x[k]) for x in m if k in x] for k in TOOL_CURVES}))
    return rows, curves


def per10(pts):  # a curve's means over each 10 steps, as text
    return ", ".join(f"{sum(y for _, y in pts[i:i + 10]) / len(pts[i:i + 10]):.2f}" for i in range(0, len(pts), 10))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", default="runs/cpu-demo", help="a run folder")
    run = Path(p.parse_args(argv).run)
    rows, curves = stage_rows(run)
    if not rows:
        p.error(f"no metrics.jsonl in {run}, nor in its stage folders ({', '.join(n for n, _ in STAGES)})")
    fmt = lambda v: "  -  " if v is None else f"{v:5.3f}"  # noqa: E731
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
