"""Rollouts: `Sample`, prompts and observations through the chat template, single/multi-turn
generation with exact token bookkeeping, group sampling and scoring.

    engine = sglang_engine.make_engine(args, hf_dir, run_dir)   # engines.LocalEngine / SGLangEngine
    samples = generate_group_samples(engine, processor, records, args)

Token-in/token-out: a sample's token list is built once, here (chat.py's prompt and observations,
the engine's ids); the engine is sent it each turn, the trainer reads it, nothing is re-tokenised.
Each turn checks that the engine saw exactly the tokens sent (SGLang re-expanding image tokens shows
as a prompt length mismatch), each sample that its placeholder runs match the images' grids. A sample failing a check is `failed` with its reason
and an all-zero loss mask; neither it nor an `aborted` one is trained on.
"""
import math
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

import chat
import env_geo3k
import flags
import reward



@dataclass
class Sample:
    """One response to one prompt: what crosses from the rollout to the trainer."""
    prompt_ids: list                 # chat-template prompt, image pads expanded
    response_ids: list = field(default_factory=list)       # model + observation tokens
    loss_mask: list = field(default_factory=list)          # 1 = the model wrote it
    rollout_logprobs: list = field(default_factory=list)   # engine logprob; 0.0 where mask 0
    images: list = field(default_factory=list)             # PIL, in order of their pads
    image_turns: list = field(default_factory=list)        # turn that brought each image
    label: str = ""
    reward: float = 0.0
    status: str = "completed"        # completed | truncated | aborted | failed
    fail_reason: str = None
    turns: int = 0
    tool_calls: int = 0
    group: int = 0                   # position of the prompt in this rollout's records
    index: int = 0                   # the prompt's index in the data
    response_text: str = ""          # the model's turns, decoded (observations excluded)
    metadata: dict = field(default_factory=dict)           # env step infos, format_ok, ...
    routed_experts: object = None    # R3: (len(tokens) - 1, layers, k) int16 array, the engine's experts
    versions: list = field(default_factory=list)           # policy version that wrote each response token; -1: observation

    @property
    def tokens(self):
        return self.prompt_ids + self.response_ids


@dataclass(frozen=True)
class RolloutConfig(flags.FromArgs):
    """What a rollout reads: the rollout flags of the same names (flags.add_rollout_args), and the
    env's oracle switch (evaluation turns it off: an oracle tool inflates multi-turn accuracy)."""
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 4
    rollout_max_response_len: int = 256
    rollout_temperature: float = 1.0
    rollout_top_p: float = 1.0
    rollout_top_k: int = -1
    max_turns: int = 1
    max_context_len: int = 8192
    dynamic_sampling: bool = False
    over_sampling_batch_size: int = None
    rm_type: str = "math"
    oracle: bool = True


def _fail(s, reason):
    s.status, s.fail_reason, s.reward = "failed", reason, 0.0
    s.loss_mask = [0] * len(s.response_ids)  # never trained on, even by a trainer that forgets


@dataclass
class Episode:
    """A sample in the making, with what continues it after an abort (--partial-rollout): its env and
    `chat` (multi-turn: the conversation as messages, which the chat template renders to frame each
    observation), where the turn being generated began, whether it is over."""
    sample: Sample
    env: object = None
    chat: dict = None
    turn_start: int = 0
    done: bool = False


def new_episode(processor, rec, args, prompt):
    """`prompt` = (messages, tools, prompt ids): made once per record and shared by its group."""
    images = list(rec["images"])
    messages, tools, ids = prompt
    s = Sample(prompt_ids=list(ids), images=images, image_turns=[0] * len(images), label=str(rec["answer"]),
               index=rec.get("index", 0), metadata={"steps": []})
    if args.max_turns == 1:
        return Episode(s)
    env = env_geo3k.build_env(rec, args)
    env.reset()
    messages = list(messages)  # each episode appends its own turns
    return Episode(s, env, {"messages": messages, "tools": tools, "opener": chat.assistant_opener(processor, messages, tools)})


