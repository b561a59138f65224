"""rollout.py and engines.py on CPU: token bookkeeping, logprobs vs a teacher-forced forward,
weight updates, multi-turn crop episodes (SGLangEngine: tests/test_sglang_engine.py).

    .venv/bin/pytest tests/test_rollout.py -q
"""
import dataclasses
from pathlib import Path

import pytest
import torch

import data
import engines
import env_geo3k
import chat
import reward
import rollout
import train_grpo
from conftest import rollout_args
from fakes import ANSWER, CROP_CALL, ForcedFirstTurnEngine, ScriptedEngine
import fakes

FAKE = str(Path(__file__).with_name("fake_sglang.py"))
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on shared cores: one thread avoids OpenMP oversubscription (40x here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def engine(ckpt, processor):
    return engines.LocalEngine(ckpt, processor=processor)


def load_model(ckpt, state=None):
    from transformers import AutoModelForImageTextToText
    m = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.float32).eval()
    if state is not None:
        m.load_state_dict(state)
    return m


@torch.no_grad()
def teacher_logprobs(model, processor, s, temperature):
    """log_softmax(logits / T) of every response token, from one full forward over s.tokens."""
    ids = torch.tensor([s.tokens])                                     # (1, L)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    pixels, grid = chat.encode_images(processor, s.images)
    logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                   mm_token_type_ids=(ids == pad).long()).logits[0]    # (L, V)
    P, T = len(s.prompt_ids), (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(logits[P - 1:-1].double() / T, -1).gather(-1, ids[0, P:, None])[:, 0].float()


def max_logprob_diff(model, processor, samples, temperature):
    worst = 0.0
    for s in samples:
        ref = teacher_logprobs(model, processor, s, temperature)
        mask = torch.tensor(s.loss_mask, dtype=torch.bool)
        got = torch.tensor(s.rollout_logprobs)
        assert (got[~mask] == 0).all()
        worst = max(worst, (ref[mask] - got[mask]).abs().max().item())
    return worst


# ---------------------------------------------------------------------------------- local engine
@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_single_turn_local_masks_and_logprobs(engine, processor, ckpt, records, temperature):
    args = rollout_args(rollout_temperature=temperature)
    samples = fakes.run_episodes(engine, processor, records[:2], args)
    assert [s.group for s in samples] == [0, 0, 1, 1]
    for s, rec in zip(samples, [records[0]] * 2 + [records[1]] * 2):
        assert s.status in ("completed", "truncated") and s.fail_reason is None
        assert s.images == rec["images"]
        assert s.prompt_ids == chat.encode_prompt(processor, data.prompt_messages(rec), rec["images"])
        assert len(s.response_ids) == len(s.loss_mask) == len(s.rollout_logprobs) <= 10
        assert s.loss_mask == [1] * len(s.response_ids) and s.turns == 1
        assert chat.check_images(processor, s.tokens, s.images) is None
    diff = max_logprob_diff(load_model(ckpt), processor, samples, temperature)
    print(f"single-turn T={temperature}: max |rollout - teacher-forced| logprob = {diff:.2e}")
    assert diff < TOL


def test_update_weights_logprobs_follow(engine, processor, ckpt, records):
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in original.items()}
    items = list(perturbed.items())
    try:
        n = engine.update_weights(items[i:i + 16] for i in range(0, len(items), 16))  # buckets
        assert n == len(items)
        samples = fakes.run_episodes(engine, processor, records[:1], rollout_args())
        new_diff = max_logprob_diff(load_model(ckpt, perturbed), processor, samples, 0.8)
        old_diff = max_logprob_diff(load_model(ckpt), processor, samples, 0.8)
        print(f"after update: max diff vs perturbed teacher {new_diff:.2e}, vs old weights {old_diff:.2e}")
        assert new_diff < TOL and old_diff > 1e-2
        with pytest.raises(KeyError):
            engine.update_weights([[("not.a.weight", torch.zeros(1))]])
    finally:
        engine.update_weights([list(original.items())])


@pytest.mark.parametrize("arch,layout,name", [
    ("qwen3_5_moe", dict(per_expert=True, mtp=True), "model.language_model.layers.0.mlp.experts.3.up_proj.weight"),
    ("qwen2_5_vl", {}, "model.layers.0.mlp.up_proj.weight")])
