"""The synthetic geometry set in the geo3k schema (regular polygons, triangles): what the CPU demo,
the tests and the benches train on. Not part of a training job on real data.

    python tools/synth.py --n 512 --out data/synth            # train.parquet + test.parquet
    python tools/synth.py --n 1024 --kinds sides --out data/sides --seed 1
"""
import argparse
import io
import math
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

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


KINDS = {"sides": lambda rng, size, jitter: _polygon(rng, size, jitter, SIDES_QUESTIONS),
         "polygon": _polygon, "triangle": _triangle}  # easiest first: one-token answers, 4 classes


def synth_records(n, seed=0, kinds=("polygon",), size=128, jitter=0.0):
    """n records in the geo3k schema; `jitter` in [0, 1] varies pose and colour (the difficulty dial)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        question, answer, img = KINDS[rng.choice(list(kinds))](rng, size, jitter)
        buf = io.BytesIO()
        img.save(buf, format="PNG")
        out.append({"images": [{"bytes": buf.getvalue(), "path": None}],
                    "problem": "<image>" + question, "answer": answer})
    return out


def write_synth(out, n, n_test=64, seed=0, kinds=("polygon",), size=128, jitter=0.0):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for split, count, s in (("train", n, seed), ("test", n_test, seed + 1_000_003)):
        pq.write_table(pa.Table.from_pylist(synth_records(count, s, kinds, size, jitter)),
                       out / f"{split}.parquet")
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=512, help="training problems")
    p.add_argument("--n-test", type=int, default=64, help="test problems")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same files)")
    p.add_argument("--kinds", default="polygon", help=f"comma list of {sorted(KINDS)}")
    p.add_argument("--size", type=int, default=128, help="image side in pixels")
    p.add_argument("--jitter", type=float, default=0.0, help="0..1: random pose and colour (harder)")
    a = p.parse_args(argv)
    kinds = tuple(k.strip() for k in a.kinds.split(","))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        p.error(f"unknown --kinds {unknown}; choose from {sorted(KINDS)}")
    out = write_synth(a.out, a.n, a.n_test, a.seed, kinds, a.size, a.jitter)
    print(f"wrote {a.n} train and {a.n_test} test problems to {out}")


if __name__ == "__main__":
    main()
