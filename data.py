"""geo3k data: loading, image decoding, prompt builders (the synthetic set: tools/synth.py).

    python data.py show tests/data/geo3k_real/test.parquet   # load and summarise a source

`load_geo3k(source, split=None)` -> [{"problem", "answer", "images" (Picture), other columns as they are}] from a
hub id, a parquet or jsonl file, or a folder; the sources, columns and bad rows: docs/data.md.
"""
import argparse
import base64
import dataclasses
import functools
import io
import json
import math
import sys
import urllib.request
from pathlib import Path

import pyarrow.parquet as pq
from PIL import Image

import flags
import task

MIN_PIXELS, MAX_PIXELS = flags.MIN_PIXELS, flags.MAX_PIXELS  # the model's view of an image (--min-pixels, --max-pixels)
URL_MAX_BYTES, URL_TIMEOUT = 32 << 20, 20  # with allow_urls: one image's body, seconds per read
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".webp", ".bmp", ".tif", ".tiff")  # a path value names an image

# --prompt-instruction's default (geo3k's); multi-turn's system prompt: the episode alone, no task, no tool (chat.prompt)
INSTRUCTION = flags.INSTRUCTION
MULTI_TURN_SYSTEM = "You may call a tool, then stop and wait for its result. When you are done, reply without a tool call."


class DataError(ValueError):
    """A data source that cannot be used as asked; the message names the file and rows."""


class TooLong(ValueError):
    """A row over a length limit (raised by a load `check`): skipped and counted, not an error."""


@dataclasses.dataclass(frozen=True, eq=False)  # eq=False: hashed as itself, a key of _view's cache
class Picture:
    """A row's image as loaded: kept encoded (its bytes, a checked path, or a PIL image a hub data set decoded) and
    decoded where it is used, so rows hold no pixels, nor do the samples, envs, --partial-rollout buffers and
    checkpoints that pickle them. `size`: the original's (width, height), which a row's `box` and the zoom read;
    `view_size`: the model's view of it (--min-pixels, --max-pixels), whose grounding frame the model writes in."""
    source: object
    size: tuple
    view_size: tuple

    def original(self):
        """The image at full resolution, RGB (the zoom crops it)."""
        return _decoded(self.source, None)

    def view(self):
        """The model's view, RGB: the pixels SGLang and the trainer's processor both get (views())."""
        return _view(self)

    def __reduce__(self):  # a path's bytes travel with it: a DP rank on another node may not have the file
        source = Path(self.source).read_bytes() if isinstance(self.source, str) else self.source
        return Picture, (source, self.size, self.view_size)


def _opened(source):
    """A Picture's source as a PIL image; an encoded one not decoded yet (its header read: the size)."""
    if isinstance(source, Image.Image):
        return source
    return Image.open(io.BytesIO(source if isinstance(source, bytes) else Path(source).read_bytes()))  # no file left open


@functools.lru_cache(maxsize=64)  # a group's samples, turns and checks decode it once; at most 64 views (x --max-pixels)
def _view(picture):
    return _decoded(picture.source, picture.view_size)


def _decoded(source, size):
    img = _opened(source)
    img.draft("RGB", size)  # a JPEG decoded at a reduced scale, still >= size (as PIL's thumbnail); others: no-op
    img = img.convert("RGB")
    return img if size in (None, img.size) else img.resize(size)


