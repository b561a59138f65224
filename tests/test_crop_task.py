"""Issue 43's task, where the answer needs the crop tool (tools/synth.py, kind "crop"): its rows, its SFT
episodes encoded as a rollout encodes them, the tool metrics of a rollout, and the blank-crop control.
The learning check (GRPO learns to crop; the blank control does not): tests/test_learning.py."""
import json
import pickle
import re
import shutil
import types
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

import data
import env_geo3k
import rollout
import chat
import sft
import train_grpo
import trainer
from conftest import grpo_args, rollout_args
from fakes import ScriptedEngine
import fakes
from test_data import _sides_from_image
from bench import blank_crop
from tools import report, synth

ZOOM = "image_zoom_in_tool"


@pytest.fixture(scope="module")
def rows():
    return synth.synth_records(12, seed=5, kinds=("crop",), size=64)  # 512-px canvases


def test_rows_name_a_box_whose_crop_is_the_polygon_of_the_answer(rows):
    for r in rows:
        canvas = data.decode_image(r["images"][0]["bytes"])
        x1, y1, x2, y2 = r["box"]
        assert canvas.size == (512, 512) and r["tools"] == [ZOOM]
        assert x1 in (96, 352) and y1 == 224 and (x2, y2) == (x1 + 64, y1 + 64)  # left or right, mid-height
        assert r["problem"] == f"<image>How many sides does the polygon in the box {r['box']} have?"
        inside = canvas.crop(r["box"])
        assert _sides_from_image(inside) == int(r["answer"])
        assert {c for _, c in canvas.getcolors(10_000)} == {(0, 0, 0), (255, 255, 255)}  # no mark: the text tells
        other = canvas.crop((448 - x2, y1, 512 - x1, y2))
        assert 3 <= _sides_from_image(other) <= 6  # the other polygon, mirrored across the middle
    (view,) = synth.crop_view(rows[:1])
    assert data.decode_image(view["images"][0]["bytes"]).tobytes() == \
        data.decode_image(rows[0]["images"][0]["bytes"]).crop(rows[0]["box"]).tobytes()


def test_a_row_offering_an_unknown_tool_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tools \['zoom'\]: a list of tool names from calc_score"):
        env_geo3k.build_env({"answer": "3", "images": [], "tools": ["zoom"]}, rollout_args(max_turns=3))


def Planned(processor, plans):
    """Plays each episode's plan, chosen by its problem's image (plans: {id(image): turns})."""
    return ScriptedEngine(processor, lambda item: plans[id(item["images"][0])])


def rel(box, side=512):
    """A box of a square canvas's pixels as Qwen3-VL writes it (relative 0-1000; the tests' rows give no checkpoint)."""
    return [v * 1000 / side for v in box]


def call(name, arguments):
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, str(arguments).replace("'", '"'))


def test_rollout_metrics_count_calls_by_tool_score_crops_against_the_box_and_split_accuracy(processor, rows, tmp_path):
    pq.write_table(pa.Table.from_pylist(rows[:4]), tmp_path / "train.parquet")
    recs = data.load_geo3k(tmp_path, "train")
    assert [r["tools"] for r in recs] == [[ZOOM]] * 4 and all(len(r["box"]) == 4 for r in recs)
    (a, b, _, _), right = [r["box"] for r in recs], [f"\\boxed{{{r['answer']}}}" for r in recs]
    plans = dict(zip([id(r["images"][0]) for r in recs], [
        [call(ZOOM, {"bbox_2d": rel(a)}), right[0]],                           # the right box, the right answer
        [call(ZOOM, {"bbox_2d": rel([b[0] + 32, b[1], b[2] + 32, b[3]])}), call(ZOOM, {"bbox_2d": rel(b)}),  # IoU 1/3, 1:
         "\\boxed{9}"],                                                        # a hit (its best crop), wrong
        [right[2]],                                                             # no call, right
        [call("calc_score", {"answer": "4"}), "\\boxed{9}"]]))                  # a tool not offered, wrong
    args = rollout_args(max_turns=3, n_samples_per_prompt=1, rollout_max_response_len=400)
    samples = fakes.run_episodes(Planned(processor, plans), processor, recs, args)
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    assert "unknown tool 'calc_score'; tools are image_zoom_in_tool" in samples[3].metadata["steps"][0]["observation"]
    par = types.SimpleNamespace(rank=0, world=1, dp=1)  # the run's rows offer crop only: no tool_calls_calc_score
    tools = train_grpo.Source(None, processor, recs, grpo_args(max_turns=3), 1, par).tools
    m = train_grpo.rollout_metrics(samples, tools)
    assert tools == [ZOOM] and m["tool_calls_image_zoom_in_tool"] == 0.75 and "tool_calls_calc_score" not in m
    assert m["tool_calls"] == 0.75
    assert m["crop_iou"] == pytest.approx((1 + 1 / 3 + 1) / 3) and m["crop_hit_frac"] == 0.5
    assert m["accuracy_with_crop"] == 0.5 and m["accuracy_without_crop"] == 0.5
    single = fakes.run_episodes(Planned(processor, plans), processor, recs[2:3], rollout_args(n_samples_per_prompt=1))
    assert not {k for k in train_grpo.rollout_metrics(single, tools) if k.startswith(("tool_calls_", "crop_", "accuracy_"))}


