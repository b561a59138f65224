"""Rollouts: the rollout's settings (add_args), `Sample`, prompts and observations through the chat template,
single/multi-turn generation with exact token bookkeeping (token in, token out: docs/rollout.md), group sampling, scores.

    samples = generate_group_samples(engine, processor, records, settings(args))  # engine: sglang_engine.make_engine

A sample failing a check is `failed` with its reason and an all-zero loss mask; neither it nor an `aborted` one is
trained on."""
import argparse
import math
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

import chat
import flags as F
import reward
import task


@dataclass
class Sample:
    """One response to one prompt: what crosses from the rollout to the trainer."""
    prompt_ids: list                 # chat-template prompt, image pads expanded
    response_ids: list = field(default_factory=list)       # model + observation tokens
    loss_mask: list = field(default_factory=list)          # 1 = the model wrote it
    rollout_logprobs: list = field(default_factory=list)   # engine logprob; 0.0 where mask 0
    images: list = field(default_factory=list)             # PIL, in order of their pads
    label: str = ""
    tools: list = field(default_factory=list)              # the tools its row offers (multi-turn): rewards read it
    reward: float = 0.0              # reward.rewarded's: correctness, plus any SHAPING term
    correct: bool = False            # --rm-type's judge: what accuracy, pass@K and --dynamic-sampling read
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


def add_args(p, chosen=None):
    """The rollout's flags, with the own flags of each SHAPING term, the env's tools and the filter (`chosen`: the env
    module and the Filter, task.chosen's; default env_geo3k's and nonzero_std): where the rollout's settings come from."""
    g = p.add_argument_group("rollout").add_argument
    g("--rollout-batch-size", type=F.POSITIVE, default=8, help="prompts per rollout")
    g("--n-samples-per-prompt", type=F.POSITIVE, default=4, help="responses per prompt (GRPO group)")
    g("--rollout-max-response-len", type=F.POSITIVE, default=256, help="tokens of a response, tool observations included")
    g("--rollout-temperature", type=F.at_least(0.0), default=1.0, help="0 = greedy")
    g("--rollout-top-p", type=F.at_least(0.0, 1.0, above=True), default=1.0, help="nucleus sampling, in (0, 1]")
    g("--rollout-top-k", type=F.top_k, default=-1, help="-1 = off")
    g("--max-turns", type=F.POSITIVE, default=1, help="1 = single-turn; >1 drives the env (--rollout-interaction-env-path)")
    g("--n-samples-per-eval-prompt", type=F.POSITIVE, default=1, help="K > 1: evaluations report pass@K too (slime's)")
    g("--max-context-len", type=F.at_least(2), default=8192, help="prompt + response token cap")
    g("--dynamic-sampling", action="store_true", help="drop the groups the filter refuses (default: all right or all "
      "wrong, DAPO's); draw more prompts")
    g(task.FILTER, default=None, help="the dynamic-sampling filter: a task.FILTERS name or your module.function "
      "(samples of a group, args) -> keep? (slime's); turns --dynamic-sampling on (default: nonzero_std)")
    g("--partial-rollout", action="store_true", help="abort the rest at B complete groups; continue them next step")
    g("--over-sampling-batch-size", type=F.POSITIVE, default=None, help="groups generating at once (default: the batch)")
    g("--mask-offpolicy-in-partial-rollout", action="store_true", help="no loss on tokens before a sample's last abort")
    g("--rm-type", default="math", choices=list(reward.REWARDS), help="the correctness judge (reward.REWARDS)")
    g(task.JUDGE, default=None, help="your own judge, module.function (response, record) -> float | bool | None, "
      "in place of --rm-type's (slime's)")
    g("--rm-timeout", type=F.at_least(0.0, above=True), default=None, help="seconds of CPU and of wall time a judge or "
      f"shaping term has for a sample (default: {reward.CPU_LIMIT_S} CPU, {reward.WALL_LIMIT_S} wall); past it: 0.0, <name>_timeouts")
    env, keep = chosen or (task.env(None), task.group_filter(None))
    for name, kw in {**F.own_flags(reward.SHAPING), **task.flags(env), **keep.flags}.items():
        g(name, **kw)
    return p


