"""Does a weight update reach an image the SGLang server has seen before? (issue 25, item 4)

    .venv/bin/python bench/vision_cache_check.py --hf-checkpoint DIR [server flags...]

Starts SGLangEngine (the trainer's own, so with its SGLANG_VLM_CACHE_SIZE_MB=0), answers one image
prompt greedily, updates ONLY the vision tower's weights (+0.5 N(0, 1) noise), and asks again: the
logprobs must change. SGLang's vision-feature cache (keyed by image content) would answer with the
old features; set SGLANG_VLM_CACHE_SIZE_MB=100 in the environment to see that. Prints one line.
"""
import argparse
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoProcessor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import data  # noqa: E402
from tools import synth  # noqa: E402
import chat  # noqa: E402
from sglang_engine import SGLangEngine  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf-checkpoint", required=True)
    p.add_argument("--weight-sync", default="disk", choices=["disk", "tensor"])
    a, server_flags = p.parse_known_args()
    processor = AutoProcessor.from_pretrained(a.hf_checkpoint)
    rec = synth.synth_records(1, seed=3, kinds=("polygon",), size=128)[0]
    rec = dict(rec, images=[data.decode_image(im) for im in rec["images"]])
    item = {"input_ids": chat.encode_prompt(processor, data.prompt_messages(rec), rec["images"]), "images": rec["images"]}
    greedy = dict(temperature=0.0, max_new_tokens=8)
    state = load_file(str(Path(a.hf_checkpoint) / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    vision = [(k, v + 0.5 * torch.randn(v.shape, generator=g)) for k, v in state.items() if ".visual." in k]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with tempfile.TemporaryDirectory() as tmp:
        eng = SGLangEngine(a.hf_checkpoint, tmp, server_args=server_flags, weight_sync=a.weight_sync)
        try:
            before = eng.generate([item], greedy)[0]
            eng.update_weights([[(k, v.to(dev)) for k, v in vision]])
            after = eng.generate([item], greedy)[0]
        finally:
            eng.shutdown()
    gap = max(abs(x - y) for x, y in zip(before["logprobs"], after["logprobs"]))
    print(f"{len(vision)} vision tensors updated; max logprob change on the same image {gap:.3e}")
    sys.exit(0 if gap > 0 else 1)


if __name__ == "__main__":
    main()
