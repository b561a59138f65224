"""attention.py: core attention for the local (CPU) layer spec: torch's causal SDPA on each sequence of the
packed THD row, not Megatron's dense (T, T) mask over the whole row (why: docs/model.md)."""
import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import gpt_layer_specs as specs

import context_parallel as C


class PackedCoreAttention(torch.nn.Module):
    """Drop-in for megatron-core 0.16's DotProductAttention (same signatures) for packed THD input."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__()
        self.cp, self.scale = config.context_parallel_size, softmax_scale  # scale None: 1 / sqrt(head dim), as Megatron

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # query (T, heads, dim); key, value (T, groups, dim): GQA is expanded by SDPA; THD packed_seq_params: model.py's
        cu = host_bounds(packed_seq_params)
        if self.cp > 1:
            return self._context_parallel(query, key, value, cu)
        out = []  # 4-D (1, heads, T_i, dim): torch's flash, efficient and cuDNN kernels take no 3-D (sdp_utils)
        for a, b in zip(cu[:-1], cu[1:]):
            q, k, v = (x[None, a:b].transpose(1, 2) for x in (query, key, value))
            out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                      enable_gqa=True)[0].transpose(0, 1))
        return torch.cat(out).reshape(query.shape[0], -1)  # (T, heads * dim)

    def _context_parallel(self, query, key, value, cu):
        """This rank's queries (T / CP, heads, dim), its zigzag chunks of the sequences cu delimits (those of the
        whole sequences, as TE takes them), over every rank's keys and values: position p sees keys <= p."""
        lens, group = tuple(b - a for a, b in zip(cu[:-1], cu[1:])), ps.get_context_parallel_group()
        key, value = (C.gather_sequence(x, lens, self.cp, group) for x in (key, value))  # (T, groups, dim)
        qpos = C.held(lens, self.cp, ps.get_context_parallel_rank()).to(query.device)
        out, lo = [], 0
        for a, b in zip(cu[:-1], cu[1:]):
            n = (b - a) // self.cp  # this rank's queries of the sequence
            q, (k, v) = query[None, lo:lo + n].transpose(1, 2), (x[None, a:b].transpose(1, 2) for x in (key, value))
            see = torch.arange(a, b, device=query.device)[None] <= qpos[lo:lo + n, None]  # (n, b - a)
            out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=see, scale=self.scale,
                                                      enable_gqa=True)[0].transpose(0, 1))
            lo += n
        return torch.cat(out).reshape(query.shape[0], -1)


def host_bounds(params):
    """cu_seqlens_q as a list, read once a forward: every layer gets the same PackedSeqParams (model.py), and each
    .tolist() of a CUDA tensor waits for every kernel queued before it."""
    if getattr(params, "host_cu", None) is None:
        params.host_cu = params.cu_seqlens_q.tolist()
    return params.host_cu


def local_layer_spec(**kw):
    """megatron-core's local GPT layer spec (get_gpt_layer_local_spec(**kw)) with this core attention."""
    spec = specs.get_gpt_layer_local_spec(**kw)
    spec.submodules.self_attention.submodules.core_attention = PackedCoreAttention
    return spec
