"""report.py: did it learn? the summary of a run folder (run.sh's stages, or one train_grpo.py or sft.py run): seconds,
train reward (SFT: loss), every eval, its start's 95% band, chance, a verdict (SFT's: eval_loss); summary.md, a PNG.

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
         "crop+": {**CROP, "eval_accuracy": "single-turn, without the tool"},
         "run": {**CROP, "eval_accuracy": "single-turn accuracy", "eval_loss": "eval loss"}}  # a run's first: its verdict
STAGES = [("sft", "SFT", "sides"), ("grpo", "GRPO single-turn", "sides"), ("sft_crop", "SFT crop calls", "crop"),
          ("grpo_mt", "GRPO crop task", "crop+")]
TOOL_CURVES = {"tool_calls_image_zoom_in_tool": "crop calls / episode", "crop_hit_frac": "share whose crop hit the box"}


def read(path):
    """metrics.jsonl's rows; where crop calls were counted without a hit share, none hit (0.0)."""
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    for r, k in [(r, k) for r in rows for k in r if k.endswith("tool_calls_image_zoom_in_tool")]:
        r.setdefault(k.replace("tool_calls_image_zoom_in_tool", "crop_hit_frac"), 0.0)
    return rows


def eval_set(folder):
    """(n: the problems of its first eval_*.jsonl, chance: its eval data's synth.json (tools/synth.py) or None)."""
    files, cfg = sorted(folder.glob("eval_*.jsonl")), sorted(folder.glob("config_*.json"))[:1]
    meta = [Path(str(json.loads(c.read_text()).get("eval_prompt_data")), "synth.json") for c in cfg]
    return (len({json.loads(x)["index"] for x in files[0].read_text().splitlines()}) or None if files else None,
            json.loads(meta[0].read_text())["chance"] if meta and meta[0].is_file() else None)


def band(p, n, z=1.96):
    """The 95% Wilson score interval of a share p of n problems (binomial): (low, high)."""
    mid, half = (p + z * z / (2 * n)) / (1 + z * z / n), z / (1 + z * z / n) * (p * (1 - p) / n + z * z / (4 * n * n)) ** 0.5
    return mid - half, mid + half


