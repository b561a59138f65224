"""Partial rollout at the recipes' shape, against a simulated continuous-batching engine (virtual time).

    .venv/bin/python bench/partial_rollout.py [--prompts 64] [--samples 8] [--turns 3] [--steps 12] [--over 1.25 1.5]

The engine (one SGLang server over --gpus GPUs, TP: run.sh's colocated default on a node of 8) decodes every
running request (at most --max-running: SGLang's --max-running-requests) a token a step, and a step takes
t0 + (weights + the running requests' KV cache) / (GPUs x HBM bandwidth): a memory-bound decode reads every
weight once a step and each request's whole KV cache, TP splitting both over the GPUs (the roofline; H100 SXM
HBM3: 3.35 TB/s, its datasheet), so a smaller batch decodes faster per request but not per token. Weight and
KV bytes come from the model's real config (Qwen3-VL-2B-Instruct, bf16). A request's new
tokens are prefilled first (2 x params FLOPs a token at --prefill-tflops); a continued request prefills its
whole context again (a weight update flushed SGLang's cache). Lengths: each turn lognormal(median --median,
sigma --sigma), an episode's response capped at --max-tokens; multi-turn: a turn but the last calls a tool
with probability --tool-p, the env then takes --env-ms and adds --obs-tokens.
Each step trains --prompts groups of --samples. Without partial rollout it starts them and waits for all.
With it (rollout.Rollout's policy with a target, which tests/test_rollout.py holds rollout.py to) it keeps --over x
--prompts groups generating, buffered ones first, stops once --prompts groups are complete (the first in
their order: buffered ones first), and keeps what the others wrote for the next step.
Prints each step's rollout seconds, samples trained, and share of trained tokens written in an earlier step;
then the steady state (the steps after --warm): seconds of rollout per trained sample and the speed-up.
"""
import argparse
import heapq
import itertools
import json
import math
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HBM = 3.35e12  # bytes/s, H100 SXM HBM3 (NVIDIA's datasheet)


class Episode:
    def __init__(self, group, rng, a):
        self.group, self.rng, self.a = group, rng, a
        self.turn, self.context, self.response = 0, a.prompt_tokens, 0
        self.left = self.draw()
        self.done, self.by_step, self.cached = False, {}, 0  # tokens written in each step; KV the server holds

    def draw(self):
        n = int(math.exp(math.log(self.a.median) + self.a.sigma * self.rng.gauss(0, 1)))
        return max(1, min(n, self.a.max_tokens - self.response))


class Sim:
    """One server's continuous batching in virtual seconds (self.t)."""

    def __init__(self, a, weights, kv):
        self.a, self.weights, self.kv, self.t, self.busy = a, weights, kv, 0.0, 0.0  # busy: seconds computing
        self.running, self.queue, self.env = [], [], []  # decoding; waiting to be admitted; (ready time, k, ep) heap
        self.order = itertools.count()  # k: ties in the heap go in push order (not by id(): memory layout)

    def submit(self, ep):
        self.queue.append(ep)

    def prefill(self, eps):
        tokens = sum(ep.context - ep.cached for ep in eps)
        took = tokens * 2 * self.a.params / (self.a.gpus * self.a.prefill_tflops * 1e12)
        self.t, self.busy = self.t + took, self.busy + took
        for ep in eps:
            ep.cached = ep.context

    def run(self, step, until, deadline=math.inf):
        """Decode until until() holds or the clock reaches `deadline`, at token granularity between events. -> episodes
        that ended (it returns early when nothing is left to do)."""
        a, ended = self.a, []
        while not until() and self.t < deadline:
            while self.env and self.env[0][0] <= self.t:
                self.submit(heapq.heappop(self.env)[2])
            room = a.max_running - len(self.running)
            if room > 0 and self.queue:
                new, self.queue = self.queue[:room], self.queue[room:]
                self.prefill(new)
                self.running += new
            if not self.running:
                self.t = min(self.env[0][0], deadline) if self.env else self.t  # idle until an env step ends
                if not self.env and not self.queue:
                    return ended
                continue
            b, ctx = len(self.running), sum(ep.context for ep in self.running)
            bw = a.gpus * HBM
            per = a.t0 + (self.weights + ctx * self.kv) / bw  # the first step's seconds
            n = min(ep.left for ep in self.running)
            for event in ([self.env[0][0]] if self.env else []) + [deadline]:  # stop at the next env step's end
                n = max(1, min(n, int(min(event - self.t, 1e9) / per) + 1))
            took = n * (a.t0 + self.weights / bw) + self.kv / bw * (n * ctx + b * n * (n - 1) / 2)
            self.t, self.busy = self.t + took, self.busy + took
            for ep in self.running:
                ep.left, ep.context, ep.response = ep.left - n, ep.context + n, ep.response + n
                ep.by_step[step] = ep.by_step.get(step, 0) + n
                ep.cached = ep.context
            for ep in [ep for ep in self.running if ep.left == 0]:
                self.running.remove(ep)
                ep.turn += 1
                more = ep.turn < a.turns and ep.response < a.max_tokens - a.obs_tokens and ep.rng.random() < a.tool_p
                if more:
                    ep.context += a.obs_tokens
                    ep.left = ep.draw()
                    heapq.heappush(self.env, (self.t + a.env_ms / 1000, next(self.order), ep))
                else:
                    ep.done = True
                    ended.append(ep)
        return ended

    def abort(self):
        """Every request stops where it is, keeping what it wrote; the next weight update flushes the KV cache."""
        for ep in self.running + self.queue + [e for _, _, e in self.env]:
            ep.cached = 0