def test_local_engine_takes_the_names_from_pretrained_takes(tiny_ckpt, tmp_path, arch, layout, name):
    """The trainer exports the source checkpoint's names; the local engine maps them as from_pretrained
    does: a Qwen3.5-MoE as transformers' save_pretrained writes it (routed experts per expert: each
    expert's gate, up and down into its slices of the fused tensors; mtp.* skipped), a Qwen2.5-VL in its
    released layout (`model.layers.*`, `visual.*`). After an update it holds what from_pretrained reads
    from the trainer's checkpoint; `tools/check.py` passes on the source."""
    import convert
    import model as M
    import parallel
    from tools import check
    from transformers import AutoModelForImageTextToText
    d = tiny_ckpt(arch, **layout)
    src = convert.weight_files(d)
    assert name in src
    parallel.init_distributed(1)
    model, engine = M.load_model(d), engines.LocalEngine(d)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the trained policy: every tensor moved, each expert and half differently
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=g))
    n = engine.update_weights(convert.export_hf(model, bucket_bytes=1 << 20))
    assert n == len([k for k in src if not k.startswith("mtp.")])
    convert.save_hf(model, tmp_path)
    want, got = AutoModelForImageTextToText.from_pretrained(tmp_path).state_dict(), engine.model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    with pytest.raises(KeyError, match="'model.layers.0.mlp.nope.weight' is not a weight"):
        engine.update_weights([[("model.layers.0.mlp.nope.weight", torch.zeros(1))]])
    assert check.check(d) <= 1e-4


def test_logprobs_exact_when_logits_are_large(engine, processor, ckpt, records):
    """A trained model's logits span tens of nats; an fp32 log-softmax over 152k of them is off
    by ~1e-5 (measured on a trained tiny checkpoint), more than train-vs-rollout may differ."""
    original = {k: v.clone() for k, v in engine.model.state_dict().items()}
    big = {**original, "lm_head.weight": original["lm_head.weight"] * 30}  # logits ~N(0, 5)
    try:
        engine.update_weights([list(big.items())])
        samples = fakes.run_episodes(engine, processor, records, rollout_args(rollout_temperature=1.0,
                                                                             n_samples_per_prompt=4))
        teacher = load_model(ckpt, big)
        diffs = torch.cat([(teacher_logprobs(teacher, processor, s, 1.0) - torch.tensor(s.rollout_logprobs)).abs()
                           for s in samples])
        print(f"large logits: |rollout - fp64 teacher| mean {diffs.mean():.2e} max {diffs.max():.2e}")
        assert diffs.mean() < 3e-6 and diffs.max() < 1e-5  # fp32: mean 1.2e-5, max 1.9e-5
    finally:
        engine.update_weights([list(original.items())])


# ---------------------------------------------------------------------------------- multi-turn
def test_multi_turn_crop_matches_full_render(processor, records):
    """The trainer-side tokens of a crop episode are exactly the processor's tokens for the whole
    conversation rendered at once, with both images, and the crop reaches turn 2's request."""
    rec = records[0]
    eng = ScriptedEngine(processor, [CROP_CALL, ANSWER])
    args = rollout_args(max_turns=3, n_samples_per_prompt=1, rollout_max_response_len=400)
    (s,) = fakes.run_episodes(eng, processor, [rec], args)
    assert s.status == "completed" and s.turns == 2 and s.tool_calls == 1, s.fail_reason
    assert len(s.images) == 2 and s.images[1].size == (64, 64)
    assert s.metadata["steps"][0]["tool"] == "image_zoom_in_tool" and s.metadata["steps"][0]["ran"]
    turn2_ids, turn2_images = eng.seen[1]
    assert turn2_ids == s.tokens[:len(turn2_ids)] and turn2_images == s.images
    observation = s.metadata["steps"][0]["observation"]
    assert observation.startswith("Zoomed into image 0 at [0, 0, 500, 500] (64x64 px")
    messages = data.prompt_messages(rec, multi_turn=True) + [
        {"role": "assistant", "content": CROP_CALL},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": observation}]},
        {"role": "assistant", "content": ANSWER}]
    # tools/tiny.py's template renders tools=, so the specs go there, in its format, not in the system text
    text = processor.apply_chat_template(messages, tools=env_geo3k.specs(env_geo3k.offered()), tokenize=False)
    assert '"name": "image_zoom_in_tool"' in text and "<tools>" in text
    full = processor(text=[text.removesuffix("\n")], images=s.images)["input_ids"][0]
    assert s.tokens == list(full)
    model_tokens = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
    tok = processor.tokenizer
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert model_tokens == tok.encode(CROP_CALL) + [im_end] + tok.encode(ANSWER) + [im_end]
    assert s.response_text == CROP_CALL + "\n" + ANSWER


