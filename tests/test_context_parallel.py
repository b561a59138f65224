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


@pytest.mark.parametrize("cp", [1, 2])
def test_local_attention_calls_sdpa_in_4d_with_the_same_outputs(monkeypatch, cp):
    """torch's flash, efficient and cuDNN SDPA kernels take 4-D (batch, heads, T, dim) only (sdp_utils'
    check_tensor_shapes): a 3-D call runs the math kernel on CUDA. Both paths, CP 1 and CP 2 (rank 0's zigzag
    queries over gathered keys), call it 4-D, and give a per-head causal softmax's outputs (GQA 4 heads on 2)."""
    import types
    import attention
    from megatron.core import parallel_state as ps
    lens, heads, groups, dim = (8, 12), 4, 2, 8  # multiples of 2 CP: zigzag chunks
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(sum(lens), h, dim, generator=g) for h in (heads, groups, groups))
    want = []  # (T, heads, dim): each sequence's causal attention, each head over its group's keys
    for a, b in zip((0, lens[0]), (lens[0], sum(lens))):
        kk, vv = (x[a:b].repeat_interleave(heads // groups, 1) for x in (k, v))
        s = torch.einsum("thd,shd->hts", q[a:b], kk) / dim ** 0.5
        s = s.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
        want.append(torch.einsum("hts,shd->thd", s.softmax(-1), vv))
    want = torch.cat(want)
    real, dims = torch.nn.functional.scaled_dot_product_attention, []

    def spy(q, *a, **kw):
        dims.append(q.dim())
        return real(q, *a, **kw)
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(attention.C, "gather_sequence", lambda x, *_: x)  # the keys given whole: one process
    monkeypatch.setattr(ps, "get_context_parallel_group", lambda: None)
    monkeypatch.setattr(ps, "get_context_parallel_rank", lambda: 0)
    core = attention.PackedCoreAttention(types.SimpleNamespace(context_parallel_size=cp), 1, None, None)
    rows = C.held(lens, cp, 0) if cp > 1 else torch.arange(sum(lens))
    cu = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, lens[0], sum(lens)]))
    out = core(q[rows], k, v, None, packed_seq_params=cu)
    assert dims == [4, 4] and torch.allclose(out, want[rows].reshape(len(rows), -1), atol=1e-5)


def test_local_attention_reads_the_sequence_bounds_once_a_forward():
    """PackedCoreAttention takes each packed sequence's bounds on the host; on CUDA each .tolist() of cu_seqlens
    waits for every kernel queued before it: once a forward (every layer gets the same PackedSeqParams: model.py),
    not once a layer (issue 75). Three layers' attention, counted on the tensor itself; their outputs unchanged."""
    import types
    import attention
    reads = []

    class Counted(torch.Tensor):
        def tolist(self):
            reads.append(1)
            return super().tolist()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(20, h, 8, generator=g) for h in (4, 2, 2))
    layers = [attention.PackedCoreAttention(types.SimpleNamespace(context_parallel_size=1), i, None, None)
              for i in range(1, 4)]
    psp = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 8, 20]).as_subclass(Counted))
    outs = [core(q, k, v, None, packed_seq_params=psp) for core in layers]
    fresh = layers[0](q, k, v, None, packed_seq_params=types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 8, 20])))
    assert len(reads) == 1 and all(torch.equal(o, fresh) for o in outs), reads
