"""The fault suite's data cases (issue 19, 50, 58): a file, row, column or image a user brings is named at load,
before any model is built; a row never reaches a URL or a file outside its data folder."""
import http.server
import json
import os
import sys
import threading
from pathlib import Path

import pytest

import data
import env_geo3k
import trainer as T

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
from test_faults import grpo_args, parquet, png, rows


# ------------------------------------------------------------------ 7, 8: loaders name the file
def test_loader_errors_name_the_file(tmp_path, monkeypatch):
    (tmp_path / "latin1.jsonl").write_bytes(b'{"problem": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(data.DataError, match=r"latin1.jsonl: not UTF-8 text \(byte"):
        data.load_geo3k(tmp_path / "latin1.jsonl")
    (tmp_path / "list.jsonl").write_text('[1, 2]\n')
    with pytest.raises(data.DataError, match="row 0: line 1 is a JSON list, not an object"):
        data.load_geo3k(tmp_path / "list.jsonl")
    (tmp_path / "fake.parquet").write_text("problem,answer\n")
    with pytest.raises(data.DataError, match="fake.parquet: not a readable parquet file"):
        data.load_geo3k(tmp_path / "fake.parquet")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(data.DataError, match="^data/trian: no such file or folder"):
        data.load_geo3k("data/trian")


def test_rows_reach_no_url_and_no_file_outside_the_data_folder(tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(png())
    inside = tmp_path / "set"
    (inside / "img").mkdir(parents=True)
    (inside / "img" / "a.png").write_bytes(png())
    for value in (str(secret), "../secret.png", "img/../../secret.png"):
        with pytest.raises(ValueError, match="outside the data set's folder.*--allow-outside-paths"):
            data.decode_image(value, base_dir=inside)
        assert data.decode_image(value, base_dir=inside, allow_outside=True).size == (32, 32)
    assert data.decode_image("img/a.png", base_dir=inside).size == (32, 32)
    with pytest.raises(ValueError, match="outside"):  # a hub data set has no folder: no path at all
        data.decode_image(str(secret))

    body = {"/small.png": png(), "/big.png": png() + b"\0" * (data.URL_MAX_BYTES + 1)}
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body[self.path])

        def log_message(self, *a):
            pass
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(ValueError, match="is a URL: not fetched.*--allow-image-urls"):
            data.decode_image(url + "/small.png")
        assert hits == []
        assert data.decode_image(url + "/small.png", allow_urls=True).size == (32, 32)
        with pytest.raises(ValueError, match=f"big.png: larger than {data.URL_MAX_BYTES >> 20} MB"):
            data.decode_image(url + "/big.png", allow_urls=True)
    finally:
        server.shutdown()


# ------------------------------------------------------------------ 3, 4: the processor's limits at load


def test_images_the_processor_refuses_and_over_long_rows_are_named_at_load(tmp_path, processor, capsys):
    import chat
    rs = rows(200)
    rs[3]["images"] = [{"bytes": png((4000, 8)), "path": None}]  # "absolute aspect ratio must be smaller than 200"
    rs[5]["problem"] = "<image>" + "How many sides? " * 4000
    args = grpo_args(prompt_data=str(parquet(tmp_path / "d.parquet", rs)))
    fit = dict(measure=lambda r: len(chat.prompt(processor, r, env_geo3k if args.max_turns > 1 else None)[2]),
               limit=(args.max_context_len - 1, f"--max-context-len {args.max_context_len}"))
    recs = T.load_data(args, **fit)
    assert len(recs) == 198
    err = capsys.readouterr().err
    assert "row 3: the processor refuses it (ValueError: absolute aspect ratio" in err
    assert "skipped 1 of 200 rows over the length limit" in err and "row 5: " in err
    assert "tokens, over --max-context-len 8192" in err
    # every prompt is longer: a clear error naming the flag, not a ZeroDivisionError in a step
    with pytest.raises(SystemExit, match="(?s)--prompt-data: .*no usable row of 200.*over --max-context-len 20"):
        T.load_data(args, measure=fit["measure"], limit=(19, "--max-context-len 20"))


def test_a_missing_column_is_named_with_the_files_columns(tmp_path):
    path = parquet(tmp_path / "d.parquet", [dict(r, question=r.pop("problem")) for r in rows(8)])
    with pytest.raises(data.DataError, match=r"d.parquet: no column 'problem'; its columns: answer, images, "
                                             r"question\. Name yours with --input-key"):
        data.load_geo3k(path)
    assert len(data.load_geo3k(path, input_key="question")) == 8
    with pytest.raises(data.DataError, match="no column 'solution'.*--label-key"):
        data.load_geo3k(path, input_key="question", label_key="solution")
    (tmp_path / "t.jsonl").write_text('{"problem": "1 + 1?", "answer": "2", "picture": "a.png"}\n')
    with pytest.raises(data.DataError, match="no column 'images'; its columns: answer, picture, problem"):
        data.load_geo3k(tmp_path / "t.jsonl")


@pytest.mark.parametrize("evaluation", [False, True], ids=["train", "eval"])
def test_training_and_eval_data_read_the_columns_the_flags_name(evaluation, tmp_path):
    """Issue 68: eval answers were read from `answer` whatever --label-key said. Each column flag names its column
    in both data sets; the default columns sit beside them with other values, so a flag not followed shows."""
    (tmp_path / "a.png").write_bytes(png((32, 32)))
    (tmp_path / "b.png").write_bytes(png((48, 40)))
    row = {"problem": "<image>wrong", "answer": "wrong", "images": "b.png", "q": "<image>right?", "gold": "7", "pic": "a.png"}
    jsonl(tmp_path / "d.jsonl", [row])
    args = grpo_args(prompt_data=str(tmp_path / "d.jsonl"), eval_prompt_data=str(tmp_path / "d.jsonl"), input_key="q",
                     label_key="gold", multimodal_keys={"image": "pic"})
    [rec] = T.load_data(args, evaluation=evaluation)
    assert (rec["problem"], rec["answer"], rec["images"][0].size) == ("<image>right?", "7", (32, 32)), rec


# ------------------------------------------------------------------ issue 58: a fork's data, a resume, a newcomer
def jsonl(path, rs):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rs))
    return path