def view_size(width, height, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """The (width, height) the model sees of an image: its own, scaled (aspect kept) into [min_pixels, max_pixels]."""
    area = width * height
    if min_pixels <= area <= max_pixels:
        return width, height
    s = math.sqrt((max_pixels if area > max_pixels else min_pixels) / area)
    rounded = int if area > max_pixels else math.ceil
    return max(1, rounded(width * s)), max(1, rounded(height * s))


def views(images):
    """Each image as the model sees it: a Picture's view decoded, a PIL image (a zoom's) as it is."""
    return [im.view() if isinstance(im, Picture) else im for im in images]


def picture(value, base_dir=None, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, allow_urls=False, allow_outside=False):
    """bytes | {"bytes", "path"} | path | data URI | http(s) URL | PIL image -> its Picture. Paths stay inside `base_dir`
    unless allow_outside, URLs need allow_urls (README, "Reliability"). The size comes from the header (where PIL
    refuses a decompression bomb, Image.MAX_IMAGE_PIXELS, before decoding); the view is decoded once, then dropped:
    a corrupt image fails here, with its row."""
    if isinstance(value, dict):  # parquet's image struct: its bytes, else its path
        if not (value.get("bytes") or value.get("path")):
            raise ValueError("image dict has neither 'bytes' nor 'path'")
        value = value.get("bytes") or value["path"]
    if isinstance(value, Image.Image):
        source = value.convert("RGB")
    elif isinstance(value, (bytes, bytearray, memoryview)):
        source = bytes(value)
    elif isinstance(value, str) and value.startswith("data:"):
        header, _, payload = value.partition(",")
        if ";base64" not in header:
            raise ValueError("data URI is not base64")
        source = base64.b64decode(payload)
    elif isinstance(value, str) and value.startswith(("http://", "https://")):
        if not allow_urls:
            raise ValueError(f"{value[:100]} is a URL: not fetched (--allow-image-urls fetches them)")
        try:
            with urllib.request.urlopen(value, timeout=URL_TIMEOUT) as r:
                source = r.read(URL_MAX_BYTES + 1)
        except OSError as e:
            raise ValueError(f"cannot fetch {value} ({e}); download the images or use a local copy")
        if len(source) > URL_MAX_BYTES:
            raise ValueError(f"{value[:100]}: larger than {URL_MAX_BYTES >> 20} MB, not read")
    elif isinstance(value, str) and value:
        path = Path(value) if base_dir is None or Path(value).is_absolute() else Path(base_dir) / value
        if not allow_outside and (base_dir is None or not path.resolve().is_relative_to(Path(base_dir).resolve())):
            raise ValueError(f"image path {value} is outside the data set's folder {base_dir} "
                             "(--allow-outside-paths reads it)")
        if not path.exists():
            raise ValueError(f"image file not found: {path}")
        source = str(path)
    else:
        raise ValueError(f"unsupported image value of type {type(value).__name__}")
    size = _opened(source).size
    pic = Picture(source, size, view_size(*size, min_pixels, max_pixels))
    if min(pic.view_size) < 4:  # transformers reads 1 or 3 px high as channels first (infer_channel_dimension_format)
        w, h = pic.view_size
        raise ValueError(f"{w}x{h} px: under 4 px a side, too small for the processor")
    _view(pic)  # into the view cache (its last 64): a row used at once (tools/synth.py) is not decoded twice
    return pic


def decode_image(value, base_dir=None, **options):
    """`value` (picture()'s forms, with its options) -> the model's view of it, an RGB PIL image."""
    return picture(value, base_dir, **options).view()


def image_to_data_uri(img):
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _read_rows(source, split):
    """-> (rows, base_dir, name): raw dict rows of a file, folder or hub data set."""
    path, split = Path(source), split or "train"
    if path.is_dir() and ((path / "state.json").exists() or (path / "dataset_dict.json").exists()):
        import datasets  # a datasets save_to_disk folder: a Dataset, or a DatasetDict of splits
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict) and split not in ds:
            raise DataError(f"{path}: a saved DatasetDict without split {split!r}; its splits: {', '.join(ds)}")
        return list(ds[split] if isinstance(ds, datasets.DatasetDict) else ds), path, str(path)
    if path.is_dir():
        for cand in (path / f"{split}.parquet", path / f"{split}.jsonl"):
            if cand.exists():
                return _read_rows(cand, None)
        if shards := sorted((path / "data").glob(f"{split}-*.parquet")):  # hub snapshot layout
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
            text = path.read_bytes().decode("utf-8-sig")  # a BOM (Windows editors write one) is no row
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


