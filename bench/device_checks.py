"""The device check (issue 59): what one lent CUDA GPU shows that the CPU suite cannot, each check against
something that is not itself. bench/device_check.sh installs the carried wheels and runs this (README,
"GPU set-up"); --dry-run runs the same code at tiny sizes on the CPU (tests/test_device_check.py).

    python bench/device_checks.py --out DIR [--dry-run] [--only parity,gdn]   # the driver: one JSON line a check
    python bench/device_checks.py --one NAME --work DIR [--dry-run]            # one check (the driver starts these)

The driver runs each check in a process of its own under its own time limit (tests/launch.py ends the whole
process tree at it: a hang costs that check alone; so does a SIGTERM to the driver), in the order of CHECKS (setup,
which says which SDPA kernels take the local attention, then grpo, the one full-size step, then the cheap ones:
what a slow one spends past the budget is the last checks'), within BUDGET_S in all, and writes {"check", "status":
PASS|FAIL|SKIP, "seconds", numbers...} to <out>/checks.jsonl, then a "budget" row naming the checks skipped or cut
short for time, and each check's output to <out>/device_check.log. A check's numbers come from <work>/<NAME>.json, which it writes when it ends, with its
verdict (VERDICTS: a function of those numbers alone, each seen to fail in tests/test_device_check.py).
"""
import argparse
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]
import device_flops  # noqa: E402 - MFU's numerator and denominator
import device_verdicts  # noqa: E402 - how each check is judged
import launch  # noqa: E402 - the tests' process starter (imports torch)

# seconds each check may take on the GPU (its process is ended past it): caps against a hang, not shares of the
# budget (they sum past it: the last checks get what is left; setup and grpo always get theirs). BUDGET_S: all of
# them; bench/device_check.sh's own limit is DRY_SCALE x BUDGET_S (dry) + MARGIN_S: the driver's imports (~15 s),
# the last check's end (launch.KILL_GRACE_S + 5 s) and the rows; with the wheels (WHEELS_S) under 8 minutes.
# A task's device time is DEVICE_S in all, a machine's start (START_S, "minutes") counted (the device README): the
# whole check and then a rerun of setup and grpo on the warm machine fit in it (tests/test_device_check.py).
# A dry run gets DRY_SCALE x both: the CPU suite's 2 shared cores run it beside other tests. Not in a dry run:
# FLA's first Triton compile and autotune on a fresh machine (parity's Qwen3.5 meets it first; gdn says its cost).
LIMITS = {"setup": 100, "grpo": 150, "preempt": 100, "ckpt": 75, "offload": 75, "parity": 120, "gdn": 90,
          "gdn_tf32": 60}
BUDGET_S = 390
MARGIN_S = 40
DRY_SCALE = 3
DEVICE_S = 900
START_S = 120
WHEELS_S = 20
GIB = 2 ** 30
ARCHS = ("qwen3_vl", "qwen2_5_vl", "qwen3_5", "qwen3_5_moe")  # Qwen2.5-VL: model.VISION on transformers 5.17
# Megatron (local spec) vs transformers. fp32: the CPU suite's bounds (tests/test_model.py, test_qwen3_5.py: logits
# and logprobs 1e-4, each tensor's gradient 1e-4 relative, Gated DeltaNet's decay parameters 1e-3, ill-conditioned).
# bf16: our parameters and activations in bf16 against transformers in fp32 on the same bf16-rounded weights, so only
# the arithmetic differs. A bf16 rounding is within u = 2^-8 relative; the 2-layer tiny models chain about 12
# roundings from input to logit (each layer's norm, projections, attention or delta rule, MLP; the head), which add
# in quadrature to sqrt(12) u / sqrt(3) = 8e-3 of a logit's scale, and the CPU suite measured 0.0067 at logit std
# 0.16 (tools/check.py's BF16_TOL, 0.02, a 3x margin, holds the logits). A gradient goes through those factors
# twice (forward and backward), so sqrt(2) x that, and a tensor's gradient norm is a sum over tokens whose random
# loss weights cancel it to ~1/3 of the terms' size: ~3 x 1.1e-2 = 3.4e-2 relative, bound 0.1 (3x); the decay
# parameters' 10x worse conditioning in fp32 (above) gives them 0.3. logprobs are computed in fp32 from bf16
# hidden states: within the logits' bound at temperature 0.7, 0.02 / 0.7, bound 0.05. MoE in bf16: a token whose
# top-2 experts differ between the two (a router-logit gap under the rounding) moves its whole expert output, which
# no per-rounding bound covers; the tiny MoE (4 experts, top 2) measured 0.032 on the logits and 0.28 on the router's
# gradient on CPU (2026-12-05): bf16_moe is twice that.
BOUNDS = {"fp32": dict(logits=1e-4, grad=1e-4, decay=1e-3, logprob=1e-4),
          "bf16": dict(logits=0.02, grad=0.1, decay=0.3, logprob=0.05),
          "bf16_moe": dict(logits=0.065, grad=0.6, decay=0.3, logprob=0.05)}
