"""Time reward scoring: 4,096 responses of about 1 KB each, scored as the rollout scores them (each
episode in its own thread as it ends, as many at once as there are cores: rollout._Episodes).

    .venv/bin/python bench/reward_bench.py                  # math RM, threads = cores
    .venv/bin/python bench/reward_bench.py --rm-type geo3k --threads 8 --n 4096

Prints responses/s and total seconds in one thread and in --threads threads, and how many
verdicts differ between them (a difference means a call ran into its time limit).
Answers mix the geo3k forms the reward must judge: radicals, fractions, decimals, degrees,
`x = 13`, units, choice letters, wrong values.
"""
import argparse
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="scoring threads at once")
    ap.add_argument("--rm-type", default="math", choices=sorted(reward.REWARDS))
    args = ap.parse_args()
    print(vars(args), f"mean response {sum(map(len, make_batch(64)[0])) / 64:.0f} chars")
    responses, labels = make_batch(args.n)
    reward.init()  # its warm-up before the clock starts

    def fn(response, label):
        return reward.score(args.rm_type, response, {"answer": label})
    serial = timed("one thread", lambda: [fn(r, lab) for r, lab in zip(responses, labels)], args.n)
    with ThreadPoolExecutor(args.threads) as pool:
        threaded = timed(f"{args.threads} threads", lambda: list(pool.map(fn, responses, labels)), args.n)
    diff = [i for i, (a, b) in enumerate(zip(serial, threaded)) if a != b]
    for i in diff[:5]:
        print(f"  differs at {i}: {responses[i][-40:]!r} label {labels[i]!r}: {serial[i]} vs {threaded[i]}")
    print(f"{len(diff)} rewards differ between one thread and {args.threads}")


if __name__ == "__main__":
    main()
