"""model.py: the Megatron VLM, Hugging Face <-> Megatron weight conversion, parity checks.

    python model.py tiny --arch qwen3_vl --out ckpt/tiny                # tiny random checkpoint
    python model.py check --hf-checkpoint ckpt/tiny                     # Megatron vs transformers, TP=1
    torchrun --nproc_per_node 2 model.py check --hf-checkpoint DIR      # the same at TP=2 (TP = world)

The language model is megatron.core's GPTModel (local layer spec; Transformer Engine's when it is
installed and CUDA is present); the vision tower is transformers' own module, replicated on every TP
rank. We use GPTModel's modules but run the decoder loop here: MRoPE angles are computed here
(Megatron's MultimodalRotaryEmbedding has no Qwen3-VL interleaved layout) and Qwen3-VL's deepstack
features are added to the first layers' outputs at image positions, as transformers does.
Packed sequences: one row of T tokens; a block-diagonal causal mask on CPU, THD + cu_seqlens with TE.
"""
import argparse
import json
import os
import shutil
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if not torch.cuda.is_available():  # Megatron's "no Apex / Transformer Engine" notes are expected on CPU
    __import__("warnings").filterwarnings("ignore", message=".*(Apex|Transformer Engine|full scope).*")
CHUNK = 16384  # vocabulary columns per LM-head chunk: bounds the (N, CHUNK) logits held at once


def _all_reduce(t, group, op=dist.ReduceOp.SUM):
    dist.all_reduce(t, op, group=group)
    return t


def cpu_shim():
    """What megatron-core 0.16 needs to run on CPU over gloo; does nothing when CUDA is present.
    1. Layers place parameters with `device=torch.cuda.current_device()`: answer "cpu".
    2. The model-parallel RNG tracker (tensor_parallel.random) saves, seeds and restores CUDA
       generator states: let it track the CPU generator instead (seeding the CPU RNG, as it would
       seed the CUDA one).
    3. GPTModel's default causal mask is built on "cuda": `_hidden` always passes an explicit one.
    Megatron's optimizer and clip_grads need CUDA: the trainer uses torch.optim instead."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)


def init_distributed(tp=1, seed=1234):
    """torchrun's environment (or a plain single process) -> (rank, world_size, device).
    gloo on CPU, nccl on GPU; Megatron's parallel state with TP=tp. A second call is a no-op."""
    from megatron.core import parallel_state as ps, tensor_parallel
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # a plain process (not torchrun): a world of one on a free port
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo", rank=int(os.environ.get("RANK", 0)),
                                world_size=int(os.environ.get("WORLD_SIZE", 1)))
    cpu_shim()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dist.get_rank(), dist.get_world_size(), device


def rope_positions(hf_config, input_ids, image_grid_thw=None):
    """(3, T) MRoPE position ids of one sequence (T,), by transformers' own get_rope_index.
    image_grid_thw: (n_images, 3) rows of this sequence's images, in order, or None."""
    from transformers import MODEL_MAPPING
    cls = MODEL_MAPPING[type(hf_config)]  # Qwen3VLModel / Qwen2_5_VLModel: methods use only .config
    rope = type("RopeIndex", (), {k: getattr(cls, k) for k in ("get_rope_index", "get_vision_position_ids")})()
    rope.config = hf_config
    ids = input_ids.cpu()[None]
    kinds = (ids == hf_config.image_token_id).int() + 2 * (ids == hf_config.video_token_id).int()
    pos, _ = rope.get_rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=image_grid_thw)
    return pos[:, 0]


def split_images(hf_config, seqs, pixel_values=None, image_grid_thw=None):
    """[(pixel_values, grid rows) or (None, None)] per sequence: images are handed out in order,
    as many as each sequence's image-token count takes; a mismatch is an error."""
    merge = hf_config.vision_config.spatial_merge_size ** 2
    grid = image_grid_thw.cpu() if image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    patches = grid.prod(-1).tolist()  # pixel_values rows per image
    out, i, row = [], 0, 0
    for s in seqs:
        n, j = int((s == hf_config.image_token_id).sum()), i
        while n > 0 and j < len(patches):
            n, j = n - patches[j] // merge, j + 1
        if n != 0:
            raise ValueError("image tokens do not match image_grid_thw")
        rows = sum(patches[i:j])
        out.append((pixel_values[row:row + rows], grid[i:j]) if j > i else (None, None))
        i, row = j, row + rows
    if i != len(patches):
        raise ValueError(f"{len(patches) - i} images left over: not enough image tokens")
    return out


