"""qwen3_5.py: the Qwen3.5 language model's layers on Megatron-core (dense and MoE): gated attention, packed
Gated DeltaNet, zero-centred norms, one layer spec per `layer_types` entry (docs/qwen3_5.md).

    spec = qwen3_5.block_spec(hf_text_config, te=False)       # model.py builds GPTModel from it
    qwen3_5.config_kwargs(hf_text_config, options)             # its TransformerConfig fields"""
import copy
import warnings

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

import attention
import context_parallel as C
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.models.gpt import gpt_layer_specs as specs
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

# GPU kernels, used on CUDA when importable, each imported alone; check_kernels says what is missing (docs/qwen3_5.md)
MISSING = {}  # package -> the ImportError it raised
try:  # causal-conv1d 1.7.0: x (B, C, T), weight (C, K), seq_idx (B, T)
    from causal_conv1d import causal_conv1d_fn
except ImportError as e:
    causal_conv1d_fn, MISSING["causal-conv1d"] = None, e
try:  # flash-linear-attention 0.6.0: q, k, v (B, T, H, D), varlen by cu_seqlens
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
except ImportError as e:
    chunk_gated_delta_rule, MISSING["flash-linear-attention"] = None, e
INSTALL = {"causal-conv1d": "pip install --no-build-isolation causal-conv1d==1.7.0  (after torch; GPU=1 bash setup.sh)",
           "flash-linear-attention": "pip install flash-linear-attention==0.6.0  (GPU=1 bash setup.sh)"}

CHUNK = 64  # positions per chunk of the CPU delta rule


def config_kwargs(tc, opts):
    """TransformerConfig fields for a Qwen3.5 text config `tc` (dense or MoE); opts: the trainer's
    MoE flags (moe_token_dispatcher_type, moe_router_dtype, moe_aux_loss_coeff)."""
    kw = dict(attention_output_gate=True, qk_layernorm=True, add_qkv_bias=False)
    if getattr(tc, "num_experts", None):
        if not hasattr(moe_utils, "te_general_gemm"):  # without TE megatron-core 0.16 leaves it undefined,
            moe_utils.te_general_gemm = None  # but the router's fp32 gemm tests it for None (docs/qwen3_5.md)
        aux = float(opts.moe_aux_loss_coeff)
        kw.update(num_moe_experts=tc.num_experts, moe_router_topk=tc.num_experts_per_tok,
                  moe_ffn_hidden_size=tc.moe_intermediate_size, ffn_hidden_size=tc.moe_intermediate_size,
                  moe_shared_expert_intermediate_size=tc.shared_expert_intermediate_size,
                  moe_shared_expert_gate=True, moe_router_score_function="softmax",
                  moe_router_pre_softmax=False,  # softmax over the top-k logits = HF's renormalised top-k
                  moe_router_load_balancing_type="aux_loss" if aux > 0 else "none", moe_aux_loss_coeff=aux,
                  moe_token_dispatcher_type=opts.moe_token_dispatcher_type,
                  moe_router_dtype=opts.moe_router_dtype, moe_grouped_gemm=torch.cuda.is_available())
    return kw


class ZeroCentredRMSNorm(torch.nn.Module):
    """x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32: Qwen3.5's RMSNorm (checkpoints store w, 0 at init)."""

    def __init__(self, config, hidden_size, eps=1e-6, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        self.eps = eps
        # a hidden-size norm sees only its sequence shard under SP: its grads are summed over TP
        self.weight.sequence_parallel = config.sequence_parallel and hidden_size == config.hidden_size

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * (1 + self.weight.float())).type_as(x)


