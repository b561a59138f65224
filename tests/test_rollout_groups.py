"""rollout.py's groups on CPU with scripted engines: rewards and --dynamic-sampling, a prompt encoded once per
group, episodes that flow on their own, --partial-rollout's parked groups, fully async updates and the staleness
bound (episode tokens: tests/test_episodes.py; logprobs against the model: test_rollout.py).

    .venv/bin/pytest tests/test_rollout_groups.py -q
"""
import pytest

import chat
import env_geo3k
import reward
import rollout
import train_grpo
from conftest import rollout_args
from fakes import ANSWER, CROP_CALL, ScriptedEngine
import fakes


def test_group_samples_rewards_and_dynamic_sampling(processor, records, monkeypatch):
    recs = [dict(r, answer=a) for r, a in zip(records * 2, ["same", "mixed", "same", "mixed", "mixed"])]
    counter = iter(range(10 ** 6))

    class Counting(ScriptedEngine):
        def generate(self, batch, sampling):
            outs = []
            for item in batch:
                ids = self.tok.encode(str(next(counter))) + [self.im_end]
                outs.append({"ids": ids, "logprobs": [-0.1] * len(ids), "finish": "stop",
                             "prompt_tokens": len(item["input_ids"])})
            return outs
    monkeypatch.setitem(reward.REWARDS, "odd", lambda response, record: record["answer"] == "mixed" and
                        int(response) % 2 == 1)  # a judge (--rm-type) of this test's own
    args = rollout_args(n_samples_per_prompt=2, rm_type="odd")
    plain = rollout.generate_group_samples(Counting(processor, []), processor, recs[:2], args)
    assert [s.group for s in plain] == [0, 0, 1, 1] and [s.reward for s in plain] == [0, 0, 0, 1]
    # a shaped reward that differs within every group: --dynamic-sampling and accuracy still read correctness
    monkeypatch.setitem(reward.SHAPING, "tiny", reward.Shaping(lambda s, rec, cfg: int(s.response_text) / 1000, {}))
    args = rollout_args(n_samples_per_prompt=2, dynamic_sampling=True, rollout_batch_size=2, rm_type="odd")
    kept = rollout.generate_group_samples(Counting(processor, []), processor, recs, args)
    assert sorted({s.group for s in kept}) == [1, 3] and len(kept) == 4
    m = train_grpo.rollout_metrics(kept)
    assert m["accuracy"] == 0.5 and m["reward"] == pytest.approx(0.5 + m["tiny_mean"]) and m["ds_keep_frac"] == 0.5
    assert m["tiny_mean"] > 0 and m["tiny_frac"] == 1.0
    assert {"truncated_frac", "aborted_frac", "turns", "tool_calls", "format_ok_frac", "response_len"} <= set(m)


def test_group_samples_default_reward(processor, records):
    recs = [dict(records[0], answer="360")]
    samples = rollout.generate_group_samples(ScriptedEngine(processor, ["So \\boxed{360}"]), processor, recs,
                                             rollout_args(n_samples_per_prompt=2))
    assert [s.reward for s in samples] == [1.0, 1.0] and all(s.metadata["format_ok"] for s in samples)


def test_prompt_encoded_once_per_group(processor, records, monkeypatch):
    """A group's samples share one prompt: the chat template and processor run once per record, and
    each sample still owns its lists (one episode's turns never leak into another's)."""
    calls = []
    plain = chat.encode_prompt
    monkeypatch.setattr(chat, "encode_prompt", lambda *a, **k: calls.append(1) or plain(*a, **k))
    eng = ScriptedEngine(processor, ['<tool_call>\n{"name": "calc_score", "arguments": {"answer": "1"}}\n</tool_call>', "hi"])
    samples = fakes.run_episodes(eng, processor, records[:2], rollout_args(n_samples_per_prompt=3, max_turns=2,
                                                                           rollout_max_response_len=400))
    assert len(calls) == 2 and len(samples) == 6
    a, b = samples[0], samples[1]
    assert a.prompt_ids == b.prompt_ids and a.prompt_ids is not b.prompt_ids
    assert a.turns == 2 and a.response_ids == b.response_ids and a.status == b.status == "completed"