def routed_rows(s):
    """Token positions whose experts the engine has reported: a turn's request asks from here on (an
    earlier turn's last token and the observation after it are routed by the next turn's prefill)."""
    return 0 if s.routed_experts is None else len(s.routed_experts)


def _finish_turn(ep, out, processor, args, stops, version=0, ours=False):
    """Append one engine answer to the episode's sample; at the end of a turn run the env and append its
    observation. -> still active? An abort we asked for (`ours`: --partial-rollout) keeps the turn open:
    its tokens so far are the sample's, and the next rollout continues it. An exception fails the sample."""
    try:
        return _turn(ep, out, processor, args, stops, version, ours)
    except Exception as e:  # noqa: BLE001 - one bad episode must not end the rollout
        return _fail(ep.sample, f"{type(e).__name__}: {e}")


def _turn(ep, out, processor, args, stops, version, ours):
    s, env, conv = ep.sample, ep.env, ep.chat
    ids, lps = list(out["ids"]), list(out["logprobs"])
    if out.get("error"):
        return _fail(s, out["error"])
    if out.get("prompt_tokens") not in (None, len(s.tokens)):
        return _fail(s, f"engine saw {out['prompt_tokens']} prompt tokens, was sent {len(s.tokens)} "
                        "(image tokens expanded twice?)")
    if len(lps) != len(ids) or not all(math.isfinite(x) and x <= 1e-6 for x in lps):
        return _fail(s, f"engine returned {len(ids)} ids with {len(lps)} logprobs (or non-finite ones)")
    routes = out.get("routed_experts")  # R3: the positions from routed_rows(s) to the last but one
    if routes is not None:
        if len(routes) != len(s.tokens) + len(ids) - 1 - routed_rows(s):
            return _fail(s, f"engine returned routes of {len(routes)} tokens, want "
                            f"{len(s.tokens) + len(ids) - 1 - routed_rows(s)}")
        s.routed_experts = routes if s.routed_experts is None else np.concatenate([s.routed_experts, routes])
    s.response_ids += ids
    s.loss_mask += [1] * len(ids)
    s.rollout_logprobs += lps
    s.versions += [version] * len(ids)
    if out["finish"] == "abort":  # ours: the turn goes on next step; else the server cut it: never trained on
        if not ours:
            s.status, s.loss_mask = "aborted", [0] * len(s.response_ids)
        return ours
    turn = s.response_ids[ep.turn_start:]
    s.turns += 1
    text = processor.tokenizer.decode([t for t in turn if t not in stops], skip_special_tokens=False)
    s.response_text += ("\n" if s.turns > 1 else "") + text
    if out["finish"] == "length":
        s.status = "truncated"
        return False
    if env is None:  # single-turn
        return False
    obs, done, info = env.step(text)
    s.metadata["steps"].append(dict(info, observation=obs["text"]))
    s.tool_calls += int(bool(info.get("ran")))  # calls that ran, not every <tool_call> tag
    if done:
        return False
    im_end = processor.tokenizer.convert_tokens_to_ids(chat.IM_END)
    close = [] if turn and turn[-1] == im_end else [im_end]  # stopped on another stop token
    # The model's text continues the generation prompt's opener (Qwen3.5's <think> block), so the
    # assistant message is opener + text: the template renders it as the tokens the model saw and
    # wrote (for canonically tokenised text), and a thinking template finds its </think> in it.
    conv["messages"].append({"role": "assistant", "content": conv["opener"] + text})
    message = env.format_observation(obs)
    obs_ids = close + chat.encode_observation(processor, conv["messages"], message, obs["images"], conv["tools"])
    conv["messages"].append(message)
    if (len(s.response_ids) + len(obs_ids) >= args.rollout_max_response_len
            or len(s.tokens) + len(obs_ids) >= args.max_context_len):
        s.status = "truncated"
        return False
    s.response_ids += obs_ids
    s.loss_mask += [0] * len(obs_ids)
    s.rollout_logprobs += [0.0] * len(obs_ids)
    s.versions += [-1] * len(obs_ids)
    s.images += list(obs["images"])
    s.image_turns += [s.turns] * len(obs["images"])
    ep.turn_start = len(s.response_ids)
    return True


