"""report.py: the summary of a run.sh pipeline: a table of reward and greedy accuracy (single-turn, and multi-turn
with the oracle off) before and after each stage on its eval set, crop calls and hits per 10 steps, a reward-curve PNG.

    python tools/report.py runs/cpu-demo            # reads <run>/<stage>/metrics.jsonl and config_*.json
"""
import json
import sys
from pathlib import Path

STAGES = [("sft", "SFT"), ("grpo", "GRPO single-turn"), ("sft_crop", "SFT tool calls"),
          ("grpo_mt", "GRPO multi-turn")]
EVALS = [("eval_accuracy", "single-turn"), ("eval_multi_turn_accuracy", "multi-turn")]
TOOL_CURVES = [("tool_calls_crop", "crop calls / episode"), ("crop_hit_frac", "share whose crop hit the box")]


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def eval_set(folder):
    """The --eval-prompt-data a stage ran with (its config_*.json), as a name."""
    cfg = next(folder.glob("config_*.json"), None)
    return Path(json.loads(cfg.read_text()).get("eval_prompt_data") or "-").name if cfg else "-"


def stage_rows(run):
    """[(title, eval set, first reward, mean of the last 5, {eval key: [before, after]})],
    [(title, rewards, {tool curve key: [(step, value)]})]; a stage's before is the last value on its eval set."""
    base = read(run / "base_eval" / "metrics.jsonl")
    last = {(eval_set(run / "base_eval"), k): base[0][k] for k, _ in EVALS if base and k in base[0]}
    rows, curves = [], []
    for name, title in STAGES:
        m, where = read(run / name / "metrics.jsonl"), eval_set(run / name)
        if not m:
            continue
        rewards = [(x["step"], x["reward"]) for x in m if "reward" in x]
        acc = {}
        for k, _ in EVALS:
            seen = [x for x in m if k in x]
            before = seen[0][k] if seen and seen[0]["step"] == 0 else last.get((where, k))
            acc[k] = [before, seen[-1][k] if seen else None]
            if rows and rows[-1][1] == where and rows[-1][4][k][1] is None and seen and seen[0]["step"] == 0:
                rows[-1][4][k][1] = before  # a stage without this eval (SFT) ends where the next begins
            last[(where, k)] = acc[k][1] if acc[k][1] is not None else before
        tail = [r for _, r in rewards[-5:]]
        rows.append((title, where, rewards[0][1] if rewards else None, sum(tail) / len(tail) if tail else None, acc))
        if rewards:  # with a multi-turn stage's tool curves
            curves.append((title, rewards, {k: [(x["step"], x[k]) for x in m if k in x] for k, _ in TOOL_CURVES}))
    return rows, curves


def per10(pts):  # a curve's means over each 10 steps, as text
    return ", ".join(f"{sum(y for _, y in pts[i:i + 10]) / len(pts[i:i + 10]):.2f}" for i in range(0, len(pts), 10))


def main(run):
    run = Path(run)
    rows, curves = stage_rows(run)
    fmt = lambda v: "  -  " if v is None else f"{v:5.3f}"  # noqa: E731
    lines = ["| stage | eval set | train reward first step | last 5 steps | greedy single-turn before | after "
             "| greedy multi-turn before | after |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {t} | {w} | {fmt(a)} | {fmt(b)} | " + " | ".join(fmt(v) for k, _ in EVALS for v in acc[k]) + " |"
              for t, w, a, b, acc in rows]
    lines += [f"\n{t}, per 10 steps: " + "; ".join(f"{label} {per10(tools[k])}" for k, label in TOOL_CURVES
                                                   if tools[k]) for t, _, tools in curves if any(tools.values())]
    (run / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib.pyplot as plt
    plt.switch_backend("Agg")
    fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
    for i, (*_, a) in enumerate(rows):  # each stage's before -> after, on its own eval set
        for (k, label), colour in zip(EVALS, ("tab:blue", "tab:orange")):
            acc.plot([i, i + 1], a[k], marker="o", color=colour, label=None if i else label)
    acc.set_xticks(range(len(rows) + 1), ["start"] + [t.replace(" ", "\n", 1) for t, *_ in rows], fontsize=7)
    acc.set(ylabel="greedy eval accuracy", ylim=(-0.02, 1.02), title="each stage, on its eval set")
    for title, pts, tools in curves:
        line, = ax.plot(*zip(*pts), marker=".", label=title)
        for (k, label), style in zip(TOOL_CURVES, ("--", ":")):
            if tools[k]:
                ax.plot(*zip(*tools[k]), ls=style, color=line.get_color(), label=f"{title}: {label}")
    ax.set(xlabel="GRPO step", ylabel="reward; crop calls, hits", ylim=(-0.02, 1.02), title=f"{run.name}: reward")
    for a in (ax, acc):
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    fig.savefig(run / "reward_curve.png", dpi=120, bbox_inches="tight")
    print(f"wrote {run / 'summary.md'} and {run / 'reward_curve.png'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/cpu-demo")
