"""sglang_engine.py's aborts on CPU against tests/fake_sglang.py (--partial-rollout's abort_all): where an abort
lands in a turn, what the rollout keeps of it, and that a hung abort holds no lock (protocol and weight sync:
tests/test_sglang_engine.py; server processes: test_sglang_processes.py).

    .venv/bin/pytest tests/test_sglang_abort.py -q
"""
import json
import threading
import time
from pathlib import Path

import chat
import env_geo3k
import reward
import rollout
from fake_sglang import fake_output, weights_digest
from conftest import rollout_args
from test_sglang_engine import held, parked_goes_after, read_record, sglang, wait_for


def test_an_abort_lands_mid_generation_and_the_rest_continues_it(ckpt, processor, records, tmp_path):
    """--partial-rollout's abort is SGLang's abort_all (AbortReq); the server answers each /generate in flight
    with what it had (finish "abort"), and a request for the rest continues it into the answer the server
    gives uninterrupted (the fake's, like greedy decoding's, a function of the ids before each token)."""
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "3")  # each request holds before its turn's token 3
    try:
        messages, _, _ = chat.prompt(processor, records[0])
        prompt = chat.encode_prompt(processor, messages, records[0]["images"])
        item, sp, box = {"input_ids": prompt, "images": records[0]["images"]}, dict(max_new_tokens=16), []
        t = threading.Thread(target=lambda: box.append(eng.generate([item, item], sp)))
        t.start()
        held(rec, 2)
        eng.abort()
        t.join(60)
        assert [c["finish"] for c in box[0]] == ["abort"] * 2 and [len(c["ids"]) for c in box[0]] == [4, 4], box
        cut = box[0][0]
        rest = eng.generate([dict(item, input_ids=prompt + cut["ids"])], sp)[0]
        ids, lps, finish = fake_output(prompt, 16, weights_digest(ckpt))
        assert (cut["ids"] + rest["ids"], cut["logprobs"] + rest["logprobs"], rest["finish"]) == (ids, lps, finish)
        assert [r["json"] for r in read_record(rec) if r["path"] == "/abort_request"] == [{"abort_all": True}]
    finally:
        eng.shutdown()


def aborted_answer(eng, rec, item, sp):
    """The engine's answer to `item` once the server holds it (--fake-hold) and an abort comes."""
    box = []
    t = threading.Thread(target=lambda: box.append(eng.generate([item], sp)[0]))
    t.start()
    held(rec)
    eng.abort()
    t.join(60)
    return box[0]


def parked(processor, rec, args, n):
    """(record, prompt, [episode]): a --partial-rollout group parked with n tokens of a turn (not FAKE_IDS)."""
    prompt = chat.prompt(processor, rec, env_geo3k if args.max_turns > 1 else None)
    ep = rollout.new_episode(processor, rec, args, prompt)
    s = ep.sample
    s.response_ids, s.loss_mask, s.rollout_logprobs, s.versions = [100] * n, [1] * n, [-1.0] * n, [0] * n
    return rec, prompt, [ep]


def test_an_abort_that_lands_on_a_turns_last_token_ends_the_turn(ckpt, processor, records, tmp_path, monkeypatch):
    """SGLang answers finish "abort" for a request its abort caught one decode step before its end: that step's
    token is kept, and the abort is checked before the stop and length checks (schedule_batch.py:2007-2014).
    The engine reports what ended the turn. Here --partial-rollout stops (a parked group needs one token) while
    record 1's sample is held before its <|im_end|> (--fake-hold 6; the parked group's request goes once it is):
    its turn ends there, decoded and scored, every token trained, and the next rollout sends nothing more for it.
    At the length cap: "length"."""
    args = rollout_args(n_samples_per_prompt=1, rollout_batch_size=1, partial_rollout=True, over_sampling_batch_size=2,
                        rollout_max_response_len=11)
    recs = [dict(r, index=i, images=[]) for i, r in enumerate(records[:2])]  # text: no image processor to load
    eng, rec = sglang(ckpt, tmp_path / "stop", "--fake-hold", "6")
    try:
        parked_goes_after(eng, lambda: held(rec))
        monkeypatch.setitem(reward.SHAPING, "length", reward.Shaping(lambda s, rec, cfg: len(s.response_text), {}))
        ro = rollout.Rollout(eng, processor, args, target=1, cap=2)
        ro.groups = {0: parked(processor, recs[0], args, 10)}
        ro.resume(recs[1:], 0)
        first = ro.take(1)
        ro.pause()
        assert [(s.index, s.status) for s in first] == [(0, "truncated")]  # its one token: the length cap
        [(_, _, [ep])] = ro.groups.values()  # complete too, beyond the batch: it waits for the next step
        s, (ids, lps, _) = ep.sample, fake_output(ep.sample.prompt_ids, 11, weights_digest(ckpt))
        text = processor.tokenizer.decode(ids[:-1], skip_special_tokens=False)
        assert ep.done and ids[-1] == 151645 and (s.status, s.turns, s.response_ids, s.rollout_logprobs) == (
            "completed", 1, ids, lps)
        assert s.loss_mask == [1] * 7 and s.response_text == text and s.metadata["shaping"]["length"] == len(text)
        n = len(read_record(rec))
        ro.resume([], 1)
        assert [x.index for x in ro.take(1)] == [1]
        ro.pause()
        assert len(read_record(rec)) == n and ro.groups == {}  # nothing generated after its <|im_end|>
    finally:
        eng.shutdown()
    eng, rec = sglang(ckpt, tmp_path / "length", "--fake-hold", "0")
    try:
        item = {"input_ids": [151644, 100, 151645], "images": []}
        out = aborted_answer(eng, rec, item, dict(max_new_tokens=1))
        assert (len(out["ids"]), out["finish"]) == (1, "length")
    finally:
        eng.shutdown()