ABORTED = {"ids": [], "logprobs": [], "finish": "abort"}  # the answer to a request never sent: the rollout stopped


@dataclass
class Partial:
    """--partial-rollout's buffer (rank 0): the groups a rollout stopped before they were complete, each
    (record, prompt, [Episode]), which the next continues first; and how many records that rollout drew.
    At most cap - rollout_batch_size groups: a rollout starts no more than cap, and ends once
    rollout_batch_size are complete. A buffered group goes first, so its samples end within as many
    steps as their --rollout-max-response-len takes; none is dropped."""
    groups: list = field(default_factory=list)
    drawn: int = 0

    @staticmethod
    def cap(args):
        """Groups generating at once: --over-sampling-batch-size, at least --rollout-batch-size."""
        return max(args.over_sampling_batch_size or 0, args.rollout_batch_size)


class _Rounds:
    """A batch engine (Engine.concurrent False: the local engine, the tests' scripted ones) fed by
    episodes that each ask on their own: a batch goes once every live episode waits, in episode
    order. These are a lockstep rollout's rounds, so the samples are the same as a serial loop's. Once
    the rollout stops (abort), a round is answered ABORTED: it stops between rounds, and so the same way
    every time."""

    def __init__(self, engine):
        self.engine, self.cond, self.live, self.waiting, self.answers = engine, threading.Condition(), 0, {}, {}
        self.broken, self.aborted = None, False  # the error that ended the rollout: no round will come

    def join(self, n):
        with self.cond:
            self.live += n

    def leave(self):
        with self.cond:
            self.live -= 1
            batch = self._take()
        self._run(batch)

    def generate(self, key, item, sampling):
        with self.cond:
            self.waiting[key] = (item, sampling)
            batch = self._take()
        self._run(batch)
        with self.cond:
            while key not in self.answers and self.broken is None:
                self.cond.wait()
            out = self.answers.pop(key, self.broken)
        if isinstance(out, BaseException):
            raise out
        return out

    def abort(self):
        self.aborted = True

    def break_(self, error):
        """Episodes waiting for a round that cannot come raise `error`."""
        with self.cond:
            self.broken = error
            self.cond.notify_all()

    def _take(self):  # under the lock: the whole round once every live episode waits
        if not self.waiting or len(self.waiting) < self.live:
            return []
        batch, self.waiting = sorted(self.waiting.items()), {}
        return batch

    def _run(self, batch):
        if not batch:
            return
        items = [item for _, (item, _) in batch]
        sampling = dict(batch[0][1][1], max_new_tokens=max(it["max_new_tokens"] for it in items))
        try:
            outs = [ABORTED] * len(batch) if self.aborted else self.engine.generate(items, sampling)
        except BaseException as e:  # noqa: BLE001 - every waiting episode raises it
            outs = [e] * len(batch)
        with self.cond:
            self.answers.update(zip([k for k, _ in batch], outs))
            self.cond.notify_all()


