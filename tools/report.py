"""report.py: the summary of a run folder (run.sh's stages sft, grpo, grpo_mt after base_eval, or one trainer
run's): training reward (SFT: loss), greedy accuracy before and after each stage; summary.md, a reward-curve PNG.

    python tools/report.py runs/cpu-demo            # or any run's folder (its metrics.jsonl)
"""
import argparse
import json
from pathlib import Path

STAGES = [("sft", "SFT"), ("grpo", "GRPO single-turn"), ("grpo_mt", "GRPO multi-turn")]
EVALS = [("eval_accuracy", "single-turn"), ("eval_multi_turn_accuracy", "multi-turn")]


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def stage_rows(run):
    """[(title, first reward, mean of the last 5, {eval key: [before, after]})], [(title, rewards, crop calls)]."""
    base = read(run / "base_eval" / "metrics.jsonl")
    last = {k: base[0][k] for k, _ in EVALS if base and k in base[0]}  # each eval's latest value
    rows, curves = [], []
    one = [(".", f"{run.name} ({kind})") for kind in ("grpo", "sft") if (run / f"config_{kind}.json").exists()]
    for name, title in one[:1] if (run / "metrics.jsonl").exists() else STAGES:  # one run, or run.sh's stages
        m = read(run / name / "metrics.jsonl")
        if not m:
            continue
        key = "reward" if any("reward" in x for x in m) else "loss"  # GRPO's, or SFT's
        rewards = [(x["step"], x[key]) for x in m if key in x]
        acc = {}
        for k, _ in EVALS:
            seen = [x for x in m if k in x]
            before = seen[0][k] if seen and seen[0]["step"] == 0 else last.get(k)
            acc[k] = [before, seen[-1][k] if seen else None]
            if rows and rows[-1][3][k][1] is None and seen and seen[0]["step"] == 0:
                rows[-1][3][k][1] = before  # a stage without this eval (SFT) ends where the next begins
            last[k] = acc[k][1] if acc[k][1] is not None else before
        tail = [r for _, r in rewards[-5:]]
        rows.append((title, rewards[0][1] if rewards else None, sum(tail) / len(tail) if tail else None, acc))
        if rewards and key == "reward":  # with the crop calls per episode of a multi-turn stage
            curves.append((title, rewards, [(x["step"], x["tool_calls_crop"]) for x in m if "tool_calls_crop" in x]))
    return rows, curves


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
    (run / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if curves:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
        names = ["start"] + [t.replace("GRPO ", "GRPO\n") for t, *_ in rows]
        for k, label in EVALS:
            ys = [rows[0][3][k][0]] + [a[k][1] for *_, a in rows]
            acc.plot(range(len(ys)), [float("nan") if y is None else y for y in ys], marker="o", label=label)
        acc.set_xticks(range(len(names)), names, fontsize=8)
        acc.set(ylabel="greedy eval accuracy", ylim=(-0.02, 1.02), title="after each stage")
        for title, pts, calls in curves:
            line, = ax.plot([s for s, _ in pts], [r for _, r in pts], marker=".", label=title)
            if calls:
                ax.plot([s for s, _ in calls], [c for _, c in calls], ls="--", color=line.get_color(),
                        label=f"{title}: crop calls / episode")
        ax.set(xlabel="GRPO step", ylabel="mean reward; crop calls", ylim=(-0.02, 1.02), title=f"{run.name}: reward")
        for a, size in ((ax, None), (acc, 8)):
            a.grid(alpha=0.3)
            a.legend(fontsize=size)
        fig.tight_layout()
        fig.savefig(run / "reward_curve.png", dpi=120)
        print(f"wrote {run / 'summary.md'} and {run / 'reward_curve.png'}")


if __name__ == "__main__":
    main()
