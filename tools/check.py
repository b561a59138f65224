"""The parity check: our Megatron model against transformers' on one checkpoint, fp32, on a packed
batch of images and text, plus the export round trip. Its last three lines: PASS or FAIL, the layout,
`max_abs_logit_diff=<x>`; it exits non-zero above 1e-4 (--bf16: BF16_TOL) or when the export differs.

    python tools/check.py --hf-checkpoint ckpt/tiny                     # TP = 1
    torchrun --nproc_per_node 2 tools/check.py --hf-checkpoint DIR      # TP = world size; or CP, PP:
        [--context-parallel-size 2 | --pipeline-model-parallel-size 2]
"""
import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from safetensors import safe_open
from transformers import AutoModelForImageTextToText, AutoProcessor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the core modules, however this is run
import convert  # noqa: E402
import model as M  # noqa: E402
import parallel  # noqa: E402
import pipeline  # noqa: E402

BF16_TOL = 0.02  # --bf16: measured 0.0067 / 0.0073 on the tiny qwen3_vl / qwen3_5 (CPU, TP1, CP2; logit std 0.16)


def check_inputs(hf_dir):
    """A packed batch as the processor makes it: [image A + text], [text only], [image B, image A + text].
    Returns (seqs, pixel_values, image_grid_thw) with the images of all sequences in order."""
    proc = AutoProcessor.from_pretrained(hf_dir)
    g = torch.Generator().manual_seed(0)

    def img(w, h):  # random pixels, reproducible
        return Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
    a, b = img(64, 96), img(112, 80)
    convs = [([a], "What is the area of the triangle?", "Answer: \\boxed{12}"),
             ([], "Hello, what is 2 + 3?", "2 + 3 = 5, so the answer is 5."),
             ([b, a], "Compare the two figures.", "The first is larger.")]
    seqs, pvs, grids = [], [], []
    for images, q, ans in convs:
        msgs = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": q}]},
                {"role": "assistant", "content": [{"type": "text", "text": ans}]}]
        text = proc.apply_chat_template(msgs, tokenize=False)
        enc = proc(text=[text], images=images or None, return_tensors="pt")
        seqs.append(enc["input_ids"][0])
        if images:
            pvs.append(enc["pixel_values"])
            grids.append(enc["image_grid_thw"])
    return seqs, torch.cat(pvs).float(), torch.cat(grids)


def hf_logits(hf, seqs, pixel_values=None, image_grid_thw=None):
    """transformers' logits [(T_i, V)], one sequence at a time (no packing)."""
    out = []
    for s, (pv, g) in zip(seqs, M.split_images(hf.config, seqs, pixel_values, image_grid_thw)):
        kw = {} if g is None else dict(pixel_values=pv, image_grid_thw=g,
                                       mm_token_type_ids=(s == hf.config.image_token_id).int()[None])
        out.append(hf(input_ids=s[None], **kw).logits[0].float())
    return out


def check(hf_dir, transformer_impl=None, tp=None, ep=1, sequence_parallel=False, cp=1, pp=1, bf16=False):
    """Megatron vs transformers (fp32) on check_inputs (packed, then each sequence alone, the same on every rank)
    and the export round trip; TP = world size / (CP PP) unless given. bf16: our parameters in bf16, exported as
    the source rounded to bf16. -> the max abs logit diff (inf when the export does not reproduce the checkpoint)."""
    tp = tp or int(os.environ.get("WORLD_SIZE", 1)) // (cp * pp)
    par = parallel.init_distributed(tp, ep=ep, cp=cp, pp=pp)
    rank, world, device = par.rank, par.world, par.device
    opts = M.ModelOptions(transformer_impl=transformer_impl, sequence_parallel=sequence_parallel, bf16=bf16,
                          moe_token_dispatcher_type="alltoall" if pp > 1 else "allgather")  # MoE under PP: alltoall
    model = M.load_model(hf_dir, opts, par)
    files = convert.weight_files(hf_dir)
    same = {}
    for n, t in convert.hf_tensors(model):
        with safe_open(files[n], "pt") as f:
            src = f.get_tensor(n)
        same[n] = torch.equal(t.cpu(), src) or (bf16 and torch.equal(t.cpu(), src.bfloat16().to(src.dtype)))
    exact = same.keys() == files.keys() and all(same.values())
    seqs, pv, grid = check_inputs(hf_dir)
    seqs, pv, grid = [s.to(device) for s in seqs], pv.to(device), grid.to(device)
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32).to(device)
    with torch.no_grad():
        theirs = hf_logits(hf, seqs, pv, grid) * 2
        # the whole batch as one packed micro-batch, then each sequence as one (through the PP schedule)
        batches = [(None, (seqs, pv, grid))] + [(None, ([s], p, g)) for s, (p, g) in
                                                zip(seqs, M.split_images(hf.config, seqs, pv, grid))]
        ours = [z for o in pipeline.run(model, batches, lambda m, x: m.logits(*x)) for z in o]
        diff = max([(x - y).abs().max().item() for x, y in zip(ours, theirs)], default=0.0)
        diff = float(parallel.all_reduce(torch.tensor(diff, device=device), None, dist.ReduceOp.MAX))  # PP: the last stage's
    tol = BF16_TOL if bf16 else 1e-4
    if rank == 0:
        print(f"{'PASS' if diff <= tol and exact else 'FAIL'}: logits within {tol}: {diff <= tol}, export exact: {exact}")
        print(f"tp={tp} cp={cp} pp={pp} ep={ep} sp={model.sp} world={world} device={device} spec={model.impl} sequences={[len(s) for s in seqs]} "
              f"image_grid_thw={grid.tolist()} export_exact={exact}")
        print(f"max_abs_logit_diff={diff:.3g}")
    return diff if exact else float("inf")


def main(argv=None):
    p = argparse.ArgumentParser(description="Megatron vs transformers logits on one checkpoint")
    p.add_argument("--hf-checkpoint", required=True, help="Hugging Face checkpoint folder")
    p.add_argument("--transformer-impl", default=None, choices=["transformer_engine", "local"],
                   help="Megatron layer spec (default: transformer_engine on CUDA, local on CPU)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None, help="TP (default: the world size / CP)")
    p.add_argument("--context-parallel-size", type=int, default=1, help="CP: each sequence split over ranks")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP: decoder layers split over stages")
    p.add_argument("--expert-model-parallel-size", type=int, default=1, help="EP: MoE experts split over ranks")
    p.add_argument("--sequence-parallel", action="store_true", help="split the sequence over TP ranks")
    p.add_argument("--bf16", action="store_true", help=f"our parameters in bf16 (passes at a diff <= {BF16_TOL})")
    a = p.parse_args(argv)
    sys.exit(0 if check(a.hf_checkpoint, a.transformer_impl, a.tensor_model_parallel_size,
                        a.expert_model_parallel_size, a.sequence_parallel, a.context_parallel_size,
                        a.pipeline_model_parallel_size, a.bf16) <= (BF16_TOL if a.bf16 else 1e-4) else 1)


if __name__ == "__main__":
    main()
