"""The synthetic geometry set in the geo3k schema (regular polygons, triangles): what the CPU demo,
the tests and the benches train on. Not part of a training job on real data.

    python tools/synth.py --n 512 --out data/synth            # train.parquet + test.parquet
    python tools/synth.py --n 1024 --kinds sides --out data/sides --seed 1
    python tools/synth.py --n 1024 --kinds crop --out data/crop          # the polygon in a box of a big canvas
    python tools/synth.py --n 512 --kinds crop --out data/crop_warm --warm-start 0.3   # SFT episodes, 30% zooming
"""
import argparse
import io
import json
import math
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core modules, however this is run
import data  # noqa: E402
import env_geo3k  # noqa: E402
import flags  # noqa: E402
import task  # noqa: E402

POLYGON_QUESTIONS = {  # question -> answer as a function of the number of sides n
    "Find the sum of the interior angles of the polygon.": lambda n: 180 * (n - 2),
    "Find the measure of each interior angle of the regular polygon.": lambda n: 180 * (n - 2) / n,
}
SIDES_QUESTIONS = {"How many sides does the polygon have?": lambda n: n}
SHAPE_COLOURS = ["black", "navy", "darkgreen", "maroon"]
FILLS = ["lightsteelblue", "khaki", "lightpink", "palegreen"]


def _num(x):
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _polygon(rng, size, jitter, questions=POLYGON_QUESTIONS):
    """A regular polygon of 3-6 sides; the answer depends on the sides, read from the image."""
    n = rng.randint(3, 6)
    question = rng.choice(sorted(questions))
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    c = size / 2 + rng.uniform(-1, 1) * jitter * size / 8
    r = size * (0.38 - 0.1 * jitter * rng.random())
    rot = -math.pi / 2 + jitter * rng.uniform(-math.pi, math.pi)
    pts = [(c + r * math.cos(rot + 2 * math.pi * k / n), c + r * math.sin(rot + 2 * math.pi * k / n))
           for k in range(n)]
    # jitter 0: a black silhouette, ~4x the contrast of a light fill after the processor's
    # normalisation: GRPO on a tiny random model reads it from chance to 0.8 in ~80 steps, not > 150.
    colour = rng.choice(SHAPE_COLOURS) if jitter else "black"
    draw.polygon(pts, fill=rng.choice(FILLS) if jitter else "black", outline=colour, width=3)
    return question, _num(questions[question](n)), img


def _triangle(rng, size, jitter):
    """A triangle with two angles labelled in degrees; the answer is the third angle."""
    a = rng.choice(range(30, 91, 10))
    b = rng.choice(range(30, 150 - a + 1, 10))
    # Vertices from the true angles (law of sines), then scaled to fit: the drawing matches the numbers.
    ra, rb = math.radians(a), math.radians(b)
    t = math.sin(rb) / math.sin(ra + rb)  # side AC for a unit base AB
    pts = [(0.0, 0.0), (1.0, 0.0), (t * math.cos(ra), t * math.sin(ra))]
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    scale = size * 0.7 / max(x1 - x0, max(p[1] for p in pts))
    (ax, ay), (bx, by), (cx, cy) = [(size * 0.15 + (x - x0) * scale, size * 0.85 - y * scale) for x, y in pts]
    img = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(img)
    draw.polygon([(ax, ay), (bx, by), (cx, cy)], outline="black", width=2)
    draw.text((ax + 5, ay - 13), str(a), fill="black")
    draw.text((bx - 20, by - 13), str(b), fill="black")
    draw.text((cx - 3, cy + 5), "x", fill="black")
    return "Find x, the measure of the unlabelled angle in degrees.", _num(180 - a - b), img