@pytest.mark.parametrize("second,extra,said", [
    ({"image_path": "a.png"}, [], "--prompt-data: {d}/train.jsonl: no column 'images'; its columns: answer, image_path, "
     "problem. Name yours with --multimodal-keys '{\"image\": \"COLUMN\"}' \\(docs/data.md\\)$"),
    ({"images": "bad.png"}, [], "(?s)--prompt-data: {d}/train.jsonl: 1 of 2 rows are unusable.*row 1: image 0: cannot"),
    ({"images": "gone.png"}, [], "(?s)--prompt-data: .*row 1: image 0: image file not found: {d}/gone.png"),
    ({}, ["--eval-prompt-data", "{d}/eval.jsonl"], "--eval-prompt-data: {d}/eval.jsonl: no column 'answer'"),
    ({}, ["--rollout-batch-size", "3"], "--rollout-batch-size 3: --prompt-data has 2 usable prompts"),
    ({}, ["--multimodal-keys", '{"video": "clip"}'], "--prompt-data: --multimodal-keys {\"video\": \"clip\"}: images "
     "only here"),
], ids=["image column", "corrupt image", "missing image", "eval label column", "batch above the data", "video"])
def test_every_data_check_runs_before_any_model_is_built(second, extra, said, ckpt, tmp_path, monkeypatch):
    """docs/data.md: the data is checked at load, before any model; each case one message naming it."""
    import model as M
    import train_grpo
    d = tmp_path / "d"
    d.mkdir()
    (d / "a.png").write_bytes(png())
    (d / "bad.png").write_bytes(b"\x89PNG not an image")
    good = {"problem": "<image>How many sides?", "answer": "4", "images": "a.png"}
    if "image_path" in second:  # a fork's column name: every row has it, none has `images`
        good = {"problem": good["problem"], "answer": "4", "image_path": "a.png"}
    jsonl(d / "train.jsonl", [good, dict(good, **second)])
    jsonl(d / "eval.jsonl", [{"problem": good["problem"], "gold": "4", "images": "a.png"}])
    monkeypatch.setattr(M, "load_model", lambda *a, **k: pytest.fail("a model was built before the data was checked"))
    argv = ["--hf-checkpoint", ckpt, "--prompt-data", d / "train.jsonl", "--save", tmp_path / "run",
            "--rollout-batch-size", "1", *extra]
    with pytest.raises(SystemExit, match=said.replace("{d}", str(d))):
        train_grpo.main([str(x).replace("{d}", str(d)) for x in argv])