class _Pipeline:
    """Each episode on its own thread: a turn goes to the engine once its env step is done; CPU work in at most
    as many threads as cores. SGLang (Engine.concurrent) takes requests as they come, a batch engine gets
    _Rounds. Up to `cap` groups run; it ends once `target` are kept (--partial-rollout: the rest parked)."""

    def __init__(self, engine, processor, args, reward_fn, target, dynamic=False, cap=None, version=0):
        self.engine, self.processor, self.args, self.dynamic, self.target = engine, processor, args, dynamic, target
        self.reward_fn, self.version, self.cap = reward_fn, version, cap
        self.rounds, self.records, self.next = None if getattr(engine, "concurrent", False) else _Rounds(engine), [], 0
        self.cpu, self.lock, self.done = threading.Semaphore(len(os.sched_getaffinity(0))), threading.Lock(), threading.Event()
        self.stops = processor.tokenizer.convert_tokens_to_ids([chat.IM_END, chat.ENDOFTEXT])
        self.sampling = dict(temperature=args.rollout_temperature, stop_token_ids=self.stops,
                             top_p=args.rollout_top_p, top_k=args.rollout_top_k)
        size = (cap or target) * (args.n_samples_per_prompt + 1)  # a thread an episode (a round waits for all)
        self.pool = ThreadPoolExecutor(size if self.rounds else min(size, 1024), thread_name_prefix="episode")
        self.groups, self.left, self.kept, self.dropped, self.running, self.errors, self.calls = {}, {}, [], set(), 0, [], []
        self.stopping, self.aborted, self.t0 = False, 0, time.perf_counter()  # partial: enough kept; requests cut

    def run(self, records, buffered=()):
        """-> (the kept groups' samples, the groups still open when it stopped: [(record, prompt, episodes)]).
        `buffered`: such groups of an earlier rollout, continued first (their samples keep their tokens)."""
        self.records, self.bar = records, tqdm(total=0, desc="rollout", file=sys.stderr, mininterval=1.0, leave=False)
        with self.lock:
            for rec, prompt, eps in buffered:
                self._open(rec, prompt, eps)
            while len(self.groups) < (self.cap or self.target) and self.next < len(records):
                self._start_group()
            if not self.running:
                self.done.set()
        while not self.done.wait(2.0 if self.stopping else 0.05):  # the abort goes from here, not under the lock:
            if self.stopping:  # within 0.05 s of the stop, then every 2 s for a request that reached a server after
                getattr(self.engine, "abort", lambda: None)()
        self.pool.shutdown(wait=False)
        self.bar.close()
        if self.errors:
            raise self.errors[0]
        stats = dict(wall_s=time.perf_counter() - self.t0, engine_busy_s=_busy(self.calls), aborted=self.aborted,
                     drawn=self.next, dropped=len(self.dropped) if self.dynamic else None)
        # the first complete groups (buffered ones first); the others stay for the next rollout
        out = [(key, ep.sample) for key in sorted(self.kept)[:self.target] for ep in self.groups.pop(key)[2]]
        for key, s in out:
            s.group, s.metadata["rollout"] = key, stats
        return [s for _, s in out], [g for k, g in sorted(self.groups.items()) if k not in self.dropped]

    def _open(self, rec, prompt, eps):  # under self.lock: a group's unfinished episodes go to work
        key = len(self.groups)
        self.groups[key] = (rec, prompt, eps)
        todo = [j for j, ep in enumerate(eps) if not ep.done]
        self.running, self.left[key] = self.running + len(todo), len(todo)
        self.bar.total += len(eps)
        self.bar.update(len(eps) - len(todo))
        if self.rounds:
            self.rounds.join(len(todo))  # before any round that must wait for them can go
        for j in todo:
            self.pool.submit(self._episode, key, j, eps[j])
        if not todo:
            self._complete(key)

    def _start_group(self):  # under self.lock: a new record's group (its prompt encoded on a worker thread)
        pos, self.next = self.next, self.next + 1
        n, key = self.args.n_samples_per_prompt, len(self.groups)
        self.groups[key] = (self.records[pos], None, [None] * n)
        self.running, self.left[key] = self.running + n, n
        self.bar.total += n
        if self.rounds:
            self.rounds.join(n)
        self.pool.submit(self._group, key)

    def _group(self, key):
        rec = self.groups[key][0]
        try:
            with self.cpu:  # the chat template and the processor once per prompt, not per sample
                prompt = chat.prompt(self.processor, rec, self.args.max_turns > 1)
                eps = [new_episode(self.processor, rec, self.args, prompt) for _ in range(self.args.n_samples_per_prompt)]
            with self.lock:
                self.groups[key] = (rec, prompt, eps)
            for j, ep in enumerate(eps):
                self.pool.submit(self._episode, key, j, ep)
        except BaseException as e:  # noqa: BLE001 - surfaced by run()
            self._stop(e)

    def _episode(self, key, j, ep):
        s, args, engine_s, own = ep.sample, self.args, 0.0, 0.0
        try:
            while not ep.done:
                room = min(args.rollout_max_response_len - len(s.response_ids), args.max_context_len - len(s.tokens))
                if room <= 0:
                    s.status = "truncated"
                    break
                if self.stopping:
                    return self._finished(None)  # --partial-rollout: it waits in its group for the next rollout
                t = time.perf_counter()
                item = {"input_ids": s.tokens, "images": s.images, "max_new_tokens": room,
                        "routed_experts_start": routed_rows(s)}
                out = (self.rounds.generate((key, j), item, self.sampling) if self.rounds
                       else self.engine.generate([item], dict(self.sampling, max_new_tokens=room))[0])
                call = (t, time.perf_counter())
                self.calls.append(call)  # list.append is atomic: no lock
                engine_s += call[1] - t
                with self.cpu:
                    t = time.perf_counter()
                    ours = self.stopping and out.get("finish") == "abort" and not out.get("error")
                    self.aborted += ours and out is not ABORTED  # requests the abort cut (not those never sent)
                    ep.done = not _finish_turn(ep, out, self.processor, args, self.stops, self.version, ours)
                    own += time.perf_counter() - t
            with self.cpu:
                t = time.perf_counter()
                _close(ep, self.groups[key][0], self.processor, args, self.reward_fn)
                s.metadata.update(engine_s=s.metadata.get("engine_s", 0.0) + engine_s,
                                  own_s=s.metadata.get("own_s", 0.0) + own + time.perf_counter() - t,
                                  end_s=time.perf_counter() - self.t0)
            self._finished(key)
        except BaseException as e:  # noqa: BLE001 - the engine gave up (a dead server): run() raises it
            self._stop(e)

    def _finished(self, key):  # an episode of group `key` ended (None: parked, not ended)
        with self.lock:
            self.running -= 1
            if key is not None:
                self.left[key] -= 1
                self.bar.update(1)
                if not self.left[key]:
                    self._complete(key)
            if not self.running:
                self.done.set()
        if self.rounds:
            self.rounds.leave()

    def _complete(self, key):  # under self.lock: a group whose every episode is done
        eps = self.groups[key][2]
        if not self.dynamic or len({ep.sample.reward for ep in eps}) > 1:
            self.kept.append(key)
        else:
            self.dropped.add(key)
            still_open = len(self.groups) - len(self.kept) - len(self.dropped)
            if len(self.kept) + still_open < (self.cap or self.target) and self.next < len(self.records):
                self._start_group()  # the moment a group is known all-equal, another is drawn
        if self.cap and len(self.kept) >= self.target and not self.stopping:
            self.stopping = True  # --partial-rollout: enough; cut what still generates
            if self.rounds:
                self.rounds.abort()  # the engine's requests: run() aborts them

    def _stop(self, e):
        with self.lock:
            self.errors.append(e)
            self.done.set()
        if self.rounds:
            self.rounds.break_(e)