class _LogprobEntropy(torch.autograd.Function):
    """z = h @ w.T / temp; returns log_softmax(z)[target] and entropy(softmax(z)), (N,) each.
    Vocab-parallel over TP (w is this rank's rows of the vocabulary) and in chunks of CHUNK columns:
    the (N, V) logits are never held at once; backward recomputes them chunk by chunk."""

    @staticmethod
    def forward(ctx, h, w, target, temp, start, n_valid, group):
        # h (N, H) same on all TP ranks; w (V_local, H); target (N,) global ids; rows of w from
        # n_valid on are vocabulary padding; start = global id of w's first row.
        n = h.shape[0]
        m = h.new_full((n,), float("-inf"))  # running max, sum exp(z - m), sum exp(z - m) * z
        s, a, zt = h.new_zeros(n), h.new_zeros(n), h.new_zeros(n)
        for c in range(0, n_valid, CHUNK):
            z = (h @ w[c:min(c + CHUNK, n_valid)].T) / temp  # (N, C)
            m_new = torch.maximum(m, z.max(1).values)
            e, scale = torch.exp(z - m_new[:, None]), torch.exp(m - m_new)
            s, a, m = s * scale + e.sum(1), a * scale + (e * z).sum(1), m_new
            local = target - start - c
            hit = (local >= 0) & (local < z.shape[1])
            zt = zt + torch.where(hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
        big_m = _all_reduce(m.clone(), group, dist.ReduceOp.MAX)  # combine the TP shards
        stats = _all_reduce(torch.stack([s * torch.exp(m - big_m), a * torch.exp(m - big_m), zt]), group)
        lse, ez = big_m + stats[0].log(), stats[1] / stats[0]  # log-sum-exp, E_p[z]
        ctx.save_for_backward(h, w, target, lse, ez)
        ctx.args = (temp, start, n_valid, group)
        return stats[2] - lse, lse - ez

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        h, w, target, lse, ez = ctx.saved_tensors
        temp, start, n_valid, group = ctx.args
        gh, gw = torch.zeros_like(h), torch.zeros_like(w)
        for c in range(0, n_valid, CHUNK):
            wc = w[c:min(c + CHUNK, n_valid)]
            z = (h @ wc.T) / temp
            p = torch.exp(z - lse[:, None])
            # d logp/dz = onehot - p ; d entropy/dz = -p (z - E_p[z])
            gz = -p * (g_lp[:, None] + g_ent[:, None] * (z - ez[:, None]))
            local = target - start - c
            hit = (local >= 0) & (local < z.shape[1])
            gz[hit, local[hit]] += g_lp[hit]
            gh += (gz := gz / temp) @ wc
            gw[c:c + wc.shape[0]] = gz.T @ h
        return _all_reduce(gh, group), gw, None, None, None, None, None  # each rank had part of the vocab


# Megatron name inside decoder.layers.{i}. -> (how it is split over TP, HF names inside layers.{i}.)
# rep: replicated; col: split along dim 1; fc1: [gate; up] rows; qkv: per query group [q, k, v].
_LAYER = {
    "input_layernorm.weight": ("rep", ["input_layernorm.weight"]),
    "self_attention.linear_qkv.layer_norm_weight": ("rep", ["input_layernorm.weight"]),  # TE fuses
    "self_attention.linear_qkv.weight": ("qkv", [f"self_attn.{x}_proj.weight" for x in "qkv"]),
    "self_attention.linear_qkv.bias": ("qkv", [f"self_attn.{x}_proj.bias" for x in "qkv"]),
    "self_attention.q_layernorm.weight": ("rep", ["self_attn.q_norm.weight"]),
    "self_attention.k_layernorm.weight": ("rep", ["self_attn.k_norm.weight"]),
    "self_attention.linear_proj.weight": ("col", ["self_attn.o_proj.weight"]),
    "pre_mlp_layernorm.weight": ("rep", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.layer_norm_weight": ("rep", ["post_attention_layernorm.weight"]),
    "mlp.linear_fc1.weight": ("fc1", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    "mlp.linear_fc2.weight": ("col", ["mlp.down_proj.weight"]),
}
_TOP = {"embedding.word_embeddings.weight": ("vocab", ["embed_tokens.weight"]),
        "decoder.final_layernorm.weight": ("rep", ["norm.weight"])}
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


class MegatronVLM(torch.nn.Module):
    """HF vision tower (.visual) + Megatron GPTModel (.language_model), on the current parallel state."""

    def __init__(self, hf_config, hf_dir):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt import gpt_layer_specs as specs
        from megatron.core.transformer import TransformerConfig
        from transformers import AutoModel
        tc = hf_config.text_config
        self.hf_config, self.hf_dir = hf_config, Path(hf_dir)
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.tp_group = ps.get_tensor_model_parallel_group()
        self.head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        self.groups, self.heads = tc.num_key_value_heads, tc.num_attention_heads
        self.vocab = tc.vocab_size
        self.padded_vocab = -(-self.vocab // self.tp) * self.tp  # VocabParallelEmbedding splits evenly
        self.tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        qwen3 = hf_config.model_type.startswith("qwen3")
        self.te = torch.cuda.is_available() and specs.HAVE_TE
        cfg = TransformerConfig(  # Qwen2.5 / Qwen3 decoder: RMSNorm, SwiGLU, GQA, QKV bias or QK-norm
            num_layers=tc.num_hidden_layers, hidden_size=tc.hidden_size, ffn_hidden_size=tc.intermediate_size,
            num_attention_heads=self.heads, num_query_groups=self.groups, kv_channels=self.head_dim,
            normalization="RMSNorm", layernorm_epsilon=tc.rms_norm_eps, gated_linear_unit=True,
            activation_func=F.silu, add_bias_linear=False, add_qkv_bias=not qwen3, qk_layernorm=qwen3,
            hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=self.tp,
            params_dtype=torch.float32, perform_initialization=False,  # weights come from the checkpoint
            use_cpu_initialization=not torch.cuda.is_available(), bias_activation_fusion=False,
            masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False)
        spec = (specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qwen3) if self.te else
                specs.get_gpt_layer_local_spec(qk_layernorm=qwen3, normalization="RMSNorm"))
        self.language_model = GPTModel(
            cfg, spec, vocab_size=self.padded_vocab, max_sequence_length=tc.max_position_embeddings,
            share_embeddings_and_output_weights=self.tie, position_embedding_type="none")
        self.visual = AutoModel.from_config(hf_config.vision_config)
        for name, p in self.language_model.named_parameters():
            if self.tp > 1 and ("q_layernorm" in name or "k_layernorm" in name):
                # shared over heads, but each rank sees only its heads: sum grads over TP
                # (what Megatron's finalize_model_grads does for qk_layernorm)
                p.register_hook(lambda g: _all_reduce(g.clone(), self.tp_group))
        rp = tc.rope_parameters
        assert rp.get("rope_type", "default") == "default", rp
        self.mrope_section, self.mrope_interleaved = rp["mrope_section"], rp.get("mrope_interleaved", False)
        d = self.head_dim
        self.register_buffer("inv_freq", 1.0 / (rp["rope_theta"] ** (
            torch.arange(0, d, 2, dtype=torch.int64).float() / d)), persistent=False)

    def _rotary(self, pos):
        """(3, T) t/h/w positions -> (T, 1, 1, head_dim) angles in Megatron's rotate-half layout."""
        f = pos.to(self.inv_freq.device)[..., None].float() * self.inv_freq  # (3, T, d/2)
        s, half = self.mrope_section, f.shape[-1]
        if self.mrope_interleaved:  # Qwen3-VL: frequency j takes h if j%3==1, w if j%3==2 (within sections)
            axis = torch.zeros(half, dtype=torch.long)
            axis[1:3 * s[1]:3], axis[2:3 * s[2]:3] = 1, 2
        else:  # Qwen2.5-VL: contiguous sections [t | h | w]
            axis = torch.repeat_interleave(torch.arange(3), torch.tensor(s))
        f = f.gather(0, axis.to(f.device).expand(f.shape[1], half)[None])[0]  # (T, d/2)
        return torch.cat([f, f], -1)[:, None, None]

    def _head_weight(self):  # (V_local, H): this rank's rows of the (padded) vocabulary
        lm = self.language_model
        return lm.embedding.word_embeddings.weight if self.tie else lm.output_layer.weight

    def _hidden(self, seqs, pixel_values=None, image_grid_thw=None):
        """Packed sequences (list of (T_i,) ids) -> final-norm hidden states (T, H), T = sum T_i."""
        from megatron.core.packed_seq_params import PackedSeqParams
        lm, cfg = self.language_model, self.hf_config
        dev = self.inv_freq.device
        ids = torch.cat(list(seqs)).to(dev)  # (T,)
        lens = [len(s) for s in seqs]
        per_seq = split_images(cfg, seqs, pixel_values, image_grid_thw)
        pos = torch.cat([rope_positions(cfg, s, g) for s, (_, g) in zip(seqs, per_seq)], 1)  # (3, T)
        h = lm.embedding(input_ids=ids[None], position_ids=None)  # (T, 1, H)
        img, deep = (ids == cfg.image_token_id).nonzero()[:, 0], []
        if pixel_values is not None:
            out = self.visual(pixel_values.to(dev, h.dtype), grid_thw=image_grid_thw.to(dev))
            h = h.index_put((img,), out.pooler_output[:, None].to(h.dtype))  # merged image tokens
            deep = getattr(out, "deepstack_features", None) or []  # Qwen3-VL: one (n_img, H) a layer
        cu = torch.tensor([0] + lens, device=dev).cumsum(0).int()
        psp, mask = None, None
        if self.te:  # THD: attention runs per segment of cu_seqlens
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                  max_seqlen_q=max(lens), max_seqlen_kv=max(lens))
        else:  # block-diagonal causal mask, True = masked: (1, 1, T, T)
            seg = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))
            mask = ~((seg[:, None] == seg[None]) & torch.ones(len(seg), len(seg), dtype=torch.bool, device=dev).tril())
            mask = mask[None, None]
        rot = self._rotary(pos)
        for i, layer in enumerate(lm.decoder.layers):
            h, _ = layer(hidden_states=h, attention_mask=mask, rotary_pos_emb=rot, packed_seq_params=psp)
            if i < len(deep):  # deepstack: add layer i's visual features at the image tokens
                h = h.index_put((img,), deep[i][:, None].to(h.dtype), accumulate=True)
        return lm.decoder.final_layernorm(h)[:, 0]

    def forward(self, seqs, pixel_values=None, image_grid_thw=None, loss_masks=None, temperature=1.0,
                with_entropy=False):
        """Token logprobs (N,) of every masked position, in sequence order, at `temperature`, and
        their distributions' entropy (N,) when with_entropy. mask[t] = 1 scores token t from the
        logits at t - 1 (mask[0] must be 0); loss_masks=None scores every token but the first.
        The LM head runs only at those N positions (vocab-parallel, chunked)."""
        h = self._hidden(seqs, pixel_values, image_grid_thw)
        rows, tgt, off = [], [], 0
        for i, s in enumerate(seqs):
            t = (torch.arange(1, len(s)) if loss_masks is None else loss_masks[i].cpu().nonzero()[:, 0])
            assert len(t) == 0 or t[0] > 0, "loss_mask[0] must be 0: token 0 has no logits before it"
            rows.append(off + t - 1)
            tgt.append(s.cpu()[t])
            off += len(s)
        k = self.padded_vocab // self.tp  # this rank's vocabulary rows: [k r, k r + k), some padding
        lp, ent = _LogprobEntropy.apply(h[torch.cat(rows).to(h.device)], self._head_weight(),
                                        torch.cat(tgt).to(h.device), float(temperature), self.tp_rank * k,
                                        max(0, min(k, self.vocab - self.tp_rank * k)), self.tp_group)
        return lp, (ent if with_entropy else None)

    def logits(self, seqs, pixel_values=None, image_grid_thw=None):
        """[(T_i, V) fp32 full logits] per sequence, gathered over TP: for parity checks only."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        h = self._hidden(seqs, pixel_values, image_grid_thw)
        z = gather_from_tensor_model_parallel_region(h @ self._head_weight().T)[:, :self.vocab]
        return list(z.float().split([len(s) for s in seqs]))

    # --- conversion ---------------------------------------------------------------------------
    def _rule(self, name):
        """Megatron parameter name -> (kind, [full HF names as in the source checkpoint])."""
        if name.startswith("visual."):
            return "rep", [self.vis_prefix + name[len("visual."):]]
        name = name[len("language_model."):]
        if name == "output_layer.weight":
            return "vocab", ["lm_head.weight"]
        if name.startswith("decoder.layers."):
            i, rest = name[len("decoder.layers."):].split(".", 1)
            kind, hf = _LAYER[rest]
            return kind, [f"{self.lm_prefix}layers.{i}.{x}" for x in hf]
        kind, hf = _TOP[name]
        return kind, [self.lm_prefix + x for x in hf]

    def _shard(self, kind, sl):
        """Lazy safetensors slices of the HF tensors -> this rank's Megatron tensor (reads only it)."""
        r, tp = self.tp_rank, self.tp

        def rows(s):  # this rank's 1/tp of s along dim 0
            k = s.get_shape()[0] // tp
            return s[r * k:(r + 1) * k]
        if kind in ("rep", "col"):
            k = sl[0].get_shape()[-1] // tp
            return sl[0][:] if kind == "rep" else sl[0][:, r * k:(r + 1) * k]
        if kind == "fc1":  # [gate_r; up_r]
            return torch.cat([rows(s) for s in sl])
        if kind == "qkv":  # per local query group g: [q heads of g; k_g; v_g]
            g = self.groups // tp
            return torch.cat([(x := rows(s)).reshape(g, -1, *x.shape[1:]) for s in sl], 1).flatten(0, 1)
        k = self.padded_vocab // tp  # vocab: rows of the padded vocabulary, padding = 0
        x = sl[0][min(r * k, self.vocab):min((r + 1) * k, self.vocab)]
        return torch.cat([x, x.new_zeros(k - len(x), *x.shape[1:])])

    def _full(self, kind, t):
        """This rank's Megatron tensor -> [full HF tensors] (gathers over TP)."""
        if kind == "rep":
            return [t]
        parts = [t]
        if self.tp > 1:
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        if kind in ("col", "vocab"):
            return [torch.cat(parts, 1)] if kind == "col" else [torch.cat(parts)[:self.vocab]]
        if kind == "fc1":  # [gate_r; up_r] of every rank -> gate, up
            return [torch.cat(x) for x in zip(*(p.chunk(2) for p in parts))]
        x = torch.cat(parts)  # qkv: rank order = query-group order
        x, d = x.reshape(self.groups, -1, *x.shape[1:]), self.head_dim
        return [y.flatten(0, 1) for y in x.split([self.heads // self.groups * d, d, d], 1)]


def _weight_files(hf_dir):
    """{HF tensor name: safetensors file} of a checkpoint folder."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: hf_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open
    return {k: f for f in sorted(hf_dir.glob("*.safetensors")) for k in safe_open(f, "pt").keys()}


def load_model(hf_dir, freeze_vit=False):
    """MegatronVLM on the current parallel state (initialised if needed), weights from the HF
    safetensors, each TP rank reading only its slices. Parameters are fp32 (CPU and GPU alike)."""
    from safetensors import safe_open
    from transformers import AutoConfig
    _, _, device = init_distributed()
    cfg = AutoConfig.from_pretrained(hf_dir)
    model = MegatronVLM(cfg, hf_dir)
    files = _weight_files(hf_dir)
    handles = {f: safe_open(f, "pt") for f in set(files.values())}
    model.src = {k: (handles[f].get_slice(k).get_shape(), _DTYPES[handles[f].get_slice(k).get_dtype()])
                 for k, f in files.items()}  # name -> (shape, dtype): what export gives back
    model.lm_prefix = next(k for k in files if k.endswith("embed_tokens.weight"))[:-len("embed_tokens.weight")]
    model.vis_prefix = next(k for k in files if k.endswith("patch_embed.proj.weight"))[:-len("patch_embed.proj.weight")]
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind, hf = model._rule(name)
            p.copy_(model._shard(kind, [handles[files[n]].get_slice(n) for n in hf]))
            if kind != "rep" and not getattr(p, "tensor_model_parallel", False):
                # what Megatron's weight init would have marked: the trainer's grad norm counts
                # sharded tensors on every TP rank, the others once
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, int(kind == "col"), 1
    model.visual.requires_grad_(not freeze_vit)
    return model.to(device)


def _hf_tensors(model, grad=False):
    """(HF name, full tensor) for every tensor of the source checkpoint; grad=True: their gradients
    (None-grads as zeros). Collective over TP: every rank gets every full tensor."""
    for name, p in model.named_parameters():
        t = p.detach() if not grad else (p.grad if p.grad is not None else torch.zeros_like(p))
        kind, hf = model._rule(name)
        full = model._full(kind, t)
        if name.endswith("word_embeddings.weight") and model.tie:  # tied: emit lm_head if the source has it
            hf, full = hf + ["lm_head.weight"], full + full
        for n, x in zip(hf, full):
            if n in model.src:
                yield n, x.to(model.src[n][1])


def export_hf(model, bucket_bytes=256 << 20):
    """Buckets [(HF name, full tensor)] of about bucket_bytes, names/shapes/dtypes as in the source
    checkpoint. Call on every TP rank (it gathers); every rank receives the full tensors."""
    bucket, size = [], 0
    for n, t in _hf_tensors(model):
        bucket.append((n, t))
        if (size := size + t.numel() * t.element_size()) >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def save_hf(model, out_dir, shard_bytes=4 << 30):
    """A checkpoint transformers and SGLang load as they are: safetensors from export_hf plus the
    source's config / tokenizer / processor / template files. Call on every rank; rank 0 writes."""
    from safetensors.torch import save_file
    out, rank0, weight_map = Path(out_dir), dist.get_rank() == 0, {}
    out.mkdir(parents=True, exist_ok=True)
    for i, bucket in enumerate(export_hf(model, shard_bytes)):
        if rank0:
            name = f"model-{i + 1:05d}.safetensors"
            save_file({n: t.cpu().contiguous() for n, t in bucket}, out / name, metadata={"format": "pt"})
            weight_map.update({n: name for n, _ in bucket})
    if rank0:
        names = sorted(set(weight_map.values()))
        if len(names) == 1:  # one shard: the plain single-file layout
            (out / names[0]).rename(out / "model.safetensors")
        else:
            (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
        for f in model.hf_dir.iterdir():
            if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
                shutil.copy2(f, out / f.name)
    dist.barrier()


# --- parity check ---------------------------------------------------------------------------------
def check_inputs(hf_dir):
    """A packed batch as the processor makes it: [image A + text], [text only], [image B, image A + text].
    Returns (seqs, pixel_values, image_grid_thw) with the images of all sequences in order."""
    from PIL import Image
    from transformers import AutoProcessor
    proc = AutoProcessor.from_pretrained(hf_dir)
    g = torch.Generator().manual_seed(0)
    img = lambda w, h: Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy())
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
    for s, (pv, g) in zip(seqs, split_images(hf.config, seqs, pixel_values, image_grid_thw)):
        kw = {} if g is None else dict(pixel_values=pv, image_grid_thw=g,
                                       mm_token_type_ids=(s == hf.config.image_token_id).int()[None])
        out.append(hf(input_ids=s[None], **kw).logits[0].float())
    return out


def check(hf_dir):
    """Megatron vs transformers (fp32) on check_inputs, and the export round trip; TP = world size.
    Returns the max abs logit diff (inf when the export does not reproduce the checkpoint)."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText
    rank, world, _ = init_distributed(int(os.environ.get("WORLD_SIZE", 1)))
    model, files = load_model(hf_dir), _weight_files(hf_dir)
    same = {n: torch.equal(t, safe_open(files[n], "pt").get_tensor(n)) for n, t in _hf_tensors(model)}
    exact = same.keys() == files.keys() and all(same.values())
    seqs, pv, grid = check_inputs(hf_dir)
    hf = AutoModelForImageTextToText.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        diff = max((x - y).abs().max().item() for x, y in zip(model.logits(seqs, pv, grid), hf_logits(hf, seqs, pv, grid)))
    if rank == 0:
        print(f"tp={world} sequences={[len(s) for s in seqs]} image_grid_thw={grid.tolist()} export_exact={exact}")
        print(f"max_abs_logit_diff={diff:.3g}")
    return diff if exact else float("inf")


if __name__ == "__main__":
    if sys.argv[1:2] == ["tiny"]:
        __import__("tiny").main(sys.argv[2:])
    elif sys.argv[1:2] == ["check"]:
        p = argparse.ArgumentParser(description="Megatron vs transformers logits on one checkpoint")
        p.add_argument("--hf-checkpoint", required=True, help="Hugging Face checkpoint folder")
        sys.exit(0 if check(p.parse_args(sys.argv[2:]).hf_checkpoint) <= 1e-4 else 1)
    else:
        sys.exit(__doc__)
