"""Memory per training GPU, estimated from a checkpoint's config.json alone (no weights are read:
the Hugging Face model is built on the meta device to count its parameters).

    python bench/memory.py --hf-checkpoint ../shared/real_models/Qwen3-VL-2B-Instruct --tp 1 --dp 4 --bf16
    python bench/memory.py --hf-checkpoint ../shared/real_models/Qwen3.5-35B-A3B --tp 1 --dp 8 --ep 8 \
        --bf16 --use-distributed-optimizer --recompute-granularity full

Bytes per GPU:
- weights: text-model matrices split over TP, experts over EP, the vision tower whole on every rank
  (model.py replicates it); 4 bytes a parameter, 2 with --bf16.
- gradients: `main_grad`, fp32 with --accumulate-allreduce-grads-in-fp32 or without --bf16.
- optimizer: Adam's two fp32 moments, plus an fp32 master copy with --bf16; divided by DP x CP
  (Megatron's distributed optimizer shards over both; experts: by the expert-DP size) with
  --use-distributed-optimizer.
- activations: what the forward pass keeps for backward, for one micro-batch of
  --max-tokens-per-gpu tokens, counted tensor by tensor for a decoder layer
  (layer_activation_elements); the vision tower's are left out (an image is a few hundred
  tokens). --recompute-granularity full keeps only each chunk's input; `recompute` is then one
  chunk's layers run again in backward. selective drops the attention scores. Under --cp a GPU
  holds 1/CP of each sequence (a micro-batch is CP x --max-tokens-per-gpu tokens) and an
  attention layer also keeps the keys and values gathered from the other CP ranks.
- sglang: the colocated server's share (--mem-fraction-static of the GPU).

Per phase (the trainer's flags, as train_grpo.py spells them), a colocated run's GPU holds:
- rollout: SGLang's --mem-fraction-static of the GPU (its weights and KV cache pool), and the
  trainer's weights, gradients and optimizer states unless --offload-train parks them in host memory
  (activations are gone: the step empties the cache). What is left is SGLang's CUDA graphs and
  activations headroom.
- train: the trainer's weights, gradients, the optimizer states it keeps on the GPU (none with
  --optimizer-cpu-offload at fraction 1) and the activations, beside what a released SGLang keeps
  (--sglang-released-gib: its CUDA context and the allocations outside its memory saver; an
  assumption until gpu_smoke.sh measures it).
- sync: after training, with --offload-train, the trainer's weights (its optimizer states and
  gradients parked) beside SGLang's weights (the model / --sglang-tp-size GPUs) and one bucket.
- host: per GPU, what --offload-train copies (weights and GPU-resident optimizer states; gradients
  are freed), and --optimizer-cpu-offload's fp32 masters, gradients and Adam states.
The last line is one JSON object: rollout_gib, train_gib, sync_gib, gpu_gib, host_gib.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from sglang_engine import COLOCATE_MEM_FRACTION, OFFLOAD_MEM_FRACTION  # noqa: E402 - the trainer's defaults

GIB = 2 ** 30


def count_params(hf_dir):
    """{'vision', 'experts', 'text'}: parameter counts of the HF model built on the meta device."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    cfg = AutoConfig.from_pretrained(hf_dir)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(cfg)
    out = {"vision": 0, "experts": 0, "text": 0}
    for n, p in model.named_parameters():
        key = "vision" if ".visual." in n else "experts" if ".experts." in n else "text"
        out[key] += p.numel()
    return cfg, out