def run_episodes(engine, processor, records, args, reward_fn=False):
    """n_samples_per_prompt episodes per record (group = record position), each on its own
    (_Pipeline); scored when reward_fn is None (--rm-type's) or a function."""
    return _Pipeline(engine, processor, args, reward_fn, len(records)).run(records)[0]


def _busy(calls):
    """Seconds the engine had a request: the union of the requests' (start, end)."""
    busy, end = 0.0, 0.0
    for a, b in sorted(calls):
        busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
    return busy


def _close(ep, rec, processor, args, reward_fn):
    """An ended episode of `rec`: its env closed, its image placeholders checked, its reward (reward_fn False: none)."""
    ep.done, s = True, ep.sample
    if ep.env is not None:
        ep.env.close()
    reason = None if s.status == "failed" else chat.check_images(processor, s.tokens, s.images)
    if reason:
        _fail(s, reason)
    if reward_fn is not False and s.status != "failed":  # reward.score under --rm-type, or reward_fn(response, rec)
        s.reward = float(reward_fn(s.response_text, rec) if reward_fn else reward.score(args.rm_type, s.response_text, rec))
    s.metadata["format_ok"] = bool(reward.format_ok(s.response_text))


def generate_group_samples(engine, processor, records, args, reward_fn=None, partial=None, version=0):
    """records x n_samples_per_prompt scored samples (group = its place in this rollout). With
    args.dynamic_sampling, a group whose rewards are all equal is dropped and another record started as
    soon as that is known, until rollout_batch_size groups are kept (the caller passes more records than
    that: the over-sample). `partial` (--partial-rollout: a Partial): its buffered groups go first, up to
    args.over_sampling_batch_size groups generate at once, and once rollout_batch_size are kept the rest
    are aborted into it (at most over-sampling - batch groups). `version`: the engine's policy version,
    kept with each token it writes (Sample.versions). The rollout's own numbers: samples' metadata["rollout"]."""
    target = (args.rollout_batch_size or len(records)) if partial or args.dynamic_sampling else len(records)
    pipe = _Pipeline(engine, processor, args, reward_fn, target, args.dynamic_sampling,
                     partial and Partial.cap(args), version)
    out, left = pipe.run(records, partial.groups if partial else ())
    if partial:
        partial.groups, partial.drawn = left, pipe.next
    return out


