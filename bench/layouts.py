"""One GRPO step of the same samples in each layout: loss and grad norm, read from metrics.jsonl.

    .venv/bin/python bench/layouts.py [--steps 1] [--out DIR]

Issue 30's setting: a tiny Qwen3-VL (hidden 96, 6 query / 2 KV heads, 4 layers, untied LM head,
depth-3 vision tower with deepstack) whose weights are redrawn large (tests/test_layouts.redraw:
logits far from uniform), 32 polygon pictures of 96 px, 4 prompts x 4 samples, one optimizer update,
--lr 1e-3 --entropy-coef 1.0 --seed 7, the local engine. Each layout runs train_grpo.py as a user
would (python, torchrun 1, torchrun 2 as DP2, TP2 and CP2, and DP2 with --freeze-vit); the rows
must agree to float noise. tests/test_layouts.py holds the same to account parameter by parameter.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

LAYOUTS = [("python", [], []), ("torchrun 1", ["1"], []), ("torchrun 2 (DP2)", ["2"], []),
           ("torchrun 2, TP2", ["2"], ["--tensor-model-parallel-size", "2"]),
           ("torchrun 2, CP2", ["2"], ["--context-parallel-size", "2"]),
           ("--freeze-vit, python", [], ["--freeze-vit"]), ("--freeze-vit, DP2", ["2"], ["--freeze-vit"])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--out", default=None, help="keep the runs here (default: a temporary folder)")
    a = p.parse_args()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from tools import synth
    from tools import tiny
    from test_layouts import redraw
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(a.out or tmp)
        base = tiny.make_tiny(out / "base", "qwen3_vl", hidden=96, heads=6, kv_heads=2, layers=4, vit_depth=3)
        ckpt = redraw(base, out / "ckpt", 1234)
        synth.write_synth(out / "data", 32, n_test=4, seed=0, size=96)
        print(f"{'layout':<24} {'loss':>16} {'grad_norm':>14} {'entropy':>14}")
        for name, nproc, flags in LAYOUTS:
            launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", nproc[0]]
                                         if nproc else [])
            save = out / name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "")
            cmd = launch + [str(ROOT / "train_grpo.py"), "--hf-checkpoint", str(ckpt), "--prompt-data", str(out / "data"),
                            "--save", str(save), "--overwrite", "--rollout-engine", "local", "--rollout-batch-size", "4",
                            "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--num-rollout", str(a.steps),
                            "--lr", "1e-3", "--entropy-coef", "1.0", "--seed", "7", "--save-interval", "0", *flags]
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
            m = [json.loads(x) for x in (save / "metrics.jsonl").read_text().splitlines() if '"loss"' in x][-1]
            print(f"{name:<24} {m['loss']:>16.9f} {m['grad_norm']:>14.9f} {m['entropy']:>14.9f}", flush=True)


if __name__ == "__main__":
    main()
