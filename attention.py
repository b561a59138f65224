"""attention.py: core attention for the local (CPU) layer spec, per packed sequence.

Megatron's local DotProductAttention takes the packed row as one sequence with a dense (T, T)
mask: T^2 scores, memory and softmax work where the sequences need sum(T_i^2). With 32 samples of
~95 tokens packed into one micro-batch that is 32x the work, and it was ~1 s of a 2.8 s GRPO train
step on 2 cores (bench/vs_trl.py). This module takes the same arguments, but reads the sequence
boundaries from PackedSeqParams (THD, as Transformer Engine's attention does; Megatron then hands
it (T, heads, dim) tensors with RoPE already applied per sequence) and runs torch's
scaled_dot_product_attention, causal, on each sequence.
"""
import torch
import torch.nn.functional as F


class PackedCoreAttention(torch.nn.Module):
    """Drop-in for megatron.core.transformer.dot_product_attention.DotProductAttention (same
    constructor and forward signatures, megatron-core 0.16) for packed THD input."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        assert config.context_parallel_size == 1, "context parallelism needs Transformer Engine's attention"
        self.scale = softmax_scale  # None: 1 / sqrt(head dim), Megatron's default too

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # query (T, heads, dim); key, value (T, groups, dim): GQA is expanded by SDPA
        assert packed_seq_params is not None and packed_seq_params.qkv_format == "thd", \
            "PackedCoreAttention needs THD PackedSeqParams (model.py passes them)"
        cu = packed_seq_params.cu_seqlens_q.tolist()
        out = []
        for a, b in zip(cu[:-1], cu[1:]):
            q, k, v = (x[a:b].transpose(0, 1) for x in (query, key, value))  # (heads, T_i, dim)
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                      enable_gqa=True).transpose(0, 1))
        return torch.cat(out).reshape(query.shape[0], -1)  # (T, heads * dim)


def local_layer_spec(**kw):
    """megatron-core's local GPT layer spec (get_gpt_layer_local_spec(**kw)) with this core attention."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    spec = specs.get_gpt_layer_local_spec(**kw)
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    return spec