def test_episodes_flow_on_their_own_and_dynamic_sampling_redraws_at_once(processor, records):
    """With a concurrent engine (SGLang's kind) an episode's next turn goes out while another episode
    is still generating, and a group known to be all-equal is replaced at once, not after the batch;
    the samples are the ones a lockstep batch engine gives. The slow request is the test's: prompt 0's
    answer waits for the event it must not block (another's next turn, a redrawn group's first request),
    30 s at most, so a rollout that waits for it fails here instead of hanging."""
    import threading
    import time
    recs = [dict(r, problem=f"{r['problem']} ({i})") for i, r in enumerate(records[:3])]  # distinct prompts

    def encoded(multi):  # each record's prompt ids, as the rollout encodes them
        out = []
        for r in recs:
            messages, tools, _ = chat.prompt(processor, r, env_geo3k if multi else None)
            out.append(tuple(chat.encode_prompt(processor, messages, r["images"], tools)))
        return out
    prompts = encoded(True)
    log, lock = [], threading.Lock()  # (prompt index, turn, start, end) of every request
    came = threading.Event()  # the request prompt 0's waits for has started

    class Concurrent(ScriptedEngine):
        concurrent = True

        def answer(self, item, p):
            return self.script[min(self.turn(item["input_ids"]), len(self.script) - 1)]

        awaited = (1, 1)  # (prompt, turn) of the request that prompt 0's answers wait for

        def generate(self, batch, sampling):
            (item,) = batch
            p = next(k for k, ids in enumerate(prompts) if tuple(item["input_ids"][:len(ids)]) == ids)
            start = time.monotonic()
            if (p, min(self.turn(item["input_ids"]), self.awaited[1])) == self.awaited:
                came.set()
            if p == 0:
                came.wait(30)
            with lock:
                log.append((p, self.turn(item["input_ids"]), start, time.monotonic()))
                ids = self.tok.encode(self.answer(item, p)) + [self.im_end]
            return [{"ids": ids, "logprobs": [-0.5] * len(ids), "finish": "stop", "prompt_tokens": len(item["input_ids"])}]
    args = rollout_args(max_turns=2, n_samples_per_prompt=1, rollout_max_response_len=400)
    got = fakes.run_episodes(Concurrent(processor, [CROP_CALL, ANSWER]), processor, recs[:2], args)
    want = fakes.run_episodes(ScriptedEngine(processor, [CROP_CALL, ANSWER]), processor, recs[:2], args)
    assert [s.tokens for s in got] == [s.tokens for s in want] and [s.loss_mask for s in got] == [s.loss_mask for s in want]
    slow_first_end = min(end for p, turn, _, end in log if p == 0 and turn == 0)
    assert any(p == 1 and turn == 1 and start < slow_first_end for p, turn, start, _ in log), log

    class Alternating(Concurrent):  # a prompt's first request is right (\boxed{360}), later ones wrong
        awaited = (2, 0)  # prompt 2's first request

        def answer(self, item, p):
            return ANSWER if sum(q == p for q, *_ in log) == 1 else "\\boxed{1}"
    log.clear()
    came.clear()
    recs = [dict(recs[0], answer="360"), dict(recs[1], answer="7"), dict(recs[2], answer="360")]
    prompts[:] = encoded(False)
    args = rollout_args(n_samples_per_prompt=2, dynamic_sampling=True, rollout_batch_size=2)
    kept = rollout.generate_group_samples(Alternating(processor, []), processor, recs, args)
    assert sorted({s.group for s in kept}) == [0, 2] and sorted(s.reward for s in kept) == [0, 0, 1, 1]
    # group 1 (quick, all wrong) is dropped, and group 2 starts while group 0 (slow) still generates
    assert min(start for p, _, start, _ in log if p == 2) < min(end for p, *_, end in log if p == 0), log