def settings(args, evaluation=False, **changes):
    """What a rollout reads: add_args' flags, --prompt-instruction, the env module's path, hf_checkpoint and the view's
    bounds (the env's grounding frame, its zoom's view), `oracle`
    (calc_score checks answers), `shaping` (SHAPING joins), then `changes`. Evaluation's: greedy, no oracle, shaping or
    dynamic sampling."""
    parser = add_args(argparse.ArgumentParser(), (task.env(args), task.group_filter(args)))
    own = {k: getattr(args, k) for k in [a.dest for a in parser._actions if a.dest != "help"] + [
        "prompt_instruction", "hf_checkpoint", "rollout_interaction_env_path", "min_pixels", "max_pixels"]}
    differ = dict(rollout_temperature=0.0, dynamic_sampling=False) if evaluation else {}
    return argparse.Namespace(**{**own, **differ, "oracle": not evaluation, "shaping": not evaluation, **changes})


def _fail(s, reason):
    s.status, s.fail_reason, s.reward, s.loss_mask = "failed", reason, 0.0, [0] * len(s.response_ids)  # never trained


@dataclass
class Episode:
    """A sample in the making and what continues it after an abort (--partial-rollout): its env, `chat` (multi-turn: the
    messages the chat template renders to frame each observation), where its current turn began, whether it is over."""
    sample: Sample
    env: object = None
    chat: dict = None
    turn_start: int = 0
    done: bool = False


def new_episode(processor, rec, args, prompt):
    """`prompt` = (messages, tools, prompt ids): made once per record and shared by its group."""
    messages, tools, ids = prompt
    s = Sample(prompt_ids=list(ids), images=list(rec["images"]), label=str(rec["answer"]), index=rec.get("index", 0),
               metadata={"steps": []})
    if args.max_turns == 1:
        return Episode(s)
    env, messages = task.env(args).build_env(rec, args), list(messages)  # each episode appends its own turns
    s.tools = task.tools(task.env(args), rec)  # the row's tools as its env offers them, for rewards to read
    return Episode(s, env, {"messages": messages, "tools": tools, "opener": chat.assistant_opener(processor, messages, tools)})


def routed_rows(s):
    """Token positions whose experts the engine has reported: a turn's request asks from here on (an
    earlier turn's last token and the observation after it are routed by the next turn's prefill)."""
    return 0 if s.routed_experts is None else len(s.routed_experts)


def _finish_turn(ep, out, processor, args, stops, version=0, ours=False):
    """Append one engine answer to the episode's sample; at the end of a turn run the env and append its
    observation. -> still active? An abort we asked for (`ours`: the run paused) keeps the turn open:
    its tokens so far are the sample's, and the next run continues it. An exception fails the sample."""
    s, env, conv = ep.sample, ep.env, ep.chat
    try:
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
        if out["finish"] == "length" or env is None:  # cut at the length cap, or single-turn: the episode ends
            s.status = "truncated" if out["finish"] == "length" else s.status
            return False
        obs, done, info = env.step(text)
        s.metadata["steps"].append(dict(info, observation=obs["text"]))
        s.tool_calls += int(bool(info.get("ran")))  # calls that ran, not every <tool_call> tag
        if done:
            return False
        close = [] if turn and turn[-1] == stops[0] else stops[:1]  # stops[0]: <|im_end|>; stopped on another stop token
        # The model's text continues the generation prompt's opener (Qwen3.5's <think>), so the assistant message is
        # opener + text: rendered as the tokens the model saw and wrote; a thinking template finds its </think> in it.
        conv["messages"].append({"role": "assistant", "content": conv["opener"] + text})
        message = env.format_observation(obs)
        obs_ids = close + chat.encode_observation(processor, conv["messages"], message, obs["images"], conv["tools"])
        conv["messages"].append(message)
        # the response cap counts observations too; the context cap, prompt and all
        if len(s.tokens) + len(obs_ids) >= min(args.max_context_len, len(s.prompt_ids) + args.rollout_max_response_len):
            s.status = "truncated"
            return False
        s.response_ids += obs_ids
        s.loss_mask += [0] * len(obs_ids)
        s.rollout_logprobs += [0.0] * len(obs_ids)
        s.versions += [-1] * len(obs_ids)
        s.images += list(obs["images"])
        ep.turn_start = len(s.response_ids)
        return True
    except Exception as e:  # noqa: BLE001 - one bad episode must not end the rollout
        return _fail(s, f"{type(e).__name__}: {e}")


