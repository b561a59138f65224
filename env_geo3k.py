"""The interactive geo3k environment for multi-turn GRPO: the model calls tools between turns.

    env = build_env(sample, args)           # args.max_turns required; sample: dict or Sample
    obs, info = env.reset()                 # ({"text": "", "images": []}, {"turn": 0})
    obs, done, info = env.step(response)    # run the last <tool_call> of the response
    message = env.format_observation(obs)   # {"role": "tool", "content": [image..., text]}

A call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` in strict JSON or Qwen3.5's XML form;
nothing the model writes is evaluated or executed. A tool: a function and its Tool in TOOLS (docs/extending.md).
From args: max_turns (required), oracle (default True; off in evaluation), rm_type ("math") and rm_timeout (its judge's
bound), min_pixels and max_pixels (the view's bounds, a zoom's too: --min-pixels, --max-pixels), max_payload (4096
chars), hf_checkpoint (its grounding frame: `grounding`), each tool's flags (env.flags)."""
import dataclasses
import functools
import json
import math
import re
from contextlib import suppress
from pathlib import Path

import data
import flags as F
import reward

MIN_SIDE, MAX_ASPECT = 56, 50  # zooms: upscaled to sides >= 56 (Qwen's 28-px merge x2), refused thinner than 1:50
# json decodes "\frac" as form feed + "rac", "\theta" as tab + "heta"...: put the LaTeX back.
_LATEX_ESCAPES = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


class ToolError(Exception):
    """Bad tool arguments; the message is shown to the model."""


def _need(ok, problem):
    """ToolError(problem) unless ok: the problem goes back to the model."""
    if not ok:
        raise ToolError(problem)


def _is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def calc_score(env, arguments):
    """Check an answer against the row's (the --rm-type reward), or only record it (oracle off)."""
    answer = str(arguments["answer"]) if _is_number(arguments["answer"]) else arguments["answer"]
    _need(isinstance(answer, str) and answer.strip(), '"answer" must be a non-empty string such as "5\\\\sqrt{3}" or a number')
    answer = re.sub(r"[\b\f\n\r\t](?=[A-Za-z])", lambda m: _LATEX_ESCAPES[m.group()], answer).strip()
    env.answers.append(answer)
    faults = {}  # the judge's error or time-out (--rm-timeout), in the step info: counted as the rollout's own
    if not env.oracle or env.record.get("answer") is None:
        text, score = f"Answer recorded: {answer}.", None
    else:
        score = env.last_score = reward.score(env.rm_type, f"\\boxed{{{answer}}}", env.record, faults, env.rm_timeout)
        text = f"Correct: {answer} is the right answer." if score > 0 else f"Incorrect: {answer} is not the right answer."
    return text, [], {"score": score, **faults}


def crop(env, arguments):
    """Zoom into `bbox_2d` of image `image` (default 0), in its original's pixels (the env converts the model's frame),
    shown within the view's bounds (--min-pixels: a small region enlarged; --max-pixels); image 0's is scored against
    the row's `box`."""
    i, n, (x1, y1, x2, y2) = arguments.get("image", 0), len(env.images), arguments["bbox_2d"]
    cw, ch = x2 - x1, y2 - y1
    _need(max(cw, ch) / min(cw, ch) <= MAX_ASPECT, f'"bbox_2d" {cw}x{ch} px is thinner than 1:{MAX_ASPECT}; widen it')
    k = max(1, math.ceil(MIN_SIDE / min(cw, ch)), math.ceil(math.sqrt(env.min_pixels / (cw * ch))))
    image = env.images[i]  # a row's Picture: its original decoded; a zoom's PIL image as it is
    original = image.original() if isinstance(image, data.Picture) else image
    region = original.crop((x1, y1, x2, y2)).convert("RGB").resize((cw * k, ch * k), resample=0)  # NEAREST: exact
    shown = data.view_size(*region.size, env.min_pixels, env.max_pixels)  # a huge region: bounded as a row's view is
    region = region if shown == region.size else region.resize(shown)
    text = f"Zoomed into image {i} ({cw}x{ch} px, shown at {shown[0]}x{shown[1]}); it is now image {n}."
    return text, [region], {"iou": iou([x1, y1, x2, y2], env.record["box"])} if env.record.get("box") and i == 0 else {}