def _looks_like_image(value):
    value = value[0] if isinstance(value, list) and value else value
    if isinstance(value, dict):
        return "bytes" in value or "path" in value
    return isinstance(value, (bytes, Image.Image)) or str(value).lower().endswith(IMAGE_SUFFIXES)


def _record(row, base_dir, input_key, label_key, image_key, pixels, allow_urls, allow_outside):
    if "__error__" in row:
        raise ValueError(row["__error__"])
    problem, answer = row.get(input_key), row.get(label_key)  # a column no row has: load_geo3k names it
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"empty {input_key!r}")
    if isinstance(answer, (bool, dict, list)):  # str() would make "True" or "{'x': 1}" the answer
        raise ValueError(f"{label_key!r} is a {type(answer).__name__} ({str(answer)[:40]}), not a text or a number")
    answer = "" if answer is None else str(answer).strip()
    if not answer:
        raise ValueError(f"empty {label_key!r}")
    raw = row.get(image_key) if image_key else None  # image_key None: a text-only task (load_geo3k)
    raw = [] if raw is None else raw if isinstance(raw, list) else [raw]
    if not raw and image_key:
        raise ValueError("no image")
    if problem.count("<image>") not in (0, len(raw)) and "messages" not in row:  # a `messages` row: sft.encode counts
        raise ValueError(f"{problem.count('<image>')} <image> marker(s) in {input_key!r} for {len(raw)} image(s): one "
                         "marker an image, or none (the images go first)")
    images = []
    for j, value in enumerate(raw):
        try:
            images.append(picture(value, base_dir, *pixels, allow_urls, allow_outside))
        except Exception as e:  # noqa: BLE001 - PIL raises many types for corrupt bytes
            raise ValueError(f"image {j}: {e}") from None
    box, (w, h) = row.get("box"), images[0].size if images else (0, 0)  # a crop task's region of image 0 (its IoU)
    numbers = isinstance(box, list) and len(box) == 4 and all(type(v) in (int, float) for v in box)
    if box is not None and not (numbers and 0 <= box[0] < box[2] <= w and 0 <= box[1] < box[3] <= h):
        raise ValueError(f"box {str(box)[:80]}: not [x1, y1, x2, y2] inside image 0 ({w}x{h} px), x1 < x2, y1 < y2")
    # other columns ride along: a `messages` conversation (SFT), the `tools` a row offers, a crop task's `box`
    rest = {k: v for k, v in row.items() if k not in (input_key, label_key, image_key)}
    return {**rest, "problem": problem, "answer": answer, "images": images}