def rollout_metrics(samples):
    """Means over samples; reward and accuracy over the ones not failed; multi-turn, the env's tool metrics."""
    n = max(len(samples), 1)
    ok = [s for s in samples if s.status != "failed"] or [Sample(prompt_ids=[])]
    m = {"reward": sum(s.reward for s in ok) / len(ok),
         "accuracy": sum(s.reward > 0 for s in ok) / len(ok),
         "response_len": sum(sum(s.loss_mask) for s in ok) / len(ok),
         "truncated_frac": sum(s.status == "truncated" for s in samples) / n,
         "aborted_frac": sum(s.status == "aborted" for s in samples) / n,
         "failed_frac": sum(s.status == "failed" for s in samples) / n,
         "turns": sum(s.turns for s in samples) / n,
         "tool_calls": sum(s.tool_calls for s in samples) / n,
         "format_ok_frac": sum(bool(s.metadata.get("format_ok")) for s in samples) / n,
         "samples": len(samples)}
    m.update(env_geo3k.tool_metrics([s.metadata.get("steps", []) for s in samples],  # multi-turn: tool use
                                    [None if s.status == "failed" else s.reward for s in samples]))
    if samples and "rollout" in samples[0].metadata:  # where the rollout's time went, what it cut and dropped
        ends, stats = [s.metadata["end_s"] for s in samples], samples[0].metadata["rollout"]
        if stats["dropped"] is not None:  # --dynamic-sampling: the share of complete groups kept
            m["ds_keep_frac"] = len({s.group for s in samples}) / (len({s.group for s in samples}) + stats["dropped"])
        m.update({f"rollout_{k}": v for k, v in stats.items() if k.endswith("_s") or k == "aborted"},
                 rollout_critical_path_s=max(s.metadata["engine_s"] for s in samples),
                 rollout_own_s_per_sample=sum(s.metadata["own_s"] for s in samples) / n,
                 rollout_tail_s=max(ends) - statistics.median(ends))
    return m