def test_the_greedy_multi_turn_eval_logs_crop_calls_and_hits_beside_accuracy(processor, rows, tmp_path):
    """train_grpo.evaluate on rows that offer crop: greedy multi-turn accuracy, crop calls per episode and the share
    of episodes whose crop hit the named box (IoU >= 0.5), each as an eval_multi_turn_ key; single-turn has none."""
    pq.write_table(pa.Table.from_pylist(rows[:4]), tmp_path / "train.parquet")
    recs = data.load_geo3k(tmp_path, "train")
    boxes, right = [r["box"] for r in recs], [f"\\boxed{{{r['answer']}}}" for r in recs]
    other = [[448 - b[2], b[1], 512 - b[0], b[3]] for b in boxes]  # the other polygon's box
    plans = dict(zip([id(r["images"][0]) for r in recs], [
        [call(ZOOM, {"bbox_2d": rel(boxes[0])}), right[0]], [call(ZOOM, {"bbox_2d": rel(other[1])}), "\\boxed{9}"],
        [right[2]], [call(ZOOM, {"bbox_2d": rel(boxes[3])}), "\\boxed{9}"]]))
    logged = {}

    class Run:
        def write_rows(self, name, rows):
            return tmp_path / name

        def log(self, step, metrics):
            logged.update(metrics)
    train_grpo.evaluate(Planned(processor, plans), processor, recs, rollout_args(max_turns=3, rollout_max_response_len=400),
                        0, Run())
    assert logged["eval_multi_turn_accuracy"] == 0.5 and logged["eval_multi_turn_tool_calls_image_zoom_in_tool"] == 0.75
    assert logged["eval_multi_turn_crop_hit_frac"] == 0.5 and not [k for k in logged if k.startswith("eval_tool")]


def test_sft_encodes_an_episode_as_the_rollout_of_it_does(processor, rows, tmp_path):
    """A warm-start row (read back from parquet) encodes to exactly the tokens, loss mask and pixels of a
    rollout whose model writes the row's assistant turns: with a crop call and without one."""
    warm = synth.warm_start(rows[:6], share=0.5, seed=1)
    assert {len(r["images"]) for r in warm} == {1, 2}
    pq.write_table(pa.Table.from_pylist(warm), tmp_path / "train.parquet")
    recs = data.load_geo3k(tmp_path, "train")
    for rec in recs:
        item = sft.encode(processor, rec)
        turns = [m["content"] for m in json.loads(rec["messages"]) if m["role"] == "assistant"]
        plans = {id(rec["images"][0]): turns}
        problem = dict(rec, images=rec["images"][:1])
        (s,) = fakes.run_episodes(Planned(processor, plans), processor, [problem],
                                    rollout_args(max_turns=3, n_samples_per_prompt=1, rollout_max_response_len=400))
        assert s.status == "completed" and s.turns == len(turns), s.fail_reason
        assert item.ids.tolist() == s.tokens
        assert item.mask.tolist() == [False] * len(s.prompt_ids) + [bool(m) for m in s.loss_mask]
        pixels, grid = chat.encode_images(processor, s.images)
        assert torch.equal(item.pixel_values, pixels) and torch.equal(item.image_grid_thw, grid)
    direct = next(r for r in recs if len(r["images"]) == 1)
    with pytest.raises(ValueError, match="messages show 1 images, the row has 2"):
        sft.encode(processor, dict(direct, images=direct["images"] * 2))
    with pytest.raises(ValueError, match=r"roles \['system', 'user'\]: want .* the last an assistant's"):
        sft.encode(processor, dict(direct, messages=json.loads(direct["messages"])[:2]))


