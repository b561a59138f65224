"""MFU's numerator and denominator for the device check's grpo (bench/device_checks.py): the model FLOPs of a
step's trainer items, the GPU's dense bf16 peak by name, and what a large matrix product reaches on it."""
import time

import torch

# dense bf16 peak of the GPU by name (NVIDIA's data sheets, SXM; PCIe H100 756): MFU's denominator
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12))


def train_flops(counts, cfg, items):
    """Model FLOPs of one forward and backward (3x the forward's) over trainer items: the language model's matrices
    at every token, the LM head at scored tokens only (logprobs.py computes no other), causal attention's two
    products per sequence (packed rows attend within each), the vision tower's matrices at every patch (its own
    attention left out: 4-64 merged tokens an image here). counts: bench/memory.count_params'. Dense models."""
    tc = cfg.text_config
    hd = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    head = tc.vocab_size * tc.hidden_size
    body = counts["text"] + counts["experts"] - head * (1 if cfg.tie_word_embeddings else 2)  # less embedding, head
    fwd = 0
    for it in items:
        n, scored = len(it.ids), int(it.mask.sum())
        patches = 0 if it.image_grid_thw is None else int(it.image_grid_thw.prod(-1).sum())
        fwd += 2 * (body * n + head * scored + tc.num_hidden_layers * tc.num_attention_heads * hd * n * n
                    + counts["vision"] * patches)
    return 3 * fwd


def matmul_flops_per_s():
    """An 8192^3 bf16 product's rate on this GPU (the mean of ten after three): what dense matrix work reaches."""
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (time.perf_counter() - t)
