"""report.py: the summary of a run.sh pipeline: a table of reward and accuracy before and
after each stage, and a reward-curve PNG.

    python tools/report.py runs/cpu-demo            # reads <run>/<stage>/metrics.jsonl
"""
import json
import sys
from pathlib import Path

STAGES = [("sft", "SFT"), ("grpo", "GRPO single-turn"), ("grpo_mt", "GRPO multi-turn")]


def read(path):
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def main(run):
    run = Path(run)
    base = read(run / "base_eval" / "metrics.jsonl")
    before = base[0].get("eval_accuracy") if base else None
    rows, curves = [], []
    for name, title in STAGES:
        m = read(run / name / "metrics.jsonl")
        if not m:
            continue
        key = "eval_multi_turn_accuracy" if any("eval_multi_turn_accuracy" in x for x in m) else "eval_accuracy"
        evals = [x for x in m if key in x]  # a multi-turn stage is judged by its multi-turn eval
        rewards = [(x["step"], x["reward"]) for x in m if "reward" in x]
        first = evals[0][key] if evals and evals[0]["step"] == 0 else before
        after = evals[-1][key] if evals else None
        r0, r1 = (rewards[0][1], sum(r for _, r in rewards[-5:]) / len(rewards[-5:])) if rewards else (None, None)
        rows.append((title, r0, r1, first, after))
        before = after if after is not None else before
        if rewards:
            curves.append((title, rewards))
    for i in range(len(rows) - 1):  # a stage without its own accuracy eval (SFT): the next stage's start
        if rows[i][4] is None:
            rows[i] = rows[i][:4] + (rows[i + 1][3],)
    fmt = lambda v: "  -  " if v is None else f"{v:5.3f}"  # noqa: E731
    lines = ["| stage | train reward first step | last 5 steps | eval accuracy before | after |",
             "| --- | --- | --- | --- | --- |"]
    lines += [f"| {t} | {fmt(a)} | {fmt(b)} | {fmt(c)} | {fmt(d)} |" for t, a, b, c, d in rows]
    (run / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    if curves:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [3, 2]})
        stages = [("start", rows[0][3])] + [(t, after) for t, _, _, _, after in rows]
        stages = [(t, a) for t, a in stages if a is not None]
        acc.plot(range(len(stages)), [a for _, a in stages], marker="o")
        acc.set_xticks(range(len(stages)), [t.replace("GRPO ", "GRPO\n") for t, _ in stages], fontsize=8)
        acc.set(ylabel="greedy eval accuracy", ylim=(-0.02, 1.02), title="after each stage")
        acc.grid(alpha=0.3)
        for title, pts in curves:
            ax.plot([s for s, _ in pts], [r for _, r in pts], marker=".", label=title)
        ax.set(xlabel="GRPO step", ylabel="mean reward", ylim=(-0.02, 1.02), title=f"{run.name}: reward")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run / "reward_curve.png", dpi=120)
        print(f"wrote {run / 'summary.md'} and {run / 'reward_curve.png'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/cpu-demo")