def delta_rule(q, k, v, g, beta):
    """Gated delta rule over padded batches, CHUNK positions at a time (the maths: docs/qwen3_5.md): per step
    S <- exp(g_t) S; d_t = beta_t (v_t - S^T k_t); S <- S + k_t d_t^T; o_t = S^T q_t, S (dk, dv) from 0.
    q, k (B, H, L, dk) (q already scaled); v (B, H, L, dv); g, beta (B, H, L) -> o (B, H, L, dv)."""
    B, H, L, dk = k.shape
    pad = -L % CHUNK  # zero padding at the end: causal, so earlier outputs do not see it
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    s, out = q.new_zeros(B, H, dk, v.shape[-1]), []
    for c in range(0, L + pad, CHUNK):
        qc, kc, vc, bc = q[:, :, c:c + CHUNK], k[:, :, c:c + CHUNK], v[:, :, c:c + CHUNK], beta[:, :, c:c + CHUNK]
        cg = g[:, :, c:c + CHUNK].cumsum(-1)  # (B, H, C)
        decay = torch.exp((cg[..., :, None] - cg[..., None, :]).masked_fill(~causal, float("-inf")))  # (B, H, C, C)
        a = (kc @ kc.transpose(-1, -2)) * decay * bc[..., None]
        rhs = bc[..., None] * (vc - cg.exp()[..., None] * (kc @ s))
        d = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)  # diagonal taken as 1
        out.append(cg.exp()[..., None] * (qc @ s) + ((qc @ kc.transpose(-1, -2)) * decay) @ d)
        s = cg[..., -1:, None].exp() * s + (kc * (cg[..., -1:] - cg).exp()[..., None]).transpose(-1, -2) @ d
    return torch.cat(out, 2)[:, :, :L]