def test_an_abort_before_any_token_leaves_an_r3_sample_open(ckpt, processor, records, tmp_path):
    """R3 + --partial-rollout: a request aborted in SGLang's queue (or mid chunked prefill) answers no tokens and no
    routed_experts (scheduler.py:5685-5702, 3807-3827): nothing generated yet, not an error; the sample stays
    open and its continuation asks routes from where they end (routed_rows)."""
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "queue", "--enable-return-routed-experts")
    try:
        eng.route_shape = (json.loads((Path(ckpt) / "config.json").read_text())["text_config"]["num_hidden_layers"], 2)
        out = aborted_answer(eng, rec, {"input_ids": [151644, 100, 151645], "images": []}, dict(max_new_tokens=8))
        assert out == {"ids": [], "logprobs": [], "finish": "abort", "prompt_tokens": None}
        args = rollout_args()
        _, _, [ep] = parked(processor, records[0], args, 0)
        assert rollout._finish_turn(ep, out, processor, args, [151645, 151643], ours=True)
        assert ep.sample.status == "completed" and rollout.routed_rows(ep.sample) == 0
    finally:
        eng.shutdown()


def test_a_hung_abort_holds_no_lock_of_the_rollout(ckpt, processor, records, tmp_path):
    """--partial-rollout's abort goes to each server with a short timeout and never under the rollout's lock:
    here the server takes 60 s to answer it (--fake-abort-delay), the abort never lands, and the request it
    meant to cut (record 1's, held before its token 4 until the abort has come: --fake-hold 4 with a gate) ends on
    its own; the rollout ends once it has, after one ABORT_TIMEOUT, not after 60 s."""
    args = rollout_args(n_samples_per_prompt=1, rollout_batch_size=1, partial_rollout=True, over_sampling_batch_size=2,
                        rollout_max_response_len=11)
    recs = [dict(r, index=i, images=[]) for i, r in enumerate(records[:2])]  # text: no image processor to load
    gate = tmp_path / "gate"
    gate.touch()
    eng, rec = sglang(ckpt, tmp_path, "--fake-abort-delay", "60", "--fake-hold", "4", "--fake-gate", str(gate))

    def release():  # the gate goes once the abort has reached the server (which answers it in 60 s)
        wait_for(lambda: any(r["path"] == "/abort_request" for r in read_record(rec)), "the abort at the server")
        gate.unlink()
    try:  # the parked group needs 3 tokens (never its token 4), record 1's group 7: held before its 4th
        parked_goes_after(eng, lambda: held(rec))
        ro, t = rollout.Rollout(eng, processor, args, target=1, cap=2), time.time()
        ro.groups = {0: parked(processor, recs[0], args, 8)}
        threading.Thread(target=release, daemon=True).start()
        ro.resume(recs[1:], 0)
        first = ro.take(1)
        ro.pause()
        took = time.time() - t
        assert [s.index for s in first] == [0] and [r["path"] for r in read_record(rec)].count("/abort_request") >= 1
        [(_, _, [ep])] = ro.groups.values()
        assert ep.done and ep.sample.status == "completed" and len(ep.sample.response_ids) == 7  # it ended on its own
        assert took < 30, f"the rollout waited {took:.0f} s for an abort the server took 60 s to answer"
    finally:
        eng.shutdown()
