"""Time reward scoring: 4,096 responses of about 1 KB each, scored by reward.batch_rewards.

    .venv/bin/python bench/reward_bench.py                  # math RM, workers=2
    .venv/bin/python bench/reward_bench.py --rm-type geo3k --workers 2 --n 4096 --serial

Prints responses/s and total seconds for the first batch (includes starting the worker
processes) and for a second batch on the warm pool; --serial also times one process.
Answers mix the geo3k forms the reward must judge: radicals, fractions, decimals, degrees,
`x = 13`, units, choice letters, wrong values.
"""
import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import reward  # noqa: E402

# (label, answer as a model might write it)
FORMS = [
    ("80", "80^\\circ"), ("80", "80°"), ("13", "x = 13"), ("9", "9"), ("48", "48.0"),
    ("5 \\sqrt { 3 }", "5\\sqrt{3}"), ("5 \\sqrt { 3 }", "8.66"), ("10", "10 \\text{ cm}"),
    ("\\frac { 2 \\sqrt { 2 } } { 5 }", "\\dfrac{2\\sqrt{2}}{5}"), ("13.5", "\\frac{27}{2}"),
    ("120", "60"), ("22", "B"), ("16", "16.00"), ("\\frac { 2 \\sqrt { 2 } } { 5 }", "0.5657"),
]


def make_batch(n, seed=0):
    rng = random.Random(seed)
    words = "so the angle opposite the side is equal and by the theorem we get".split()
    responses, labels = [], []
    for _ in range(n):
        label, answer = rng.choice(FORMS)
        text = " ".join(rng.choice(words) for _ in range(220))[:1000]  # ~1 KB of reasoning
        responses.append(f"{text}\nAnswer: \\boxed{{{answer}}}")
        labels.append(label)
    return responses, labels


def timed(label, fn, n):
    t = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t
    print(f"{label:<34} {n / dt:8.0f} responses/s  {dt:7.2f} s total  mean reward {sum(out) / n:.3f}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096, help="responses per batch")
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--rm-type", default="math", choices=sorted(reward.REWARDS))
    ap.add_argument("--serial", action="store_true", help="also time a single process")
    args = ap.parse_args()
    print(vars(args), f"mean response {sum(map(len, make_batch(64)[0])) / 64:.0f} chars")
    responses, labels = make_batch(args.n)
    run = lambda: reward.batch_rewards(responses, labels, args.rm_type, workers=args.workers)  # noqa: E731
    cold = timed(f"workers={args.workers} first (spawns pool)", run, args.n)
    warm = timed(f"workers={args.workers} warm pool", run, args.n)
    runs = {"first": cold, "warm": warm}
    if args.serial:
        runs["serial"] = timed("serial (one process)", lambda: [reward.REWARDS[args.rm_type](r, l)
                                                                 for r, l in zip(responses, labels)], args.n)
    # a verdict must not depend on the run: differences mean a call hit its time limit
    for name, out in runs.items():
        diff = [i for i, (a, b) in enumerate(zip(out, warm)) if a != b]
        for i in diff[:5]:
            print(f"  {name} != warm at {i}: {responses[i][-40:]!r} label {labels[i]!r}: {out[i]} vs {warm[i]}")
        print(f"{name}: {len(diff)} rewards differ from the warm run")


if __name__ == "__main__":
    main()