def test_blank_crop_returns_a_white_image_of_the_crops_size_and_runs_the_real_trainer(monkeypatch):
    canvas = Image.new("RGB", (500, 200), "black")
    args = rollout_args(max_turns=3)
    monkeypatch.setitem(env_geo3k.TOOLS, ZOOM, env_geo3k.TOOLS[ZOOM])
    real = env_geo3k.build_env({"answer": "3", "images": [canvas]}, args)
    want, _, _ = real.step(call(ZOOM, {"bbox_2d": [20, 100, 60, 170]}))  # 20x14 px -> shown 4x: 80x56
    seen = {}

    def trainer(argv):  # what train_grpo.main would build: an env, while blank_crop's crop is in place
        env = env_geo3k.build_env({"answer": "3", "images": [canvas]}, args)
        seen.update(argv=argv, env=env, step=env.step(call(ZOOM, {"bbox_2d": [20, 100, 60, 170]})))

    monkeypatch.setattr(blank_crop.train_grpo, "main", trainer)
    blank_crop.main(["--flags"])
    assert seen["argv"] == ["--flags"] and env_geo3k.TOOLS[ZOOM].run is not blank_crop.blank_crop  # restored after
    env, (got, _, info) = seen["env"], seen["step"]
    assert info["ran"] and got["text"] == want["text"] and got["images"][0].size == want["images"][0].size == (80, 56)
    assert got["images"][0].getcolors() == [(80 * 56, (255, 255, 255))] and env.images[1] is got["images"][0]