ABORTED = {"ids": [], "logprobs": [], "finish": "abort"}  # the answer to a request never sent: the rollout stopped


class _Rounds:
    """A batch engine (Engine.concurrent False: the local one, the tests') fed by episodes asking on their own: a batch
    goes once every live episode waits, in episode order (a lockstep rollout's rounds); once the run stops, ABORTED."""

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
            self.cond.wait_for(lambda: key in self.answers or self.broken is not None)
            out = self.answers.pop(key, self.broken)
        if isinstance(out, BaseException):
            raise out
        return out

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


class _Episodes:
    """Each episode on its own thread: a turn goes to the engine once its env step is done; CPU work in at most as many
    threads as cores. SGLang (Engine.concurrent) takes requests as they come, a batch engine gets _Rounds."""

    def __init__(self, engine, processor, args):
        self.engine, self.processor, self.args = engine, processor, args
        self.cpu, self.cond = threading.Semaphore(len(os.sched_getaffinity(0))), threading.Condition()
        self.stops = processor.tokenizer.convert_tokens_to_ids([chat.IM_END, chat.ENDOFTEXT])
        self.sampling = dict(temperature=args.rollout_temperature, stop_token_ids=self.stops,
                             top_p=args.rollout_top_p, top_k=args.rollout_top_k)
        self.running, self.errors, self.calls = 0, [], []  # episodes on a thread; calls: (start, end) of each request

    def _open(self, rec, prompt, eps):  # under the lock: a group's unfinished episodes go to work (prompt None: new)
        key = len(self.left)  # the run's groups so far
        self.groups[key] = (rec, prompt, eps)
        todo = [j for j, ep in enumerate(eps) if ep is None or not ep.done]
        self.running, self.left[key] = self.running + len(todo), len(todo)
        self.bar.total += len(eps)
        self.bar.update(len(eps) - len(todo))
        if self.rounds:
            self.rounds.join(len(todo))  # before any round that must wait for them can go
        if prompt is None:
            self.pool.submit(self._group, key)
        for j in todo if prompt is not None else ():
            self.pool.submit(self._episode, key, j, eps[j])
        if not todo:
            self._complete(key)

    def _group(self, key):
        rec = self.groups[key][0]
        try:
            with self.cpu:  # the chat template and the processor once per prompt, not per sample
                prompt = chat.prompt(self.processor, rec, task.env(self.args) if self.args.max_turns > 1 else None,
                                     self.args.prompt_instruction)
                eps = [new_episode(self.processor, rec, self.args, prompt) for _ in range(self.args.n_samples_per_prompt)]
            with self.cond:
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
                    return self._finished(None)  # parked: the next run goes on with it
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
                _close(ep, self.groups[key][0], self.processor, args)
                s.metadata.update(engine_s=s.metadata.get("engine_s", 0.0) + engine_s,
                                  own_s=s.metadata.get("own_s", 0.0) + own + time.perf_counter() - t,
                                  end_s=time.perf_counter() - self.t0)
            self._finished(key)
        except BaseException as e:  # noqa: BLE001 - the engine gave up (a dead server): run() raises it
            self._stop(e)

    def _finished(self, key):  # an episode of group `key` ended (None: parked, not ended)
        with self.cond:
            self.running -= 1
            if key is not None:
                self.left[key] -= 1
                self.bar.update(1)
                if not self.left[key]:
                    self._complete(key)
            if not self.running:
                self.ended = time.perf_counter()
            self.cond.notify_all()
        if self.rounds:
            self.rounds.leave()

    def _stop(self, e):
        with self.cond:
            self.errors.append(e)
            self.cond.notify_all()
        if self.rounds:
            self.rounds.break_(e)