def frame(resize, width, height):
    """The (width, height) of the grounding frame of a `width` x `height` image: Qwen2.5-VL's resized view, or 0-1000."""
    if resize is None:
        return 1000, 1000
    fh, fw = resize(height, width)
    return fw, fh


def scale(values, src, dst, outward=True):
    """A box [x1, y1, x2, y2] (rounded outwards, so never empty) or a point [x, y] (the pixel holding it) from a frame of
    (width, height) `src` to one of `dst`: the one conversion of grounding coordinates (the env's; tools/synth.py's
    into the model's frame, rounded to the nearest)."""
    out = [v * d / s for v, s, d in zip(values, src * 2, dst * 2)]
    if not outward:
        return [round(v) for v in out]
    if len(values) == 2:
        return [min(math.floor(v), d - 1) for v, d in zip(out, dst)]
    return [math.floor(out[0]), math.floor(out[1]), math.ceil(out[2]), math.ceil(out[3])]


def iou(a, b):
    """Intersection over union of two [x1, y1, x2, y2] boxes."""
    w, h = min(a[2], b[2]) - max(a[0], b[0]), min(a[3], b[3]) - max(a[1], b[1])
    inter = max(0, w) * max(0, h)
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def crop_metrics(ran, correct):
    """crop_iou (crops of image 0), crop_hit_frac (an episode's best IoU >= 0.5), accuracy_with_crop and _without_crop."""
    m, ious = {}, [[i["iou"] for i in st if "iou" in i] for st in ran]
    if any(ious):
        m["crop_iou"] = sum(map(sum, ious)) / sum(map(len, ious))
        m["crop_hit_frac"] = sum(max(x, default=0) >= 0.5 for x in ious) / len(ran)
    cropped = [any(ALIASES.get(i["tool"], i["tool"]) == "image_zoom_in_tool" for i in st) for st in ran]
    for key, want in (("accuracy_with_crop", True), ("accuracy_without_crop", False)):
        if part := [r for r, c in zip(correct, cropped) if c == want and r is not None]:
            m[key] = sum(map(bool, part)) / len(part)
    return m


@dataclasses.dataclass(frozen=True)
class Tool:
    """A tool's declaration: what varies with the tool is read from here (docs/extending.md, "A tool")."""
    run: object          # (env, arguments) -> (text, new images, {key: value} the step info gains); ToolError: bad ones
    usage: str           # its line in the call-format help (system prompt, error feedback)
    description: str     # with parameters: the JSON-schema spec a chat template renders (`tools=`)
    parameters: dict     # JSON-schema properties; the env refuses arguments not named here
    example: dict        # a call's required arguments (the spec's `required`), shown in the call-format help
    default: bool = True  # offered to a row that names no `tools`
    metrics: object = None  # (ran: each episode's step infos that ran, correct) -> its rollout metrics
    flags: dict = dataclasses.field(default_factory=dict)  # its own flags: {"--name": add_argument's keywords}
    coords: dict = dataclasses.field(default_factory=dict)  # its arguments in the model's grounding frame, each a box
    # (4: [x1, y1, x2, y2]) or a point (2: [x, y]): run() gets them in the image's pixels (Geo3kEnv.grounded)

    def spec(self, name):
        return {"type": "function", "function": {"name": name, "description": self.description, "parameters": {
            "type": "object", "properties": self.parameters, "required": list(self.example)}}}