def test_multi_turn_max_turns_and_context_budget(processor, records):
    eng = ScriptedEngine(processor, [CROP_CALL])  # calls a tool every turn
    (s,) = fakes.run_episodes(eng, processor, records[:1], rollout_args(max_turns=2, n_samples_per_prompt=1,
                                                                      rollout_max_response_len=400))
    assert s.status == "completed" and s.turns == 2 and s.tool_calls == 2 and len(s.images) == 2
    assert s.loss_mask[-1] == 1  # no observation after the last allowed turn
    (s,) = fakes.run_episodes(eng, processor, records[:1], rollout_args(max_turns=4, n_samples_per_prompt=1,
                                                                      rollout_max_response_len=60))
    assert s.status == "truncated" and s.turns == 1 and len(s.response_ids) <= 60  # observation would not fit
    P = len(s.prompt_ids)
    (s,) = fakes.run_episodes(eng, processor, records[:1], rollout_args(max_turns=4, n_samples_per_prompt=1,
                                                                      rollout_max_response_len=400,
                                                                      max_context_len=P + 5))
    assert s.status == "truncated" and len(s.tokens) == P + 5


def test_overlong_penalty_counts_what_the_response_cap_counts(processor, records):
    """--overlong-buffer-len / --overlong-penalty-factor on the tokens --rollout-max-response-len cuts: multi-turn,
    the tool observation between the model's turns too; logged as overlong_penalty_mean and _frac."""
    eng = ScriptedEngine(processor, [CROP_CALL, ANSWER])
    args = rollout_args(max_turns=3, n_samples_per_prompt=1, rollout_max_response_len=400)
    (s,) = fakes.run_episodes(eng, processor, records[:1], args)
    n, model = len(s.response_ids), sum(s.loss_mask)
    assert s.status == "completed" and s.turns == 2 and n > model + 20  # the crop's observation: 20+ tokens
    cap, buffer = n + 5, n - model  # the buffer starts before the model's tokens reach it alone
    args = rollout_args(max_turns=3, n_samples_per_prompt=1, rollout_max_response_len=cap, overlong_buffer_len=buffer,
                        overlong_penalty_factor=0.5)
    (s,) = fakes.run_episodes(eng, processor, records[:1], args)
    want = -0.5 * (n - (cap - buffer)) / buffer
    assert len(s.response_ids) == n and s.metadata["shaping"] == {"overlong_penalty": pytest.approx(want)}
    m = train_grpo.rollout_metrics([s, dataclasses.replace(s, metadata=dict(s.metadata, shaping={"overlong_penalty": 0.0}))])
    assert m["overlong_penalty_mean"] == pytest.approx(want / 2) and m["overlong_penalty_frac"] == 0.5


def test_tool_calls_counts_calls_that_ran(processor, records):
    unknown = '<tool_call>\n{"name": "nope", "arguments": {"x": 1}}\n</tool_call>'
    eng = ScriptedEngine(processor, [unknown, CROP_CALL, ANSWER])
    (s,) = fakes.run_episodes(eng, processor, records[:1], rollout_args(max_turns=4, n_samples_per_prompt=1,
                                                                      rollout_max_response_len=1000))
    assert s.status == "completed" and s.turns == 3, s.fail_reason
    assert [step["ran"] for step in s.metadata["steps"]] == [False, True, False] and s.tool_calls == 1


