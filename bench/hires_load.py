"""Loading high-resolution rows: time and memory of data.load_geo3k on N rows of a W x H photo-like JPEG.

    .venv/bin/python bench/hires_load.py [--rows 256] [--size 4000 3000] [--code DIR]   # DIR: another checkout's data.py

The rows are written once in two forms: a parquet file of image bytes (as `datasets` writes them) and a jsonl file of
image paths (every row the same file). Each load runs in a fresh interpreter, which prints its wall time, its resident
memory (VmRSS) before reading the file and after the load (garbage collected, the records still held; the parquet
reader's own peak stays in the allocator), what the records hold (their pickle: decoded pixels or encoded images), and
what one row then costs to see: its view decoded.
"""
import argparse
import io
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def child(path, code):
    sys.path.insert(0, code)
    import gc

    import pickle

    import data
    before, t = rss_mb(), time.perf_counter()
    recs = data.load_geo3k(path, verbose=False)
    load_s = time.perf_counter() - t
    gc.collect()
    after = rss_mb()
    t = time.perf_counter()
    image = recs[0]["images"][0]
    view = image.view() if hasattr(image, "view") else image  # the row's view as an episode decodes it
    view_s = time.perf_counter() - t
    print(f"{Path(path).name}: rows={len(recs)} load_s={load_s:.2f} rss_before_mb={before:.0f} rss_after_mb={after:.0f} "
          f"records_mb={len(pickle.dumps(recs)) / 2**20:.0f} view={view.size} view_s={view_s:.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--size", type=int, nargs=2, default=(4000, 3000))
    p.add_argument("--code", default=str(ROOT), help="the checkout whose data.py loads")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        return child(a.child, a.code)
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image, ImageDraw
    w, h = a.size
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], -1) + np.random.default_rng(0).normal(0, 6, (h, w, 3))
    img = Image.fromarray(rgb.clip(0, 255).astype(np.uint8))
    ImageDraw.Draw(img).text((w // 2, h // 2), "label 42", fill=(0, 0, 0))  # the small detail a zoom is for
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    row = {"problem": "<image>What does the label say?", "answer": "42"}
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(pa.Table.from_pylist([dict(row, images=[{"bytes": buf.getvalue(), "path": None}])] * a.rows),
                       Path(tmp) / "train.parquet")
        (Path(tmp) / "label.jpg").write_bytes(buf.getvalue())
        (Path(tmp) / "train.jsonl").write_text((json.dumps(dict(row, images="label.jpg")) + "\n") * a.rows)
        print(f"{a.rows} rows of a {w}x{h} JPEG ({len(buf.getvalue()) / 2**20:.1f} MB each), code {a.code}")
        for name in ("train.parquet", "train.jsonl"):
            subprocess.run([sys.executable, __file__, "--child", str(Path(tmp) / name), "--code", a.code], check=True)


if __name__ == "__main__":
    main()
