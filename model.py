"""model.py: the Megatron VLM: the Hugging Face vision tower, then megatron-core GPTModel's modules in a decoder
loop of ours (MRoPE, deepstack, packed rows: docs/model.md), built from ModelOptions. Parity: tools/check.py."""
import copy
import dataclasses
import functools
import logging
import math
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
with warnings.catch_warnings():  # megatron-core's import, without TE and Apex (CPU): ~10 lines of true notes that
    warnings.filterwarnings("ignore", "(Transformer Engine and )?Apex (is|are) not installed")  # help no one
    logging.disable(logging.WARNING)  # and torch's "No CUDA runtime is found"; both as they were after (docs/model.md)
    from megatron.core import tensor_parallel
    from megatron.core.enums import ModelType
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs as specs
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    logging.disable(logging.NOTSET)
from transformers import AutoConfig, AutoModel
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

import attention
import context_parallel as C
import convert
import flags
import logprobs
import parallel
import pipeline
import qwen3_5
import routing

VISION = {"qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel._from_config}  # AutoModel: from transformers 5.19


def rope_positions(hf_config, input_ids, image_grid_thw=None):
    """(3, T) MRoPE (t, h, w) positions of one sequence (T,), as transformers' get_rope_index (docs/model.md);
    image_grid_thw: (n_images, 3) of its images, or None."""
    merge, ids = hf_config.vision_config.spatial_merge_size, input_ids.cpu().tolist()
    out = torch.empty(3, len(ids), dtype=torch.long)
    pos, i, k = 0, 0, 0
    while i < len(ids):
        if ids[i] != hf_config.image_token_id:
            out[:, i] = pos
            pos, i = pos + 1, i + 1
            continue
        t, h, w = image_grid_thw[k].tolist()
        h, w = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, i:i + t * h * w] = grid.reshape(3, -1) + pos  # (3, t*h*w), frame-major like the tokens
        pos, i, k = pos + max(t, h, w), i + t * h * w, k + 1
    return out