TOOLS = {
    "calc_score": Tool(
        calc_score, 'calc_score {"answer": "<your answer>"}: check an answer (scored or just recorded).',
        "Check a candidate answer to the problem and say whether it is right.",
        {"answer": {"type": "string", "description": "the answer, such as 5\\sqrt{3} or 42"}}, {"answer": "42"}),
    "image_zoom_in_tool": Tool(  # DeepEyes' and verl's zoom call, the one Qwen-VL RL work prompts with
        crop, 'image_zoom_in_tool {"bbox_2d": [x1, y1, x2, y2], "label": "..."}: zoom into a region of an image.',
        "Zoom into a region of an image seen so far, its box in your grounding coordinates (Qwen3-VL, Qwen3.5: relative "
        "0-1000; Qwen2.5-VL: pixels of the image as you see it); it comes back enlarged, as a new image.",
        {"bbox_2d": {"type": "array", "items": {"type": "number"}, "description": "[x1, y1, x2, y2]: corners of the region"},
         "label": {"type": "string", "description": "what the region shows (optional)"},
         "image": {"type": "integer", "description": "0: the problem's (default); zooms are numbered after it, in order"}},
        {"bbox_2d": [0, 0, 100, 100]}, metrics=crop_metrics, coords={"bbox_2d": 4}),
}
ALIASES = {"calc_geo3k_reward": "calc_score", "crop": "image_zoom_in_tool"}  # old names that still run, not advertised


def offered(names=None):
    """The names of the tools a row gets: its `tools` (None: TOOLS' default ones), checked (docs/extending.md)."""
    if names is None:
        return [n for n, t in TOOLS.items() if t.default]
    if isinstance(names, str) or not names or not all(ALIASES.get(n, n) in TOOLS for n in names):
        raise ValueError(f"tools {names!r}: a list of tool names from {', '.join(TOOLS)}")
    return [ALIASES.get(n, n) for n in names]


def specs(names):
    """The JSON-schema specs of the tools `names`, as chat templates take them (`tools=`)."""
    return [TOOLS[n].spec(n) for n in names]


def usage(names, xml=False):
    """The call format on the first tool's example (Qwen3.5's XML if the model wrote XML), then each tool's usage."""
    name, example, lines = names[0], TOOLS[names[0]].example, "\n".join("- " + TOOLS[n].usage for n in names)
    call = json.dumps({"name": name, "arguments": example})
    if xml:  # as Qwen3.5's template writes it: strings raw, the rest as JSON
        call = f"<function={name}>\n" + "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n"
                                                "</parameter>\n" for k, v in example.items()) + "</function>"
    return f"Call one tool exactly like this:\n<tool_call>\n{call}\n</tool_call>\nTools:\n{lines}"


def tool_metrics(steps, correct, tools):
    """tool_calls_<tool> (calls that ran, per episode) of the `tools` some row offers, and their metrics; single-turn {}."""
    if not any(steps):
        return {}
    ran, n = [[i for i in st if i.get("ran")] for st in steps], len(steps)
    m = {f"tool_calls_{t}": sum(ALIASES.get(i["tool"], i["tool"]) == t for st in ran for i in st) / n for t in tools}
    for t in tools:
        m.update(TOOLS[t].metrics(ran, correct) if TOOLS[t].metrics else {})
    return m


_XML_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)


