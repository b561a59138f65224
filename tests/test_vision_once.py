"""model.unique_images: the vision tower runs once per distinct image of a micro-batch (a GRPO
group's samples share their prompt's image), with the same logprobs and gradients as running it
on every copy. Parity with transformers on a batch holding a repeated image: tests/test_model.py.

    .venv/bin/pytest tests/test_vision_once.py -q
"""
import pytest
import torch

import model as M
from tools import check
import parallel


@pytest.mark.parametrize("arch", ["qwen3_vl", "qwen2_5_vl"])
def test_vision_tower_once_per_distinct_image(tiny_ckpt, arch, monkeypatch):
    parallel.init_distributed(1)
    d = tiny_ckpt(arch)
    m = M.load_model(d)
    seqs, pix, grid = check.check_inputs(d)       # images A | none | B, A: A twice
    seqs, pix, grid = seqs * 2, torch.cat([pix, pix]), torch.cat([grid, grid])   # A x4, B x2
    seen = []
    m.visual.register_forward_pre_hook(lambda mod, args, kw: seen.append(len(kw["grid_thw"])), with_kwargs=True)

    def run():
        m.zero_grad()
        lp, _ = m(seqs, pix, grid)
        (lp * torch.linspace(-1, 1, len(lp))).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in m.visual.named_parameters() if p.grad is not None}
    lp, grads = run()
    ident = lambda p, g, ms: (p, g, torch.arange(sum(M.image_tokens(g, ms))))  # noqa: E731 - no dedup
    monkeypatch.setattr(M, "unique_images", ident)
    lp_all, grads_all = run()
    assert seen == [2, 6]                    # distinct images once, then every copy
    assert (lp - lp_all).abs().max() < 1e-5
    assert grads.keys() == grads_all.keys() and grads
    for n, g in grads.items():
        assert torch.allclose(g, grads_all[n], rtol=1e-4, atol=1e-6), n