def test_the_demo_report_shows_each_stage_on_its_own_evals_and_the_crop_calls_and_hits(tmp_path):
    """tools/report.py on a run.sh folder: each stage's seconds and its own test set's greedy evals (the crop stages:
    multi-turn accuracy, the share whose crop hit the named box, crop calls; single-turn only as "without the tool");
    an SFT stage ends where the next stage's eval begins, and begins where the last ended if it is on the same set,
    else nowhere (the crop SFT does not borrow the sides set's 1.0); an eval that cropped nothing hit nothing; the
    crop stage's calls and hits per 10 steps reach summary.md and the curve."""
    def stage(name, rows):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    stage("base_eval", [{"step": 0, "eval_accuracy": 0.0}])
    stage("sft", [{"step": 1, "loss": 1.0}, {"step": 1, "eval_loss": 0.5}])
    stage("grpo", [{"step": 0, "eval_accuracy": 0.3}, {"step": 1, "reward": 0.4},
                   {"step": 1, "eval_accuracy": 1.0, "eval_multi_turn_accuracy": 0.9}])
    stage("sft_crop", [{"step": 1, "loss": 1.0}])
    steps = [{"step": i + 1, "reward": 0.5, "tool_calls_image_zoom_in_tool": 0.2 if i < 10 else 0.9, "crop_hit_frac": 0.1 if i < 10
              else 0.5} for i in range(20)]
    stage("grpo_mt", [{"step": 0, "eval_accuracy": 0.25, "eval_multi_turn_accuracy": 0.22,
                       "eval_multi_turn_tool_calls_image_zoom_in_tool": 0.0}, *steps, {"step": 20, "eval_accuracy": 0.25,
                       "eval_multi_turn_accuracy": 0.6, "eval_multi_turn_tool_calls_image_zoom_in_tool": 1.0,
                       "eval_multi_turn_crop_hit_frac": 0.8}])
    (tmp_path / "stages.tsv").write_text("data\t9\nsft\t30\ngrpo\t200\nsft_crop\t60\ngrpo_mt\t300\n")
    report.main([str(tmp_path)])
    rows, _, _ = report.stage_rows(tmp_path)
    hit, calls, multi = "crop hits the named box", "crop calls / episode", "multi-turn accuracy"
    assert [(t, s, {k: e[:3] for k, e in evals.items()}) for t, s, _, _, evals, _ in rows] == [
        ("SFT", "30", {"eval_accuracy": ["accuracy", 0.0, 0.3]}),
        ("GRPO single-turn", "200", {"eval_accuracy": ["accuracy", 0.3, 1.0]}),
        ("SFT crop calls", "60", {"eval_multi_turn_accuracy": [multi, None, 0.22],
                                  "eval_multi_turn_crop_hit_frac": [hit, None, 0.0],
                                  "eval_multi_turn_tool_calls_image_zoom_in_tool": [calls, None, 0.0]}),
        ("GRPO crop task", "300", {"eval_multi_turn_accuracy": [multi, 0.22, 0.6],
                                   "eval_multi_turn_crop_hit_frac": [hit, 0.0, 0.8],
                                   "eval_multi_turn_tool_calls_image_zoom_in_tool": [calls, 0.0, 1.0],
                                   "eval_accuracy": ["single-turn, without the tool", 0.25, 0.25]})]
    summary = (tmp_path / "summary.md").read_text()
    assert ("| GRPO crop task | 300 | 0.500 -> 0.500 | multi-turn accuracy 0.220 -> 0.600; crop hits the named box "
            "0.000 -> 0.800; crop calls / episode 0.000 -> 1.000; single-turn, without the tool 0.250 -> 0.250 |"
            in summary), summary
    assert "whole run: 599 s (data 9 s, sft 30 s, grpo 200 s, sft_crop 60 s, grpo_mt 300 s)" in summary
    assert ("GRPO crop task, per 10 steps: crop calls / episode 0.20, 0.90; share whose crop hit the box 0.10, 0.50"
            in summary), summary
    assert summary.count("per 10 steps") == 1 and (tmp_path / "reward_curve.png").stat().st_size > 0