@pytest.mark.parametrize("entry", ["train_grpo", "sft"])
def test_eval_data_reads_its_own_columns_and_a_missing_one_names_the_eval_flag(entry, tmp_path):
    mod = __import__(entry)
    (tmp_path / "a.png").write_bytes(png())
    jsonl(tmp_path / "train.jsonl", [{"problem": "<image>How many sides?", "answer": "4", "images": "a.png"}])
    jsonl(tmp_path / "eval.jsonl", [{"question": "<image>How many corners?", "gold": "3", "images": "a.png"}])
    argv = ["--hf-checkpoint", "x", "--prompt-data", str(tmp_path / "train.jsonl"), "--save", "x",
            "--eval-prompt-data", str(tmp_path / "eval.jsonl"), "--eval-input-key", "question"]
    with pytest.raises(SystemExit) as e:
        T.load_data(mod.parse_args(argv), evaluation=True)
    assert str(e.value.code).endswith("no column 'answer'; its columns: gold, images, question. Name yours with "
                                      "--eval-label-key (docs/data.md)"), e.value.code
    (rec,) = T.load_data(mod.parse_args(argv + ["--eval-label-key", "gold"]), evaluation=True)
    assert (rec["problem"], rec["answer"]) == ("<image>How many corners?", "3")
    assert T.load_data(mod.parse_args(argv + ["--eval-label-key", "gold"]))[0]["answer"] == "4"  # training: its own


@pytest.mark.parametrize("flag,offered", [([], "calc_score, image_zoom_in_tool"), (["calc_score"], "calc_score"),
                                          (["nope"], None)])
def test_multi_turn_rows_with_no_tools_are_offered_the_default_or_flags_tools_said_once(flag, offered, ckpt, tmp_path,
                                                                                          monkeypatch, capsys):
    import model as M
    import train_grpo
    (tmp_path / "a.png").write_bytes(png())
    row = {"problem": "<image>How many sides?", "answer": "4", "images": "a.png"}
    jsonl(tmp_path / "train.jsonl", [row, dict(row, tools=["image_zoom_in_tool"])])
    loaded, load = [], T.load_data
    monkeypatch.setattr(T, "load_data", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    monkeypatch.setattr(M, "load_model", lambda *a, **k: sys.exit("loaded"))
    argv = ["--hf-checkpoint", ckpt, "--prompt-data", tmp_path / "train.jsonl", "--save", tmp_path / "run",
            "--rollout-batch-size", "1", "--max-turns", "3"] + (["--default-tools", *flag] if flag else [])
    with pytest.raises(SystemExit) as e:
        train_grpo.main([str(x) for x in argv])
    if offered is None:
        assert e.value.code == "--default-tools: tools ['nope']: a list of tool names from calc_score, image_zoom_in_tool"
        return
    said = [x for x in capsys.readouterr().out.splitlines() if "`tools`" in x]
    assert said == [f"[grpo] 1 rows have no `tools`: each is offered {offered} (--default-tools)"]
    assert [r["tools"] for r in loaded[0]] == [offered.split(", "), ["image_zoom_in_tool"]]


def test_prompts_a_response_cannot_fill_under_the_context_cap_are_said_at_load(ckpt, tmp_path, monkeypatch, capsys):
    import model as M
    import train_grpo
    (tmp_path / "a.png").write_bytes(png())
    rs = [{"problem": "<image>How many sides?" + " and" * k, "answer": "4", "images": "a.png"} for k in (0, 400)]
    jsonl(tmp_path / "train.jsonl", rs)
    monkeypatch.setattr(M, "load_model", lambda *a, **k: sys.exit("loaded"))
    argv = ["--hf-checkpoint", ckpt, "--prompt-data", tmp_path / "train.jsonl", "--save", tmp_path / "run",
            "--rollout-batch-size", "1", "--max-context-len", "600", "--rollout-max-response-len", "300"]
    with pytest.raises(SystemExit, match="loaded"):
        train_grpo.main([str(x) for x in argv])
    said = [x for x in capsys.readouterr().out.splitlines() if "--max-context-len" in x]
    assert len(said) == 1 and said[0].startswith("[grpo] 1 of 2 prompts (up to 4"), said  # the longer: 400-odd tokens
    assert said[0].endswith("+ --rollout-max-response-len 300 are over --max-context-len 600, which cuts them first"), said