# ---------------------------------------------------------------------------------- partial rollout
def test_partial_rollout_parks_what_still_generates_and_continues_it_as_if_uninterrupted(processor, records):
    """--partial-rollout: once rollout_batch_size groups are complete the rollout aborts the rest and
    parks them (an episode cut mid-turn, one cut in its second turn after a crop); the next rollout, at
    the next policy version, continues them first, and each sample ends as the uninterrupted one does:
    the same tokens, loss mask, logprobs, turns, tool calls and text; each token keeps its version."""
    import threading
    recs = [dict(r, problem=f"{r['problem']} ({i})", index=i) for i, r in enumerate(records[:3])]
    script = {0: [ANSWER], 1: [CROP_CALL, ANSWER], 2: [CROP_CALL, ANSWER]}
    blocked, waiting, go = [], threading.Event(), threading.Event()

    class Scripted(ScriptedEngine):  # record 1 waits in turn 2, record 2 in turn 1, until the abort
        concurrent, cut = True, 3  # an aborted request answers with its first 3 tokens

        def __init__(self, block):
            super().__init__(processor, [])
            self.block, self.aborts = block, 0

        def abort(self):
            self.aborts += 1
            go.set()

        def generate(self, batch, sampling):
            (item,) = batch
            ids = item["input_ids"]
            rec = next(i for i in script if f"({i})" in self.tok.decode(ids))
            turn = self.turn(ids)
            head = len(ids) - max(i + len(self.header) for i in range(len(ids)) if ids[i:i + len(self.header)] == self.header)
            full = self.tok.encode(script[rec][turn]) + [self.im_end]
            out = {"ids": full[head:], "logprobs": [-0.25 - 0.01 * k for k in range(head, len(full))],
                   "finish": "stop", "prompt_tokens": len(ids)}
            if self.block and (rec, turn) in ((1, 1), (2, 0)):
                blocked.append(1)  # list.append is atomic
                if len(blocked) == 4:
                    waiting.set()
                go.wait(30)
                out.update(ids=out["ids"][:self.cut], logprobs=out["logprobs"][:self.cut], finish="abort")
            elif self.block and rec == 0:  # the four others are waiting: this group completes while they generate
                assert waiting.wait(30)
            return [out]
    args = rollout_args(max_turns=3, n_samples_per_prompt=2, rollout_batch_size=1, partial_rollout=True,
                        over_sampling_batch_size=3, rollout_max_response_len=400)
    want = fakes.run_episodes(Scripted(False), processor, recs, args)
    eng = Scripted(True)
    ro = rollout.Rollout(eng, processor, args, target=1, cap=3)
    ro.resume(recs, 0)
    first = ro.take(1)
    ro.pause()
    assert ro.drawn == 3  # the records it started
    assert [s.index for s in first] == [0, 0] and eng.aborts >= 1
    assert first[0].metadata["rollout"]["aborted"] == 4 and first[0].metadata["rollout"]["buffer_groups"] == 2
    assert [r["problem"] for r, _, _ in ro.groups.values()] == [recs[1]["problem"], recs[2]["problem"]]
    cut = ro.groups[2][2][0].sample  # record 2, cut in its first turn: 3 tokens, no turn done yet
    assert len(cut.response_ids) == 3 and cut.turns == 0 and cut.loss_mask == [1] * 3 and cut.versions == [0] * 3
    go.clear()
    ro.engine, rest = Scripted(False), []
    for version in (1, 2):
        ro.resume([], version)
        rest += ro.take(1)
        ro.pause()
        assert len(rest) == 2 * version and len(ro.groups) == 2 - version  # one kept; the other goes first next
    assert {s.index for s in rest} == {1, 2}
    for s in rest:
        w = next(x for x in want if x.index == s.index)
        assert (s.response_ids, s.loss_mask, s.rollout_logprobs) == (w.response_ids, w.loss_mask, w.rollout_logprobs)
        assert (s.turns, s.tool_calls, s.response_text, s.status) == (w.turns, w.tool_calls, w.response_text, w.status)
        model = [v for v, m in zip(s.versions, s.loss_mask) if m]
        before = 3 + (len(processor.tokenizer.encode(CROP_CALL)) + 1 if s.index == 1 else 0)  # record 1's first turn
        assert model == sorted(model) and model[-1] in (1, 2) and model.count(0) == before  # 2: cut twice
        assert all(v == -1 for v, m in zip(s.versions, s.loss_mask) if not m)  # observation tokens


