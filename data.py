"""geo3k data: loading, image decoding, prompt builders, and a synthetic geometry set.

    python data.py synth --n 512 --out data/synth            # train.parquet + test.parquet
    python data.py show tests/data/geo3k_real/test.parquet   # load and summarise a source

`load_geo3k(source, split=None)` returns a list of {"problem", "answer", "images"} records
(images as RGB PIL images) from a hub id (`hiyouga/geometry3k`), a parquet or jsonl file, or a
folder holding `<split>.parquet` / `<split>.jsonl`; how bad rows are handled: README, "Reliability".
"""
import argparse
import base64
import io
import json
import math
import random
import sys
import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

MAX_PIXELS = 1 << 20  # decoded images above this are downscaled (the processor resizes again)
URL_MAX_BYTES, URL_TIMEOUT = 32 << 20, 20  # with allow_urls: one image's body, seconds per read

SINGLE_TURN_INSTRUCTION = ("Solve the geometry problem shown in the diagram. Think briefly, then "
                           "give the final answer as \\boxed{<answer>}.")
# The tools themselves reach the model as rollout.chat_prompt decides (the template's `tools=`, or a list here).
MULTI_TURN_SYSTEM = (
    "You solve geometry problems from diagrams. You may call one of your tools, then stop and "
    "wait for its result: calc_score checks a candidate answer, crop shows a region of an image "
    "enlarged so that you can read small labels. When you are done, reply without a tool call "
    "and give the final answer as \\boxed{<answer>}.")


class DataError(ValueError):
    """A data source that cannot be used as asked; the message names the file and rows."""


class TooLong(ValueError):
    """A row over a length limit (raised by a load `check`): skipped and counted, not an error."""


def decode_image(value, base_dir=None, max_pixels=MAX_PIXELS, allow_urls=False, allow_outside=False):
    """bytes | {"bytes", "path"} | path | data URI | http(s) URL | PIL image -> RGB PIL image. Paths
    stay inside `base_dir` unless allow_outside, URLs need allow_urls (README, "Reliability")."""
    if isinstance(value, dict):  # parquet's image struct: its bytes, else its path
        if not (value.get("bytes") or value.get("path")):
            raise ValueError("image dict has neither 'bytes' nor 'path'")
        value = value.get("bytes") or value["path"]
    if isinstance(value, Image.Image):
        img = value
    elif isinstance(value, (bytes, bytearray, memoryview)):
        img = Image.open(io.BytesIO(bytes(value)))
    elif isinstance(value, str) and value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header:
            raise ValueError("data URI is not base64")
        img = Image.open(io.BytesIO(base64.b64decode(payload)))
    elif isinstance(value, str) and value.startswith(("http://", "https://")):
        if not allow_urls:
            raise ValueError(f"{value[:100]} is a URL: not fetched (--allow-image-urls fetches them)")
        try:
            with urllib.request.urlopen(value, timeout=URL_TIMEOUT) as r:
                body = r.read(URL_MAX_BYTES + 1)
        except OSError as e:
            raise ValueError(f"cannot fetch {value} ({e}); download the images or use a local copy")
        if len(body) > URL_MAX_BYTES:
            raise ValueError(f"{value[:100]}: larger than {URL_MAX_BYTES >> 20} MB, not read")
        img = Image.open(io.BytesIO(body))
    elif isinstance(value, str) and value:
        path = Path(value) if base_dir is None or Path(value).is_absolute() else Path(base_dir) / value
        if not allow_outside and (base_dir is None or not path.resolve().is_relative_to(Path(base_dir).resolve())):
            raise ValueError(f"image path {value} is outside the data set's folder {base_dir} "
                             "(--allow-outside-paths reads it)")
        if not path.exists():
            raise ValueError(f"image file not found: {path}")
        img = Image.open(path)
    else:
        raise ValueError(f"unsupported image value of type {type(value).__name__}")
    img.load()  # decode now, so a corrupt image fails here with its row, not in a worker later
    img = img.convert("RGB")
    if img.width * img.height > max_pixels:
        scale = math.sqrt(max_pixels / (img.width * img.height))
        img = img.resize((max(1, int(img.width * scale)), max(1, int(img.height * scale))))
    return img


