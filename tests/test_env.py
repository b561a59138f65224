"""env_geo3k: a table of model outputs (each asserting observation, done and info), episode
rules, crop pixels against PIL, and a crop + calc_score episode through the chat template.

    .venv/bin/pytest tests/test_env.py -q
"""
import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

import env_geo3k
from fakes import make_env, picture

ANY = object()  # the info field is not checked
ZOOM = "image_zoom_in_tool"
FORMAT = '<tool_call>\n{"name": "calc_score", "arguments": {"answer": "42"}}\n</tool_call>'


def call(name, arguments, **extra):
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments, **extra})}\n</tool_call>"


def calc(answer):
    return call("calc_score", {"answer": answer})


def xml(name, **params):
    """A call in Qwen3.5's XML form, as its chat template writes one (raw strings, JSON lists)."""
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


XML_FORMAT = "<tool_call>\n<function=calc_score>\n<parameter=answer>\n42\n</parameter>\n</function>\n</tool_call>"


OK = dict(done=False, ran=True, error=None)


def bad(error, tool=ANY, **kw):
    return dict(done=False, ran=False, error=error, tool=tool, score=None, **kw)


# (id, response, expected obs substring, expected info/done fields)
CASES = [
    # well-formed calls
    ("calc_right", calc("80"), "Correct: 80", dict(OK, tool="calc_score", score=1.0, n_calls=1)),
    ("calc_wrong", calc("30"), "Incorrect: 30", dict(OK, tool="calc_score", score=0.0)),
    ("alias", call("calc_geo3k_reward", {"answer": "80"}), "Correct",
     dict(OK, tool="calc_geo3k_reward", score=1.0)),
    ("alias_wrong", call("calc_geo3k_reward", {"answer": "81"}), "Incorrect", dict(OK, score=0.0)),
    ("thinking_before", "First, angle C is 40.\n" + calc("80"), "Correct", dict(OK, score=1.0)),
    ("compact_no_newlines", '<tool_call>{"name":"calc_score","arguments":{"answer":"80"}}</tool_call>',
     "Correct", dict(OK, score=1.0)),
    ("answer_number", calc(80), "Correct: 80", dict(OK, score=1.0, arguments={"answer": 80})),
    ("answer_latex_escaped", calc("\\frac{160}{2}"), "\\frac{160}{2}", dict(OK, score=1.0)),
    ("latex_single_backslash_ff",  # json reads \f as form feed: the env restores "\frac"
     '<tool_call>{"name": "calc_score", "arguments": {"answer": "\\frac{1}{2}"}}</tool_call>',
     "Incorrect: \\frac{1}{2}", dict(OK, score=0.0)),
    ("latex_invalid_escape",
     '<tool_call>{"name": "calc_score", "arguments": {"answer": "\\sqrt{3}"}}</tool_call>',
     "invalid JSON", bad("invalid JSON", tool=None)),
    ("nested_braces_in_string", calc("}{ {{\\frac{1}{2}}} }"), "Incorrect", dict(OK, score=0.0)),
    ("close_tag_in_string", calc("a</tool_call"), "Incorrect", dict(OK, score=0.0)),
    ("unicode_answer", call("calc_score", {"answer": "80°"}), "80°", dict(OK, score=1.0)),
    ("unicode_escapes", '<tool_call>{"name": "calc_score", "arguments": {"answer": "\\u0038\\u0030"}}'
     '</tool_call>', "Correct: 80", dict(OK, score=1.0)),
    ("unicode_text_around", "答案是八十。" + calc("80") + " ✓", "Correct", dict(OK, score=1.0)),
    ("unicode_tool_name", call("cr\u043ep", {"bbox_2d": [0, 0, 10, 10]}), "unknown tool", bad("unknown tool")),
    ("code_like_answer", calc("__import__('os').system('rm -rf /')"), "Incorrect",
     dict(OK, score=0.0)),
    ("code_like_name", call("__import__('os').getcwd()", {"answer": "1"}), "unknown tool",
     bad("unknown tool", tool="__import__('os').getcwd()")),
    ("code_like_bbox", call(ZOOM, {"bbox_2d": "__import__('os').listdir('.')"}), "4 numbers",
     bad("4 numbers", tool=ZOOM)),
    # no call: the episode ends
    ("no_call_boxed", "The answer is \\boxed{80}.", "", dict(done=True, tool=None, ran=False, n_calls=0)),
    ("empty_response", "", "", dict(done=True, tool=None, ran=False, error=None)),
    ("stray_close_tag", "oops </tool_call> \\boxed{3}", "", dict(done=True, n_calls=0)),
    ("tool_call_in_prose", "I could use tool_call here: \\boxed{80}", "", dict(done=True, n_calls=0)),
    # several calls: the last one runs
    ("two_calls_last_right", calc("30") + calc("80"), "Correct: 80",
     dict(OK, score=1.0, n_calls=2, note="2 tool calls found; executed the last")),
    ("three_calls_last_zoom", calc("1") + calc("2") + call(ZOOM, {"bbox_2d": [0, 0, 100, 100]}),
     "Zoomed into image 0", dict(OK, tool=ZOOM, n_calls=3, note="3 tool calls found; executed the last")),
    ("calls_last_malformed", calc("80") + "<tool_call>{'name': 'crop'}</tool_call>", "invalid JSON",
     bad("invalid JSON", n_calls=2)),
    ("calls_last_unclosed", calc("80") + '<tool_call>{"name": "calc_score"', "unclosed",
     bad("unclosed", n_calls=2)),
    # malformed JSON and shapes
    ("trailing_comma_obj", '<tool_call>{"name": "calc_score", "arguments": {"answer": "80"},}</tool_call>',
     "invalid JSON", bad("invalid JSON")),
    ("trailing_comma_args", '<tool_call>{"name": "calc_score", "arguments": {"answer": "80",}}</tool_call>',
     "invalid JSON", bad("invalid JSON")),
    ("single_quotes", "<tool_call>{'name': 'calc_score', 'arguments': {'answer': '80'}}</tool_call>",
     "invalid JSON", bad("invalid JSON")),
    ("unclosed_brace", '<tool_call>{"name": "calc_score", "arguments": {"answer": "80"}</tool_call>',
     "invalid JSON", bad("invalid JSON")),
    ("unclosed_tag", '<tool_call>{"name": "calc_score", "arguments": {"answer": "80"}}', "unclosed",
     bad("unclosed", n_calls=1)),
    ("empty_call", "<tool_call></tool_call>", "invalid JSON", bad("invalid JSON")),
    ("python_call_syntax", "<tool_call>calc_score(answer='80')</tool_call>", "invalid JSON",
     bad("invalid JSON")),
    ("nan_constant", '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [NaN, 0, 1, 1]}}</tool_call>',
     "invalid JSON", bad("invalid JSON")),
    ("json_array", f"<tool_call>[{json.dumps({'name': 'calc_score', 'arguments': {'answer': '80'}})}]"
     "</tool_call>", "must be a JSON object", bad("got list", tool=None)),
    ("json_string", '<tool_call>"calc_score"</tool_call>', "must be a JSON object", bad("got str")),
    ("deep_nesting", '<tool_call>{"name": "calc_score", "arguments": {"answer": ' + "[" * 1900
     + "]" * 1900 + "}}</tool_call>", "nested too deeply", bad("nested too deeply")),
    ("payload_100kb", calc("8" * 100_000), "limit is 4096", bad("the limit is 4096", tool=None)),
    ("missing_arguments", '<tool_call>{"name": "calc_score"}</tool_call>', '"arguments" object',
     bad('non-empty "arguments"', tool="calc_score", arguments=None)),
    ("empty_arguments", call("calc_score", {}), '"arguments" object', bad('non-empty "arguments"')),
    ("arguments_as_string", call("calc_score", '{"answer": "80"}'), '"arguments" object',
     bad('"arguments" object')),
    ("arguments_null", call("calc_score", None), '"arguments" object', bad('"arguments" object')),
    ("missing_name", '<tool_call>{"arguments": {"answer": "80"}}</tool_call>', 'string "name"',
     bad('string "name"', tool=None)),
    ("name_number", '<tool_call>{"name": 5, "arguments": {"answer": "80"}}</tool_call>',
     'string "name"', bad('string "name"')),
    ("unknown_tool", call("search", {"query": "x"}), "unknown tool 'search'", bad("unknown tool")),
    ("extra_top_key", call("calc_score", {"answer": "80"}, id=1), "unexpected key 'id'",
     bad("unexpected key", arguments={"answer": "80"})),
    ("calc_wrong_key", call("calc_score", {"ans": "80"}), "missing argument 'answer'",
     bad("missing argument", tool="calc_score", arguments={"ans": "80"})),
    ("calc_extra_key", call("calc_score", {"answer": "80", "why": "x"}), "unexpected argument 'why'",
     bad("unexpected argument")),
    ("calc_empty_answer", calc("  "), "non-empty string", bad("non-empty string")),
    ("calc_null_answer", calc(None), "non-empty string", bad("non-empty string")),
    ("calc_list_answer", calc(["80"]), "non-empty string", bad("non-empty string")),
    ("calc_bool_answer", calc(True), "non-empty string", bad("non-empty string")),
    # image_zoom_in_tool: the table's env has no checkpoint, so boxes are relative 0-1000 (picture(): 200x100 px)
    ("zoom_ok", call(ZOOM, {"bbox_2d": [50, 200, 550, 700], "label": "angle C"}),
     "Zoomed into image 0 (100x50 px, shown at 200x100); it is now image 1",
     dict(OK, tool=ZOOM, score=None, arguments={"bbox_2d": [50, 200, 550, 700], "label": "angle C"}, n_images=1)),
    ("zoom_whole", call(ZOOM, {"bbox_2d": [0, 0, 1000, 1000]}), "(200x100 px, shown at 200x100)",
     dict(OK, n_images=1)),
    ("zoom_small_upscaled", call(ZOOM, {"bbox_2d": [0, 0, 50, 100], "image": 0}), "(10x10 px, shown at 60x60)",
     dict(OK, n_images=1)),
    ("zoom_floats_round_outwards", call(ZOOM, {"bbox_2d": [48.2, 201, 550, 695.5]}), "(101x50 px", dict(OK)),
    ("zoom_old_name", call("crop", {"bbox_2d": [50, 200, 550, 700]}), "Zoomed into image 0",
     dict(OK, tool="crop", n_images=1)),
    ("zoom_old_name_old_argument", call("crop", {"bbox": [10, 20, 110, 70]}), "missing argument 'bbox_2d'",
     bad("missing argument", tool="crop")),
    ("zoom_strings", call(ZOOM, {"bbox_2d": ["10", "20", "110", "70"]}), "4 numbers",
     bad("must be 4 numbers", tool=ZOOM, n_images=0)),
    ("zoom_pixels_out_of_range", call(ZOOM, {"bbox_2d": [0, 0, 1500, 50]}), "0 <= x1 < x2 <= 1000 and 0 <= y1 < y2 <= 1000 (image 0 in your grounding frame)",
     bad("4 numbers")),
    ("zoom_inverted", call(ZOOM, {"bbox_2d": [550, 200, 50, 700]}), "0 <= x1 < x2 <= 1000", bad("4 numbers")),
    ("zoom_zero_area", call(ZOOM, {"bbox_2d": [50, 100, 550, 100]}), "0 <= y1 < y2 <= 1000", bad("4 numbers")),
    ("zoom_negative", call(ZOOM, {"bbox_2d": [-5, 0, 10, 10]}), "0 <= x1", bad("4 numbers")),
    ("zoom_three_numbers", call(ZOOM, {"bbox_2d": [1, 2, 3]}), "4 numbers", bad("4 numbers")),
    ("zoom_bbox_dict", call(ZOOM, {"bbox_2d": {"x1": 0}}), "4 numbers", bad("4 numbers")),
    ("zoom_bools", call(ZOOM, {"bbox_2d": [True, 0, 10, 10]}), "4 numbers", bad("4 numbers")),
    ("zoom_infinity", '<tool_call>{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 1e400, 10]}}'
     '</tool_call>', "4 numbers", bad("4 numbers")),
    ("zoom_thin", call(ZOOM, {"bbox_2d": [0, 0, 1000, 20]}), "1:50", bad("thinner")),
    ("zoom_bad_image_index", call(ZOOM, {"bbox_2d": [0, 0, 10, 10], "image": 1}), "from 0 to 0",
     bad('"image" must be')),
    ("zoom_image_as_string", call(ZOOM, {"bbox_2d": [0, 0, 10, 10], "image": "0"}), "from 0 to 0",
     bad('"image" must be')),
    ("zoom_missing_bbox", call(ZOOM, {"box": [0, 0, 10, 10]}), "missing argument 'bbox_2d'",
     bad("missing argument")),
    # Qwen3.5's XML form: string parameters stay text, others are JSON
    ("xml_calc_right", xml("calc_score", answer="80"), "Correct: 80",
     dict(OK, tool="calc_score", score=1.0, arguments={"answer": "80"})),
    ("xml_alias", xml("calc_geo3k_reward", answer="81"), "Incorrect: 81", dict(OK, score=0.0)),
    ("xml_latex_raw", xml("calc_score", answer="\\frac{160}{2}"), "Correct: \\frac{160}{2}",
     dict(OK, score=1.0, arguments={"answer": "\\frac{160}{2}"})),
    ("xml_answer_json_looking", xml("calc_score", answer="[1, 2]"), "Incorrect: [1, 2]",
     dict(OK, arguments={"answer": "[1, 2]"})),
    ("xml_zoom", xml(ZOOM, bbox_2d=[50, 200, 550, 700], label="[1, 2]", image=0), "Zoomed into image 0 (100x50 px",
     dict(OK, tool=ZOOM, arguments={"bbox_2d": [50, 200, 550, 700], "label": "[1, 2]", "image": 0}, n_images=1)),
    ("xml_zoom_old_name", xml("crop", bbox_2d=[50, 200, 550, 700]), "(100x50 px", dict(OK, tool="crop")),
    ("xml_compact", "<tool_call><function=calc_score><parameter=answer>80</parameter></function></tool_call>",
     "Correct", dict(OK, score=1.0)),
    ("xml_text_around", "Let me check.\n" + xml("calc_score", answer="80") + "\n", "Correct", dict(OK)),
    ("xml_after_json", calc("30") + xml("calc_score", answer="80"), "Correct: 80", dict(OK, n_calls=2)),
    ("xml_bbox_not_json", xml(ZOOM, bbox_2d="0 0 10 10"), "4 numbers", bad("4 numbers", tool=ZOOM)),
    ("xml_bbox_nan", xml(ZOOM, bbox_2d="[NaN, 0, 1, 1]"), "4 numbers", bad("4 numbers")),
    ("xml_image_as_text", xml(ZOOM, bbox_2d=[0, 0, 10, 10], image="first"), "from 0 to 0",
     bad('"image" must be')),
    ("xml_unknown_tool", xml("search", query="x"), "unknown tool 'search'", bad("unknown tool", tool="search")),
    ("xml_missing_required", xml(ZOOM, image=0), "missing argument 'bbox_2d'", bad("missing argument")),
    ("xml_unclosed_function", "<tool_call>\n<function=calc_score>\n<parameter=answer>\n80\n</parameter>\n"
     "</tool_call>", "unclosed <function", bad("unclosed <function", tool=None)),
    ("xml_no_name", "<tool_call><function=><parameter=answer>80</parameter></function></tool_call>",
     "function name", bad("function name", tool=None)),
    ("xml_no_parameters", "<tool_call><function=calc_score></function></tool_call>", "at least one",
     bad("at least one <parameter", tool="calc_score")),
    ("xml_duplicate", "<tool_call><function=calc_score><parameter=answer>1</parameter>"
     "<parameter=answer>80</parameter></function></tool_call>", "given twice", bad("given twice")),
    ("xml_stray_text", "<tool_call><function=calc_score>answer: 80<parameter=answer>80</parameter>"
     "</function></tool_call>", "unexpected text 'answer: 80'", bad("unexpected text")),
    ("xml_unclosed_parameter", "<tool_call><function=calc_score><parameter=answer>80</function></tool_call>",
     "unexpected text", bad("unexpected text")),
]