def test_fully_async_update_lands_within_a_turn_and_between_turns(processor, records):
    """--fully-async: take(1) hands out the first complete group while the others generate; pause(), before a weight
    update, cuts record 1 in its second turn and catches record 2 between turns (its first turn ended as the abort
    came); they park (and pickle: a checkpoint holds them). The run at the next version goes on with both and each
    sample ends as the uninterrupted one does, every token with the version that wrote it and every route (R3)
    from a forward at that version. A parked group more than max_stale versions old is dropped, and counted."""
    import pickle
    import threading
    import numpy as np
    recs = [dict(r, problem=f"{r['problem']} ({i})", index=i) for i, r in enumerate(records[:3])]
    script = {0: [ANSWER], 1: [CROP_CALL, ANSWER], 2: [CROP_CALL, ANSWER]}
    held, go = threading.Semaphore(0), threading.Event()

    class Scripted(ScriptedEngine):  # routes: the engine's version at every position its request covers
        concurrent = True

        def __init__(self, block, version=0):
            super().__init__(processor, [])
            self.block, self.version = block, version

        def abort(self):
            go.set()

        def generate(self, batch, sampling):
            (item,) = batch
            ids = item["input_ids"]
            rec, turn = next(i for i in script if f"({i})" in self.tok.decode(ids)), self.turn(ids)
            head = len(ids) - max(i + len(self.header) for i in range(len(ids)) if ids[i:i + len(self.header)] == self.header)
            full = self.tok.encode(script[rec][turn]) + [self.im_end]
            out = {"ids": full[head:], "logprobs": [-0.25 - 0.01 * k for k in range(head, len(full))],
                   "finish": "stop", "prompt_tokens": len(ids)}
            if self.block and (rec, turn) in ((1, 1), (2, 0)):
                held.release()
                assert go.wait(30)
                if rec == 1:  # cut within its second turn; record 2's first turn ends whole
                    out.update(ids=out["ids"][:3], logprobs=out["logprobs"][:3], finish="abort")
            rows = len(ids) + len(out["ids"]) - 1 - item["routed_experts_start"]
            return [dict(out, routed_experts=np.full((rows, 1, 1), self.version, dtype=np.int16))]
    args = rollout_args(max_turns=3, n_samples_per_prompt=2, rollout_max_response_len=400)
    want = fakes.run_episodes(Scripted(False), processor, recs, args)
    ro = rollout.Rollout(Scripted(True), processor, args, cap=3, max_stale=1)
    ro.resume(recs, 0)
    assert [s.index for s in ro.take(1)] == [0, 0]
    assert all(held.acquire(timeout=30) for _ in range(4))  # records 1 and 2 generate
    ro.pause()
    assert ro.drawn == 3 and sorted(r["index"] for r, _, _ in ro.groups.values()) == [1, 2]
    parked = {r["index"]: eps for r, _, eps in ro.groups.values()}
    assert all(ep.sample.turns == 1 and ep.sample.versions[-1] == 0 for ep in parked[1])  # 3 tokens of turn 2
    assert all(ep.sample.turns == 1 and ep.sample.versions[-1] == -1 for ep in parked[2])  # its observation
    saved = pickle.dumps(ro.groups)
    ro.engine = Scripted(False, version=1)
    ro.resume([], 1)
    rest = ro.take(2)
    ro.pause()
    assert sorted(s.index for s in rest) == [1, 1, 2, 2] and not ro.groups
    for s in rest:
        w = next(x for x in want if x.index == s.index)
        assert (s.tokens, s.loss_mask, s.rollout_logprobs, s.response_text) == (w.tokens, w.loss_mask, w.rollout_logprobs,
                                                                                w.response_text)
        turn2 = len(s.response_ids) - len(processor.tokenizer.encode(ANSWER)) - 1
        model = [v for v in s.versions[turn2:]]
        assert model == ([0] * 3 if s.index == 1 else []) + [1] * (len(model) - 3 * (s.index == 1)), (s.index, model)
        last0 = len(s.prompt_ids) + max(i for i, v in enumerate(s.versions) if v == 0)  # its route came at version 1
        assert s.routed_experts[:, 0, 0].tolist() == [0] * last0 + [1] * (len(s.tokens) - 1 - last0)
    stale = rollout.Rollout(Scripted(False, version=2), processor, args, cap=3, max_stale=1)
    stale.groups = pickle.loads(saved)
    stale.resume([], 2)  # two versions after their oldest token
    assert stale.stale == 2 and stale.take(2) == []
    stale.pause()