def test_multi_turn_local_logprobs(ckpt, processor, records):
    eng = ForcedFirstTurnEngine(ckpt, processor=processor)
    args = rollout_args(max_turns=3, n_samples_per_prompt=2, rollout_max_response_len=160)
    samples = fakes.run_episodes(eng, processor, records[:1], args)
    model, first_turn, later = load_model(ckpt), 0.0, 0.0
    for s in samples:
        assert s.fail_reason is None and s.turns >= 2 and len(s.images) == 2
        mask = s.loss_mask
        first = mask.index(0)        # the observation starts after the forced turn
        back = first + mask[first:].index(1)
        obs = s.response_ids[first:back]
        assert obs[0] == processor.tokenizer.encode("\n")[0]  # "\n" after the model's <|im_end|>
        assert s.response_ids[first - 1] == processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        assert processor.tokenizer.decode(obs).startswith("\n<|im_start|>user\n<tool_response>\n<|vision_start|>")
        assert processor.tokenizer.decode(obs).endswith("<|im_start|>assistant\n")
        assert all(m == 1 for m in mask[back:]) and sum(mask) == len(mask) - len(obs)
        diff = (teacher_logprobs(model, processor, s, 0.8) - torch.tensor(s.rollout_logprobs)).abs()
        first_turn = max(first_turn, diff[:first].max().item())
        later = max(later, diff[back:].max().item())
        assert all(lp == 0.0 for lp in s.rollout_logprobs[first:back])  # observation: no logprob
    print(f"multi-turn: max |rollout - teacher-forced| logprob, forced turn 1 {first_turn:.2e}, "
          f"sampled turns (2 images) {later:.2e}")
    assert first_turn < TOL and later < TOL


def test_truncation_and_failures(processor, records):
    eng = ScriptedEngine(processor, ["word " * 50])
    (s,) = fakes.run_episodes(eng, processor, records[:1], rollout_args(n_samples_per_prompt=1))
    assert s.status == "truncated" and len(s.response_ids) == 10

    class DoubleExpander(ScriptedEngine):  # a server that expanded the image tokens again
        def generate(self, batch, sampling):
            outs = super().generate(batch, sampling)
            for o, item in zip(outs, batch):
                o["prompt_tokens"] = len(item["input_ids"]) + 15
            return outs
    samples = fakes.run_episodes(DoubleExpander(processor, ["hi"]), processor, records[:1], rollout_args())
    assert all(s.status == "failed" and "expanded twice" in s.fail_reason for s in samples)
    assert all(set(s.loss_mask) <= {0} for s in samples)
    m = train_grpo.rollout_metrics(samples)
    assert m["failed_frac"] == 1.0 and m["samples"] == 2

    tokens = list(samples[0].prompt_ids)
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    tokens.remove(pad)                                # one placeholder lost
    assert "placeholders" in chat.check_images(processor, tokens, samples[0].images)
    assert chat.check_images(processor, samples[0].prompt_ids, samples[0].images * 2) is not None
    # a model that writes an image placeholder itself: the sample's runs no longer match its grids
    (s,) = fakes.run_episodes(ScriptedEngine(processor, ["<|image_pad|> 4"]), processor, records[:1],
                                rollout_args(n_samples_per_prompt=1))
    assert s.status == "failed" and "placeholders" in s.fail_reason and set(s.loss_mask) == {0}, s.fail_reason


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
            messages, tools, _ = chat.prompt(processor, r, multi)
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


def test_local_engine_abort_lands_mid_generation_and_greedy_continues_it(engine, processor, records, monkeypatch):
    """LocalEngine.abort() stops a generate at its next token: the rows answer finish "abort" with the
    tokens they had, and a greedy request for the rest continues them into the uninterrupted answer."""
    messages, _, _ = chat.prompt(processor, records[0])
    prompt = chat.encode_prompt(processor, messages, records[0]["images"])
    item, sp = {"input_ids": prompt, "images": records[0]["images"]}, dict(temperature=0.0, max_new_tokens=12, stop_token_ids=[1])
    whole = engine.generate([item, item], sp)[0]
    assert whole["finish"] == "length" and len(whole["ids"]) == 12
    calls, plain = [], engines.Sampler.__call__

    def counting(self, input_ids, scores):  # the abort comes after the 4th token is drawn
        calls.append(1)
        if len(calls) == 4:
            engine.abort()
        return plain(self, input_ids, scores)
    monkeypatch.setattr(engines.Sampler, "__call__", counting)
    cut = engine.generate([item, item], sp)
    monkeypatch.setattr(engines.Sampler, "__call__", plain)
    assert [c["finish"] for c in cut] == ["abort"] * 2 and len(cut[0]["ids"]) == 4
    rest = engine.generate([dict(item, input_ids=prompt + cut[0]["ids"])], dict(sp, max_new_tokens=8))[0]
    assert cut[0]["ids"] + rest["ids"] == whole["ids"]
    got = torch.tensor(cut[0]["logprobs"] + rest["logprobs"])
    assert (got - torch.tensor(whole["logprobs"])).abs().max() <= TOL
    assert engine.generate([item], dict(sp, max_new_tokens=3))[0]["finish"] == "length"  # a later call runs whole
