"""Context parallelism: the zigzag layout, and `tools/check.py --context-parallel-size 2` against
transformers through the user's command. The gradients at CP2 (dense with the vision tower, and
Qwen3.5-MoE's Gated DeltaNet and experts at CP2 x EP2) are test_layouts.py's; SFT and GRPO steps at
CP2 are test_sft.py's and test_grpo.py's."""
import pytest
import torch

import context_parallel as C
from test_model import torchrun2


def test_zigzag_chunks_balance_the_ranks_and_come_back_in_token_order():
    assert [C.padded(n, 2) for n in (35, 36, 1)] == [36, 36, 4] and C.padded(35, 1) == 35
    lens = (8, 12)  # chunks of 2 and 3 tokens at CP 2
    assert C.held(lens, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19]
    assert C.held(lens, 2, 1).tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16]
    for cp in (1, 2, 3):
        lens = (6 * cp, 2 * cp, 10 * cp)
        rows = C.rank_order(lens, cp)
        assert sorted(rows.tolist()) == list(range(sum(lens)))  # every token on one rank
        assert torch.equal(rows[C.token_order(lens, cp)], torch.arange(sum(lens)))
        starts = torch.tensor([0, 6 * cp, 8 * cp])

        def work(r):  # causal attention's: the keys each of rank r's queries sees
            p = C.held(lens, cp, r)
            return int((p - starts[torch.searchsorted(starts, p, right=True) - 1] + 1).sum())
        assert len({work(r) for r in range(cp)}) == 1, [work(r) for r in range(cp)]


@pytest.mark.cores
def test_cp2_check_command(tiny_ckpt):
    """Qwen3.5's logits at CP=2 over gloo against transformers' (sequences of 34, 35 and 38 tokens,
    padded to multiples of 4; Gated DeltaNet head-parallel, gated attention over gathered keys). The
    other families at CP2 (and CP4, TP2 x CP2, CP2 x EP2) measured: bench/RESULTS.md, "Layouts"."""
    lines = torchrun2("tools/check.py", "--hf-checkpoint", tiny_ckpt("qwen3_5"), "--context-parallel-size", "2")
    assert "export_exact=True" in lines[-2] and "tp=1 cp=2" in lines[-2]
    assert lines[-1].startswith("max_abs_logit_diff=") and float(lines[-1].split("=")[1]) <= 1e-4


def test_fp32_under_cp_with_transformer_engine_is_refused_at_build(tiny_ckpt, monkeypatch):
    """TE 2.20.2 leaves no attention backend for fp32 under CP (Flash and Fused take bf16/fp16 only,
    Unfused no CP: dot_product_attention/utils.py:670-712, 1269-1273), so its "No dot product attention
    backend" would come at the first forward, after the engine started: the build says it, naming the
    flags. TE stands in on CPU."""
    import types
    import pytest
    from transformers import AutoConfig
    import model as M
    d = tiny_ckpt("qwen3_vl")
    monkeypatch.setattr(M, "layer_impl", lambda impl: "transformer_engine")
    par = types.SimpleNamespace(tp_rank=0, tp=1, ep=1, cp=2)
    with pytest.raises(SystemExit, match="--context-parallel-size 2 with Transformer Engine needs --bf16.*"
                                         "--transformer-impl local"):
        M.MegatronVLM(AutoConfig.from_pretrained(d), d, par, M.ModelOptions())


def test_check_command_in_bf16(tiny_ckpt):
    """`tools/check.py --bf16`, what bench/gpu_smoke.sh runs under CP on GPUs: our bf16 logits within
    BF16_TOL of transformers' fp32 ones, and the export equal to the source rounded to bf16."""
    import parallel
    from tools import check
    parallel.init_distributed(1)
    assert 0 < check.check(tiny_ckpt("qwen3_5"), bf16=True) <= check.BF16_TOL
