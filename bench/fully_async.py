"""Samples trained per second: synchronous, --async-rollout and --fully-async, at the recipes' shape, against the
simulated continuous-batching engine of bench/partial_rollout.py (virtual time), on GPUs of its own.

    .venv/bin/python bench/fully_async.py [--train 0.5 1 2] [--staleness 2] [--over 1.5 2] [--seed 0] [--turns 3]

A step trains --prompts groups of --samples (the same in every mode) for --train x the synchronous rollout's own
seconds a step (measured first, at the same seed), then the new weights take --sync-s, during which the engine
generates nothing. The three sources, as train_grpo.Source runs them:
- synchronous: the rollout makes the step's groups, training waits for it, the engine waits for training and sync;
- --async-rollout: the next step's rollout runs while a step trains; the weight update waits for both;
- --fully-async: up to --over x --prompts groups are open or complete and not taken; a step takes the first
  --prompts complete ones (in the order they started) as soon as there are that many, and the engine goes on while
  it trains. At the update what generates is cut (each request's KV cache is lost: the next run prefills its whole
  context again, as an abort and a continued request do; --keep-kv: as SGLang's in_place pause would keep it) and
  parked groups whose oldest token is more than --staleness versions old are dropped and replaced.
Prints, per mode and training time, the steady state (steps after --warm): samples trained per second, the speed-up
over the synchronous and the one-step-off runs, the share of trained tokens older than the step's policy, the
groups dropped a step and the engine's idle share.
"""
import argparse
import heapq
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from partial_rollout import Episode, Sim, add_args, model  # noqa: E402


def new_groups(n, rng, a, serial):
    return [[Episode(serial + g, rng, a) for _ in range(a.samples)] for g in range(n)]


def trained(groups, step):
    """-> (samples, share of their tokens written by a version older than `step`)."""
    tokens = [ep.by_step for g in groups for ep in g]
    total = sum(sum(t.values()) for t in tokens)
    return sum(len(g) for g in groups), sum(n for t in tokens for v, n in t.items() if v < step) / max(total, 1)


def synchronous(a, weights, kv, train_s):
    """-> [(the time step k's update ended, samples, off-policy share, groups dropped)], the engine's busy seconds."""
    rng, sim, out = random.Random(a.seed), Sim(a, weights, kv), []
    for step in range(a.steps):
        groups = new_groups(a.prompts, rng, a, step * a.prompts)
        for ep in (ep for g in groups for ep in g):
            sim.submit(ep)
        sim.run(step, lambda: all(ep.done for g in groups for ep in g))
        sim.t += train_s + a.sync_s
        out.append((sim.t, *trained(groups, step), 0))
    return out, sim.busy


def one_step_off(a, weights, kv, train_s):
    """--async-rollout: step k trains the groups made while step k - 1 trained (the first: made before it)."""
    rng, sim, out = random.Random(a.seed), Sim(a, weights, kv), []

    def rollout(step):
        groups = new_groups(a.prompts, rng, a, step * a.prompts)
        for ep in (ep for g in groups for ep in g):
            sim.submit(ep)
        sim.run(step, lambda: all(ep.done for g in groups for ep in g))
        return groups
    batch = rollout(0)
    for step in range(a.steps):
        start = sim.t
        ahead = rollout(step) if step + 1 < a.steps else []  # with the weights before this step's update
        sim.t = max(sim.t, start + train_s) + a.sync_s
        out.append((sim.t, *trained(batch, step), 0))
        batch = ahead
    return out, sim.busy