def rollouts(a, over, weights, kv):
    """-> [(seconds, samples trained, off-policy token share, share of samples at the cap)] of a.steps steps."""
    rng, out, buffer, serial = random.Random(a.seed), [], [], 0
    for step in range(a.steps):
        sim = Sim(a, weights, kv)
        cap = a.prompts if over is None else round(over * a.prompts)
        groups = buffer + [[Episode(serial + g, rng, a) for _ in range(a.samples)] for g in range(cap - len(buffer))]
        serial += cap - len(buffer)
        for g in groups:
            for ep in g:
                if not ep.done:
                    sim.submit(ep)

        def complete():
            return [g for g in groups if all(ep.done for ep in g)]
        sim.run(step, lambda: len(complete()) >= a.prompts)
        sim.abort()
        done = complete()
        kept = [g for g in groups if g in done][:a.prompts]  # in their order: buffered groups first
        buffer = [g for g in groups if not any(g is k for k in kept)]
        tokens = [ep.by_step for g in kept for ep in g]
        total = sum(sum(t.values()) for t in tokens)
        old = sum(v for t in tokens for s, v in t.items() if s < step)
        capped = sum(ep.response + a.obs_tokens >= a.max_tokens for g in kept for ep in g)
        out.append((sim.t, sum(len(g) for g in kept), old / max(total, 1), capped / sum(len(g) for g in kept)))
    return out


def add_args(p):
    """The simulated engine's and the episodes' flags (bench/fully_async.py takes them too)."""
    p.add_argument("--config", default=str(ROOT.parent / "shared" / "real_models" / "Qwen3-VL-2B-Instruct" / "config.json"))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tool-p", type=float, default=0.7, help="a turn but the last calls a tool")
    p.add_argument("--median", type=float, default=300, help="median tokens of a turn")
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of a turn's tokens")
    p.add_argument("--max-tokens", type=int, default=4096, help="an episode's response cap")
    p.add_argument("--prompt-tokens", type=int, default=700, help="prompt with its diagram's image tokens")
    p.add_argument("--obs-tokens", type=int, default=200, help="a tool observation with its crop's image tokens")
    p.add_argument("--env-ms", type=float, default=30.0)
    p.add_argument("--gpus", type=int, default=8, help="the server's GPUs (TP)")
    p.add_argument("--max-running", type=int, default=512)
    p.add_argument("--t0", type=float, default=0.003, help="a decode step's fixed seconds (launch, sampling, scheduler)")
    p.add_argument("--prefill-tflops", type=float, default=400.0)
    return p


def model(a):
    """Sets a.params (the language model's); -> (weight bytes, KV bytes a token), bf16, from --config."""
    cfg = json.loads(Path(a.config).read_text())
    tc = cfg.get("text_config", cfg)
    h, layers, ffn, vocab = tc["hidden_size"], tc["num_hidden_layers"], tc["intermediate_size"], tc["vocab_size"]
    hd = tc.get("head_dim") or h // tc["num_attention_heads"]
    attn = h * hd * (tc["num_attention_heads"] * 2 + tc["num_key_value_heads"] * 2)
    a.params = layers * (attn + 3 * h * ffn) + vocab * h * (1 if tc.get("tie_word_embeddings", cfg.get("tie_word_embeddings")) else 2)
    weights, kv = 2 * a.params, 2 * layers * 2 * tc["num_key_value_heads"] * hd  # bf16 bytes; K and V a token
    return weights, kv


def main():
    p = add_args(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warm", type=int, default=3, help="steps before the steady state")
    p.add_argument("--over", type=float, nargs="+", default=[1.25, 1.5])
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    weights, kv = model(a)
    print(f"{Path(a.config).parent.name}: {a.params / 1e9:.2f} B language-model parameters, {kv / 1024:.0f} KiB of KV a token; "
          f"{a.prompts} x {a.samples}, {a.turns} turns, turn lognormal(median {a.median:g}, sigma {a.sigma:g}), cap {a.max_tokens}")
    step = lambda b, ctx: 1000 * (a.t0 + (weights + b * ctx * kv) / (a.gpus * HBM))  # noqa: E731
    print(f"a decode step on {a.gpus} GPUs: {step(1, 1000):.1f} ms at 1 request, {step(64, 1000):.1f} at 64, "
          f"{step(512, 1000):.1f} at 512 (1,000 tokens of context each)")
    base = None
    for over in [None] + a.over:
        rows = rollouts(a, over, weights, kv)
        steady = rows[a.warm:]
        secs = sum(r[0] for r in steady) / len(steady)
        per = sum(r[0] / r[1] for r in steady) / len(steady)
        base = base or per
        name = "without" if over is None else f"over-sampling {over:g}x"
        print(f"{name:>21}: rollout s per step {[round(r[0], 1) for r in rows]}")
        print(f"{'':>21}  samples trained {sorted({r[1] for r in rows})}, off-policy token share "
              f"{[round(r[2], 2) for r in rows]}")
        print(f"{'':>21}  steady state: {secs:.1f} s a step, {per * 1000:.1f} ms per trained sample, "
              f"{sum(r[2] for r in steady) / len(steady):.2f} off-policy, {sum(r[3] for r in steady) / len(steady):.3f} "
              f"of samples at the cap, speed-up {base / per:.2f}x")


if __name__ == "__main__":
    main()