def demo_folder(path, hits=(0.0, 0.5, 1.0, 1.0), multi=1.0, single=0.25, sides=(0.3, 1.0)):
    """A made-up run.sh folder: the sides stages' greedy accuracy `sides`; the crop stage evaluated at steps 0, 10,
    ... with crop-hit shares `hits`, ending at multi-turn accuracy `multi` and single-turn `single`."""
    for name, rows in (("sft", [{"step": 1, "loss": 1.0}]), ("sft_crop", [{"step": 1, "loss": 1.0}]),
                       ("grpo", [{"step": 0, "eval_accuracy": sides[0]}, {"step": 1, "reward": 0.5},
                                 {"step": 100, "eval_accuracy": sides[1]}]),
                       ("grpo_mt", [{"step": 10 * i, "eval_multi_turn_crop_hit_frac": h, "eval_accuracy": single,
                                     "eval_multi_turn_accuracy": multi if i == len(hits) - 1 else 0.2,
                                     "eval_multi_turn_tool_calls_image_zoom_in_tool": 1.0} for i, h in enumerate(hits)])):
        (path / name).mkdir(parents=True)
        (path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("change,missed", [({}, None), ({"hits": (0.0, 0.5, 0.8), "multi": 0.7}, None),  # on the bounds
                                           ({"single": 0.6}, None), ({"hits": (0.9, 1.0, 1.0)}, "from below it"),
                                           ({"hits": (0.0, 0.75)}, "the crop stage's evals"),
                                           ({"hits": (0.0, 0.5, 0.75)}, "greedy crop hit share"),
                                           ({"multi": 0.6}, "multi-turn 0.6"), ({"single": 0.7}, "whole canvas 0.7"),
                                           ({"sides": (0.3, 0.7)}, "0.7")])
def test_the_demo_tests_bounds_hold_on_a_run_that_meets_them_and_name_each_miss(tmp_path, change, missed):
    """tests/test_learning.py's demo_claims (the slow demo test's assertions, issue 76's bounds) on made-up run.sh
    folders: a run meeting every bound passes; each miss fails with what it missed."""
    from test_learning import demo_claims
    run = demo_folder(tmp_path, **change)
    if missed is None:
        demo_claims(run)
        return
    with pytest.raises(AssertionError, match=re.escape(missed)):
        demo_claims(run)


# ---------------------------------------------------------------------------------- the model's own grounding frame
REAL = Path(__file__).resolve().parents[2] / "shared" / "real_models"
# (image size, a region in its pixels): landscape and portrait; Qwen2.5-VL's processor shrinks the last (> max_pixels)
FRAMES = [((640, 480), [160, 120, 320, 240]), ((600, 1400), [100, 700, 450, 1300]),
          ((1920, 1080), [1000, 200, 1600, 700]), ((4000, 3600), [2500, 400, 3900, 1200])]


def model_box(ckpt, size, region):
    """The box the checkpoint's model writes for `region` (pixels of an image of `size`), from its files, apart from
    the env's code: Qwen3-VL and Qwen3.5 relative 0-1000 (Qwen's 2d_grounding cookbook), Qwen2.5-VL pixels of the
    image as its processor resizes it (transformers' smart_resize; min/max_pixels or size, patch x merge)."""
    (w, h), (fw, fh) = size, (1000, 1000)
    if json.loads((ckpt / "config.json").read_text())["model_type"] == "qwen2_5_vl":
        pre = ckpt / "preprocessor_config.json"  # the released checkpoints'; tools/tiny.py's: processor_config.json
        pre = json.loads(pre.read_text()) if pre.exists() else json.loads((ckpt / "processor_config.json").read_text())[
            "image_processor"]
        lo, hi = pre.get("min_pixels") or pre["size"]["shortest_edge"], pre.get("max_pixels") or pre["size"]["longest_edge"]
        fh, fw = smart_resize(h, w, pre["patch_size"] * pre["merge_size"], lo, hi)
    return [round(v * f / s) for v, f, s in zip(region, (fw, fh) * 2, (w, h) * 2)]


@pytest.mark.parametrize("name", ["Qwen3-VL-2B-Instruct", "Qwen2.5-VL-3B-Instruct", "Qwen3.5-0.8B", "tiny qwen3_vl",
                                  "tiny qwen2_5_vl"])
def test_the_zoom_takes_the_box_each_family_writes_and_scores_it_a_hit(name, tmp_path, tiny_ckpt):
    """Through build_env with the trainer's parsed args as the rollout hands them over: the box a model writes for a
    region in its own frame crops that region (IoU >= 0.95) and the hit metric counts it; the same region written
    in another frame (the image's own pixels to Qwen3-VL, relative 0-1000 to Qwen2.5-VL) is no hit."""
    if name.startswith("tiny"):
        ckpt = tiny_ckpt(name.split()[1])
    elif not (REAL / name).is_dir():
        pytest.skip("../shared/real_models not beside the repo")
    else:  # the real configs alone, copied out of the shared folder
        (ckpt := tmp_path / name).mkdir()
        for f in ("config.json", "preprocessor_config.json"):
            shutil.copy(REAL / name / f, ckpt / f)
    args = rollout.settings(train_grpo.parse_args(["--hf-checkpoint", str(ckpt), "--prompt-data", "x", "--save", "x",
                                                   "--max-turns", "3"]))
    relative = json.loads((ckpt / "config.json").read_text())["model_type"] != "qwen2_5_vl"
    if relative:  # the cookbook's example
        assert model_box(ckpt, (640, 480), [160, 120, 320, 240]) == [250, 250, 500, 500]
    misses = env_geo3k.grounding.cache_info().misses
    for size, region in FRAMES:
        env = env_geo3k.build_env({"answer": "3", "images": [Image.new("L", size)], "box": region, "tools": [ZOOM]}, args)
        env = pickle.loads(pickle.dumps(env))  # as a --partial-rollout buffer keeps it
        obs, _, info = env.step(call(ZOOM, {"bbox_2d": model_box(ckpt, size, region), "label": "the region"}))
        assert info["ran"] and info["iou"] >= 0.95, (size, info, obs["text"])
        assert env_geo3k.tool_metrics([[info]], [True], [ZOOM])["crop_hit_frac"] == 1.0
        wrong = region if relative else [round(v * 1000 / s) for v, s in zip(region, size * 2)]
        _, _, info = env.step(call(ZOOM, {"bbox_2d": wrong}))
        assert not info["ran"] or info["iou"] < 0.5, (size, wrong, info)
    assert env_geo3k.grounding.cache_info().misses - misses <= 1  # read once a checkpoint, not per env or call



@pytest.mark.parametrize("size", [(2400, 1000), (900, 2000)])
@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_a_zoom_into_a_small_region_of_a_large_image_returns_the_originals_pixels(arch, size, tiny_ckpt, tmp_path):
    """A row of a large non-square image loaded as the trainer loads it: its `box` in the original's pixels (beyond
    the view's size) loads; the model names a 64x48-px region of the original in its family's frame of its view
    (--max-pixels): the zoom shows the original's own pixels of that region, enlarged (not the view's blur of ~25x19
    px), and scores a hit on the box; the env pickles (a --partial-rollout buffer) with no decoded original in it; a zoom
    of the whole image comes back within the run's --max-pixels (the rollout's settings carry it to the env)."""
    w, h = size
    original = fakes.picture(w, h)
    original.save(tmp_path / "big.png")
    region = [w - 100, h - 80, w - 36, h - 32]  # the original's pixels, outside a view of its size
    row = {"problem": "<image>What is written?", "answer": "3", "images": "big.png", "box": region, "tools": [ZOOM]}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    args = train_grpo.parse_args(["--hf-checkpoint", str(tiny_ckpt(arch)), "--prompt-data", str(tmp_path / "rows.jsonl"),
                                  "--save", "x", "--max-turns", "3", "--max-pixels", "150000"])
    (rec,) = trainer.load_data(args, verbose=False)
    image = rec["images"][0]
    assert image.size == size and image.view_size[0] * image.view_size[1] <= 150000 < w * h
    env = pickle.loads(pickle.dumps(env_geo3k.build_env(rec, rollout.settings(args))))
    seen = [v * s / o for v, s, o in zip(region, image.view_size * 2, size * 2)]  # the region in the view's pixels
    box = model_box(tiny_ckpt(arch), image.view_size, seen)
    obs, _, info = env.step(call(ZOOM, {"bbox_2d": box}))
    assert info["ran"] and info["iou"] >= 0.5, (info, obs["text"])
    frame = env_geo3k.frame(env.resize, *image.view_size)
    px = env_geo3k.scale(box, frame, size)  # the original's pixels the model named, within a frame unit's rounding
    assert all(abs(a - b) <= 1 + s / f for a, b, s, f in zip(px, region, size * 2, frame * 2)), (px, region)
    out, k = obs["images"][0], obs["images"][0].width // (px[2] - px[0])
    assert k > 1 and out.size == ((px[2] - px[0]) * k, (px[3] - px[1]) * k), (out.size, px)
    assert out.reduce(k).tobytes() == original.crop(px).tobytes()  # each pixel of the original a k x k block
    held = (tmp_path / "big.png").stat().st_size + out.width * out.height * 3 + 10_000  # the row's file, the zoom
    assert len(pickle.dumps(env)) < held < w * h * 3, (len(pickle.dumps(env)), held)  # no decoded original
    whole = model_box(tiny_ckpt(arch), image.view_size, [0, 0, *image.view_size])  # the whole image: a huge region
    obs, _, info = env.step(call(ZOOM, {"bbox_2d": whole}))
    shown = obs["images"][0]
    assert info["ran"] and shown.width * shown.height <= 150000 < w * h, shown.size  # bounded by the run's --max-pixels


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_the_warm_start_calls_the_zoom_in_the_checkpoints_own_frame(rows, tiny_ckpt, arch):
    ckpt = tiny_ckpt(arch)
    (episode,) = synth.warm_start(rows[:1], share=1.0, hf_checkpoint=ckpt)  # warm_start asserts that the env ran it
    call = json.loads(episode["messages"])[2]["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>")
    assert json.loads(call) == {"name": ZOOM, "arguments": {"bbox_2d": model_box(ckpt, (512, 512), rows[0]["box"])}}
