"""rollout.py and engines.py on CPU with the local engine: masks and logprobs vs a teacher-forced forward, single
and multi-turn, weight updates, an abort mid-generation (scripted episodes: tests/test_episodes.py; groups and
scheduling: test_rollout_groups.py; SGLangEngine: test_sglang_engine.py).

    .venv/bin/pytest tests/test_rollout.py -q
"""
import pytest
import torch

import data
import engines
import chat
from conftest import rollout_args
from fakes import ForcedFirstTurnEngine
import fakes

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