@pytest.fixture
def high_recursion_limit():
    """The table runs at the recursion limit a process has once torch inductor compiled (2,000+; here 20,000):
    no guard may lean on the interpreter's state (issue 49, item 10)."""
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    yield
    sys.setrecursionlimit(old)


def every_tool():
    """The table's env: a row offering every tool in TOOLS (a fork's default=False one too)."""
    return make_env(row={"answer": "80", "images": [picture()], "tools": list(env_geo3k.TOOLS)})


@pytest.mark.parametrize("response,text,expect", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_step_table(response, text, expect, high_recursion_limit):
    env = every_tool()
    env.reset()
    obs, done, info = env.step(response)
    assert {"turn", "tool", "arguments", "ran", "error", "score", "n_calls", "note"} <= set(info)  # a tool's info joins
    assert info["turn"] == 1 and isinstance(obs["text"], str)
    assert text in obs["text"], obs["text"]
    expect = dict(expect)
    assert done == expect.pop("done")
    n_images = expect.pop("n_images", None)
    if n_images is not None:
        assert len(obs["images"]) == n_images
    for key, want in expect.items():
        if want is ANY:
            continue
        if key == "error" and want is not None:
            assert want in info["error"], info["error"]
        else:
            assert info[key] == want, (key, info)
    if info["error"]:  # every error shows the exact call format (the one the model used) and the tools
        used_xml = "<function=" in response.rsplit("<tool_call>", 1)[-1]
        assert obs["text"].startswith("Error: ") and (XML_FORMAT if used_xml else FORMAT) in obs["text"]
        assert "- image_zoom_in_tool {" in obs["text"] and obs["images"] == [] and info["score"] is None
    assert obs["images"] == env.images[1:]  # what a step shows is what it added to the images seen
    assert len(obs["text"]) < 2000  # feedback stays short, whatever the model sent


def test_table_runs_every_tool_in_both_call_formats():
    """A tool (or call format) added without table cases that run it fails here."""
    ran = set()
    for _, response, _, _ in CASES:
        env = every_tool()
        _, _, info = env.step(response)
        if info["ran"]:
            ran.add((info["tool"], "xml" if "<function=" in response.rsplit("<tool_call>", 1)[-1] else "json"))
    assert ran == {(name, form) for name in [*env_geo3k.TOOLS, *env_geo3k.ALIASES] for form in ("json", "xml")}


def test_tool_declarations_make_the_prompt_and_the_offer():
    """Each declaration's spec is a template's JSON schema; the alias runs but is not advertised; a row's
    `tools` (or the default ones) is what the env runs and the prompt lists, nothing else."""
    for name, tool in env_geo3k.TOOLS.items():
        spec = tool.spec(name)
        params = spec["function"]["parameters"]
        assert spec["type"] == "function" and params["type"] == "object" and spec["function"]["name"] == name
        assert set(params["required"]) <= set(params["properties"]) and tool.usage.startswith(name + " {")
    everything = env_geo3k.offered()
    assert [s["function"]["name"] for s in env_geo3k.specs(everything)] == ["calc_score", ZOOM]
    assert env_geo3k.ALIASES == {"calc_geo3k_reward": "calc_score", "crop": ZOOM} and everything == ["calc_score", ZOOM]
    listed = env_geo3k.usage(everything)
    assert "- calc_score {" in listed and "- image_zoom_in_tool {" in listed and "calc_geo3k_reward" not in listed
    assert "crop" not in listed and env_geo3k.offered(["crop"]) == [ZOOM]  # a row of before the rename still runs
    crop_only = env_geo3k.offered([ZOOM])
    assert "calc_score" not in env_geo3k.usage(crop_only) + env_geo3k.usage(crop_only, xml=True)
    assert '{"name": "image_zoom_in_tool", "arguments": {"bbox_2d": [0, 0, 100, 100]}}' in env_geo3k.usage(crop_only)
    assert ("<function=image_zoom_in_tool>\n<parameter=bbox_2d>\n[0, 0, 100, 100]\n</parameter>"
            in env_geo3k.usage(crop_only, xml=True))
    assert len(env_geo3k.specs(crop_only)) == 1
    env = env_geo3k.build_env({"answer": "80", "images": [picture()], "tools": [ZOOM]}, SimpleNamespace(max_turns=3))
    assert "unknown tool 'calc_score'; tools are image_zoom_in_tool" in env.step(calc("80"))[2]["error"]


def test_answers_and_scores_recorded_and_reset():
    env = make_env()
    env.step(calc("30"))
    env.step(calc(80))
    env.step(call(ZOOM, {"bbox_2d": [0, 0, 250, 500]}))
    assert env.answers == ["30", "80"] and env.last_score == 1.0 and len(env.images) == 2
    assert env.step('<tool_call>{"name": "calc_score", "arguments": {"answer": "\\theta"}}'
                    '</tool_call>')[2]["ran"] and env.answers[-1] == "\\theta"
    assert env.reset() == ({"text": "", "images": []}, {"turn": 0})
    assert env.answers == [] and env.last_score is None and env.turn == 0 and len(env.images) == 1


def test_max_turns_and_last_turn_warning():
    env = make_env(max_turns=3)
    obs, done, info = env.step(calc("30"))
    assert not done and "last turn" not in obs["text"]
    obs, done, info = env.step(calc("30"))  # turn 2 of 3: the next answer is the final one
    assert not done and "last turn" in obs["text"] and "\\boxed{" in obs["text"]
    obs, done, info = env.step(call(ZOOM, {"bbox_2d": [0, 0, 250, 500]}))
    assert done and info["turn"] == 3 and info["ran"] and "last turn" not in obs["text"]
    env = make_env(max_turns=2)
    obs, done, _ = env.step("garbage <tool_call>{,}</tool_call>")
    assert not done and "last turn" in obs["text"]  # errors warn too
    assert env.step("<tool_call>{,}</tool_call>")[1]  # an error on the last turn still ends it
    assert make_env(max_turns=1).step(calc("80"))[1]


def test_rm_type_selects_the_reward():
    assert make_env().step(calc("80.5"))[2]["score"] == 0.0
    assert make_env(rm_type="geo3k").step(calc("80.5"))[2]["score"] == 1.0  # within 5%


def test_oracle_off_records_without_judging():
    for answer in ["80", "30"]:
        env = make_env(oracle=False)
        obs, done, info = env.step(calc(answer))
        assert obs["text"] == f"Answer recorded: {answer}."
        assert info["ran"] and info["score"] is None and env.last_score is None
        assert env.answers == [answer]


def test_build_env_args_and_samples():
    with pytest.raises(ValueError, match="max_turns"):
        env_geo3k.build_env({"answer": "1", "images": []}, SimpleNamespace(rollout_batch_size=2))
    with pytest.raises(ValueError, match="max_turns"):
        env_geo3k.build_env({"answer": "1", "images": []})
    # a Sample-like object (attributes), extra keyword arguments ignored
    sample = SimpleNamespace(label="80", images=[picture()], prompt="p")
    env = env_geo3k.build_env(sample=sample, args=SimpleNamespace(max_turns=2), tokenizer=None)
    assert env.step(calc("80"))[2]["score"] == 1.0
    env.close()
    env = env_geo3k.build_env({"answer": "80", "images": []}, SimpleNamespace(max_turns=2))
    obs, done, info = env.step(call(ZOOM, {"bbox_2d": [0, 0, 1, 1]}))
    assert "no image" in info["error"] and not done


def test_forks_add_a_tool_with_one_declaration(monkeypatch):
    def echo(env, arguments):
        return arguments["text"][::-1], [], {}
    tool = env_geo3k.Tool(echo, 'echo {"text": "..."}: repeat the text backwards.', "Reverse a text.",
                          {"text": {"type": "string"}}, {"text": "abc"}, default=False)
    monkeypatch.setitem(env_geo3k.TOOLS, "echo", tool)
    assert "echo" not in env_geo3k.offered() and "echo" not in env_geo3k.usage(env_geo3k.offered())
    env = env_geo3k.build_env({"answer": "80", "images": [], "tools": ["echo", "calc_score"]},
                              SimpleNamespace(max_turns=5))
    assert env.step(call("echo", {"text": "abc"}))[0]["text"] == "cba"
    assert env.step(xml("echo", text="[1]"))[0]["text"] == "]1["  # its spec's string type keeps XML text
    assert '- echo {"text": "..."}' in env.step(call("nope", {"a": 1}))[0]["text"]
    assert env_geo3k.tool_metrics([[{"tool": "echo", "ran": True}]], [True], ["echo"]) == {"tool_calls_echo": 1.0}


def test_crop_pixels_match_pil():
    image = picture()
    env = make_env()
    obs, _, _ = env.step(call(ZOOM, {"bbox_2d": [50, 200, 550, 900]}))  # relative 0-1000: 100x70 px, no upscale
    assert np.array_equal(np.asarray(obs["images"][0]), np.asarray(image.crop((10, 20, 110, 90))))
    obs, _, _ = env.step(call(ZOOM, {"bbox_2d": [25, 70, 95, 170]}))  # 14x10 px -> x6 (sides >= 56)
    out, ref = obs["images"][0], image.crop((5, 7, 19, 17))
    assert out.size == (84, 60) and min(out.size) >= env_geo3k.MIN_SIDE
    assert np.array_equal(np.asarray(out.reduce(6)), np.asarray(ref))  # each pixel a 6x6 block
    obs, _, _ = env.step(call(ZOOM, {"bbox_2d": [0, 0, 600, 1000], "image": 1}))  # of a zoom: relative to image 1
    assert np.array_equal(np.asarray(obs["images"][0]), np.asarray(image.crop((10, 20, 70, 90))))
    env = make_env(min_pixels=64 * 64 * 4)  # area floor from the processor's min pixels
    out = env.step(call(ZOOM, {"bbox_2d": [0, 0, 500, 600]}))[0]["images"][0]
    assert out.size == (200, 120) and out.size[0] * out.size[1] >= 64 * 64 * 4


def test_format_observation():
    env = make_env()
    obs, _, _ = env.step(call(ZOOM, {"bbox_2d": [0, 0, 250, 500]}))
    msg = env.format_observation(obs)
    assert msg == {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": obs["text"]}]}
    obs, _, _ = env.step(calc("3"))
    assert env.format_observation(obs)["content"] == [{"type": "text", "text": obs["text"]}]


def test_episode_renders_through_chat_template(geo3k_real):
    from tools import tiny
    processor = tiny.tiny_processor("qwen3_vl")
    record = json.loads((geo3k_real / "test.jsonl").read_text().splitlines()[0])
    image = Image.open(geo3k_real / record["image"]).convert("RGB")
    env = env_geo3k.build_env({"answer": record["answer"], "images": [image]},
                              SimpleNamespace(max_turns=4))
    env.reset()

    def assistant(name, arguments):  # the call as the chat template renders it: what the model emits
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}

    messages = [{"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": record["problem"]}]}]
    images = [image]
    for name, arguments in [(ZOOM, {"bbox_2d": [20, 20, 120, 100]}),
                            ("calc_score", {"answer": record["answer"]})]:
        messages.append(assistant(name, arguments))
        generated = processor.apply_chat_template(messages[-1:], tokenize=False)
        obs, done, info = env.step(generated)
        assert info["ran"] and info["tool"] == name and info["arguments"] == arguments and not done
        messages.append(env.format_observation(obs))
        images += obs["images"]
    assert info["score"] == 1.0 and len(images) == 2
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.count("<tool_response>") == 2 and text.count("<|vision_start|>") == 2
    batch = processor(text=[text], images=images, return_tensors="pt")
    n_pad = int((batch["input_ids"] == 151655).sum())
    assert n_pad == int(batch["image_grid_thw"].prod(-1).sum()) // 4
    assert batch["image_grid_thw"].shape[0] == 2