def image_to_data_uri(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _read_rows(source, split):
    """-> (rows, base_dir, name): raw dict rows of a file, folder or hub data set."""
    path, split = Path(source), split or "train"
    if path.is_dir():
        for cand in (path / f"{split}.parquet", path / f"{split}.jsonl"):
            if cand.exists():
                return _read_rows(cand, None)
        shards = sorted((path / "data").glob(f"{split}-*.parquet"))  # hub snapshot layout
        if shards:
            return [r for s in shards for r in _read_rows(s, None)[0]], path, str(path)
        raise DataError(f"{path}: no {split}.parquet, {split}.jsonl or data/{split}-*.parquet inside")
    if path.suffix in (".parquet", ".jsonl", ".json") and not path.exists():
        raise DataError(f"{path}: no such file or folder")
    if path.suffix == ".parquet":
        try:
            return pq.read_table(path).to_pylist(), path.parent, str(path)
        except Exception as e:  # noqa: BLE001 - arrow raises several types for a file that is not parquet
            raise DataError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    if path.suffix in (".jsonl", ".json"):
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
        rows = []
        for i, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    row = {"__error__": f"line {i + 1} is not JSON ({e.msg})"}
                rows.append(row if isinstance(row, dict) else
                            {"__error__": f"line {i + 1} is a JSON {type(row).__name__}, not an object"})
        return rows, path.parent, str(path)
    if path.exists():
        raise DataError(f"{path}: unknown file type (use .parquet, .jsonl or a folder)")
    # a hub id such as hiyouga/geometry3k; data/trian (its folder exists here) is a mistyped path
    if source.count("/") == 1 and not source.startswith((".", "/")) and not path.parent.is_dir():
        try:
            import datasets
            ds = datasets.load_dataset(source, split=split)
        except Exception as e:  # noqa: BLE001 - network, auth or a missing split: say which source
            raise DataError(f"cannot load hub data set {source!r} split {split!r}: {e}")
        return list(ds), None, source
    raise DataError(f"{source}: no such file or folder")


def _record(row, base_dir, input_key, label_key, max_pixels, allow_urls, allow_outside):
    if "__error__" in row:
        raise ValueError(row["__error__"])
    for key in (input_key, label_key):
        if key not in row:
            raise ValueError(f"missing column {key!r}")
    problem, answer = row[input_key], row[label_key]
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"empty {input_key!r}")
    answer = "" if answer is None else str(answer).strip()
    if not answer:
        raise ValueError(f"empty {label_key!r}")
    raw = row.get("images", row.get("image"))
    raw = [] if raw is None else raw if isinstance(raw, list) else [raw]
    if not raw:
        raise ValueError("no image")
    images = []
    for j, value in enumerate(raw):
        try:
            images.append(decode_image(value, base_dir, max_pixels, allow_urls, allow_outside))
        except Exception as e:  # noqa: BLE001 - PIL raises many types for corrupt bytes
            raise ValueError(f"image {j}: {e}") from None
    return {"problem": problem, "answer": answer, "images": images}


