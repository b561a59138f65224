"""Hugging Face <-> Megatron weights: one name map, each TP rank loading its slices, export of full HF
tensors (for checkpoints and the rollout engine), and the one safetensors folder writer (docs/convert.md).

    model.names = name_map(model, hf_dir)         # model: model.MegatronVLM on its parallel context
    load_weights(model)
    for bucket in export_hf(model): ...           # [(HF name, full tensor)], names as in the source
    save_hf(model, out_dir)                        # a folder transformers and SGLang load as it is"""
import dataclasses
import json
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

# Megatron name in decoder.layers.{i}. -> (its TP split: shard()'s kinds, HF names in layers.{i}.) (docs/convert.md)
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
    # Qwen3.5's MoE block: the router and the gated shared expert
    "mlp.router.weight": ("rep", ["mlp.gate.weight"]),
    "mlp.shared_experts.linear_fc1.weight": ("fc1", ["mlp.shared_expert.gate_proj.weight",
                                                     "mlp.shared_expert.up_proj.weight"]),
    "mlp.shared_experts.linear_fc2.weight": ("col", ["mlp.shared_expert.down_proj.weight"]),
    "mlp.shared_experts.gate_weight": ("rep", ["mlp.shared_expert_gate.weight"]),
}
# Qwen3.5's Gated DeltaNet in the place of self_attention: HF's linear_attn.{the same name}
_GDN = {"in_proj_qkv.weight": "gdn", "conv1d.weight": "gdn", "in_proj_z.weight": "rows", "in_proj_b.weight": "rows",
        "in_proj_a.weight": "rows", "A_log": "rows", "dt_bias": "rows", "norm.weight": "rep", "out_proj.weight": "col"}
_LAYER.update({f"self_attention.{n}": (kind, [f"linear_attn.{n}"]) for n, kind in _GDN.items()})
# Routed experts, whole on their EP rank: SequentialMLP's `local_experts.{j}.linear_fc1.weight` or TE's grouped
# `linear_fc1.weight{j}`; HF's fused (E, 2I, H) / (E, H, I) or per-expert tensors (docs/convert.md)
_EXPERT = re.compile(r"mlp\.experts\.(?:local_experts\.(\d+)\.(linear_fc[12])\.weight|(linear_fc[12])\.weight(\d+))$")
_TOP = {"embedding.word_embeddings.weight": ("vocab", ["embed_tokens.weight"]),
        "decoder.final_layernorm.weight": ("rep", ["norm.weight"])}
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
# Files of a checkpoint folder that are not weights: copied next to exported weights.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth")


FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")  # config.json model_types model.py builds (tools/tiny.py)