class Geo3kEnv:
    def __init__(self, record, max_turns, oracle=True, rm_type="math", min_pixels=data.MIN_PIXELS,
                 max_payload=4096, flags=None, hf_checkpoint=None, max_pixels=data.MAX_PIXELS, rm_timeout=None):
        self.record, self.tools, self.resize = record, offered(record.get("tools")), grounding(hf_checkpoint)
        self.problem_images, self.rm_type, self.flags = list(record.get("images") or []), rm_type or "math", flags or {}
        self.max_turns, self.oracle, self.max_payload = max_turns, oracle, max_payload
        self.rm_timeout = rm_timeout  # the oracle's judge's bound (--rm-timeout; None: reward's defaults)
        self.min_pixels, self.max_pixels = min_pixels, max_pixels  # the view's bounds, a zoom's too
        self.reset()

    def reset(self):
        self.turn, self.answers, self.last_score, self.images = 0, [], None, list(self.problem_images)  # images seen
        return {"text": "", "images": []}, {"turn": 0}

    def parse(self, text, info):
        """The last <tool_call> of `text` -> (name, arguments), noted in `info` as far as valid; ToolError: what is wrong."""
        start = text.rfind("<tool_call>") + len("<tool_call>")
        end = text.find("</tool_call>", start)
        _need(end >= 0, "unclosed <tool_call> (no </tool_call> after it)")
        payload = text[start:end].strip()
        _need(len(payload) <= self.max_payload, f"tool call is {len(payload)} characters; the limit is {self.max_payload}")
        if payload.startswith("<function="):
            return self.parse_xml(payload, info)
        try:
            call = reward.strict_json(payload)
        except ValueError as e:
            raise ToolError(f"invalid JSON in tool call ({e}); use double quotes, no trailing "
                            "commas, and write \\\\ for a backslash") from None
        _need(isinstance(call, dict), f"tool call must be a JSON object, got {type(call).__name__}")
        name, arguments = call.get("name"), call.get("arguments")
        _need(isinstance(name, str) and name, 'tool call needs a string "name"')
        info["tool"] = name
        _need(isinstance(arguments, dict) and arguments, 'tool call needs a non-empty "arguments" object')
        info["arguments"] = arguments
        extra = min(set(call) - {"name", "arguments"}, default="")
        _need(not extra, f"unexpected key {extra[:80]!r} in tool call")
        return name, arguments

    def parse_xml(self, payload, info):
        """Qwen3.5's form, `<function=NAME>` and `<parameter=K>\\nV\\n</parameter>` blocks, as its chat template
        writes it: V is text where the tool's spec says string, else JSON (the template writes lists with tojson);
        V that is not JSON stays text, and the tool's own checks say what is wrong with it."""
        m = re.fullmatch(r"<function=([^>\n]*)>(.*)</function>", payload, re.DOTALL)
        _need(m, "unclosed <function=...> (no </function> at the end of the tool call)")
        name, body = m.group(1).strip(), m.group(2)
        _need(name, "tool call needs a function name: <function=NAME>")
        info["tool"] = name
        stray = _XML_PARAMETER.sub(" ", body).strip()  # text outside the <parameter> blocks
        _need(not stray, f"unexpected text {stray[:80]!r} in tool call; each argument goes in <parameter=NAME>...</parameter>")
        tool, arguments = TOOLS.get(ALIASES.get(name, name)), {}
        strings = {k for k, p in tool.parameters.items() if p.get("type") == "string"} if tool else set()
        for p in _XML_PARAMETER.finditer(body):
            key, raw = p.group(1).strip(), p.group(2)
            _need(key not in arguments, f"parameter {key[:80]!r} given twice")
            arguments[key] = raw
            if key not in strings:
                with suppress(ValueError):
                    arguments[key] = reward.strict_json(raw)
        _need(arguments, "tool call needs at least one <parameter=NAME> argument")
        info["arguments"] = arguments
        return name, arguments

    def step(self, response_text):
        self.turn += 1
        n_calls = response_text.count("<tool_call>")
        info = {"turn": self.turn, "tool": None, "arguments": None, "ran": False, "error": None,
                "score": None, "n_calls": n_calls,
                "note": f"{n_calls} tool calls found; executed the last" if n_calls > 1 else None}
        if n_calls == 0:
            return {"text": "", "images": []}, True, info
        images = []
        try:
            name, arguments = self.parse(response_text, info)
            _need(ALIASES.get(name, name) in self.tools, f"unknown tool {name[:80]!r}; tools are {', '.join(self.tools)}")
            tool = TOOLS[ALIASES.get(name, name)]
            missing = next((k for k in tool.example if k not in arguments), "")  # its example's arguments are required
            _need(not missing, f"missing argument {missing[:80]!r}")
            extra = next((k for k in arguments if k not in tool.parameters), "")
            _need(not extra, f"unexpected argument {extra[:80]!r}")
            text, images, gained = tool.run(self, self.grounded(tool, arguments))
            self.images += images  # what a tool shows, later calls can refer to
            info.update(gained, ran=True)
        except ToolError as e:
            info["error"] = str(e)
            xml = "<function=" in response_text[response_text.rfind("<tool_call>"):]
            text = f"Error: {e}.\n{usage(self.tools, xml)}"
        except Exception as e:  # noqa: BLE001 - the tool's own bug, not the model's mistake: counted, the episode goes on
            info.update(raised=reward.raised(info["tool"], self.record), error=f"the tool failed ({type(e).__name__}: {e})")
            text = f"Error: {info['error']}."  # the model's call was fine; rollout metrics: <tool>_errors
        if self.turn == self.max_turns - 1:  # every tool's feedback warns, not only calc_score's
            text += "\nThis is your last turn: give your final answer now as \\boxed{...}."
        return {"text": text, "images": images}, self.turn >= self.max_turns, info

    def grounded(self, tool, arguments):
        """`arguments` with the tool's coordinates (Tool.coords) checked in the model's grounding frame of image `image`
        (default 0), the frame of its view, and converted to the pixels of its original (a row's Picture.size): no image
        tool reads the model's frame itself."""
        if not tool.coords:
            return arguments
        i, n = arguments.get("image", 0), len(self.images)
        _need(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n,
              f'"image" must be an integer from 0 to {n - 1} (images seen so far)' if n else "this problem has no image")
        image, out = self.images[i], dict(arguments)
        fw, fh = frame(self.resize, *(image.view_size if isinstance(image, data.Picture) else image.size))
        for key, size in ((k, n) for k, n in tool.coords.items() if k in arguments):
            v = arguments[key]
            ok = isinstance(v, list) and len(v) == size and all(_is_number(c) and 0 <= c for c in v)
            inside = ok and v[0] <= fw and v[1] <= fh and (size == 2 or v[0] < v[2] <= fw and v[1] < v[3] <= fh)
            form = (f"[x, y] with 0 <= x <= {fw} and 0 <= y <= {fh}" if size == 2
                    else f"[x1, y1, x2, y2] with 0 <= x1 < x2 <= {fw} and 0 <= y1 < y2 <= {fh}")
            _need(inside, f'"{key}" must be {size} numbers {form} (image {i} in your grounding frame)')
            out[key] = scale(v, (fw, fh), image.size)
        return out

    def format_observation(self, observation):
        """-> a `tool` chat message; the images themselves travel in observation["images"]."""
        parts = [{"type": "image"} for _ in observation["images"]]
        return {"role": "tool", "content": parts + [{"type": "text", "text": observation["text"]}]}

    def close(self):
        self.images, self.problem_images = [], []


