"""rollout.py's episodes on CPU with scripted engines: a multi-turn crop episode's tokens against the whole
conversation rendered at once, its turn and context budgets, the overlong penalty, tool calls counted, truncation
and failed samples (logprobs against the model: tests/test_rollout.py; groups and scheduling: test_rollout_groups.py).

    .venv/bin/pytest tests/test_episodes.py -q
"""
import dataclasses
import itertools

import pytest

import data
import env_geo3k
import reward
import rollout
import chat
import train_grpo
from conftest import grpo_args, rollout_args
from fakes import ANSWER, CROP_CALL, ScriptedEngine
import fakes


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
    assert observation.startswith("Zoomed into image 0 (64x64 px")
    messages = data.prompt_messages(rec, multi_turn=True) + [
        {"role": "assistant", "content": CROP_CALL},
        {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": observation}]},
        {"role": "assistant", "content": ANSWER}]
    # tools/tiny.py's template renders tools=, so the specs go there, in its format, not in the system text
    text = processor.apply_chat_template(messages, tools=env_geo3k.specs(env_geo3k.offered()), tokenize=False)
    assert '"name": "image_zoom_in_tool"' in text and "<tools>" in text
    full = processor(text=[text.removesuffix("\n")], images=data.views(s.images))["input_ids"][0]
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


def test_the_prompt_instruction_is_the_runs(processor, records, tmp_path):
    """--prompt-instruction ends the user turn of every prompt, a rollout's single- and multi-turn, training's and
    evaluation's (GRPO), and SFT's training and evaluation rows (issue 75: its eval set was geo3k's); "" gives none;
    the multi-turn system prompt names no task (a fork's counting task is told nothing of geometry). data.py show:
    tests/test_data.py."""
    import sft
    from tools import synth
    problem = records[0]["problem"].split("<image>")[-1].strip()
    rows = synth.write_synth(tmp_path, 1, n_test=1, seed=0)
    for instruction in ("Count the sides.", ""):
        args = sft.parse_args(["--hf-checkpoint", "x", "--prompt-data", str(rows), "--eval-prompt-data", str(rows),
                               "--save", "x", "--prompt-instruction", instruction])
        for evaluation in (False, True):  # the rows SFT trains on and those it evaluates on
            (item,) = sft.items(args, processor, evaluation=evaluation)
            (row,) = data.load_geo3k(rows, "test" if evaluation else "train")
            user = processor.tokenizer.decode(item.ids).split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            ending = row["problem"].split("<image>")[-1].strip() + ("\n" + instruction if instruction else "")
            assert user.endswith(ending) and "geometry" not in user, (evaluation, user)
        ids = [list(sft.encode(processor, records[0], args.prompt_instruction).ids)]
        for turns, evaluation in itertools.product((1, 2), (False, True)):  # training's rollouts and evaluation's
            eng = ScriptedEngine(processor, ["\\boxed{3}"])
            cfg = rollout.settings(grpo_args(max_turns=turns, n_samples_per_prompt=1, rollout_max_response_len=10,
                                             rollout_batch_size=None, prompt_instruction=instruction), evaluation)
            ids.append(fakes.run_episodes(eng, processor, records[:1], cfg)[0].prompt_ids)
        for prompt in map(processor.tokenizer.decode, ids):
            user = prompt.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
            assert user.endswith(problem + ("\n" + instruction if instruction else "")) and "geometry" not in prompt


def test_what_raises_is_counted_printed_once_and_a_judge_raising_on_every_sample_stops(processor, records, monkeypatch,
                                                                                        capsys):
    """A judge reading a column some rows lack (KeyError) scores them 0.0, counted in the step's metrics as
    <name>_errors, its first traceback printed once with the row; a tool's own bug is counted too, and the episode goes
    on with an error observation; a rollout whose judge raised on every sample stops the run with that traceback."""
    def broken(env, arguments):
        raise RuntimeError("a bug of the tool's")
    monkeypatch.setattr(reward, "_TOLD", {})
    monkeypatch.setitem(reward.REWARDS, "choice", lambda response, record: record["choices"][0] in response)
    monkeypatch.setitem(env_geo3k.TOOLS, "broken", env_geo3k.Tool(broken, "broken", "broken", {"n": {"type": "integer"}},
                                                                  {"n": 1}))
    call = '<tool_call>{"name": "broken", "arguments": {"n": 1}}</tool_call>'
    recs = [dict(records[0], choices=["3"], tools=["broken"]), dict(records[1], tools=["broken"])]
    cfg = rollout_args(max_turns=2, rm_type="choice", rollout_max_response_len=400)
    samples = fakes.run_episodes(ScriptedEngine(processor, [call, "\\boxed{3}"]), processor, recs, cfg)
    assert [(s.status, s.turns, s.correct) for s in samples] == [("completed", 2, True)] * 2 + [("completed", 2, False)] * 2
    step = samples[0].metadata["steps"][0]
    assert step["observation"].startswith("Error: the tool failed (RuntimeError: a bug of the tool's)") and step["tool"] == "broken"
    m = train_grpo.rollout_metrics(samples)
    assert m["choice_errors"] == 2 and m["broken_errors"] == 4
    err = capsys.readouterr().err  # each entry's first, with its row
    assert err.count("Traceback") == 2 and "KeyError: 'choices'" in err and "RuntimeError: a bug" in err
    assert f"choice raised on the row {{'problem': {records[1]['problem']!r}" in err
    with pytest.raises(SystemExit, match="(?s)--rm-type choice raised or ran past its time bound .--rm-timeout. on every "
                                         "sample of this rollout.*KeyError: 'ch"):
        fakes.run_episodes(ScriptedEngine(processor, ["\\boxed{3}"]), processor, records[1:2], rollout_args(rm_type="choice"))


def test_a_judge_past_its_time_bound_is_counted_said_once_and_on_every_sample_stops_naming_the_bound(
        processor, records, monkeypatch, capsys):
    """Issue 75: a judge slower than the bound scored 0.0 on every sample, nothing said, rc 0. Its time-outs are counted
    (<name>_timeouts) and the first said with its row; --rm-timeout is the bound; a rollout whose every sample timed
    out stops, naming it. The slow rows loop until cut: no clock is read."""
    def slow(response, record):
        while record.get("slow"):
            pass
        return "3" in response
    monkeypatch.setattr(reward, "_TOLD", {})
    monkeypatch.setitem(reward.REWARDS, "slow", slow)
    cfg = rollout_args(rm_type="slow", rm_timeout=0.05)
    samples = fakes.run_episodes(ScriptedEngine(processor, ["\\boxed{3}"]), processor,
                                 [dict(records[0], slow=True), records[1]], cfg)
    assert [s.correct for s in samples] == [False, False, True, True]
    assert train_grpo.rollout_metrics(samples)["slow_timeouts"] == 2 and "slow_errors" not in train_grpo.rollout_metrics(samples)
    err = capsys.readouterr().err
    assert err.count("[error] slow ran past its time bound (0.05 s: --rm-timeout) on the row {'problem'") == 1, err
    with pytest.raises(SystemExit, match="(?s)--rm-type slow raised or ran past its time bound .--rm-timeout. on every "
                                         "sample.*slow ran past its time bound .0.05 s: --rm-timeout."):
        fakes.run_episodes(ScriptedEngine(processor, ["\\boxed{3}"]), processor, [dict(records[1], slow=True)], cfg)
    # the same judge as calc_score's oracle, in a multi-turn episode: bounded by --rm-timeout, counted, not silent
    call = '<tool_call>{"name": "calc_score", "arguments": {"answer": "3"}}</tool_call>'
    cfg = rollout_args(rm_type="slow", rm_timeout=0.05, max_turns=2, rollout_max_response_len=400)
    monkeypatch.setitem(reward.REWARDS, "slow", lambda response, record: slow(response, dict(record, slow=response == "\\boxed{3}")))
    samples = fakes.run_episodes(ScriptedEngine(processor, [call, "so \\boxed{3}"]), processor, records[1:2], cfg)
    assert train_grpo.rollout_metrics(samples)["slow_timeouts"] == 2 and all(s.correct for s in samples)
    assert all(s.metadata["steps"][0]["timeouts"]["slow"] for s in samples)