# Gated DeltaNet, FLA vs the torch delta rule in float64, as ||x - ref|| / ||ref|| of the output and each input's
# gradient. fp32 (TRITON_F32_DEFAULT=ieee): the CPU suite's 1e-4. bf16: FLA 0.6.0 keeps q, k, v (rounded alike for
# the reference), the WY factors w, u, the chunk states h, the corrected values v_new and o in bf16
# (fla/ops/gated_delta_rule/wy_fast.py, fla/ops/common/chunk_delta_h.py, chunk_o.py): 4 roundings in a row of u /
# sqrt(3) RMS each, 4.5e-3 in quadrature (a state's rounding decays with the gate, it does not pile up over
# chunks); bound 2e-2 (4x). Backward stores dh and dv in bf16 too and runs the chain twice: 4e-2; the gate's
# gradient is a sum of cancelling terms (as A_log's above): 0.1.
GDN_BOUNDS = {"fp32": dict(out=1e-4, grad=1e-4, dg=1e-3), "bf16": dict(out=2e-2, grad=4e-2, dg=0.1)}
BF16 = ["--bf16", "--accumulate-allreduce-grads-in-fp32", "--use-distributed-optimizer"]


def device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def setup(w, dry, real_config):
    """Tiny Qwen3-VL, Qwen3.5 and Qwen3.5-MoE checkpoints (tools/tiny.py), a synthetic set (tools/synth.py), and
    `real`: Qwen3-VL-2B's real config with random bf16 weights (dry run: its structure at toy widths, tiny.py
    --like; without the config, as in a fork's CI, the tiny Qwen3-VL, said), with the tiny processor (the real Qwen
    vocabulary). -> versions, what is missing, by name, and which SDPA kernels take the local attention (sdpa)."""
    import torch
    import transformers
    import megatron.core
    import qwen3_5
    from tools import synth, tiny
    for arch in ARCHS:
        tiny.make_tiny(w / arch, arch)
    synth.write_synth(w / "data", 16, n_test=4, seed=0, kinds=("sides",), size=64)
    found = (real_config / "config.json").exists()
    if not (found or dry):
        raise SystemExit(f"no Qwen3-VL-2B config in {real_config}: bash bench/device_bundle.sh carries it")
    if dry:
        arch, sizes = tiny.sizes_like(real_config / "config.json") if found else ("qwen3_vl", {})
        tiny.make_tiny(w / "real", arch, **sizes)
    else:
        from transformers import AutoConfig, AutoModelForImageTextToText
        cfg = AutoConfig.from_pretrained(real_config)
        with torch.device("cuda"):
            AutoModelForImageTextToText.from_config(cfg, dtype=torch.bfloat16).save_pretrained(w / "real")
        tiny.tiny_processor(cfg.model_type).save_pretrained(w / "real")
    missing = {k: str(e) for k, e in qwen3_5.MISSING.items()}
    for pkg in ("transformer_engine", "sglang"):
        try:
            __import__(pkg)
        except Exception as e:  # noqa: BLE001 - absent or broken: either way the check runs without it
            missing[pkg] = f"{type(e).__name__}: {e}"
    cuda = torch.cuda.is_available()
    try:  # first, so that a later check's time-out cannot lose it; an error here is its row's, not setup's end
        sdpa = sdpa_backends() if cuda else "not run: CPU"
    except Exception as e:  # noqa: BLE001
        sdpa = {"passed": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return dict(real=str(real_config) if found else "the tiny Qwen3-VL (no Qwen3-VL-2B config here)", sdpa=sdpa,
                python=sys.version.split()[0], torch=torch.__version__, cuda=torch.version.cuda,
                transformers=transformers.__version__, megatron_core=megatron.core.__version__,
                gpu=torch.cuda.get_device_name() if cuda else None, missing=missing,
                runs_instead={"transformer_engine": "--transformer-impl local", "sglang": "--rollout-engine local",
                              "causal-conv1d": "torch's conv1d on a padded batch (qwen3_5.GatedDeltaNet._conv)",
                              "flash-linear-attention": "the torch delta rule (qwen3_5.delta_rule)"})


def hf_torch_gdn():
    """transformers' Qwen3.5 runs FLA's delta rule when FLA imports (hub_kernels.use_kernel_func_from_hub_with_fallback
    picks it at import): its own torch functions instead, so our FLA path meets an implementation not its own."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    for mod in (modeling_qwen3_5, modeling_qwen3_5_moe):
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            setattr(mod, name, inspect.unwrap(getattr(mod, name)))


def sdpa_backends():
    """Which of torch's SDPA kernels take the local spec's attention (attention.PackedCoreAttention, bf16, Qwen3-VL-2B's
    16 heads on 8 KV groups of 128, two packed sequences), each alone (sdpa_kernel): a fused one must. CUDA only."""
    import types
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import attention
    core = attention.PackedCoreAttention(types.SimpleNamespace(context_parallel_size=1), 1, None, None)
    q, k, v = (torch.randn(640, h, 128, device="cuda", dtype=torch.bfloat16) for h in (16, 8, 8))
    cu = types.SimpleNamespace(cu_seqlens_q=torch.tensor([0, 128, 640]))
    took = {}
    for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([b]):
                core(q, k, v, None, packed_seq_params=cu)
            took[b.name.lower()] = True
        except RuntimeError as e:  # "No available kernel": torch's warnings above it say why
            took[b.name.lower()] = str(e)[:200]
    return dict(took, passed=any(took[n] is True for n in ("flash_attention", "cudnn_attention", "efficient_attention")))


def parity(w, dry, real_config):
    """Megatron (local spec) vs transformers on one device, each tiny family: logits of tools/check.py's packed
    batch and every tensor's gradient of tests/_model_tp_worker.grad_errors' loss, fp32 and bf16 (BOUNDS)."""
    import torch
    from transformers import AutoModelForImageTextToText
    import model as M
    import parallel
    from _model_tp_worker import grad_errors
    from tools import check
    hf_torch_gdn()
    par = parallel.init_distributed(1)
    out = {}
    for arch in ARCHS:
        seqs, pv, grid = check.check_inputs(w / arch)
        inputs = ([s.to(par.device) for s in seqs], pv.to(par.device), grid.to(par.device))
        for dtype in ("fp32", "bf16"):
            bound = BOUNDS[dtype + ("_moe" if arch.endswith("moe") and dtype == "bf16" else "")]
            model = M.load_model(w / arch, M.ModelOptions(transformer_impl="local", bf16=dtype == "bf16"), par)
            hf = AutoModelForImageTextToText.from_pretrained(w / arch, dtype=torch.float32)
            if dtype == "bf16":  # the weights ours hold, in fp32
                hf = hf.to(torch.bfloat16).float()
            hf = hf.to(par.device)
            with torch.no_grad():
                logits = max((a - b).abs().max().item() for a, b in zip(model.logits(*inputs), check.hf_logits(hf, *inputs)))
            rel, _, lp, _ = grad_errors(model, hf, *inputs)
            out[f"{arch}_{dtype}"] = device_verdicts.parity_row(logits, rel, lp, bound)
            del model, hf
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    return dict(out, bounds=BOUNDS)


def gdn(w, dry, real_config, dtypes=tuple(GDN_BOUNDS)):
    """Qwen3.5's Gated DeltaNet core, qwen3_5.GatedDeltaNet._delta_rule (FLA's varlen chunk kernel on CUDA) against
    the torch delta rule in float64 (qwen3_5.delta_rule, per sequence), forward and the gradient of q, k, v, the gate
    and beta, fp32 and bf16, on packed sequences of Qwen3.5's head size; the causal conv's path, said; the seconds
    of FLA's first call of each dtype (Triton's compile and autotune: cold on a fresh machine)."""
    import torch
    import torch.nn.functional as F
    import qwen3_5
    dev, fla = device(), qwen3_5.chunk_gated_delta_rule
    lens, H, D = ([40, 90], 2, 16) if dry else ([64, 1000, 3000], 16, 128)
    cu, T, g = torch.tensor([0, *lens]).cumsum(0), sum(lens), torch.Generator().manual_seed(0)
    q, k = (F.normalize(torch.randn(T, H, D, generator=g), dim=-1) for _ in range(2))
    q = q * D ** -0.5  # as GatedDeltaNet._split hands them over
    v = torch.randn(T, H, D, generator=g)
    gate = -F.softplus(torch.randn(T, H, generator=g) + torch.linspace(-5, 1, H))  # decay per token e^-0.007..e^-1.3
    beta = torch.rand(T, H, generator=g)
    wo = torch.randn(T, H, D, generator=g)

    def grads(fn, dtype):  # -> [o, dq, dk, dv, dgate, dbeta] in float64, inputs rounded to dtype where FLA keeps it
        x = [t.to(dev, dtype if i < 3 else torch.float32).detach().requires_grad_() for i, t in enumerate((q, k, v, gate, beta))]
        if dtype == torch.bfloat16:  # q, k come in fp32 (GatedDeltaNet._split), rounded where FLA rounds them
            x[:2] = [t.detach().float().requires_grad_() for t in x[:2]]
        o = fn(*x, cu.to(dev))
        (o.double() * wo.to(dev, torch.float64)).sum().backward()
        return [o.detach().double()] + [t.grad.double() for t in x]

    def reference(q, k, v, gate, beta, cu):  # the CPU path's delta rule, float64, one sequence at a time
        parts = [qwen3_5.delta_rule(*(t[a:b].transpose(0, 1)[None] for t in (q, k, v, gate, beta)))[0].transpose(0, 1)
                 for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
        return torch.cat(parts)

    def rel(a, b):
        return [((x - y).norm() / y.norm()).item() for x, y in zip(a, b)]
    names = ["out", "dq", "dk", "dv", "dg", "dbeta"]
    out, first = {}, {}
    for dtype in dtypes:
        bound, dt = GDN_BOUNDS[dtype], getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[dtype])
        ref = grads(lambda *a: reference(*(t.double() for t in a[:5]), a[5]), dt)  # the same rounded inputs
        for path in ("fla", "torch"):
            qwen3_5.chunk_gated_delta_rule = fla if path == "fla" else None
            if path == "fla" and (fla is None or dev.type != "cuda"):  # a fail on CUDA (VERDICTS), said on a dry run
                out[f"{path}_{dtype}"] = "not run: " + ("CPU" if dev.type != "cuda" else "FLA missing")
                continue
            if path == "torch" and dtype == "bf16":  # the torch path computes in fp32 whatever the input
                continue
            t = time.perf_counter()
            errs = dict(zip(names, rel(grads(lambda *a: qwen3_5.GatedDeltaNet._delta_rule(None, *a), dt), ref)))
            if path == "fla":  # its first call of this dtype: Triton's compile and autotune, then ms of work
                first[dtype] = time.perf_counter() - t
            out[f"{path}_{dtype}"] = device_verdicts.gdn_row(errs, bound)
    qwen3_5.chunk_gated_delta_rule = fla
    conv = "causal-conv1d" if qwen3_5.causal_conv1d_fn is not None and dev.type == "cuda" else \
        "torch conv1d on a padded batch (GatedDeltaNet._conv's fallback)"
    return dict(out, lens=lens, heads=H, head_dim=D, bounds=GDN_BOUNDS, conv_path=conv, fla_first_call_s=first,
                triton_f32_default=os.environ.get("TRITON_F32_DEFAULT"))


def gdn_tf32(w, dry, real_config):
    """gdn's bf16 half as training runs it: without TRITON_F32_DEFAULT=ieee (device_check.sh's, for fp32's 1e-4), so
    FLA's fp32 dots run in TF32 on NVIDIA (Triton reads the variable at each compile, knobs.py:496): the bf16
    bounds as training meets them. This check's process is its own: nothing compiled yet."""
    os.environ.pop("TRITON_F32_DEFAULT", None)
    return gdn(w, dry, real_config, ("bf16",))


