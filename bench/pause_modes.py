"""A weight update landing while requests generate, on the REAL SGLang 0.5.23 server (CPU harness): SGLang's
/pause_generation modes against ours, by how far the tokens written after the update are from the new weights.

    source /tmp/sglang-cpu/env.sh && python bench/pause_modes.py [--tokens 256] [--after 2.0] [--requests 4]

Starts one real server on a tiny random Qwen3-VL (text prompts) and, for each mode, lets --requests greedy requests
generate for --after seconds, then lands an update to other weights (the checkpoint + 0.05 noise, from disk, with
weight_version "1"), then lets them finish:
- in_place: /pause_generation in_place, the update (flush_cache false: SGLang refuses to flush a cache that
  running requests hold), /continue_generation: each request goes on from the KV of the old weights;
- retract: /pause_generation retract, the update, /continue_generation: each request is prefilled again;
- abort (what --fully-async does): /abort_request by rid, the update, each request continued by a new one with its
  tokens so far.
Each token's version comes from the server's meta_info.weight_versions spans (abort: from the request that wrote
it). Prints, per mode, the tokens written after the update and the largest |logprob - the new weights' own| over
them: the server's teacher-forced logprobs of the same sequence at the new weights (input_token_logprobs).
"""
import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import convert  # noqa: E402
from sglang_engine import SGLangEngine  # noqa: E402
from tools import tiny  # noqa: E402

FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
         "--mem-fraction-static", "0.5", "--disable-radix-cache", "--max-total-tokens", "8192", "--dtype", "float32"]


def generate(server, ids, n, rid):
    body = {"input_ids": ids, "rid": rid, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True}}
    meta = server.call("/generate", body)["meta_info"]
    pairs = meta["output_token_logprobs"]
    return [int(p[1]) for p in pairs], [float(p[0]) for p in pairs], meta


def scored(server, ids, start):
    """The server's own logprobs of ids[start:] given what precedes each (teacher-forced)."""
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start - 1,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 1}}
    got = server.call("/generate", body)["meta_info"]["input_token_logprobs"]
    return [float(p[0]) for p in got[1:]]


def one_mode(server, mode, prompts, a, new_dir, old_dir):
    outs, cut = [None] * len(prompts), [None] * len(prompts)

    def run(i):
        outs[i] = generate(server, prompts[i], a.tokens, f"{mode}-{i}")
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(a.after)
    t0 = time.perf_counter()
    body = {"model_path": str(new_dir), "weight_version": "1", "flush_cache": mode != "in_place"}
    if mode == "abort":
        for i in range(len(prompts)):
            server.post("/abort_request", {"rid": f"{mode}-{i}"})
        for t in threads:
            t.join()
        cut = outs[:]
        server.call("/update_weights_from_disk", body)
        threads = [threading.Thread(target=lambda i=i: outs.__setitem__(i, generate(
            server, prompts[i] + cut[i][0], a.tokens - len(cut[i][0]), f"{mode}-{i}b"))) for i in range(len(prompts))]
        for t in threads:
            t.start()
    else:
        server.call("/pause_generation", {"mode": mode})
        server.call("/update_weights_from_disk", body)
        server.call("/continue_generation", {"torch_empty_cache": False})
    took = time.perf_counter() - t0
    for t in threads:
        t.join()
    after, worst = [], 0.0
    for i, (ids, lps, meta) in enumerate(outs):
        if mode == "abort":
            first, ids, lps = len(cut[i][0]), cut[i][0] + ids, cut[i][1] + lps
        else:
            first = next((s["start"] for s in meta.get("weight_versions", []) if s["version"] == "1"), len(ids))
        ref = scored(server, prompts[i] + ids, len(prompts[i]))
        after.append(len(ids) - first)
        worst = max([worst] + [abs(x - y) for x, y in zip(lps[first:], ref[first:])])
    server.call("/update_weights_from_disk", {"model_path": str(old_dir), "weight_version": "0"})
    print(f"{mode:>8}: tokens after the update {after} of {a.tokens} each; largest |logprob - the new weights'| "
          f"over them {worst:.2e}; pause to continue {took:.2f} s", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--after", type=float, default=2.0, help="seconds the requests generate before the update")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--modes", nargs="+", default=["in_place", "retract", "abort"])
    a = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tiny.make_tiny(tmp / "ckpt", "qwen3_vl")
        state = load_file(str(ckpt / "model.safetensors"))
        gen = torch.Generator().manual_seed(3)
        convert.write_hf([[(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in state.items()]],
                         tmp / "new", ckpt)
        engine = SGLangEngine(ckpt, tmp / "run", server_args=FLAGS, launch_cmd=[sys.executable, "-m", "sglang.launch_server"])
        try:
            server = engine.server
            prompts = [[151644, 872, 198] + [9707 + 17 * i + k for k in range(12)] + [151645, 198, 151644, 77091, 198]
                       for i in range(a.requests)]  # <|im_start|>user ... <|im_end|> <|im_start|>assistant
            generate(server, prompts[0], 4, "warm")  # the first request is slow (~25 s)
            for mode in a.modes:
                one_mode(server, mode, prompts, a, tmp / "new", ckpt)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