class GatedDeltaNet(MegatronModule):
    """Qwen3.5's linear attention (HF's parameter names), this TP rank's heads, in the place of Megatron's
    self_attention: (T, 1, H) -> ((T, 1, H), None); T is this rank's sequence shard under SP."""

    def __init__(self, config, layer_number=None, dims=None, **_):
        super().__init__(config)
        tp = config.tensor_model_parallel_size
        self.kh, self.vh = dims["linear_num_key_heads"] // tp, dims["linear_num_value_heads"] // tp  # local heads
        self.dk, self.dv = dims["linear_key_head_dim"], dims["linear_value_head_dim"]
        conv = 2 * self.kh * self.dk + self.vh * self.dv  # local [q | k | v] channels
        lin = dict(config=config, init_method=config.init_method, bias=False)
        # forward() does the SP gather / TP grad all-reduce once for all four projections: a config without SP
        self.sequence_parallel = config.sequence_parallel and tp > 1
        unsharded = copy.copy(config)
        unsharded.sequence_parallel = False
        col = dict(lin, config=unsharded, gather_output=False, disable_grad_reduce=True)
        self.in_proj_qkv = tensor_parallel.ColumnParallelLinear(config.hidden_size, tp * conv, **col)
        self.in_proj_z = tensor_parallel.ColumnParallelLinear(config.hidden_size, tp * self.vh * self.dv, **col)
        self.in_proj_b = tensor_parallel.ColumnParallelLinear(config.hidden_size, tp * self.vh, **col)
        self.in_proj_a = tensor_parallel.ColumnParallelLinear(config.hidden_size, tp * self.vh, **col)
        self.conv1d = torch.nn.Conv1d(conv, conv, dims["linear_conv_kernel_dim"], groups=conv, bias=False)
        self.A_log = torch.nn.Parameter(torch.zeros(self.vh))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.vh))
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(self.dv))  # plain RMSNorm weight, shared by heads
        self.eps = config.layernorm_epsilon
        self.out_proj = tensor_parallel.RowParallelLinear(tp * self.vh * self.dv, config.hidden_size,
                                                          input_is_parallel=True, skip_bias_add=True, **lin)
        self.cp = config.context_parallel_size
        if self.cp > 1:  # head-parallel over CP: rank j runs key heads [j kh / CP, ...) and their value heads
            if self.kh % self.cp:
                raise SystemExit(f"Qwen3.5 under --context-parallel-size {self.cp}: text_config.linear_num_key_heads "
                                 f"{dims['linear_num_key_heads']} / TP {tp} must be divisible by CP")
            q, k, v = torch.arange(conv).split([self.kh * self.dk, self.kh * self.dk, self.vh * self.dv])
            self.cp_parts = [torch.cat([x.chunk(self.cp)[j] for x in (q, k, v)]) for j in range(self.cp)]  # rank j's

    def forward(self, hidden_states, packed_seq_params=None, **_):
        if self.sequence_parallel:  # (T/tp, 1, H) -> (T, 1, H), kept for the four wgrads; backward: one reduce-scatter
            x = tensor_parallel.gather_from_sequence_parallel_region(hidden_states)
        else:  # identity; backward: one all-reduce over TP (none at TP=1)
            x = tensor_parallel.copy_to_tensor_model_parallel_region(hidden_states)
        projections = (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        qkv, z, b, a = (proj(x)[0][:, 0] for proj in projections)  # (T, conv), (T, vh*dv), (T, vh), (T, vh)
        cu, beta = packed_seq_params.cu_seqlens_q, b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # (T, vh) log decay
        w, kh, vh = self.conv1d.weight, self.kh, self.vh
        if self.cp > 1:  # -> every token of the whole sequences, this CP rank's heads
            lens, group, rank = tuple((cu[1:] - cu[:-1]).tolist()), ps.get_context_parallel_group(), ps.get_context_parallel_rank()
            qkv = C.to_heads(qkv[:, torch.cat(self.cp_parts).to(qkv.device)], lens, self.cp, group)
            gb = C.to_heads(torch.stack([g, beta.float()], -1).flatten(1), lens, self.cp, group).unflatten(-1, (-1, 2))
            g, beta = gb[..., 0], gb[..., 1]
            w, kh, vh = w[self.cp_parts[rank].to(w.device)], kh // self.cp, vh // self.cp
        q, k, v = self._split(self._conv(qkv, cu, w), kh, vh)  # (T, vh, d)
        o = self._delta_rule(q, k, v, g, beta, cu).float()  # (T, vh, dv)
        if self.cp > 1:  # back to this rank's tokens, every head
            o = C.from_heads(o.flatten(1), lens, self.cp, group).unflatten(-1, (self.vh, self.dv))
        # gated RMSNorm per head: w * x_hat * silu(z)
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.norm.weight.float()
        o = o * F.silu(z.float().view(o.shape))
        out, _ = self.out_proj(o.to(hidden_states.dtype).flatten(1)[:, None])
        return out, None

    def _split(self, x, kh, vh):
        """(..., conv) of kh key and vh value heads -> q, k (..., vh, dk) L2-normalised in fp32, q scaled
        by dk^-1/2, k heads repeated; v (..., vh, dv) in x's dtype (FLA takes all three in it)."""
        q, k, v = x.split([kh * self.dk, kh * self.dk, vh * self.dv], -1)
        q, k = (t.unflatten(-1, (kh, self.dk)).repeat_interleave(vh // kh, -2) for t in (q, k))
        q, k = (t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + 1e-6) for t in (q.float(), k.float()))
        return q * self.dk ** -0.5, k, v.unflatten(-1, (vh, self.dv))

    def _conv(self, qkv, cu, w):
        """Causal depthwise conv (w (conv, 1, K)) + silu within each sequence of the packed (T, conv) -> (T, conv):
        causal-conv1d on CUDA (seq_idx keeps state from crossing cu), else torch on a padded batch."""
        lens = cu[1:] - cu[:-1]
        if qkv.is_cuda and causal_conv1d_fn is not None:
            seq_idx = torch.repeat_interleave(torch.arange(len(lens), device=qkv.device, dtype=torch.int32), lens)
            # seq_idx needs the channel-last layout: (1, conv, T) with stride 1 along conv
            return causal_conv1d_fn(qkv[None].transpose(1, 2), w[:, 0], None, seq_idx=seq_idx[None],
                                    activation="silu")[0].T
        lens = lens.tolist()
        x = pad_sequence(qkv.split(lens), batch_first=True)  # (S, L, conv), zeros after each end
        x = F.silu(F.conv1d(F.pad(x.transpose(1, 2), (w.shape[-1] - 1, 0)), w, groups=w.shape[0])).transpose(1, 2)
        return torch.cat([x[i, :n] for i, n in enumerate(lens)])

    def _delta_rule(self, q, k, v, g, beta, cu):
        """q, k (T, vh, dk), v (T, vh, dv), g, beta (T, vh) -> o (T, vh, dv), per sequence: FLA's varlen kernel on
        CUDA in v's dtype (bf16 under --bf16), else delta_rule above in fp32 on a padded batch (S, L)."""
        if v.is_cuda and chunk_gated_delta_rule is not None:
            o, _ = chunk_gated_delta_rule(q[None].to(v.dtype), k[None].to(v.dtype), v[None], g[None],
                                          beta[None].float(), scale=1.0, cu_seqlens=cu.long())  # q already scaled
            return o[0]
        lens = (cu[1:] - cu[:-1]).tolist()
        q, k, v, g, beta = (pad_sequence(t.float().split(lens), batch_first=True).transpose(1, 2)
                            for t in (q, k, v, g, beta))  # (S, vh, L, ...)
        o = delta_rule(q, k, v, g, beta).transpose(1, 2)  # (S, L, vh, dv)
        return torch.cat([o[i, :n] for i, n in enumerate(lens)])


def check_kernels(te):
    """On CUDA, say at model build what runs in place of a missing Gated DeltaNet kernel: FLA missing is an
    error (with te; a warning with --transformer-impl local), causal-conv1d missing a warning (docs/qwen3_5.md)."""
    if not torch.cuda.is_available():
        return

    def why(pkg):
        e = MISSING.get(pkg)
        return f"{pkg} cannot be imported ({type(e).__name__}: {e}); install it with `{INSTALL[pkg]}`"
    if chunk_gated_delta_rule is None:
        if te:
            raise SystemExit(f"Qwen3.5 on CUDA: {why('flash-linear-attention')}, or pass --transformer-impl local "
                             "to run Gated DeltaNet's torch delta rule (slow).")
        warnings.warn(f"Qwen3.5 on CUDA: {why('flash-linear-attention')}. Gated DeltaNet runs its torch delta "
                      "rule instead (slow).", stacklevel=2)
    if causal_conv1d_fn is None:
        warnings.warn(f"Qwen3.5 on CUDA: {why('causal-conv1d')}. Gated DeltaNet runs its conv in torch instead "
                      "(slower).", stacklevel=2)


def block_spec(tc, te):
    """TransformerBlockSubmodules: one layer spec per `layer_types` entry, zero-centred norms."""
    check_kernels(te)
    moe = getattr(tc, "num_experts", None)
    if moe and getattr(tc, "mlp_only_layers", None):  # released configs have []: every layer is MoE
        raise ValueError(f"config.json text_config.mlp_only_layers {tc.mlp_only_layers}: dense layers in a MoE "
                         "model are not supported")
    if te:  # Transformer Engine's norms are zero-centred by config (layernorm_zero_centered_gamma)
        base = specs.get_gpt_layer_with_transformer_engine_spec(num_experts=moe, moe_grouped_gemm=bool(moe),
                                                                qk_layernorm=True)
    else:
        base = attention.local_layer_spec(num_experts=moe, qk_layernorm=True, normalization="RMSNorm")
        sub = base.submodules
        sub.input_layernorm = sub.pre_mlp_layernorm = ZeroCentredRMSNorm
        sub.self_attention.submodules.q_layernorm = sub.self_attention.submodules.k_layernorm = ZeroCentredRMSNorm
    dims = {k: getattr(tc, k) for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                        "linear_value_head_dim", "linear_conv_kernel_dim")}
    layers = []
    for kind in tc.layer_types:
        spec = copy.deepcopy(base)
        if kind == "linear_attention":
            spec.submodules.input_layernorm = ZeroCentredRMSNorm
            spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, params={"dims": dims})
        elif kind != "full_attention":
            raise ValueError(f"config.json text_config.layer_types: unknown layer type {kind!r}")
        layers.append(spec)
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=ZeroCentredRMSNorm)