def image_tokens(image_grid_thw, merge_size):
    """[<|image_pad|> tokens (= vision tower features) of each image]: its (t, h, w) patches / merge_size**2."""
    return [int(t * h * w) // merge_size ** 2 for t, h, w in image_grid_thw.tolist()]


def unique_images(pixel_values, image_grid_thw, merge_size):
    """-> (pixel rows of each distinct image once, their grids, take): vision_output[take] is every image's
    output, in order. A GRPO group shares its prompt's image: the tower runs once, not once a sample."""
    rows = pixel_values.split(image_grid_thw.prod(-1).tolist())
    tokens = image_tokens(image_grid_thw, merge_size)
    first, start, take = [], [], []  # each distinct image's first index, its first output row
    for i, r in enumerate(rows):
        j = next((k for k, f in enumerate(first) if rows[f].shape == r.shape and torch.equal(rows[f], r)
                  and torch.equal(image_grid_thw[f], image_grid_thw[i])), None)
        if j is None:
            j = len(first)
            start.append(sum(tokens[f] for f in first))
            first.append(i)
        take.append(torch.arange(start[j], start[j] + tokens[i]))
    return torch.cat([rows[f] for f in first]), image_grid_thw[first], torch.cat(take)


def split_images(hf_config, seqs, pixel_values=None, image_grid_thw=None):
    """[(pixel_values, grid rows) or (None, None)] per sequence, images in order as its image tokens take them."""
    grid = image_grid_thw.cpu() if image_grid_thw is not None else torch.zeros(0, 3, dtype=torch.long)
    patches = grid.prod(-1).tolist()  # pixel_values rows per image
    tokens = image_tokens(grid, hf_config.vision_config.spatial_merge_size)
    out, i, row = [], 0, 0
    for s in seqs:
        n, j = int((s == hf_config.image_token_id).sum()), i
        while n > 0 and j < len(patches):
            n, j = n - tokens[j], j + 1
        if n != 0:
            raise ValueError("image tokens do not match image_grid_thw")
        rows = sum(patches[i:j])
        out.append((pixel_values[row:row + rows], grid[i:j]) if j > i else (None, None))
        i, row = j, row + rows
    if i != len(patches):
        raise ValueError(f"{len(patches) - i} images left over: not enough image tokens")
    return out


def layer_impl(impl=None):
    """--transformer-impl: transformer_engine (the CUDA default) or local; TE that cannot load is an error."""
    impl = impl or ("transformer_engine" if torch.cuda.is_available() else "local")
    if impl == "local":
        return impl
    if not torch.cuda.is_available():
        raise SystemExit("--transformer-impl transformer_engine needs CUDA; use --transformer-impl local on CPU")
    try:
        import transformer_engine.pytorch  # noqa: F401 - only to surface its ImportError
    except Exception as e:  # noqa: BLE001 - a missing or broken build: say which
        raise SystemExit(f"Transformer Engine cannot be imported ({type(e).__name__}: {e}). Install it after "
                         "torch with `pip install --no-build-isolation transformer-engine[pytorch]==2.20.2` "
                         "(README, GPU set-up), or pass --transformer-impl local (unfused, slow).")
    if not specs.HAVE_TE:
        raise SystemExit("megatron-core did not find Transformer Engine's layers although it imports; "
                         "check the versions (README, GPU set-up) or pass --transformer-impl local")
    return impl


@dataclasses.dataclass(frozen=True)
class ModelOptions(flags.FromArgs):
    """How the model is built: the trainer's flags of the same names (Megatron's)."""
    transformer_impl: str | None = None  # None: transformer_engine on CUDA, local on CPU
    freeze_vit: bool = False
    bf16: bool = False  # parameters in bf16 (the optimizer keeps fp32 masters)
    sequence_parallel: bool = False
    recompute_granularity: str | None = None  # full | selective
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    moe_token_dispatcher_type: str = "allgather"
    moe_router_dtype: str = "fp32"
    moe_aux_loss_coeff: float = 0.0
    decoder_first_pipeline_num_layers: int | None = None  # PP: an uneven split (Megatron's flags)
    decoder_last_pipeline_num_layers: int | None = None


def transformer_config(hf_config, par, opts, te, sp):
    """Megatron's TransformerConfig of an HF Qwen VLM config; options it cannot run are errors naming the flag."""
    tc, qwen3 = hf_config.text_config, hf_config.model_type.startswith("qwen3")
    q35, moe = hf_config.model_type in ("qwen3_5", "qwen3_5_moe"), getattr(tc, "num_experts", None)
    if te and par.cp > 1 and not opts.bf16:  # no TE attention backend takes fp32 under CP (docs/model.md)
        raise SystemExit(f"--context-parallel-size {par.cp} with Transformer Engine needs --bf16: TE has no fp32 "
                         "attention under context parallelism. Pass --bf16, or --transformer-impl local (unfused).")
    if opts.recompute_granularity == "selective" and not torch.cuda.is_available():  # its backward calls CUDA
        raise SystemExit("--recompute-granularity selective needs CUDA; on CPU use --recompute-granularity full")
    if moe and par.tp > 1 and not sp:
        raise SystemExit("MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel (Megatron's rule)")
    if moe and par.pp > 1 and opts.moe_token_dispatcher_type == "allgather":
        raise SystemExit("MoE with --pipeline-model-parallel-size > 1 needs --moe-token-dispatcher-type alltoall")
    extra = dict(add_qkv_bias=not qwen3, qk_layernorm=qwen3, ffn_hidden_size=getattr(tc, "intermediate_size", 0),
                 moe_token_dispatcher_type="alltoall")  # dense: unused, but megatron refuses allgather under PP
    if q35:
        extra.update(qwen3_5.config_kwargs(tc, opts))  # gated attention, MoE
    return TransformerConfig(
        num_layers=tc.num_hidden_layers, hidden_size=tc.hidden_size, sequence_parallel=sp,
        expert_model_parallel_size=par.ep, layernorm_zero_centered_gamma=q35 and te,
        num_attention_heads=tc.num_attention_heads, num_query_groups=tc.num_key_value_heads,
        kv_channels=getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        normalization="RMSNorm", layernorm_epsilon=tc.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=par.tp, context_parallel_size=par.cp, expert_tensor_parallel_size=1,
        pipeline_model_parallel_size=par.pp, pipeline_dtype=torch.bfloat16 if opts.bf16 else torch.float32,
        num_layers_in_first_pipeline_stage=opts.decoder_first_pipeline_num_layers if par.pp > 1 else None,
        num_layers_in_last_pipeline_stage=opts.decoder_last_pipeline_num_layers if par.pp > 1 else None,
        variable_seq_lengths=par.pp > 1,  # packed rows differ in length: the pipeline sends each shape first
        batch_p2p_comm=torch.cuda.is_available(),  # gloo: plain isend/irecv
        params_dtype=torch.float32, perform_initialization=False,  # weights come from the checkpoint
        use_cpu_initialization=not torch.cuda.is_available(), bias_activation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
        cuda_graph_scope=[],  # what its default "full" becomes, without the deprecation warning
        recompute_granularity="selective" if opts.recompute_granularity == "selective" else None, **extra)


def recompute_plan(n, granularity, method, k):
    """[(first layer, end, recompute?)] of n decoder layers as the --recompute-* flags say."""
    if granularity != "full":
        return [(0, n, False)]
    if method == "block":
        return [(i, i + 1, True) for i in range(min(k, n))] + ([(k, n, False)] if k < n else [])
    return [(i, min(i + k, n), True) for i in range(0, n, k)]


def mrope_angles(pos, inv_freq, rope_parameters):
    """(3, T) t/h/w positions -> (T, 1, 1, 2 len(inv_freq)) angles in Megatron's rotate-half layout."""
    f = pos.to(inv_freq.device)[..., None].float() * inv_freq  # (3, T, d/2)
    half, section = f.shape[-1], rope_parameters["mrope_section"]
    if rope_parameters.get("mrope_interleaved", False):  # Qwen3-VL: frequency j takes h if j%3==1, w if j%3==2
        axis = torch.zeros(half, dtype=torch.long)
        axis[1:3 * section[1]:3], axis[2:3 * section[2]:3] = 1, 2
    else:  # Qwen2.5-VL: contiguous sections [t | h | w]
        axis = torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    f = f.gather(0, axis.to(f.device).expand(f.shape[1], half)[None])[0]  # (T, d/2)
    return torch.cat([f, f], -1)[:, None, None]


def sum_shared_grads_over_tp(language_model, par):
    """Sum over TP the gradients of parameters shared over heads (QK-norms, GDN's norm) or the sequence (SP)."""
    for name, p in language_model.named_parameters():
        shared = any(k in name for k in ("q_layernorm", "k_layernorm", "self_attention.norm."))
        if par.tp > 1 and (shared or getattr(p, "sequence_parallel", False)):
            p.register_hook(lambda g: parallel.all_reduce(g.clone(), par.tp_group))


def packed_row(hf_config, seqs, per_seq, par, sp):
    """-> (ids (T,), MRoPE positions (3, T), lens) of the row a micro-batch runs (docs/model.md). per_seq:
    split_images' (pixel_values, grid) of each sequence."""
    lens, ids, pos = [C.padded(len(s), par.cp) for s in seqs], [], []
    for s, (_, g), n in zip(seqs, per_seq, lens):
        ids += [s.cpu(), torch.zeros(n - len(s), dtype=torch.long)]
        pos += [rope_positions(hf_config, s, g), torch.arange(n - len(s)).expand(3, -1)]
    m = math.lcm(par.tp if sp else 1, 2 if par.cp > 1 else 1)
    share = -(-sum(lens) // par.cp // m) * m
    if par.ep > 1:
        share = int(parallel.all_reduce(torch.tensor(share, device=par.device), par.ep_group, dist.ReduceOp.MAX))
    if extra := share * par.cp - sum(lens):
        lens, ids, pos = lens + [extra], ids + [torch.zeros(extra, dtype=torch.long)], pos + [torch.arange(extra).expand(3, -1)]
    return torch.cat(ids), torch.cat(pos, 1), tuple(lens)


def packed_seq_params(lens, cp, device):
    """THD PackedSeqParams: attention and Gated DeltaNet run per sequence (under CP whole: TE splits them)."""
    cu = torch.tensor([0, *lens], device=device).cumsum(0).int()
    padded = dict(cu_seqlens_q_padded=cu, cu_seqlens_kv_padded=cu) if cp > 1 else {}  # TE's THD CP reads these
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                           max_seqlen_kv=max(lens), **padded)


def scored_positions(seqs, lens, loss_masks=None):
    """-> (rows (N,), tokens (N,)): mask[t] = 1 scores token t from the logits at packed-row position t - 1
    (mask[0] must be 0); loss_masks=None scores every token but the first."""
    rows, tgt, off = [], [], 0
    for i, (s, n) in enumerate(zip(seqs, lens)):
        t = torch.arange(1, len(s)) if loss_masks is None else loss_masks[i].cpu().nonzero()[:, 0]
        assert len(t) == 0 or t[0] > 0, "loss_mask[0] must be 0: token 0 has no logits before it"
        rows.append(off + t - 1)
        tgt.append(s.cpu()[t])
        off += n
    return torch.cat(rows), torch.cat(tgt)


def vision_features(visual, hf_config, par, pix, grid):
    """The vision tower on distinct images -> [merged-token features (n, H), then (n, H) a deepstack layer].
    Under CP image j runs on CP rank j % CP and the features are all-gathered."""
    cp, merge = par.cp, hf_config.vision_config.spatial_merge_size

    def tower(p, g):
        out = visual(p, grid_thw=g.to(p.device))
        return [out.pooler_output, *(getattr(out, "deepstack_features", None) or [])]
    if cp == 1:
        return tower(pix, grid)
    rows = pix.split(grid.prod(-1).tolist())
    mine, back = C.images_here(image_tokens(grid, merge), cp, par.cp_rank)
    if mine:
        feats = tower(torch.cat([rows[j] for j in mine]), grid[mine])
    else:  # no image for this rank: empty features, for the same collectives as the others
        n = 1 + len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or [])
        feats = [pix.new_zeros(0, hf_config.text_config.hidden_size)] * n
    return [C.gather_rows(f, par.cp_group, sum_grads=True)[back.to(pix.device)] for f in feats]