def test_staleness_judges_a_parked_group_by_its_oldest_token_across_pause_resume_and_checkpoint(processor, records):
    """--max-weight-staleness K (here 1): a parked group is dropped when its OLDEST model-written token is more than
    K versions older than the run that would continue it, however fresh its newest is; exactly K old is kept. Record
    0 writes at version 0 and 1 (newest 1, oldest 0), record 1 at version 1 only; each run is cut by a pause (every
    request waits for the abort, then answers 2 tokens), the groups go through a checkpoint (pickle, a fresh
    Rollout), and the run at version 2 drops record 0 (oldest 2 old) and continues record 1 (oldest 1 old)."""
    import pickle
    import threading
    recs = [dict(r, problem=f"{r['problem']} ({i})", index=i, images=[]) for i, r in enumerate(records[:2])]
    came, go = threading.Semaphore(0), threading.Event()

    class Cut(ScriptedEngine):
        concurrent = True

        def abort(self):
            go.set()

        def generate(self, batch, sampling):
            (item,) = batch
            ids = item["input_ids"]
            head = len(ids) - max(i + len(self.header) for i in range(len(ids)) if ids[i:i + len(self.header)] == self.header)
            came.release()
            assert go.wait(30)
            return [{"ids": self.tok.encode(ANSWER)[head:head + 2], "logprobs": [-0.5] * 2, "finish": "abort",
                     "prompt_tokens": len(ids)}]

    def run(ro, new, version, requests):  # a run cut by a pause once its requests are all at the engine
        go.clear()
        ro.resume(new, version)
        assert all(came.acquire(timeout=30) for _ in range(requests))
        ro.pause()
        return {r["index"]: eps[0].sample.versions for r, _, eps in ro.groups.values()}
    args = rollout_args(n_samples_per_prompt=1)
    ro = rollout.Rollout(Cut(processor, []), processor, args, cap=2, max_stale=1)
    assert run(ro, recs[:1], 0, 1) == {0: [0, 0]}
    assert run(ro, recs[1:], 1, 2) == {0: [0, 0, 1, 1], 1: [1, 1]} and ro.stale == 0
    later = rollout.Rollout(Cut(processor, []), processor, args, cap=2, max_stale=1)  # a resumed run's
    later.groups = pickle.loads(pickle.dumps(ro.groups))
    assert run(later, [], 2, 1) == {1: [1, 1, 2, 2]} and later.stale == 1