def load_geo3k(source, split=None, input_key="problem", label_key="answer", max_bad_frac=0.01, max_pixels=MAX_PIXELS,
               verbose=True, check=None, allow_urls=False, allow_outside=False, multimodal_keys=None, flag="--",
               min_pixels=MIN_PIXELS):
    """Load geo3k-style records; stop when more than `max_bad_frac` of the rows are unusable (each
    named by row and reason). `check(record)` raises ValueError for a bad row, TooLong for one to
    skip and count. multimodal_keys: slime's {"image": column} (default: `images`, else `image`)."""
    if min_pixels > max_pixels:
        raise DataError(f"--min-pixels {min_pixels} is above --max-pixels {max_pixels}: no view fits")
    rows, base_dir, name = _read_rows(str(source), split)
    columns, keys = sorted({k for row in rows for k in row} - {"__error__"}), multimodal_keys or {}
    if not isinstance(keys, dict) or set(keys) - {"image"}:  # slime's video and audio: no model input for them here
        raise DataError(f"""--multimodal-keys {json.dumps(keys)}: images only here, '{{"image": "COLUMN"}}'""")
    images = keys.get("image") or ("image" if "image" in columns and "images" not in columns else "images")
    markers = any("<image>" in str(row.get(input_key, "")) for row in rows)
    pictures = any(_looks_like_image(v) for row in rows for v in row.values())  # a forgotten image column
    if columns and images not in columns and not keys.get("image") and not markers and not pictures:  # a text task
        images = None
        if verbose:
            print(f"[data] {name}: no image column (images, image): text-only rows", file=sys.stderr)
    needs = [(input_key, f"{flag}input-key"), (label_key, f"{flag}label-key")]  # flag "--eval-": eval data's
    for need, flag in needs + ([(images, """--multimodal-keys '{"image": "COLUMN"}'""")] if images else []):
        if columns and need not in columns:
            raise DataError(f"{name}: no column {need!r}; its columns: {', '.join(columns)}. Name yours with {flag} "
                            "(docs/data.md)")
    records, bad, long = [], [], []
    for i, row in enumerate(rows):
        try:
            rec = _record(row, base_dir, input_key, label_key, images, (min_pixels, max_pixels), allow_urls, allow_outside)
            if check:
                check(rec)
            records.append(rec)
        except TooLong as e:
            long.append((i, str(e)))
        except ValueError as e:
            bad.append((i, str(e)))
    if not rows:
        raise DataError(f"{name}: no rows")
    if len(bad) > max_bad_frac * len(rows) and records:  # none usable: no --max-bad-frac helps (below)
        raise DataError(f"{name}: {len(bad)} of {len(rows)} rows are unusable (limit "
                        f"{max_bad_frac:.1%}; raise --max-bad-frac to skip them):\n{_listing(bad)}")
    if long and (verbose or not records):
        print(f"[data] {name}: skipped {len(long)} of {len(rows)} rows over the length limit:\n{_listing(long)}",
              file=sys.stderr)
    if not records:
        raise DataError(f"{name}: no usable row of {len(rows)}:\n{_listing(bad + long)}")
    if bad and verbose:
        print(f"[data] {name}: skipped {len(bad)} of {len(rows)} rows, using {len(records)}:\n{_listing(bad)}",
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


def prompt_messages(record, multi_turn=False, tool_list=None, instruction=INSTRUCTION):
    """The prompt as chat messages: the problem, then the run's `instruction` (--prompt-instruction; "": none); multi-turn,
    MULTI_TURN_SYSTEM first, `tool_list` (text) appended to it for templates that render no tools."""
    content = user_content(record["problem"], len(record["images"]))
    if instruction:
        content.append({"type": "text", "text": "\n" + instruction})
    system = [{"role": "system", "content": MULTI_TURN_SYSTEM + ("\n\n" + tool_list if tool_list else "")}]
    return (system if multi_turn else []) + [{"role": "user", "content": content}]


def sft_target(answer):
    return f"Answer: \\boxed{{{answer}}}"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("show", help="load a source as the trainers do (their flags for rows) and print a summary")
    sh.add_argument("source")
    flags.add_column_args(sh.add_argument)
    sh.add_argument("--max-turns", type=flags.POSITIVE, default=1, help="train_grpo's: > 1 checks each row's tools")
    a = p.parse_args(argv)
    try:
        env = task.env(a)
    except ValueError as e:
        p.error(str(e))
    tools = (lambda rec: task.tools(env, rec)) if a.max_turns > 1 else None  # train_grpo's row check
    try:
        recs = load_geo3k(a.source, a.split, a.input_key, a.label_key, a.max_bad_frac, a.max_pixels, check=tools,
                          min_pixels=a.min_pixels, allow_urls=a.allow_image_urls, allow_outside=a.allow_outside_paths,
                          multimodal_keys=a.multimodal_keys)
    except DataError as e:
        raise SystemExit(str(e)) from None
    turn = prompt_messages(recs[0], instruction=a.prompt_instruction)[-1]["content"]  # the user turn, as the trainers'
    print(f"{len(recs)} records; first: {''.join(p.get('text', '<image>') for p in turn)!r} -> {recs[0]['answer']!r}, "
          f"images {[im.size for im in recs[0]['images']]}")


if __name__ == "__main__":
    main()