class MegatronVLM(torch.nn.Module):
    """HF vision tower (.visual) + Megatron GPTModel (.language_model) on `par`. PP: this rank's stage holds
    layers [offset, offset + n); the first embeds and runs the tower, the last has the final norm and LM head."""

    def __init__(self, hf_config, hf_dir, par, opts=ModelOptions()):
        super().__init__()
        tc = hf_config.text_config
        self.hf_config, self.hf_dir, self.par = hf_config, Path(hf_dir), par
        self.groups, self.heads, self.vocab = tc.num_key_value_heads, tc.num_attention_heads, tc.vocab_size
        self.padded_vocab = -(-self.vocab // par.tp) * par.tp  # VocabParallelEmbedding splits evenly
        self.tie = bool(getattr(hf_config, "tie_word_embeddings", False))
        qwen3 = hf_config.model_type.startswith("qwen3")  # Qwen3-VL and Qwen3.5: QK-norm, no QKV bias
        self.q35 = hf_config.model_type in ("qwen3_5", "qwen3_5_moe")
        self.impl = layer_impl(opts.transformer_impl)
        self.te = self.impl == "transformer_engine"
        self.sp = opts.sequence_parallel and par.tp > 1
        self.recompute = (opts.recompute_granularity, opts.recompute_method, opts.recompute_num_layers)
        cfg = transformer_config(hf_config, par, opts, self.te, self.sp)
        self.head_dim = cfg.kv_channels
        self.names = None  # convert.NameMap of the source checkpoint: load_model sets it
        self.pre, self.post = par.pp_rank == 0, par.pp_rank == par.pp - 1
        self.offset, n_local = pipeline.stage_layers(cfg, par, hf_config)
        self.input_tensor = None  # PP: the hidden states the previous stage sent (set_input_tensor)
        if self.q35:  # per-layer specs: Gated DeltaNet or gated attention, dense MLP or MoE
            spec = qwen3_5.block_spec(tc, self.te)
            spec.layer_specs = spec.layer_specs[self.offset:self.offset + n_local]
        elif self.te:
            spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qwen3)
        else:
            spec = attention.local_layer_spec(qk_layernorm=qwen3, normalization="RMSNorm")
        with parallel.megatron_on_cpu():
            self.language_model = GPTModel(
                cfg, spec, vocab_size=self.padded_vocab, max_sequence_length=tc.max_position_embeddings,
                share_embeddings_and_output_weights=self.tie and par.pp == 1, position_embedding_type="none",
                pre_process=self.pre, post_process=self.post)
        # model.config, what megatron's schedules read: a copy of the model's (on its own it would rescale the MoE aux
        # loss too) with calculate_per_token_loss, so that they do not divide our loss (docs/layouts.md)
        self.config, self.model_type = copy.copy(cfg), ModelType.encoder_or_decoder
        self.config.calculate_per_token_loss = True
        if self.tie and par.pp > 1 and self.post:  # Megatron's mark: its grad norm skips the copy
            self.language_model.output_layer.weight.shared = True
        self.routes = routing.RouteCounter(self.language_model, self.offset, cfg.num_layers)
        self.replays = routing.install(self.language_model)  # {local layer: Replay}, R3 (routing.py)
        if self.pre:  # we embed, place the image features and scatter the sequence (SP) ourselves
            self.language_model.embedding.word_embeddings.reduce_scatter_embeddings = False
        self.visual = VISION.get(hf_config.model_type, AutoModel.from_config)(hf_config.vision_config) if self.pre else None
        sum_shared_grads_over_tp(self.language_model, par)
        rp = tc.rope_parameters
        assert rp.get("rope_type", "default") == "default", rp
        d = int(self.head_dim * rp.get("partial_rotary_factor", 1.0))  # Megatron rotates the first d dims
        self.register_buffer("inv_freq", 1.0 / (rp["rope_theta"] ** (
            torch.arange(0, d, 2, dtype=torch.int64).float() / d)), persistent=False)

    def expert_load(self):
        """(decoder layers, experts) tokens routed here since the last call, padding included, or zeros; None: dense."""
        cfg, load = self.language_model.config, self.routes.take()
        if load is None and cfg.num_moe_experts:
            return torch.zeros(cfg.num_layers, cfg.num_moe_experts, dtype=torch.float64, device=self.par.device)
        return load

    def head_weight(self):  # (V_local, H): this rank's rows of the (padded) vocabulary; tied: the embedding
        lm = self.language_model
        return lm.embedding.word_embeddings.weight if self.tie and self.pre else lm.output_layer.weight

    def set_input_tensor(self, t):
        """PP: the previous stage's hidden states for the next forward (megatron's schedules call it)."""
        self.input_tensor = t[0] if isinstance(t, list) else t

    def _layers(self, h, lo, hi, rot, psp, img, deep, routes=None):
        """Decoder layers lo..hi-1 on h (T, 1, H); routes (T_local, all layers, k): routing.packed's."""
        with parallel.megatron_on_cpu():  # also when backward recomputes
            for i in range(lo, hi):
                if i in self.replays:  # set here, so a recomputed layer replays the same
                    self.replays[i].target = None if routes is None else routes[:, self.offset + i]
                h, _ = self.language_model.decoder.layers[i](hidden_states=h, attention_mask=None,
                                                             rotary_pos_emb=rot, packed_seq_params=psp)
                if i < len(deep):  # deepstack: add layer i's visual features at the image tokens
                    h = h.index_put((img,), deep[i][:, None].to(h.dtype), accumulate=True)
        return h

    def _hidden(self, seqs, pixel_values=None, image_grid_thw=None, routed_experts=None):
        """Sequences [(T_i,) ids] -> (final-norm hidden states (T_local, H) of this rank's part of the row, lens)."""
        lm, cfg, par = self.language_model, self.hf_config, self.par
        dev = self.inv_freq.device
        ids, pos, lens = packed_row(cfg, seqs, split_images(cfg, seqs, pixel_values, image_grid_thw), par, self.sp)
        ids, held = ids.to(dev), C.held(lens, par.cp, par.cp_rank)
        img, deep = (ids == cfg.image_token_id).nonzero()[:, 0], []
        h = lm.embedding.word_embeddings(ids[None]).transpose(0, 1) if self.pre else None  # (T, 1, H)
        if pixel_values is not None and self.pre:
            pix, grid, take = unique_images(pixel_values, image_grid_thw.cpu(), cfg.vision_config.spatial_merge_size)
            feats = vision_features(self.visual, cfg, par, pix.to(dev, h.dtype), grid)  # merged tokens, deepstack
            take = take.to(dev)
            h = h.index_put((img,), feats[0][take][:, None].to(h.dtype))
            deep = [d[take] for d in feats[1:]]  # Qwen3-VL's deepstack: one (n_img, H) a layer
        if par.cp > 1 and self.pre:  # this rank's chunks from here on; deepstack rows of its image tokens
            is_img, here = ids == cfg.image_token_id, held.to(dev)
            row = (is_img.cumsum(0) - 1)[here]  # each held token's row among the image tokens
            h, local = h[here], is_img[here]
            img, deep = local.nonzero()[:, 0], [d[row[local]] for d in deep]
        psp = packed_seq_params(lens, par.cp, dev)
        # the whole row's angles: Megatron's THD RoPE takes each CP rank's chunks of them
        rot = mrope_angles(pos, self.inv_freq, self.hf_config.text_config.rope_parameters)
        routes = None
        if self.replays and routed_experts is not None and any(r is not None for r in routed_experts):
            routes = routing.packed(list(routed_experts), list(seqs), lens, held, par.tp_rank, par.tp if self.sp else 1)
        with parallel.megatron_on_cpu():
            if self.sp and self.pre:  # (T / TP, 1, H) from here on: this rank's shard of the sequence
                h = tensor_parallel.scatter_to_sequence_parallel_region(h)
            if not self.pre:  # PP: what the previous stage sent, as it left its last layer
                h = self.input_tensor
            for lo, hi, again in recompute_plan(len(lm.decoder.layers), *self.recompute):  # full: again = True
                run = functools.partial(self._layers, lo=lo, hi=hi, rot=rot, psp=psp, img=img, deep=deep, routes=routes)
                h = torch.utils.checkpoint.checkpoint(run, h, use_reentrant=False) if again else run(h)
            if not self.post:  # PP: (T_local, 1, H) to the next stage
                return h, lens
            h = lm.decoder.final_layernorm(h)
            if self.sp:  # the LM head's gradient is whole on every rank: gather, backward splits
                h = tensor_parallel.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)
        return h[:, 0], lens

    def forward(self, seqs, pixel_values=None, image_grid_thw=None, loss_masks=None, temperature=1.0,
                with_entropy=False, routed_experts=None):
        """(logprobs (N,), entropy (N,) or None) of the tokens scored_positions picks, at `temperature`; the LM
        head runs at those N positions only. PP: a stage before the last returns its hidden states."""
        h, lens = self._hidden(seqs, pixel_values, image_grid_thw, routed_experts)
        if not self.post:
            return h
        rows, tgt = scored_positions(seqs, lens, loss_masks)
        if self.par.cp > 1:  # score the rows this rank holds; all ranks' scores come back in token order below
            rows, pick, back = C.scored_here(lens, self.par.cp, self.par.cp_rank, rows)
            tgt = tgt[pick]
        k, r = self.padded_vocab // self.par.tp, self.par.tp_rank  # this rank's vocabulary rows: [k r, k r + k)
        lp, ent = logprobs.LogprobEntropy.apply(h[rows.to(h.device)].float(), self.head_weight(), tgt.to(h.device),
                                                float(temperature), r * k, max(0, min(k, self.vocab - r * k)),
                                                self.par.tp_group)
        if self.par.cp > 1:
            lp, ent = (C.gather_rows(x, self.par.cp_group)[back.to(h.device)] for x in (lp, ent))
        return lp, (ent if with_entropy else None)

    def logits(self, seqs, pixel_values=None, image_grid_thw=None):
        """[(T_i, V) fp32 full logits] per sequence, gathered over TP: for parity checks only."""
        h, lens = self._hidden(seqs, pixel_values, image_grid_thw)
        if not self.post:
            return h
        with parallel.megatron_on_cpu():  # the gather allocates on torch.cuda.current_device()
            z = tensor_parallel.gather_from_tensor_model_parallel_region(h @ self.head_weight().T)[:, :self.vocab]
        if self.par.cp > 1:
            z = C.gather_sequence(z, lens, self.par.cp, self.par.cp_group)
        return [x[:len(s)].float() for s, x in zip(seqs, z.split(lens))]


def load_model(hf_dir, opts=ModelOptions(), par=None):
    """MegatronVLM on `par` (default: the current context) with the checkpoint's weights, fp32 or opts.bf16."""
    par = par or parallel.init_distributed()
    model = MegatronVLM(AutoConfig.from_pretrained(hf_dir), hf_dir, par, opts)
    model.names = convert.name_map(model, hf_dir)
    model.config_json = (Path(hf_dir) / "config.json").read_text()  # what save_hf writes beside these weights
    convert.load_weights(model)
    if model.visual is not None:
        model.visual.requires_grad_(not opts.freeze_vit)
    if opts.bf16:
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    if par.rank == 0:
        print(f"[model] {hf_dir}: layer spec {model.impl}, parameters {next(model.parameters()).dtype}, "
              f"device {par.device}, TP {par.tp}, PP {par.pp}", flush=True)
    return model.to(par.device)