def load_geo3k(source, split=None, input_key="problem", label_key="answer", max_bad_frac=0.01,
               max_pixels=MAX_PIXELS, verbose=True, check=None, allow_urls=False, allow_outside=False):
    """Load geo3k-style records; stop when more than `max_bad_frac` of the rows are unusable (each
    named by row and reason). `check(record)` raises ValueError for a bad row, TooLong for one to
    skip and count."""
    rows, base_dir, name = _read_rows(str(source), split)
    records, bad, long = [], [], []
    for i, row in enumerate(rows):
        try:
            rec = _record(row, base_dir, input_key, label_key, max_pixels, allow_urls, allow_outside)
            if check:
                check(rec)
            records.append(rec)
        except TooLong as e:
            long.append((i, str(e)))
        except ValueError as e:
            bad.append((i, str(e)))
    if not rows:
        raise DataError(f"{name}: no rows")
    listing = _listing(bad)
    if len(bad) > max_bad_frac * len(rows):
        raise DataError(f"{name}: {len(bad)} of {len(rows)} rows are unusable (limit "
                        f"{max_bad_frac:.1%}; raise --max-bad-frac to skip them):\n{listing}")
    if long and (verbose or not records):
        print(f"[data] {name}: skipped {len(long)} of {len(rows)} rows over the length limit:\n{_listing(long)}",
              file=sys.stderr)
    if not records:
        raise DataError(f"{name}: no usable row of {len(rows)}:\n{_listing(bad + long)}")
    if bad and verbose:
        print(f"[data] {name}: skipped {len(bad)} of {len(rows)} rows, using {len(records)}:\n{listing}",
              file=sys.stderr)
    return records


def _listing(rows):
    return "\n".join(f"  row {i}: {why}" for i, why in rows[:10]) + ("\n  ..." if len(rows) > 10 else "")


def user_content(problem, n_images):
    """Chat content parts: each `<image>` marker in the problem becomes an image part (in
    order); images without a marker go first, as geo3k problems start with `<image>`."""
    pieces = problem.split("<image>")
    parts = [{"type": "image"} for _ in range(max(0, n_images - (len(pieces) - 1)))]
    for k, text in enumerate(pieces):
        if k > 0 and k <= n_images:
            parts.append({"type": "image"})
        if text.strip():
            parts.append({"type": "text", "text": text.strip()})
    return parts


def prompt_messages(record, multi_turn=False, tool_list=None):
    """The prompt as chat messages: single-turn asks for a box, multi-turn explains the episode;
    `tool_list` (text) is appended to its system prompt for templates that render no tools."""
    content = user_content(record["problem"], len(record["images"]))
    if not multi_turn:
        content.append({"type": "text", "text": "\n" + SINGLE_TURN_INSTRUCTION})
        return [{"role": "user", "content": content}]
    system = MULTI_TURN_SYSTEM if not tool_list else MULTI_TURN_SYSTEM + "\n\n" + tool_list
    return [{"role": "system", "content": system}, {"role": "user", "content": content}]


def sft_target(answer):
    return f"Answer: \\boxed{{{answer}}}"


def sft_messages(record):
    return prompt_messages(record) + [{"role": "assistant", "content": sft_target(record["answer"])}]


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
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("synth", help="write a synthetic geometry set in the geo3k schema")
    s.add_argument("--n", type=int, default=512, help="training problems")
    s.add_argument("--n-test", type=int, default=64, help="test problems")
    s.add_argument("--out", required=True, help="output folder")
    s.add_argument("--seed", type=int, default=0, help="random seed (same seed, same files)")
    s.add_argument("--kinds", default="polygon", help=f"comma list of {sorted(KINDS)}")
    s.add_argument("--size", type=int, default=128, help="image side in pixels")
    s.add_argument("--jitter", type=float, default=0.0, help="0..1: random pose and colour (harder)")
    sh = sub.add_parser("show", help="load a source and print a summary")
    sh.add_argument("source")
    sh.add_argument("--split", default=None)
    a = p.parse_args(argv)
    if a.cmd == "synth":
        kinds = tuple(k.strip() for k in a.kinds.split(","))
        unknown = [k for k in kinds if k not in KINDS]
        if unknown:
            p.error(f"unknown --kinds {unknown}; choose from {sorted(KINDS)}")
        out = write_synth(a.out, a.n, a.n_test, a.seed, kinds, a.size, a.jitter)
        print(f"wrote {a.n} train and {a.n_test} test problems to {out}")
    else:
        recs = load_geo3k(a.source, a.split)
        print(f"{len(recs)} records; first: {recs[0]['problem'][:80]!r} -> {recs[0]['answer']!r}, "
              f"images {[im.size for im in recs[0]['images']]}")


if __name__ == "__main__":
    main()
