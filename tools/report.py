"""report.py: the summary of a run folder (run.sh's stages, or one run of train_grpo.py or sft.py) as summary.md and a
PNG: each stage's seconds, training reward (SFT: loss), and what its greedy evals show before and after it.

    python tools/report.py runs/cpu-demo            # or any run's folder (its metrics.jsonl)
"""
import argparse
import json
from pathlib import Path
from statistics import fmean

from matplotlib.figure import Figure

CROP = {"eval_multi_turn_accuracy": "multi-turn accuracy", "eval_multi_turn_crop_hit_frac": "crop hits the named box",
        "eval_multi_turn_tool_calls_image_zoom_in_tool": "crop calls / episode"}
EVALS = {"sides": {"eval_accuracy": "accuracy"}, "crop": CROP,  # greedy, on each stage's own test set
         "crop+": {**CROP, "eval_accuracy": "single-turn, without the tool"}, "run": {"eval_accuracy": "single-turn accuracy", **CROP}}
STAGES = [("sft", "SFT", "sides"), ("grpo", "GRPO single-turn", "sides"), ("sft_crop", "SFT crop calls", "crop"),
          ("grpo_mt", "GRPO crop task", "crop+")]
TOOL_CURVES = {"tool_calls_image_zoom_in_tool": "crop calls / episode", "crop_hit_frac": "share whose crop hit the box"}


def read(path):
    """metrics.jsonl's rows; where crop calls were counted without a hit share, none hit (0.0)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    for r, k in [(r, k) for r in rows for k in r if k.endswith("tool_calls_image_zoom_in_tool")]:
        r.setdefault(k.replace("tool_calls_image_zoom_in_tool", "crop_hit_frac"), 0.0)
    return rows


def stage_rows(run):
    """[(title, seconds, first reward (SFT: loss), last 5's mean, {eval key: [label, before, after]})], [(title, reward
    curve, {tool curve: points})]. A stage without an eval on its set begins where the last stage on that set ended
    and ends where the next begins (the crop SFT: no before; base_eval: the random model, SFT's before)."""
    tsv = run / "stages.tsv"  # run.sh's stage\tseconds
    seconds = dict(x.split("\t") for x in tsv.read_text().splitlines()) if tsv.exists() else {}
    one = [(".", f"{run.name} ({kind})", "run") for kind in ("grpo", "sft") if (run / f"config_{kind}.json").exists()]
    rows, curves, last, prev = [], [], dict((read(run / "base_eval" / "metrics.jsonl") or [{}])[0]), "sides"
    for name, title, group in one[:1] if (run / "metrics.jsonl").exists() else STAGES:
        if not (m := read(run / name / "metrics.jsonl")):
            continue
        key = "reward" if any("reward" in x for x in m) else "loss"  # the curve: GRPO's reward, or SFT's loss
        curve = [(x["step"], x[key]) for x in m if key in x]
        last = last if group.rstrip("+") == prev.rstrip("+") else {}
        evals = {}
        for k, label in EVALS[group].items():
            if not (seen := [x for x in m if k in x]) and group == "run":
                continue
            evals[k] = [label, seen[0][k] if seen and seen[0]["step"] == 0 else last.get(k), seen[-1][k] if seen else None]
            if rows and k in rows[-1][4] and rows[-1][4][k][2] is None and seen and seen[0]["step"] == 0:
                rows[-1][4][k][2] = evals[k][1]  # a stage without this eval (SFT) ends where the next begins
        last, prev = {k: a if a is not None else b for k, (_, b, a) in evals.items()}, group
        rows.append((title, seconds.get(name), curve[0][1] if curve else None,
                     fmean(r for _, r in curve[-5:]) if curve else None, evals))
        if curve and key == "reward":  # with a multi-turn stage's tool curves
            curves.append((title, curve, {k: [(x["step"], x[k]) for x in m if k in x] for k in TOOL_CURVES}))
    return rows, curves, seconds


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", nargs="?", default="runs/cpu-demo", help="a run folder")
    run = Path(p.parse_args(argv).run)
    rows, curves, seconds = stage_rows(run)
    if not rows:
        p.error(f"no metrics.jsonl in {run}, nor in its stage folders ({', '.join(n for n, *_ in STAGES)})")
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    per10 = lambda pts: ", ".join(f"{fmean(y for _, y in pts[i:i + 10]):.2f}" for i in range(0, len(pts), 10))  # noqa
    lines = ["| stage | seconds | train reward (SFT: loss), first step -> last 5 | greedy eval on its test set, before -> "
             "after |", "| --- | --- | --- | --- |"]
    lines += [f"| {t} | {s or '-'} | {fmt(a)} -> {fmt(b)} | " + "; ".join(f"{lab} {fmt(x)} -> {fmt(y)}" for lab, x, y
                                                                        in evals.values()) + " |" for t, s, a, b, evals in rows]
    lines += [f"\nwhole run: {sum(map(int, seconds.values()))} s (" + ", ".join(f"{k} {v} s" for k, v in seconds.items())
              + ")"] if seconds else []
    lines += [f"\n{t}, per 10 steps: " + "; ".join(f"{TOOL_CURVES[k]} {per10(pts)}" for k, pts in tools.items() if pts)
              for t, _, tools in curves if any(tools.values())]
    print(text := "\n".join(lines))
    (run / "summary.md").write_text(text + "\n")
    if curves:
        ax, acc = Figure(figsize=(11, 4)).subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})  # no pyplot: no GUI
        first = {}  # each eval's first stage: its legend entry
        for i, (*_, evals) in enumerate(rows):  # each stage's before -> after, on its own eval set
            for k, (label, *ys) in evals.items():
                acc.plot([i, i + 1], ys, marker="o", color=f"C{list(EVALS['run']).index(k)}",
                         label=label if first.setdefault(k, i) == i else None)
        acc.set_xticks(range(len(rows) + 1), ["start"] + [t.replace(" ", "\n", 1) for t, *_ in rows], fontsize=7)
        acc.set(ylabel="greedy eval", ylim=(-0.02, 1.02), title="each stage, before -> after")
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