def _boxed(rng, size, jitter, canvas=8):
    """Two `sides` pictures of `size` px on a canvas `canvas` times as wide, at mid-height, a quarter of the
    way in from either side; the question names one's box in pixels. At the tiny processor's 256 px for the
    whole canvas each polygon is a few patches; the env's crop of the box is that `sides` picture. Only the
    text says which polygon is asked, by which digits it holds (NOTES-43.md: why two places and no mark)."""
    side = size * canvas
    img = Image.new("RGB", (side, side), "white")
    spots = [(side // 4 - size // 2, (side - size) // 2), (3 * side // 4 - size // 2, (side - size) // 2)]
    rng.shuffle(spots)  # the first is the one asked
    answers = []
    for x, y in spots:
        _, n, pic = _polygon(rng, size, jitter, SIDES_QUESTIONS)
        img.paste(pic, (x, y))
        answers.append(n)
    box = [spots[0][0], spots[0][1], spots[0][0] + size, spots[0][1] + size]
    return f"How many sides does the polygon in the box {box} have?", answers[0], img, {"box": box, "tools": ["image_zoom_in_tool"]}


KINDS = {"sides": lambda rng, size, jitter: _polygon(rng, size, jitter, SIDES_QUESTIONS),
         "polygon": _polygon, "triangle": _triangle, "crop": _boxed}  # easiest first: one-token answers, 4 classes
CHOICES = {"sides": 4, "polygon": 4, "triangle": 10, "crop": 4}  # answers a kind's question can have: report.py's chance


def _png(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return {"bytes": buf.getvalue(), "path": None}


def synth_records(n, seed=0, kinds=("polygon",), size=128, jitter=0.0):
    """n records in the geo3k schema (crop: its `box`, the `tools` offered); `jitter` in [0, 1]: pose and colour vary."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        question, answer, img, *extra = KINDS[rng.choice(list(kinds))](rng, size, jitter)
        out.append({"images": [_png(img)], "problem": "<image>" + question, "answer": answer, **(extra or [{}])[0]})
    return out


def crop_view(rows):
    """The crop kind's rows with the env's crop of the box as their only image: what a model that always crops sees."""
    out = []
    for r in rows:
        env = env_geo3k.Geo3kEnv({"answer": r["answer"], "images": [data.decode_image(r["images"][0]["bytes"])]}, 2)
        _, images, _ = env_geo3k.crop(env, {"bbox_2d": r["box"]})  # the tool's own call: the box in pixels
        out.append(dict(r, images=[_png(images[0])]))
    return out


def warm_start(rows, share, seed=0, hf_checkpoint=None):
    """SFT episodes (slime's `messages` form) of the crop kind's rows: a `share` zoom into the named box (`hf_checkpoint`'s
    frame), then answer; the rest at once. Tool turns are the env's own; SFT teaches the call's format, not a policy."""
    parser = argparse.ArgumentParser()  # the env's args as parsed: its tools' own flags at their defaults
    for name, kw in task.flags(env_geo3k).items():
        parser.add_argument(name, **kw)
    args = argparse.Namespace(**vars(parser.parse_args([])), max_turns=3, hf_checkpoint=hf_checkpoint)
    rng, out = random.Random(seed), []
    for r in rows:
        canvas = data.decode_image(r["images"][0]["bytes"])
        messages, images = data.prompt_messages({**r, "images": [canvas]}, multi_turn=True), [r["images"][0]]
        if rng.random() < share:
            env = env_geo3k.build_env({**r, "images": [canvas]}, args)
            bbox = env_geo3k.scale(r["box"], canvas.size, env_geo3k.frame(env.resize, *canvas.size), outward=False)
            call = '<tool_call>\n' + json.dumps({"name": "image_zoom_in_tool", "arguments": {"bbox_2d": bbox}}) + '\n</tool_call>'
            obs, _, info = env.step(call)
            assert info["ran"], info
            messages += [{"role": "assistant", "content": call}, env.format_observation(obs)]
            images += [_png(im) for im in obs["images"]]
        messages.append({"role": "assistant", "content": data.sft_target(r["answer"])})
        out.append(dict(r, images=images, messages=json.dumps(messages)))  # JSON: each content's form kept
    return out


def write_synth(out, n, n_test=64, seed=0, kinds=("polygon",), size=128, jitter=0.0, view=None, warm=None, hf=None):
    """view "crop": crop_view's rows; warm: warm_start's, calls in `hf`'s frame; synth.json: a guess's accuracy."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "synth.json").write_text(json.dumps({"kinds": list(kinds), "chance": sum(1 / CHOICES[k] for k in kinds) / len(kinds)}))
    for split, count, s in (("train", n, seed), ("test", n_test, seed + 1_000_003)):
        rows = synth_records(count, s, kinds, size, jitter)
        rows = crop_view(rows) if view == "crop" else warm_start(rows, warm, s, hf) if warm is not None else rows
        pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=512, help="training problems")
    p.add_argument("--n-test", type=int, default=64, help="test problems")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same files)")
    p.add_argument("--kinds", default="polygon", help=f"comma list of {sorted(KINDS)}")
    p.add_argument("--size", type=int, default=128, help="image side in pixels (crop: the box's; the canvas is 8x)")
    p.add_argument("--jitter", type=float, default=0.0, help="0..1: random pose and colour (harder)")
    p.add_argument("--crop-view", action="store_true", help="crop: each image is the crop of its box")
    p.add_argument("--warm-start", type=flags.fraction, default=None, metavar="SHARE",
                   help="crop: SFT episodes (`messages`), SHARE of them calling image_zoom_in_tool")
    p.add_argument("--hf-checkpoint", help="--warm-start: calls in its model's grounding frame (default relative 0-1000)")
    a = p.parse_args(argv)
    kinds = tuple(k.strip() for k in a.kinds.split(","))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown --kinds {unknown}; choose from {sorted(KINDS)}")
    if (a.crop_view or a.warm_start is not None) and kinds != ("crop",):
        p.error(f"--crop-view and --warm-start need --kinds crop (got --kinds {a.kinds})")
    out = write_synth(a.out, a.n, a.n_test, a.seed, kinds, a.size, a.jitter, "crop" if a.crop_view else None,
                      a.warm_start, a.hf_checkpoint)
    print(f"wrote {a.n} train and {a.n_test} test problems to {out}")


if __name__ == "__main__":
    main()