def grpo(w, dry, real_config):
    """Two GRPO steps of `real` (Qwen3-VL-2B's config, random weights), bf16 with fp32 master weights and gradients
    and the distributed optimizer, the local engine generating on the same GPU; the second step's numbers: rollout
    and training tokens/s, MFU against the GPU's dense bf16 peak (device_flops.PEAK_BF16, by name; and against a measured matrix
    product), the training phase's peak memory against bench/memory.py's estimate for the same flags. Its last
    checkpoint is not written (the 2B's optimizer state is ~25 GB of disk): ckpt and preempt write theirs."""
    import torch
    import memory
    import train_grpo as G
    import trainer as T
    cuda = torch.cuda.is_available()
    B, n, resp, mt = (2, 2, 8, 1024) if dry else (8, 8, 128, 4096)
    counts = memory.count_params(w / "real")[1]
    train = G.Policy.train

    def measured(self, batch):  # the training phase's peak and model FLOPs, into the step's metrics
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        stats = train(self, batch)
        items = [it for part in batch.items if part for it in part]
        stats["train_flops"] = device_flops.train_flops(counts, self.model.hf_config, items)
        if cuda:
            stats["train_peak_alloc_gib"] = torch.cuda.max_memory_allocated() / GIB
        return stats
    G.Policy.train = measured
    T.Run.save_checkpoint = lambda self, *a, **k: T.atomic_write(self.save / "latest", "not_written")
    G.main(["--hf-checkpoint", str(w / "real"), "--prompt-data", str(w / "data"), "--save", str(w / "grpo"),
            "--rollout-engine", "local", "--transformer-impl", "local", "--num-rollout", "2", "--rollout-batch-size",
            str(B), "--n-samples-per-prompt", str(n), "--global-batch-size", str(B * n), "--rollout-max-response-len",
            str(resp), "--max-tokens-per-gpu", str(mt), "--lr", "1e-6", "--entropy-coef", "0.01", *BF16])
    rows = [json.loads(x) for x in (w / "grpo" / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    out = dict(steps=len(rows), samples=last["samples"], response_len=last["response_len"], tokens=last["tokens"],
               rollout_s=last["rollout_s"], train_s=last["train_s"], grad_norm=last["grad_norm"],
               logprob_diff_mean=last["logprob_diff_mean"], failed_frac=max(r["failed_frac"] for r in rows),
               rollout_tokens_per_s=last["samples"] * last["response_len"] / last["rollout_s"],
               train_tokens_per_s=last["tokens_per_s"], train_tflops_per_s=last["train_flops"] / last["train_s"] / 1e12)
    est = memory.estimate(w / "real", bf16=True, fp32_grads=True, distributed=True, tokens=mt,
                          attention="flash" if cuda else "dense")  # SDPA's flash kernel on CUDA in bf16
    out["estimate_train_gib"] = sum(est[k] for k in ("weights", "grads", "optimizer", "activations", "recompute")) / GIB
    if cuda:
        name = torch.cuda.get_device_name()
        peak = next((p for k, p in device_flops.PEAK_BF16 if k in name), None)
        engine = 4 * sum(counts.values()) / GIB  # the local engine's fp32 copy, on the GPU throughout
        out.update(gpu=name, peak_bf16_tflops=peak and peak / 1e12, mfu=peak and last["train_flops"] / last["train_s"] / peak,
                   matmul_tflops=device_flops.matmul_flops_per_s() / 1e12, train_peak_alloc_gib=last["train_peak_alloc_gib"],
                   engine_gib=engine, trainer_peak_gib=last["train_peak_alloc_gib"] - engine)
        out["mfu_of_matmul"] = out["train_tflops_per_s"] / out["matmul_tflops"]
        out["trainer_peak_over_estimate"] = out["trainer_peak_gib"] / out["estimate_train_gib"]
    return out


def offload(w, dry, real_config):
    """--offload-train on `real` in bf16 with the distributed optimizer (bench/offload_check.py): parameters,
    gradients and optimizer state to pinned host memory and back bit for bit, and the CUDA cache returned."""
    import offload_check
    return offload_check.measure([str(w / "real"), "--transformer-impl", "local", *BF16])


def ckpt(w, dry, real_config):
    """A checkpoint written on the GPU (convert.save_hf, the trainer's writer, from `real` loaded in fp32: the file
    keeps the source's bf16) loads in transformers on the GPU with our logits: every parameter halved first (exact)
    so the file differs from its source; the files equal our export bit for bit; logits within 1e-4 of the
    larger of 1 and the largest logit (the CPU suite's bound, at a deep model's scale)."""
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText
    import convert
    import model as M
    import parallel
    from tools import check
    par = parallel.init_distributed(1)
    model = M.load_model(w / "real", M.ModelOptions(transformer_impl="local"), par)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    convert.save_hf(model, w / "saved", src_dir=w / "real")
    files = convert.weight_files(w / "saved")
    exact = all(torch.equal(t.cpu(), safe_open(files[n], "pt").get_tensor(n)) for n, t in convert.hf_tensors(model))
    seqs, pv, grid = check.check_inputs(w / "saved")
    inputs = ([s.to(par.device) for s in seqs], pv.to(par.device), grid.to(par.device))
    hf = AutoModelForImageTextToText.from_pretrained(w / "saved", dtype=torch.float32).to(par.device)
    with torch.no_grad():
        ours, theirs = model.logits(*inputs), check.hf_logits(hf, *inputs)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
    scale = max(1.0, max(b.abs().max().item() for b in theirs))
    return dict(shards=len(set(files.values())), tensors=len(files), exact=exact, max_abs_logit_diff=diff,
                logit_scale=scale)


def preempt(w, dry, real_config):
    """--exit-signal-handler under torchrun (tests/test_console.py's case, one GPU): SFT of the tiny Qwen3-VL,
    SIGTERM to torchrun once a step is logged (it forwards it to its worker); the step ends, its checkpoint is
    written; resumed with --load and --exit-duration-in-mins 1e-6 it runs one step more: every step once, in order."""
    save = w / "preempt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", str(ROOT / "sft.py"),
           "--hf-checkpoint", str(w / "qwen3_vl"), "--prompt-data", str(w / "data"), "--save", str(save),
           "--global-batch-size", "4", "--num-epoch", "50", "--save-interval", "0", "--exit-signal-handler",
           "--transformer-impl", "local"]

    def steps():
        return [json.loads(x)["step"] for x in (save / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (save / "metrics.jsonl").exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # torchrun's agent: it sends its worker SIGTERM and waits for it
        first, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    print(first)
    done = steps()
    k = done[-1] if done else 0
    said = f"[run] SIGTERM: stopped after step {k} of 200, saved {save / f'iter_{k:07d}'}; resume: " in first
    latest = (save / "latest").read_text() if (save / "latest").exists() else None
    r = launch.run(cmd + ["--load", str(save), "--exit-duration-in-mins", "1e-6"], timeout=240)
    print(r.stdout, r.stderr[-3000:])
    again = steps()
    return dict(stopped_after=k, said=said, latest=latest, torchrun_exit=p.returncode, resume_exit=r.returncode,
                steps_after_resume=len(again), steps=done, resumed_steps=again)


CHECKS = {"setup": setup, "grpo": grpo, "preempt": preempt, "ckpt": ckpt, "offload": offload, "parity": parity,
          "gdn": gdn, "gdn_tf32": gdn_tf32}


def one(name, work, dry, real_config):
    """Run check `name` in this process -> <work>/<name>.json, its verdict in "passed"."""
    res = dict(CHECKS[name](Path(work), dry, Path(real_config)), dry=dry)
    res["passed"] = bool(device_verdicts.VERDICTS[name](res))
    (Path(work) / f"{name}.json").write_text(json.dumps(res, default=str))


def start(args, limit, env):
    """This file with `args` in a process of its own, ended with its whole tree past `limit` s (AssertionError) ->
    CompletedProcess. On CUDA a fresh interpreter: importing FLA queries the GPU (fla/utils/hardware.py), and a
    process forked after that cannot use CUDA. Without CUDA a fork of tests/launch.py's forkserver, which imported
    torch, transformers, megatron-core and the project once (each fresh interpreter spends ~6 s of CPU on them)."""
    import torch
    if torch.cuda.is_available():
        return launch.run([sys.executable, __file__, *args], timeout=limit, env=env)
    return launch.start(__file__, *args, env=env).wait(limit)


def stop_with_me():
    """SIGTERM (device_check.sh's outer limit) ends this process through its finally blocks: launch's end the check
    in flight with its whole process tree, which would otherwise hold the GPU into a rerun."""
    def handler(signum, frame):
        raise SystemExit(f"device_checks: signal {signum}: the check in flight and its processes stopped")
    signal.signal(signal.SIGTERM, handler)


def drive(out, work, dry, only, real_config):
    """Each check in a process of its own, in order, within its limit and what is left of BUDGET_S; then the
    "budget" row: the checks skipped for time, and those cut short by it (ended before their own cap) -> exit code."""
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    scale = DRY_SCALE if dry else 1
    begin, failed = time.time(), 0
    short = {"skipped_for_time": [], "cut_for_time": []}
    stop_with_me()
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    with open(out / "checks.jsonl", "a") as results, open(out / "device_check.log", "a") as log:
        def say(row):
            line = json.dumps(row, default=str)
            print(line, flush=True)
            results.write(line + "\n")
            results.flush()
        for name in [c for c in CHECKS if not only or c in only]:
            t, cap = time.time(), scale * LIMITS[name]
            limit = min(cap, begin + scale * BUDGET_S - t)
            row = {"check": name, "status": "SKIP", "seconds": 0}
            if limit < 15:
                row["why"] = f"the {scale * BUDGET_S} s budget is spent"
                short["skipped_for_time"].append(name)
            elif name != "setup" and not (work / "setup.json").exists():
                row["why"] = "setup did not finish"
            else:
                args = ["--one", name, "--work", work, "--real-config", real_config] + (["--dry-run"] if dry else [])
                try:
                    r = start(args, limit, env)
                    text, code = f"{r.stdout}\n{r.stderr}", r.returncode
                except AssertionError as e:  # past its limit: launch.run ended its process tree
                    text, code = str(e), f"timed out after {limit:.0f} s"
                    if limit < cap:
                        row["why"] = f"cut short at the budget's end: {limit:.0f} s of its {cap} s"
                        short["cut_for_time"].append(name)
                got = json.loads((work / f"{name}.json").read_text()) if code == 0 else {}
                row = dict(row, status="PASS" if got.pop("passed", False) else "FAIL", seconds=round(time.time() - t, 1), **got)
                if code != 0:
                    row["error"] = f"exit {code}: " + " | ".join(x for x in text.strip().splitlines()[-4:])[-600:]
                log.write(f"===== {name} ({row['status']}, {row['seconds']} s)\n{text[-200_000:]}\n")
                log.flush()
            failed += row["status"] != "PASS"
            say(row)
        say(dict(check="budget", budget_s=scale * BUDGET_S, spent_s=round(time.time() - begin, 1), **short))
    return 1 if failed else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="the driver: checks.jsonl and device_check.log here")
    p.add_argument("--work", type=Path, default=None, help="checkpoints and runs (default: <out>/work)")
    p.add_argument("--one", choices=list(CHECKS), default=None, help="run this check here (the driver's child)")
    p.add_argument("--only", default="", help="comma-separated checks (setup always runs first)")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes, CPU where there is no GPU")
    p.add_argument("--real-config", type=Path, default=ROOT / "bench" / "device_wheels" / "Qwen3-VL-2B-Instruct",
                   help="Qwen3-VL-2B's config folder (device_bundle.sh copies it; else ../shared/real_models)")
    a = p.parse_args()
    if not (a.real_config / "config.json").exists():
        a.real_config = ROOT.parent / "shared" / "real_models" / "Qwen3-VL-2B-Instruct"
    if a.one:
        return one(a.one, a.work, a.dry_run, a.real_config)
    if a.out is None:
        p.error("--out DIR (or --one NAME)")
    only = set(filter(None, a.only.split(","))) | {"setup"} if a.only else set()
    return drive(a.out, a.work or a.out / "work", a.dry_run, only, a.real_config)


if __name__ == "__main__":
    sys.exit(main())
