"""bench/crop_sets.py: variants of the CPU demo's crop sets for issue 76's loop (bench/crop_stage.sh): the crop task
(train/test) and its SFT warm start, built as run.sh builds them (tools/synth.py, same seeds), then changed:

    python bench/crop_sets.py --out runs/sets-last --hf-checkpoint runs/base/base --question last
    python bench/crop_sets.py --out runs/sets-rand --hf-checkpoint runs/base/base --pick random --share 1.0

--question last: the box is the question's last words ("How many sides does the polygon have in the box [..]?"), nearest
the call; --question frame: the question names the box in the model's grounding frame (Qwen3-VL's 0-1000), the frame
its call writes in, not in the canvas's pixels (the row's `box`, which the crop-hit metric reads, stays in pixels);
--instruction "": no geo3k instruction after the question (pass --prompt-instruction "" to train_grpo.py too);
--pick random: each zooming SFT episode zooms into one of the two boxes at random (its answer stays the named one's), so
that GRPO, not SFT, must find which. Writes OUT/crop and OUT/crop_warm (train.parquet, test.parquet)."""
import argparse
import json
import random
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
import env_geo3k  # noqa: E402
from tools import synth  # noqa: E402

PAIR = 192 + 704  # tools/synth.py's crop boxes' x1 (left, right): the other box's x1 is PAIR - x1


def reword(rows, question):
    if question == "frame":  # the demo's Qwen3-VL grounds in 0-1000 (env_geo3k.frame), its canvas is 1,024 px
        for r in rows:
            named = env_geo3k.scale(r["box"], (1024, 1024), env_geo3k.frame(None, 1024, 1024), outward=False)
            r["problem"] = r["problem"].replace(str(r["box"]), str(named))
    if question == "last":
        for r in rows:
            r["problem"] = re.sub(r"polygon in the box (\[[^\]]*\]) have\?", r"polygon have in the box \1?", r["problem"])
    return rows


def warm(rows, share, seed, hf, pick, instruction):
    rng = random.Random(seed)
    other = [dict(r, box=[PAIR - r["box"][0], r["box"][1], PAIR - r["box"][0] + 128, r["box"][3]]) if pick == "random"
             and rng.random() < 0.5 else r for r in rows]  # the box the episode zooms into
    out = [dict(w, box=r["box"]) for w, r in zip(synth.warm_start(other, share, seed, hf), rows)]
    for r in out:  # the instruction after the question: run.sh's (geo3k's), or none
        messages = json.loads(r["messages"])
        for m in messages:
            if m["role"] == "user" and not isinstance(m["content"], str):
                m["content"] = [p for p in m["content"] if p.get("text") != "\n" + data.INSTRUCTION] + (
                    [{"type": "text", "text": "\n" + instruction}] if instruction else [])
        r["messages"] = json.dumps(messages)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--hf-checkpoint", required=True, help="the demo's base model (its grounding frame)")
    p.add_argument("--data-seed", type=int, default=0, help="run.sh's DATA_SEED")
    p.add_argument("--question", choices=["synth", "last", "frame"], default="synth")
    p.add_argument("--instruction", default=data.INSTRUCTION)
    p.add_argument("--pick", choices=["named", "random"], default="named")
    p.add_argument("--share", type=float, default=0.5, help="SFT episodes that zoom (run.sh: 0.5)")
    a = p.parse_args()
    seed = a.data_seed
    for name, n, n_test, s in (("crop", 512, 64, seed + 2), ("crop_warm", 512, 8, seed + 3)):
        out = Path(a.out, name)
        out.mkdir(parents=True, exist_ok=True)
        (out / "synth.json").write_text(json.dumps({"kinds": ["crop"], "chance": 0.25}))
        for split, count, s2 in (("train", n, s), ("test", n_test, s + 1_000_003)):  # tools/synth.py's seeds
            rows = reword(synth.synth_records(count, s2, ("crop",)), a.question)
            if name == "crop_warm":
                rows = warm(rows, a.share, s2, a.hf_checkpoint, a.pick, a.instruction)
            pq.write_table(pa.Table.from_pylist(rows), out / f"{split}.parquet")
    print(f"wrote {a.out}/crop and {a.out}/crop_warm")


if __name__ == "__main__":
    main()