def build_env(sample=None, args=None, **_):
    """The published entry point; `sample`: a row (dict) or a Sample-like object (label, images or multimodal_inputs)."""
    max_turns = getattr(args, "max_turns", None)
    if not isinstance(max_turns, int) or max_turns < 1:
        raise ValueError(f"build_env needs args.max_turns (a positive int), got {max_turns!r}")
    record = dict(sample if isinstance(sample, dict) else vars(sample) if sample is not None else {})
    record["answer"] = record.get("label") if record.get("answer") is None else record["answer"]
    record["images"] = record.get("images") or (record.get("multimodal_inputs") or {}).get("images")
    names = ("oracle", "rm_type", "rm_timeout", "min_pixels", "max_pixels", "max_payload", "hf_checkpoint")
    options = {k: getattr(args, k) for k in names
               if getattr(args, k, None) is not None}
    return Geo3kEnv(record, max_turns, **options, flags=F.declared(F.own_flags(TOOLS), args))


@functools.cache
def grounding(hf_checkpoint):
    """Boxes' frame, once a checkpoint: None, relative 0-1000 (Qwen3-VL, Qwen3.5, none), or Qwen2.5-VL's processor resize."""
    if not hf_checkpoint or json.loads((Path(hf_checkpoint) / "config.json").read_text())["model_type"] != "qwen2_5_vl":
        return None
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor, smart_resize  # lazy: 5 s
    p = Qwen2VLImageProcessor.from_pretrained(hf_checkpoint)  # its size: preprocessor_config's min/max_pixels or size
    return functools.partial(smart_resize, factor=p.patch_size * p.merge_size, min_pixels=p.size.shortest_edge,
                             max_pixels=p.size.longest_edge)  # picklable: a --partial-rollout buffer keeps the env