def layer_activation_elements(tc, layer_type, t, tp, attention, cp=1, sp=False):
    """Elements one decoder layer keeps for backward, for t tokens on one GPU, tensor by tensor
    as Megatron's local layers save them: per token the two RMSNorms' inputs and outputs (4 H);
    attention's q, k, v out of the QKV projection, again after RoPE and again reshaped for the
    score matmul, and its output (3 q + 5 kv); the MLP's fc1 output (gate, up), silu(gate) and the
    product (4 I). 'dense' attention (--transformer-impl local, or TE in fp32) also keeps each
    head's T x T softmax output; 'flash' (TE's fused attention in bf16) keeps none. sp: the norms'
    share split over TP too (--sequence-parallel)."""
    h, nh, nkv = tc.hidden_size, tc.num_attention_heads, tc.num_key_value_heads
    hd = getattr(tc, "head_dim", None) or h // nh
    norms = 4 * t * h // (tp if sp else 1)
    if layer_type == "linear_attention":  # Gated DeltaNet: projections, conv, recurrent outputs
        k, v = tc.linear_num_key_heads * tc.linear_key_head_dim, tc.linear_num_value_heads * tc.linear_value_head_dim
        attn = t * (3 * (2 * k + v) + 3 * v) // tp
    else:
        gate = 2 if getattr(tc, "layer_types", None) else 1  # Qwen3.5's gated attention doubles q
        attn = t * (3 * gate * nh * hd + 5 * nkv * hd + 2 * (cp - 1) * nkv * hd) // tp  # + gathered K, V
        if attention == "dense":
            attn += (nh // tp) * t * cp * t  # this rank's queries over the whole sequences' keys
    if getattr(tc, "num_experts", None):  # each token's top-k experts (their tokens reach this rank)
        k, im, si = tc.num_experts_per_tok, tc.moe_intermediate_size, tc.shared_expert_intermediate_size
        mlp = t * (h + tc.num_experts) + k * t * (h + 4 * im) + t * 4 * si // tp
    else:
        mlp = 4 * t * tc.intermediate_size // tp
    return norms + attn + mlp


def estimate(hf_dir, tp=1, dp=1, ep=1, bf16=False, fp32_grads=False, distributed=False, tokens=4096,
             recompute=None, recompute_num_layers=1, attention="flash", mem_fraction=0.0, gpu_bytes=0, cp=1, pp=1,
             sp=False):
    """Bytes per GPU of each part. PP: the first stage, the fullest: the vision tower, 1/PP of the
    language model's parameters (the embedding / head imbalance ignored) and, under 1F1B, the
    activations of PP micro-batches in flight."""
    cfg, n = count_params(hf_dir)
    tc = cfg.text_config
    n = dict(n, text=n["text"] / pp, experts=n["experts"] / pp)
    local = n["text"] / tp + n["experts"] / ep + n["vision"]  # parameters held on one GPU
    wb = 2 if bf16 else 4
    gb = 4 if (fp32_grads or not bf16) else 2
    ob = 8 + (4 if bf16 else 0)  # Adam's moments, and the fp32 master copy under --bf16
    if distributed:
        opt = ob * ((n["text"] / tp + n["vision"]) / (dp * cp) + n["experts"] / ep / max(1, dp * cp * tp // ep))
    else:
        opt = ob * local
    types = getattr(tc, "layer_types", None) or ["full_attention"] * tc.num_hidden_layers
    per = [layer_activation_elements(tc, ty, tokens, tp, "flash" if recompute == "selective" else attention, cp, sp)
           for ty in types][:-(-len(types) // pp)]
    if recompute == "full":  # chunk inputs kept; in backward one chunk's layers at a time again
        chunk = max(per) * min(recompute_num_layers, len(per))
        kept, again = tokens * tc.hidden_size * -(-len(per) // recompute_num_layers), chunk
    else:
        kept, again = sum(per), 0
    kept += tokens * tc.hidden_size * 3  # the final norm's input and output, the LM head's fp32 input
    kept *= pp  # 1F1B: the first stage holds PP micro-batches before its first backward
    act_b = 2 if bf16 else 4
    return {"params_per_gpu": local, "weights": wb * local, "grads": gb * local, "optimizer": opt,
            "activations": act_b * kept, "recompute": act_b * again, "sglang": mem_fraction * gpu_bytes,
            "model_params": sum(n.values()) * pp, "optimizer_bytes_per_param": ob}


def phases(est, a, gpu_bytes):
    """{phase: bytes per GPU} of a colocated run (module doc), and host bytes per GPU."""
    frac = a.optimizer_offload_fraction if a.optimizer_cpu_offload else 0.0
    opt_gpu = est["optimizer"] * (1 - frac)
    host_opt = est["optimizer"] * frac * (1 + 4 / est["optimizer_bytes_per_param"])  # + its fp32 gradient copy
    trainer = est["weights"] + est["grads"] + opt_gpu
    world = a.tp * a.cp * a.pp * a.dp
    sglang_weights = est["model_params"] * 2 / (a.sglang_tp_size or min(8, world))  # bf16, split over its GPUs
    bucket = 2 * (256 << 20)  # one 256 MB bucket, and the server's copy of it
    out = {"rollout": a.mem_fraction_static * gpu_bytes + (0 if a.offload_train else trainer),
           "train": trainer + est["activations"] + est["recompute"] + a.sglang_released_gib * GIB,
           "sync": est["weights"] + (0 if a.offload_train else est["grads"] + opt_gpu) + sglang_weights + bucket}
    host = host_opt + ((est["weights"] + opt_gpu) if a.offload_train else 0)
    return out, host


def saved_bytes(fn, params):
    """Bytes of the tensors autograd saves for backward while fn() runs (each storage once,
    parameters not counted): the activations, measured."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            seen[st.data_ptr()] = st.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def measure(a):
    """One SFT step of --max-tokens-per-gpu text tokens on CPU, this process alone (TP = DP = 1):
    the parameters' bytes, what the forward pass leaves alive for backward (activations), and
    the optimizer's tensors after the first step (Adam's moments; MasterAdamW's masters)."""
    import model as M
    import optim
    import sft
    flags = ["--hf-checkpoint", a.hf_checkpoint, "--prompt-data", "x", "--save", "x"]
    flags += [f for f, on in (("--bf16", a.bf16), ("--accumulate-allreduce-grads-in-fp32", a.accumulate_allreduce_grads_in_fp32),
                              ("--use-distributed-optimizer", a.use_distributed_optimizer)) if on]
    if a.recompute_granularity:
        flags += ["--recompute-granularity", a.recompute_granularity, "--recompute-num-layers", str(a.recompute_num_layers)]
    args = sft.parse_args(flags)
    model = M.load_model(a.hf_checkpoint, M.ModelOptions.from_args(args))
    opt, sched = optim.build_optimizer(model, args, 10)
    seq = torch.randint(0, 1000, (a.max_tokens_per_gpu,), generator=torch.Generator().manual_seed(0))
    out = {}
    kept = saved_bytes(lambda: out.update(loss=-model([seq])[0].mean()), list(model.parameters()))
    out["loss"].backward()
    optim.optimizer_step(model, opt, sched, model.par, args)
    inner = getattr(opt, "inner", opt)
    states = sum(t.numel() * t.element_size() for st in inner.state.values() for t in st.values()
                 if torch.is_tensor(t) and t.numel() > 1)
    states += sum(m.numel() * m.element_size() for *_, m in getattr(opt, "pieces", []) if args.bf16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"weights": weights, "activations": kept, "optimizer": states}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf-checkpoint", required=True, help="folder with config.json (weights not needed)")
    p.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1)
    p.add_argument("--dp", type=int, default=1, help="data-parallel size: world / (TP x CP x PP)")
    p.add_argument("--expert-model-parallel-size", "--ep", dest="ep", type=int, default=1, help="EP (MoE)")
    p.add_argument("--context-parallel-size", "--cp", dest="cp", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1)
    p.add_argument("--sequence-parallel", action="store_true", help="TP > 1: the norms' activations split over TP")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--optimizer-cpu-offload", action="store_true")
    p.add_argument("--optimizer-offload-fraction", type=float, default=1.0)
    p.add_argument("--offload-train", action="store_true", help="the trainer's state in host memory during the rollout")
    p.add_argument("--sglang-tp-size", type=int, default=None, help="GPUs one server spans (default: the node's, up to 8)")
    p.add_argument("--sglang-released-gib", type=float, default=1.0, help="what a released SGLang keeps per GPU")
    p.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    p.add_argument("--recompute-num-layers", type=int, default=1)
    p.add_argument("--max-tokens-per-gpu", type=int, default=4096)
    p.add_argument("--attention", choices=["flash", "dense"], default=None,
                   help="flash: Transformer Engine's fused attention (bf16 on GPU); dense: stored T x T "
                        "scores (--transformer-impl local, and TE in fp32). Default: flash with --bf16")
    p.add_argument("--colocate", action="store_true", help="train_grpo's: SGLang shares the training GPUs")
    p.add_argument("--mem-fraction-static", type=float, default=None, help="colocated SGLang's share of a GPU "
                   "(default: the trainer's, 0.4, 0.7 with --offload-train; 0 without --colocate)")
    p.add_argument("--gpu-gib", type=float, default=80.0)
    p.add_argument("--measure", action="store_true",
                   help="also run one CPU step (a tiny checkpoint) and print measured bytes beside the estimate")
    a = p.parse_args(argv)
    if not a.colocate and a.mem_fraction_static is None:  # SGLang on GPUs of its own
        a.mem_fraction_static = 0.0
    elif a.mem_fraction_static is None:
        a.mem_fraction_static = OFFLOAD_MEM_FRACTION if a.offload_train else COLOCATE_MEM_FRACTION
    if not (Path(a.hf_checkpoint) / "config.json").exists():
        sys.exit(f"--hf-checkpoint {a.hf_checkpoint}: no config.json there")
    est = estimate(a.hf_checkpoint, a.tp, a.dp, a.ep, a.bf16, a.accumulate_allreduce_grads_in_fp32,
                   a.use_distributed_optimizer, a.max_tokens_per_gpu, a.recompute_granularity,
                   a.recompute_num_layers, a.attention or ("flash" if a.bf16 and not a.measure else "dense"),
                   a.mem_fraction_static, a.gpu_gib * GIB, a.cp, a.pp, a.sequence_parallel)
    total = sum(v for k, v in est.items() if k != "params_per_gpu")  # an upper bound: peaks overlap
    print(f"{Path(a.hf_checkpoint).name} tp={a.tp} cp={a.cp} pp={a.pp} dp={a.dp} ep={a.ep} bf16={a.bf16} "
          f"dist_opt={a.use_distributed_optimizer} recompute={a.recompute_granularity} "
          f"tokens={a.max_tokens_per_gpu}: {est['params_per_gpu'] / 1e9:.2f} B params per GPU")
    for k in ("weights", "grads", "optimizer", "activations", "recompute", "sglang"):
        print(f"  {k:12s} {est[k] / GIB:8.2f} GiB")
    print(f"  {'total':12s} {total / GIB:8.2f} GiB")
    peaks, host = phases(est, a, a.gpu_gib * GIB)
    print(f"per phase, colocated (--mem-fraction-static {a.mem_fraction_static}, offload_train={a.offload_train}, "
          f"optimizer_cpu_offload={a.optimizer_cpu_offload}), of {a.gpu_gib:.0f} GiB:")
    for k, v in peaks.items():
        print(f"  {k:12s} {v / GIB:8.2f} GiB  {'fits' if v <= a.gpu_gib * GIB else 'DOES NOT FIT'}")
    print(f"  {'host':12s} {host / GIB:8.2f} GiB per GPU, {host * min(8, a.tp * a.cp * a.pp * a.dp) / GIB:.0f} per node")
    if a.measure:  # a tiny checkpoint on CPU: the estimate against the tensors really held
        got = measure(a)
        for k, v in got.items():
            print(f"  measured {k:12s} {v / 2**20:9.1f} MiB, estimated {est[k] / 2**20:9.1f} MiB, "
                  f"ratio {v / est[k]:.2f}")
        return est, got
    print(json.dumps({"rollout_gib": round(peaks["rollout"] / GIB, 2), "train_gib": round(peaks["train"] / GIB, 2),
                      "sync_gib": round(peaks["sync"] / GIB, 2), "gpu_gib": a.gpu_gib, "host_gib": round(host / GIB, 2)}))
    return est


if __name__ == "__main__":
    main()