def family(folder):
    """An error naming folder/config.json's model_type and FAMILIES unless it is one of them (before anything loads)."""
    try:
        kind = json.loads((Path(folder) / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError) as e:
        raise SystemExit(f"--hf-checkpoint {folder}: its config.json is not a JSON object ({e})") from None
    if kind not in FAMILIES:
        raise SystemExit(f"--hf-checkpoint {folder}: model_type {kind!r} (config.json) is not a family this trainer "
                         f"builds: {', '.join(FAMILIES)}")


# config.json fields that shape a tensor, by name (sizes, dims, head and layer counts, layer kinds; not ids or rope)
SHAPES = re.compile(r"architectures|tie_word_embeddings|layer_types|depth|in_chans|in_channels|"
                    r"num_(?!experts_per_tok).*|.*_(size|dim|heads|layers|indexes)")


def shape_fields(folder):
    """{name: value} of folder/config.json's SHAPES fields, a nested config's named with its key (text_config.depth)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    parts = [("", config)] + [(f"{k}.", v) for k, v in config.items() if isinstance(v, dict)]
    return {p + k: v for p, part in parts for k, v in part.items() if SHAPES.fullmatch(k)}


def same_architecture(hf_checkpoint, ckpt):
    """A resume trains `ckpt`'s weights, built as --hf-checkpoint's config says: one of another shape is refused."""
    new, run = shape_fields(hf_checkpoint), shape_fields(ckpt)
    if differ := [f"{k} {new.get(k)}, the run's {run.get(k)}" for k in sorted(new | run) if new.get(k) != run.get(k)]:
        raise SystemExit(f"--hf-checkpoint {hf_checkpoint}: not the architecture of {ckpt} ({'; '.join(differ)}), "
                         "whose weights a resume trains; resume with the run's --hf-checkpoint, or start a new run "
                         "from this one in another --save")


def weight_files(hf_dir):
    """{HF tensor name: safetensors file} of a checkpoint folder."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.exists():
        return {k: hf_dir / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        with open_weights(f) as handle:
            out.update(dict.fromkeys(handle.keys(), f))
    return out


def open_weights(f):
    """safe_open(f), or an error naming the file (safetensors' own says only what broke)."""
    try:
        return safe_open(f, "pt")
    except Exception as e:  # noqa: BLE001 - SafetensorError (truncated, bad header), OSError
        raise SystemExit(f"{f}: not a readable safetensors file ({type(e).__name__}: {e})") from None


def rule(model, name):
    """Megatron parameter name -> (kind, [full HF names as in the source checkpoint]); kind: shard()'s."""
    if name.startswith("visual."):
        return "rep", [model.names.vis_prefix + name[len("visual."):]]
    name = name[len("language_model."):]
    if name == "output_layer.weight":  # under PP a tied head is the last stage's copy of the embedding
        return "vocab", [model.names.lm_prefix + "embed_tokens.weight" if model.tie else "lm_head.weight"]
    if name.startswith("decoder.layers."):
        i, rest = name[len("decoder.layers."):].split(".", 1)
        i = int(i) + model.offset  # PP: the stage's first layer's index in the whole model
        if m := _EXPERT.match(rest):  # -> ("fused", [3-D name]) or ("expert", [gate, up] / [down]) of global expert e
            fc, e, pre = m[2] or m[3], expert_id(model, name), f"{model.names.lm_prefix}layers.{i}.mlp.experts."
            if model.names.fused_experts:
                return "fused", [pre + ("gate_up_proj" if fc == "linear_fc1" else "down_proj")]
            return "expert", [f"{pre}{e}.{x}_proj.weight" for x in (["gate", "up"] if fc == "linear_fc1" else ["down"])]
        kind, hf = _LAYER[rest]
        if kind == "qkv" and model.q35:  # q_proj holds [q | gate] per head
            kind = "qgkv"
        return kind, [f"{model.names.lm_prefix}layers.{i}.{x}" for x in hf]
    kind, hf = _TOP[name]
    return kind, [model.names.lm_prefix + x for x in hf]


def expert_id(model, name):
    """Global index of the routed expert a Megatron parameter belongs to."""
    m = _EXPERT.search(name)
    return model.names.ep_rank * model.names.local_experts + int(m[1] or m[4])


def _rows(s, r, tp):
    """Rank r's 1/tp of a lazy safetensors slice along dim 0."""
    k = s.get_shape()[0] // tp
    return s[r * k:(r + 1) * k]


def _gather(t, n, group):
    """[t of each of the group's n ranks], [t] when n is 1."""
    if n == 1:
        return [t]
    parts = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def shard(model, kind, slices):
    """Lazy safetensors slices of the HF tensors -> this rank's Megatron tensor, split as `kind` says."""
    r, tp = model.par.tp_rank, model.par.tp
    if kind == "rep":
        return slices[0][:]
    if kind == "col":  # split along dim 1
        k = slices[0].get_shape()[-1] // tp
        return slices[0][:, r * k:(r + 1) * k]
    if kind == "fc1":  # [gate_r; up_r]
        return torch.cat([_rows(s, r, tp) for s in slices])
    if kind == "rows":  # split along dim 0
        return _rows(slices[0], r, tp)
    if kind == "expert":  # whole: [gate; up] or down
        return torch.cat([s[:] for s in slices])
    if kind == "gdn":  # [q_r; k_r; v_r]
        kd, vd = model.names.gdn_dims
        return torch.cat([slices[0][o + r * n // tp:o + (r + 1) * n // tp] for o, n in ((0, kd), (kd, kd), (2 * kd, vd))])
    if kind == "qgkv":  # per local query group g: [q heads of g; their gates; k_g; v_g]
        g, d = model.groups // tp, model.head_dim
        q = _rows(slices[0], r, tp).reshape(g, -1, 2, d, slices[0].get_shape()[-1])  # HF: [q_h | gate_h] per head
        k, v = (_rows(s, r, tp).reshape(g, d, -1) for s in slices[1:])
        return torch.cat([q[:, :, 0].flatten(1, 2), q[:, :, 1].flatten(1, 2), k, v], 1).flatten(0, 1)
    if kind == "qkv":  # per local query group g: [q heads of g; k_g; v_g]
        g, parts = model.groups // tp, [_rows(s, r, tp) for s in slices]
        return torch.cat([x.reshape(g, -1, *x.shape[1:]) for x in parts], 1).flatten(0, 1)
    k = model.padded_vocab // tp  # vocab: rows of the padded vocabulary, padding = 0
    x = slices[0][min(r * k, model.vocab):min((r + 1) * k, model.vocab)]
    return torch.cat([x, x.new_zeros(k - len(x), *x.shape[1:])])


def full(model, kind, t):
    """This rank's Megatron tensor -> [full HF tensors] (gathers over TP)."""
    if kind == "rep":
        return [t]
    parts, tp = _gather(t, model.par.tp, model.par.tp_group), model.par.tp
    if kind == "col":
        return [torch.cat(parts, 1)]
    if kind == "vocab":
        return [torch.cat(parts)[:model.vocab]]
    if kind == "rows":
        return [torch.cat(parts)]
    if kind == "gdn":  # each rank's [q_r; k_r; v_r] -> [q; k; v]
        kd, vd = model.names.gdn_dims
        sections = [p.split([kd // tp, kd // tp, vd // tp]) for p in parts]
        return [torch.cat([torch.cat([s[i] for s in sections]) for i in range(3)])]
    if kind == "fc1":  # [gate_r; up_r] of every rank -> gate, up
        halves = [p.chunk(2) for p in parts]
        return [torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])]
    x = torch.cat(parts)  # qkv: rank order = query-group order
    x, d, rq = x.reshape(model.groups, -1, *x.shape[1:]), model.head_dim, model.heads // model.groups
    if kind == "qgkv":  # -> q_proj [q_h | gate_h] per head, k, v
        q, gate, k, v = x.split([rq * d, rq * d, d, d], 1)
        q = torch.stack([q.reshape(model.heads, d, -1), gate.reshape(model.heads, d, -1)], 1)
        return [q.flatten(0, 2), k.flatten(0, 1), v.flatten(0, 1)]
    return [y.flatten(0, 1) for y in x.split([rq * d, d, d], 1)]


@dataclasses.dataclass(frozen=True)
class NameMap:
    """What conversion knows of the source checkpoint and of this rank's share of it."""
    src: dict  # HF name -> (shape, dtype): export gives back exactly these
    files: dict  # HF name -> safetensors file (export passes `mtp.*` on from them)
    fused_experts: bool  # routed experts as 3-D gate_up_proj / down_proj (released checkpoints) or per expert
    local_experts: int  # routed experts on this EP rank (0: dense)
    ep_rank: int
    gdn_dims: tuple  # Gated DeltaNet (key, value) widths: linear heads x head dim
    lm_prefix: str  # "model.language_model." or the like
    vis_prefix: str


def name_map(model, hf_dir):
    """The source checkpoint's names, shapes and dtypes (safetensors headers only) for `model`."""
    files = weight_files(hf_dir)
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no *.safetensors weights")
    src = {}
    for f in set(files.values()):
        with open_weights(f) as handle:
            for k in handle.keys():
                if files.get(k) == f:
                    sl = handle.get_slice(k)
                    src[k] = (sl.get_shape(), _DTYPES[sl.get_dtype()])
    lm, tc = model.language_model.config, model.hf_config.text_config
    local = (lm.num_moe_experts or 0) // lm.expert_model_parallel_size
    return NameMap(
        src=src, files=files, local_experts=local, ep_rank=model.par.ep_rank if local else 0,
        fused_experts=any(k.endswith("mlp.experts.gate_up_proj") and not k.startswith("mtp.") for k in files),
        gdn_dims=(getattr(tc, "linear_num_key_heads", 0) * getattr(tc, "linear_key_head_dim", 0),
                  getattr(tc, "linear_num_value_heads", 0) * getattr(tc, "linear_value_head_dim", 0)),
        lm_prefix=next(k for k in files if k.endswith("embed_tokens.weight")
                       and not k.startswith("mtp."))[:-len("embed_tokens.weight")],
        vis_prefix=next(k for k in files if k.endswith("patch_embed.proj.weight"))[:-len("patch_embed.proj.weight")])


def load_weights(model):
    """Copy the source checkpoint's tensors (model.names) into `model`, each TP rank reading only its slices."""
    files = model.names.files
    handles = {f: open_weights(f) for f in set(files.values())}
    read = {"lm_head.weight"} if model.tie else set()  # a tied head's: export writes the embedding there
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind, hf = rule(model, name)
            read.update(hf)
            slices = [handles[files[n]].get_slice(n) for n in hf]
            if kind in ("fused", "expert"):  # whole experts, one set per EP rank: reduced over expert-DP
                e = expert_id(model, name)
                p.copy_(slices[0][e:e + 1][0] if kind == "fused" else shard(model, kind, slices))
                p.allreduce = False  # Megatron's mark (TE sets it; the local SequentialMLP does not)
                continue
            p.copy_(shard(model, kind, slices))
            if kind != "rep" and not getattr(p, "tensor_model_parallel", False):
                # Megatron's init would have marked it: the grad norm counts sharded tensors on every TP rank
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, int(kind == "col"), 1
    if bad := [rule(model, n)[1][0] for n, p in model.named_parameters() if not torch.isfinite(p).all()]:
        raise SystemExit(f"{files[bad[0]]}: tensor {bad[0]} holds NaN or inf"
                         + (f" ({len(bad) - 1} more tensors too)" if len(bad) > 1 else ""))
    # every tensor but mtp.* must reach a parameter: export sends only those (why: docs/convert.md)
    everyone = [None] * model.par.world
    dist.all_gather_object(everyone, read)
    if left := sorted(n for n in files if not n.startswith("mtp.") and not any(n in r for r in everyone)):
        raise SystemExit(f"{model.hf_dir}: {len(left)} tensors of the checkpoint load into no parameter of the "
                         f"model: {', '.join(left[:5])}" + (" ..." if len(left) > 5 else ""))


def _experts(model, name, kind, hf, t, fused):
    """Routed-expert tensors of every EP rank -> [(HF name, tensor)]: per-expert names at once, a
    fused 3-D tensor once its layer's last expert is in (`fused` collects them by name)."""
    mine, local, out = expert_id(model, name), model.names.local_experts, []
    for r, x in enumerate(_gather(t, model.par.ep, model.par.ep_group)):
        e = r * local + mine % local  # EP rank r's expert in the place of this rank's
        if kind == "expert":
            names = [n.replace(f".experts.{mine}.", f".experts.{e}.") for n in hf]
            out += list(zip(names, x.chunk(len(names))))
        else:
            fused.setdefault(hf[0], {})[e] = x
    n_all = local * model.par.ep
    if kind == "fused" and len(fused[hf[0]]) == n_all:
        out.append((hf[0], torch.stack([fused[hf[0]].pop(e) for e in range(n_all)])))
    return out


def hf_tensors(model, grad=False):
    """(HF name, full tensor) for every tensor of the source checkpoint, `mtp.*` passed through as it is;
    grad=True: their gradients (None as zeros; no `mtp.*`). Collective over TP, EP and PP: every rank gets all."""
    par = model.par
    if par.pp == 1:
        yield from _stage_tensors(model, grad)
        return
    for stage in range(par.pp):
        mine = _stage_tensors(model, grad) if stage == par.pp_rank else None
        src = dist.get_global_rank(par.pp_group, stage)
        while True:  # one (name, shape, dtype) header, then the tensor; None ends the stage's
            n, t = next(mine, (None, None)) if mine is not None else (None, None)
            head = [None if n is None else (n, tuple(t.shape), t.dtype)]
            dist.broadcast_object_list(head, src=src, group=par.pp_group)
            if head[0] is None:
                break
            n, shape, dtype = head[0]
            # on par.device: NCCL refuses a CPU tensor, and `mtp.*` comes from the file
            x = torch.empty(shape, dtype=dtype, device=par.device) if mine is None else t.to(par.device).contiguous()
            dist.broadcast(x, src=src, group=par.pp_group)
            yield n, x


def _stage_tensors(model, grad):
    """hf_tensors of this rank's PP stage (all of them without PP)."""
    fused = {}
    for name, p in model.named_parameters():
        if name == "language_model.output_layer.weight" and model.tie:  # PP: the first stage exports it
            continue
        t = (p.grad if p.grad is not None else torch.zeros_like(p)) if grad else p.detach()
        kind, hf = rule(model, name)
        if kind in ("fused", "expert"):
            for n, x in _experts(model, name, kind, hf, t, fused):
                yield n, x.to(model.names.src[n][1])
            continue
        tensors = full(model, kind, t)
        if name.endswith("word_embeddings.weight") and model.tie:  # tied: emit lm_head if the source has it
            hf, tensors = hf + ["lm_head.weight"], tensors + tensors
        for n, x in zip(hf, tensors):
            if n in model.names.src:
                yield n, x.to(model.names.src[n][1])
    if not grad and model.post:  # the MTP head, untrained here: as the source holds it
        for n in sorted(k for k in model.names.src if k.startswith("mtp.")):
            with safe_open(model.names.files[n], "pt") as f:
                yield n, f.get_tensor(n)


def export_hf(model, bucket_bytes=256 << 20):
    """Buckets [(HF name, full tensor)] of about bucket_bytes, names/shapes/dtypes as in the source
    checkpoint. Call on every TP rank (it gathers); every rank receives the full tensors."""
    bucket, size = [], 0
    for n, t in hf_tensors(model):
        bucket.append((n, t))
        size += t.numel() * t.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def write_hf(buckets, out_dir, src_dir, config=None):
    """Write (HF name, tensor) buckets as a checkpoint folder, a safetensors file a bucket (one: model.safetensors),
    old weights removed, the source folder's other files copied; `config`: config.json's text, when src_dir's may not
    describe these weights (save_hf). -> number of tensors written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file() and f.name.endswith(_WEIGHT_SUFFIXES):
            f.unlink()
    weight_map = {}
    for i, bucket in enumerate(buckets):
        name = f"model-{i + 1:05d}.safetensors"
        save_file({n: t.detach().cpu().contiguous() for n, t in bucket}, str(out / name), metadata={"format": "pt"})
        (out / name).chmod(out.stat().st_mode & 0o666)  # safetensors writes 0600; the folder's umask, as the others
        weight_map.update(dict.fromkeys((n for n, _ in bucket), name))
    names = sorted(set(weight_map.values()))
    if len(names) == 1:  # one shard: the plain single-file layout
        (out / names[0]).rename(out / "model.safetensors")
    else:
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    for f in Path(src_dir).iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(f, out / f.name)
    if config is not None:
        (out / "config.json").write_text(config)
    return len(weight_map)


def save_hf(model, out_dir, shard_bytes=4 << 30, src_dir=None):
    """A checkpoint transformers and SGLang load as they are: config.json the model's own, its other files from
    `src_dir` (default: the model's own folder). Call on every rank (export gathers); global rank 0 writes."""
    buckets = export_hf(model, shard_bytes)
    if dist.get_rank() == 0:
        write_hf(buckets, out_dir, src_dir or model.hf_dir, model.config_json)
    else:
        for _ in buckets:  # take part in the gathers
            pass
    dist.barrier()