def fully_async(a, weights, kv, train_s, over, staleness, keep_kv=False):
    """--fully-async: the engine never waits for training, only for the weight update."""
    rng, sim, out, groups, serial = random.Random(a.seed), Sim(a, weights, kv), [], [], 0
    cap = round(over * a.prompts)

    def top_up():
        nonlocal serial
        new = new_groups(cap - len(groups), rng, a, serial)
        serial += len(new)
        groups.extend(new)
        for ep in (ep for g in new for ep in g):
            sim.submit(ep)

    def complete():
        return [g for g in groups if all(ep.done for ep in g)]
    top_up()
    for step in range(a.steps):  # the engine holds the weights of `step` updates
        sim.run(step, lambda: len(complete()) >= a.prompts)  # the trainer waits for B complete groups
        start, batch = sim.t, complete()[:a.prompts]
        groups[:] = [g for g in groups if not any(g is b for b in batch)]
        top_up()
        sim.run(step, lambda: False, deadline=start + train_s)  # it goes on while the step trains
        sim.t = max(sim.t, start + train_s) + a.sync_s
        if not keep_kv:  # cut at the update: every request's KV is prefilled again when it goes on
            sim.abort()
            sim.queue, sim.running = sim.running + sim.queue, []
        stale = [g for g in groups if step + 1 - min((v for ep in g for v, n in ep.by_step.items() if n),
                                                     default=step + 1) > staleness]
        gone = {id(ep) for g in stale for ep in g}
        groups[:] = [g for g in groups if not any(g is s for s in stale)]
        sim.running, sim.queue = [e for e in sim.running if id(e) not in gone], [e for e in sim.queue if id(e) not in gone]
        sim.env = [x for x in sim.env if id(x[2]) not in gone]
        heapq.heapify(sim.env)
        top_up()
        out.append((sim.t, *trained(batch, step), len(stale)))
    return out, sim.busy


def steady(a, rows, busy):
    """-> (samples a second, off-policy share, groups dropped a step, engine idle share) after --warm steps."""
    rows, begin = rows[a.warm:], rows[a.warm - 1][0]
    secs = rows[-1][0] - begin
    return (sum(r[1] for r in rows) / secs, sum(r[2] for r in rows) / len(rows), sum(r[3] for r in rows) / len(rows),
            1 - busy / rows[-1][0])


def main():
    p = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--train", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="training s / synchronous rollout s")
    p.add_argument("--sync-s", type=float, default=2.0, help="seconds of a weight update (the engine generates nothing)")
    p.add_argument("--over", type=float, nargs="+", default=[1.5, 2.0], help="--fully-async: groups at once / B")
    p.add_argument("--staleness", type=int, default=2, help="--max-weight-staleness")
    p.add_argument("--keep-kv", action="store_true", help="a cut request keeps its KV (SGLang's in_place pause)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warm", type=int, default=4, help="steps before the steady state")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    weights, kv = model(a)
    rows, busy = synchronous(a, weights, kv, 0.0)
    rollout_s = (rows[-1][0] - rows[a.warm - 1][0]) / (a.steps - a.warm) - a.sync_s  # the rollout alone, a step
    print(f"{a.prompts} x {a.samples}, {a.turns} turns, turn lognormal(median {a.median:g}, sigma {a.sigma:g}), seed "
          f"{a.seed}: the synchronous rollout takes {rollout_s:.1f} s a step; weight update {a.sync_s:g} s; K = "
          f"{a.staleness}{', KV kept at the update' if a.keep_kv else ''}")
    for f in a.train:
        train_s = f * rollout_s
        runs = {"synchronous": synchronous(a, weights, kv, train_s), "async-rollout": one_step_off(a, weights, kv, train_s)}
        for over in a.over:
            runs[f"fully-async {over:g}x"] = fully_async(a, weights, kv, train_s, over, a.staleness, a.keep_kv)
        got = {name: steady(a, *r) for name, r in runs.items()}
        for name, (rate, off, dropped, idle) in got.items():
            print(f"train {f:g}x ({train_s:5.1f} s) {name:>17}: {rate:5.2f} samples/s, {rate / got['synchronous'][0]:.2f}x "
                  f"sync, {rate / got['async-rollout'][0]:.2f}x async-rollout; off-policy {off:.2f}, dropped "
                  f"{dropped:.2f} groups a step, engine idle {idle:.2f}", flush=True)


if __name__ == "__main__":
    main()