def stage_rows(run):
    """[(title, seconds, first 5 steps' mean reward (SFT: loss), last 5's, {eval key: [label, before, after, [(step,
    value) of each eval]]}, eval_set)], [(title, reward curve, {tool curve: points})]. A stage without an eval on its set
    begins where the last on that set ended, ends where the next begins (base_eval: the random model, SFT's before)."""
    tsv = run / "stages.tsv"  # run.sh's stage\tseconds
    seconds = dict(x.split("\t") for x in tsv.read_text().splitlines()) if tsv.exists() else {}
    one = [(".", f"{run.name} ({kind})", "run") for kind in ("grpo", "sft") if (run / f"config_{kind}.json").exists()]
    rows, curves, last, prev = [], [], dict((read(run / "base_eval" / "metrics.jsonl") or [{}])[0]), "sides"
    for name, title, group in one[:1] if (run / "metrics.jsonl").exists() else STAGES:
        m = read(run / name / "metrics.jsonl")
        if not m:
            continue
        key = "reward" if any("reward" in x for x in m) else "loss"  # the curve: GRPO's reward, or SFT's loss
        curve = [(x["step"], x[key]) for x in m if key in x]
        last = last if group.rstrip("+") == prev.rstrip("+") else {}
        evals = {}
        for k, label in EVALS[group].items():
            seen = [(x["step"], x[k]) for x in m if k in x]
            if seen or group != "run":
                evals[k] = [label, seen[0][1] if seen and seen[0][0] == 0 else last.get(k), seen[-1][1] if seen else None, seen]
            if rows and k in rows[-1][4] and rows[-1][4][k][2] is None and seen and seen[0][0] == 0:
                rows[-1][4][k][2] = evals[k][1]  # a stage without this eval (SFT) ends where the next begins
        last, prev, ys = {k: a if a is not None else b for k, (_, b, a, _) in evals.items()}, group, [r for _, r in curve]
        rows.append((title, seconds.get(name), fmean(ys[:5]) if ys else None, fmean(ys[-5:]) if ys else None, evals,
                     eval_set(run / name)))
        if curve and (key == "reward" or group == "run"):  # with a multi-turn stage's tool curves; a run's own SFT loss
            curves.append((title, curve, {k: [(x["step"], x[k]) for x in m if k in x] for k in TOOL_CURVES}, key))
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
    lines = ["| stage | seconds | train reward (SFT: loss), mean of the first 5 steps -> the last 5 | greedy eval on its "
             "test set, before -> after |", "| --- | --- | --- | --- |"]
    lines += [f"| {t} | {s or '-'} | {fmt(a)} -> {fmt(b)} | " + ("; ".join(f"{e[0]} {fmt(e[1])} -> {fmt(e[2])}" for e in
                                                                         evals.values()) or "no eval") + " |" for t, s, a, b, evals, _ in rows]
    lines += [f"\nwhole run: {sum(map(int, seconds.values()))} s (" + ", ".join(f"{k} {v} s" for k, v in seconds.items())
              + ")"] if seconds else []
    lines += [f"\n{t}, per 10 steps: " + "; ".join(f"{TOOL_CURVES[k]} {per10(pts)}" for k, pts in tools.items() if pts)
              for t, _, tools, _ in curves if any(tools.values())]
    for t, _, _, _, evals, (n, chance) in rows:  # did it learn: its first eval above the 95% band of its start?
        own = [(k, *e) for k, e in evals.items() if e[3]]  # [(key, label, before, after, [(step, value)])]
        if own and own[0][0] == "eval_loss" and own[0][2] is not None:  # SFT's: lower than at its start?
            _, label, before, after, _ = own[0]
            lines.append(f"\n{t} {'learnt' if after < before else 'did not learn'}: {label} {before:.3f} -> {after:.3f}, "
                         f"{'below' if after < before else 'not below'} its start")
        elif own and n and own[0][2] is not None:
            k, label, before, after, _ = own[0]
            low, high = band(before, n)
            where = "above" if after > high else "below" if after < low else "within"
            odds = f"; chance {'unknown' if chance is None else f'{chance:.3f}'}" if k.endswith("accuracy") else ""
            lines.append(f"\n{t} {'learnt' if where == 'above' else 'did not learn'}: {label} {before:.3f} -> {after:.3f}, "
                         f"{where} the 95% band of its start ({low:.3f} to {high:.3f} for {n} problems{odds})")
        lines += [f"- {t}, {e[1]} at each greedy eval (step value): " + ", ".join(f"{s} {v:.3f}" for s, v in e[4]) for e in own]
    text = "\n".join(lines)
    print(text)
    (run / "summary.md").write_text(text + "\n")
    if curves:
        ax, acc = Figure(figsize=(11, 4)).subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})  # no pyplot: no GUI
        first, one = {}, (run / "metrics.jsonl").exists()  # each eval's first stage: its legend entry; one run: by step
        for i, (*_, evals, (n, chance)) in enumerate(rows):  # each stage on [i, i + 1]: its start, every eval, its end
            span = (0, max((s for e in evals.values() for s, _ in e[3]), default=0)) if one else (i, i + 1)
            for k, (label, before, after, seen) in evals.items():
                pts = [(s if one else i + s / max(seen[-1][0], 1), v) for s, v in seen]
                if before is not None and not (seen and seen[0][0] == 0):
                    pts.insert(0, (i, before))
                if after is not None and not seen:
                    pts.append((i + 1, after))
                colour = f"C{list(EVALS['run']).index(k)}"
                acc.plot(*zip(*pts), marker="o", color=colour, label=label if first.setdefault(k, i) == i else None)
                if n and before is not None and "tool_calls" not in k:  # the start's noise: above it, it learnt
                    acc.fill_between(span, *band(before, n), color=colour, alpha=0.1)
            if chance is not None:
                acc.hlines(chance, *span, colors="grey", linestyles="--")
        if not one:
            acc.set_xticks(range(len(rows) + 1), ["start"] + [t.replace(" ", "\n", 1) for t, *_ in rows], fontsize=7)
        acc.set(xlabel="step" if one else None, ylabel="eval", title="every eval; its start's 95% band; chance --")
        for title, pts, tools, _ in curves:
            line, = ax.plot(*zip(*pts), marker=".", label=title)
            for (k, got), style in zip(tools.items(), ("--", ":")):  # none in a single-turn stage: no line
                ax.plot(*zip(*got), ls=style, color=line.get_color(), label=f"{title}: {TOOL_CURVES[k]}")
        ax.set(xlabel="step", ylabel=curves[0][3], title=f"{run.name}: {curves[0][3]}")  # reward (tool curves), or SFT's loss
        for a in (ax, acc):
            a.grid(alpha=0.3)
            if a.lines:  # a run with no eval: none on the right
                a.legend(fontsize=8)
        ax.figure.savefig(run / "reward_curve.png", dpi=120, bbox_inches="tight")


if __name__ == "__main__":
    main()