class Rollout(_Episodes):
    """Runs of episodes, each from resume() at a policy version (kept with each token) to pause(), which parks what
    still generates in `groups` ({key: (record, prompt, episodes)}) for the next run; take(n): the first n kept. A
    `target` stops a run once that many are kept; `cap`, `max_stale`, `drawn`: docs/rollout.md."""

    def __init__(self, engine, processor, args, target=None, cap=None, max_stale=None):
        super().__init__(engine, processor, args)  # args: settings(...); its dynamic_sampling drops all-equal groups
        self.target, self.cap, self.max_stale = target, cap or target, max_stale
        self.groups, self.pool, self.stale, self.since, self.drawn = {}, None, 0, None, 0  # pool None: paused
        self.aborted = 0  # requests cut since the last take (a pause's too)
        self.keep = task.group_filter(args)  # --dynamic-sampling's filter

    def resume(self, records, version):
        """A run at `version` (none while one runs): the parked groups first, then records'."""
        if self.pool is not None:
            return
        parked, self.groups, self.left, self.kept = [g for _, g in sorted(self.groups.items())], {}, {}, []
        fresh = [g for g in parked if self.max_stale is None or version - min(
            (v for ep in g[2] for v in ep.sample.versions if v >= 0), default=version) <= self.max_stale]
        self.stale += len(parked) - len(fresh)
        self.version, self.records, self.next, self.dropped, self.stopping = version, records, 0, 0, False
        self.t0 = self.ended = time.perf_counter()  # ended: when the last episode stopped
        self.since = self.since or self.t0  # the last take
        self.rounds = None if getattr(self.engine, "concurrent", False) else _Rounds(self.engine)
        size = self.cap * (self.args.n_samples_per_prompt + 1)  # a thread an episode (a round waits for all)
        self.pool = ThreadPoolExecutor(size if self.rounds else min(size, 1024), thread_name_prefix="episode")
        self.bar = tqdm(total=0, desc="rollout", unit="sample", file=sys.stderr, mininterval=1.0, delay=2.0, leave=False)
        with self.cond:
            for rec, prompt, eps in fresh:
                self._open(rec, prompt, eps)
            self._top_up()

    def take(self, n):
        """The first n kept groups' samples (fewer where none can come); with a target, once stopped (not by timing)."""
        self._wait(lambda: not self.running or (self.target is None and len(self.kept) >= n))
        with self.cond:
            keys = sorted(self.kept)[:n]
            self.kept = [k for k in self.kept if k not in keys]
            out = [(key, ep.sample) for key in keys for ep in self.groups.pop(key)[2]]
            self._top_up()
        now, busy, end = time.perf_counter(), 0.0, self.since  # the engine's busy time since the last take (or run):
        for a, b in sorted(self.calls):  # the union of its requests' (start, end)
            busy, end = busy + max(0.0, b - max(a, end)), max(end, b)
        stats = dict(wall_s=now - self.t0, engine_busy_s=busy, engine_idle_frac=1 - busy / max(now - self.since, 1e-9),
                     aborted=self.aborted, stale_dropped=self.stale, buffer_groups=len(self.groups),
                     dropped=self.dropped if self.args.dynamic_sampling else None)
        for key, s in out:
            s.group, s.metadata["rollout"] = key, stats
        self.calls, self.stale, self.aborted, self.since = [], 0, 0, now
        judged = [reward.fault(s.metadata, self.args.rm_type) for _, s in out if s.status != "failed"]
        if judged and all(judged):  # scored 0.0 for nothing: the judge's bug (a column the data lacks) or bound, not the model's
            raise SystemExit(f"--rm-type {self.args.rm_type} raised or ran past its time bound (--rm-timeout) on every "
                             f"sample of this rollout; the first:\n{judged[0]}")
        return [s for _, s in out]

    def pause(self):
        """End the run (with a target: once it stopped itself). -> its (start, end), None if none ran."""
        if self.pool is None:
            return None
        with self.cond:
            if self.target is None:
                self._cut()
        self._wait(lambda: not self.running)
        self.pool.shutdown(wait=False)
        self.bar.close()
        self.pool = None
        return self.t0, self.ended

    def _wait(self, ready):
        """Until ready() (read under the lock). A stopping run's abort goes from here, never under the lock: within
        0.05 s of the stop, then every 2 s for a request that reached a server after it."""
        told = -math.inf
        while True:
            with self.cond:
                if ready() or self.errors:
                    break
                self.cond.wait(0.05)
                cut = self.stopping and self.running  # read under the lock: the stop may have ended the run
            if cut and time.perf_counter() - told >= 2.0:
                getattr(self.engine, "abort", lambda: None)()
                told = time.perf_counter()
        if self.errors:
            raise self.errors[0]

    def _top_up(self):  # under the lock: new records' groups while fewer than cap are open or kept
        while not self.stopping and len(self.groups) < self.cap and self.next < len(self.records):
            self.next, self.drawn = self.next + 1, self.drawn + 1
            self._open(self.records[self.next - 1], None, [None] * self.args.n_samples_per_prompt)

    def _complete(self, key):  # under the lock: a group whose every episode is done
        if self.args.dynamic_sampling and not self._keeps(key):
            del self.groups[key]
            self.dropped += 1
            self._top_up()  # the moment a group is known all-equal, another is drawn
        else:
            self.kept.append(key)
        if self.target and len(self.kept) >= self.target and not self.stopping:
            self._cut()

    def _keeps(self, key):  # under the lock: the filter's verdict on a complete group; its exception keeps the group
        samples = [ep.sample for ep in self.groups[key][2]]
        name = self.args.dynamic_sampling_filter_path or "nonzero_std"
        try:
            return bool(self.keep.keep(samples, self.args))
        except Exception:  # noqa: BLE001 - the user's filter's bug: counted (<name>_errors), printed once, group kept
            samples[0].metadata.setdefault("errors", {})[name] = reward.raised(name, self.groups[key][0])
            return True

    def _cut(self):  # under the lock: what still generates is cut (the engine's abort: _wait); its episodes park
        self.stopping = True
        if self.running and self.rounds:
            self.rounds.aborted = True  # the rounds still to come answer ABORTED


def _close(ep, rec, processor, args):
    """An ended episode of `rec`: its env closed, its image placeholders checked, its correctness and reward."""
    ep.done, s = True, ep.sample
    if ep.env is not None:
        ep.env.close()
    reason = None if s.status == "failed" else chat.check_images(processor, s.tokens, s.images)
    if reason:
        _fail(s, reason)
    s.metadata["format_ok"] = bool(reward.format_ok(s.response_text))  # before the reward: a shaping term may read it
    if s.status != "failed":
        s.reward = reward.rewarded(s, rec, args)


def generate_group_samples(engine, processor, records, args):
    """records x n_samples_per_prompt scored samples, group = the record's place. --dynamic-sampling: a group all right
    or all wrong is dropped and the next record starts at once, until rollout_batch_size are kept (docs/rollout.md)."""
    target = (args.rollout_batch_size or len(records)) if args.dynamic_sampling else len(records)
    ro = Rollout(engine, processor, args, target)  # one run from start to end
    ro.resume(records, 0)
    out = ro.take(target)
    ro.pause()
    return out
