"""Qwen3.5 (dense and MoE) on Megatron vs transformers: tiny random checkpoints, CPU, fp32, gloo.

TP=1 runs in this process (the TP=1 logits check is test_model.py's, parametrised over these
architectures too); TP=2 (+SP), EP=2 and TP2 x EP2 run `tools/check.py` / the gradient
worker under torchrun. Gated DeltaNet's packing is checked against per-sequence runs and a plain
token-by-token recurrence.
"""
import collections
import importlib.util
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import convert
import launch
import model as M
from tools import check
import parallel
import qwen3_5
from _model_tp_worker import grad_errors
from conftest import ROOT
from test_model import source_tensors, torchrun2

ARCHS = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    from transformers import AutoModelForImageTextToText
    parallel.init_distributed(1)
    made = {}

    def get(arch):
        if arch not in made:
            d = tiny_ckpt(arch)
            hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
            made[arch] = d, M.load_model(d), hf, check.check_inputs(d)
        return made[arch]
    return get


def torchrun_n(n, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = launch.python(*args, nproc=n, timeout=600, env=env)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r.stdout.strip().splitlines()


def test_tiny_checkpoints_have_the_released_structure(tiny_ckpt):
    cfg = json.loads((tiny_ckpt("qwen3_5_moe") / "config.json").read_text())
    tc = cfg["text_config"]
    assert {"linear_attention", "full_attention"} == set(tc["layer_types"]) and tc["num_experts_per_tok"] == 2
    names = source_tensors(tiny_ckpt("qwen3_5_moe"))
    assert names["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 64, 64)  # (E, 2I, H)
    assert names["model.language_model.layers.0.mlp.experts.down_proj"].shape == (4, 64, 32)  # (E, H, I)
    assert not any(".experts.0." in n for n in names)


@pytest.mark.parametrize("arch", ARCHS)
def test_grads_match_transformers(setup, arch):
    """Every tensor's gradient within 1e-4 (relative) of transformers', but the decay parameters'
    (A_log, dt_bias) within 1e-3: their gradient is a sum of cancelling terms, ill-conditioned in
    fp32 (measured on the tiny dense model: ours vs transformers fp32 3.7e-4, while transformers
    fp32 vs transformers fp64 is 4.2e-3 and ours vs fp64 the same 4.2e-3)."""
    d, model, hf, inputs = setup(arch)
    rel, ref, lp_diff, _ = grad_errors(model, hf, *inputs)
    assert rel.keys() == ref.keys() and any("linear_attn.A_log" in n for n in rel)
    worst = max(rel, key=rel.get)
    print(f"{arch} TP=1 max grad rel err {rel[worst]:.3g} ({worst}), logprob/entropy diff {lp_diff:.3g}")
    assert all(e <= (1e-3 if n.endswith(("A_log", "dt_bias")) else 1e-4) for n, e in rel.items()), rel
    assert lp_diff <= 1e-4


def per_expert(fused):
    """The per-expert names transformers' save_pretrained writes, from the fused tensors."""
    out = {}
    for k, v in fused.items():
        if k.endswith("experts.gate_up_proj"):
            for e, x in enumerate(v):
                gate, up = x.chunk(2)
                out[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate
                out[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up
        elif k.endswith("experts.down_proj"):
            for e, x in enumerate(v):
                out[k.replace("down_proj", f"{e}.down_proj.weight")] = x
        else:
            out[k] = v
    return out


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
def test_export_is_bit_exact_in_both_expert_layouts_with_mtp(setup, layout, tmp_path):
    """Export writes the source's expert layout and passes `mtp.*` (the MTP head `tools/tiny.py --mtp`
    writes, one in bf16) through untouched; transformers loads the checkpoint all the same."""
    import shutil
    from tools import tiny
    from transformers import AutoModelForImageTextToText
    d, _, _, _ = setup("qwen3_5_moe")
    shutil.copytree(d, tmp_path, dirs_exist_ok=True)
    tiny.add_mtp(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    sd = per_expert(sd) if layout == "per_expert" else sd
    assert {"mtp.fc.weight", "mtp.layers.0.self_attn.q_proj.weight", "mtp.norm.weight"} <= set(sd)
    sd["mtp.fc.weight"] = sd["mtp.fc.weight"].bfloat16()
    save_file(sd, str(tmp_path / "model.safetensors"))
    AutoModelForImageTextToText.from_pretrained(tmp_path)
    model = M.load_model(tmp_path)
    got = dict(x for b in convert.export_hf(model, bucket_bytes=1 << 20) for x in b)
    assert sorted(got) == sorted(sd)
    for n, t in got.items():
        assert t.dtype == sd[n].dtype and torch.equal(t, sd[n]), n


def test_packed_gated_deltanet_equals_per_sequence(setup):
    """One packed row of lengths [37, 70, 5] (70 crosses a chunk) gives each sequence's own output,
    and changing one sequence leaves its neighbours' outputs exactly as they were."""
    from megatron.core.packed_seq_params import PackedSeqParams
    _, model, _, _ = setup("qwen3_5")
    gdn = next(m for m in model.modules() if isinstance(m, qwen3_5.GatedDeltaNet))
    lens = [37, 70, 5]
    x = torch.randn(sum(lens), 1, 64, generator=torch.Generator().manual_seed(0))

    def run(x, lens):
        cu = torch.tensor([0] + lens).cumsum(0).int()
        with torch.no_grad(), parallel.megatron_on_cpu():
            return gdn(x, packed_seq_params=PackedSeqParams(cu_seqlens_q=cu))[0]
    packed = run(x, lens)
    alone = torch.cat([run(s, [len(s)]) for s in x.split(lens)])
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-6)
    y = x.clone()
    y[37:107] = torch.randn(70, 1, 64)  # a different middle sequence
    other = run(y, lens)
    assert torch.equal(other[:37], packed[:37]) and torch.equal(other[107:], packed[107:])
    assert not torch.allclose(other[37:107], packed[37:107])


def test_gated_deltanet_keeps_bf16_for_the_delta_rule(monkeypatch):
    """In a bf16 model the delta rule gets v in bf16, the dtype FLA's chunk_gated_delta_rule then takes q
    and k in (v in fp32 made FLA run all three in fp32: twice the memory and bandwidth on that path);
    the torch delta rule (CPU) computes in fp32 all the same."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer import TransformerConfig
    parallel.init_distributed(1)
    dims = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.bfloat16)
    with parallel.megatron_on_cpu():
        gdn = qwen3_5.GatedDeltaNet(cfg, dims=dims).bfloat16()
    seen, rule = [], gdn._delta_rule

    def recorded(q, k, v, *rest):
        seen.append(v.dtype)
        return rule(q, k, v, *rest)
    monkeypatch.setattr(gdn, "_delta_rule", recorded)
    x = torch.randn(20, 1, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.no_grad(), parallel.megatron_on_cpu():
        out = gdn(x, packed_seq_params=PackedSeqParams(cu_seqlens_q=torch.tensor([0, 7, 20], dtype=torch.int32)))[0]
    assert seen == [torch.bfloat16] and out.dtype == torch.bfloat16


def test_chunked_delta_rule_equals_the_recurrence():
    g = torch.Generator().manual_seed(0)
    B, H, L, dk, dv = 2, 3, 150, 8, 5
    q, k = torch.randn(B, H, L, dk, generator=g), torch.nn.functional.normalize(torch.randn(B, H, L, dk, generator=g), dim=-1)
    v, beta = torch.randn(B, H, L, dv, generator=g), torch.rand(B, H, L, generator=g)
    decay = -torch.rand(B, H, L, generator=g)
    s, ref = torch.zeros(B, H, dk, dv), []
    for t in range(L):  # S <- exp(g) S; d = beta (v - S^T k); S <- S + k d^T; o = S^T q
        s = s * decay[:, :, t, None, None].exp()
        d = beta[:, :, t, None] * (v[:, :, t] - (s * k[:, :, t, :, None]).sum(-2))
        s = s + k[:, :, t, :, None] * d[:, :, None]
        ref.append((s * q[:, :, t, :, None]).sum(-2))
    torch.testing.assert_close(qwen3_5.delta_rule(q, k, v, decay, beta), torch.stack(ref, 2), rtol=0, atol=1e-4)


def gdn_collectives():
    """The worker of test_gated_deltanet_communicates_once (torchrun, 2 processes, TP2): one GatedDeltaNet
    forward and backward with and without SP; rank 0 prints the collectives each direction called."""
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.tensor_parallel import layers, mappings
    from megatron.core.transformer import TransformerConfig
    rank = parallel.init_distributed(2).rank
    calls = collections.Counter()

    def counted(kind, fn):
        def call(*a, **k):
            calls[kind] += 1
            return fn(*a, **k)
        return call
    for mod in (layers, mappings):  # both bind torch's functions at import (layers.py:79-86, mappings.py:10-18)
        mod.dist_all_gather_func = counted("all_gather", mod.dist_all_gather_func)
        mod.dist_reduce_scatter_func = counted("reduce_scatter", mod.dist_reduce_scatter_func)
    torch.distributed.all_reduce = counted("all_reduce", torch.distributed.all_reduce)
    dims = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                linear_conv_kernel_dim=4)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)  # two packed sequences, 20 tokens
    for sp in (True, False):
        cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, tensor_model_parallel_size=2,
                                sequence_parallel=sp, use_cpu_initialization=True)
        with parallel.megatron_on_cpu():
            gdn = qwen3_5.GatedDeltaNet(cfg, dims=dims)
            x = torch.randn(10 if sp else 20, 1, 64, requires_grad=True)  # (T / TP under SP, 1, H)
            calls.clear()
            out, _ = gdn(x, packed_seq_params=PackedSeqParams(cu_seqlens_q=cu))
            forward = dict(calls)
            calls.clear()
            out.sum().backward()
        if rank == 0:
            print("collectives", json.dumps({"sp": sp, "forward": forward, "backward": dict(calls)}))


@pytest.mark.cores
def test_gated_deltanet_communicates_once():
    """TP2 + SP: one all-gather of the input for the four input projections (backward: its one
    reduce-scatter), plus out_proj's reduce-scatter (backward: its all-gather); each projection gathering
    on its own made it 4 all-gathers forward, 5 all-gathers and 4 reduce-scatters backward. TP2 without SP:
    one all-reduce of the input gradient (was 4) and out_proj's forward all-reduce."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))  # run as a script
    r = launch.python(__file__, "gdn-collectives", nproc=2, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    got = {d["sp"]: d for d in (json.loads(x.split(" ", 1)[1]) for x in r.stdout.splitlines()
                                if x.startswith("collectives "))}
    print(got)
    assert got[True]["forward"] == {"all_gather": 1, "reduce_scatter": 1}, got
    assert got[True]["backward"] == {"all_gather": 1, "reduce_scatter": 1}, got
    assert got[False]["forward"] == {"all_reduce": 1} and got[False]["backward"] == {"all_reduce": 1}, got


@pytest.mark.parametrize("arch,flags", [pytest.param("qwen3_5", ["--sequence-parallel"], marks=pytest.mark.slow),
                                        ("qwen3_5_moe", ["--sequence-parallel"]),
                                        ("qwen3_5_moe", ["--tensor-model-parallel-size", "1",
                                                         "--expert-model-parallel-size", "2"])])
@pytest.mark.cores
def test_two_process_check_command(tiny_ckpt, arch, flags):
    """TP2 + SP (dense, MoE) and EP2: logits within 1e-4 of transformers and the export round trip.
    The packed batch has 107 tokens: SP pads it to 108 and drops the pad again."""
    lines = torchrun2("tools/check.py", "--hf-checkpoint", tiny_ckpt(arch), *flags)
    assert "export_exact=True" in lines[-2]
    assert lines[-1].startswith("max_abs_logit_diff=") and float(lines[-1].split("=")[1]) <= 1e-4


@pytest.mark.slow
def test_moe_tp2_without_sp_is_refused(tiny_ckpt):
    with pytest.raises(AssertionError, match="needs --sequence-parallel"):
        torchrun2("tools/check.py", "--hf-checkpoint", tiny_ckpt("qwen3_5_moe"))


def grads_in_processes(n, *args):
    """tests/_model_tp_worker.py under torchrun: its JSON rows, one dict a checkpoint."""
    with tempfile.TemporaryDirectory() as tmp:
        torchrun_n(n, "tests/_model_tp_worker.py", "--out", Path(tmp) / "grads.json", *args)
        return json.loads((Path(tmp) / "grads.json").read_text())


def assert_grads_match(f):
    assert f["params"] == f["hf_params"] and f["replicas_agree"], f
    assert f["max_rel_err"] <= 1e-4 and f["decay_rel_err"] <= 1e-3 and f["logprob_diff"] <= 1e-4, f
    # the trainer's norm = the norm of the gathered gradient, to fp32 row norms summed in fp64 (optim.grad_norm_and_clip):
    assert f["grad_norm_rel_err"] <= 1e-6, f  # 4e-9 measured at EP2; experts reduced over DP instead: 2x


@pytest.mark.cores
def test_ep2_grads_match_transformers(tiny_ckpt):
    """EP2 (each rank holds 2 of the 4 experts, DP 2): after the trainer's reduction (dense over DP,
    experts over expert-DP), / DP, every gradient equals transformers' single-process one, and the
    grad norm sums the experts over the EP group. Reducing the experts over DP instead doubles them."""
    (f,) = grads_in_processes(2, "--tp", "1", "--ep", "2", tiny_ckpt("qwen3_5_moe"))
    assert_grads_match(f)


@pytest.mark.slow
def test_tp2_sp_grads_match_transformers(tiny_ckpt):
    for f in grads_in_processes(2, "--sp", tiny_ckpt("qwen3_5"), tiny_ckpt("qwen3_5_moe")):
        assert_grads_match(f)


@pytest.mark.slow
def test_tp2_ep2_four_processes(tiny_ckpt):
    """TP2 x EP2 with SP on 4 processes: logits, export and gradients."""
    d = tiny_ckpt("qwen3_5_moe")
    lines = torchrun_n(4, "tools/check.py", "--hf-checkpoint", d, "--tensor-model-parallel-size", "2",
                       "--expert-model-parallel-size", "2", "--sequence-parallel")
    assert "export_exact=True" in lines[-2] and float(lines[-1].split("=")[1]) <= 1e-4
    (f,) = grads_in_processes(4, "--tp", "2", "--ep", "2", "--sp", d)
    assert_grads_match(f)


def run_entry(script, *args, nproc=1):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = launch.python(ROOT / script, *args, nproc=nproc, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return [json.loads(x) for x in (Path(args[args.index("--save") + 1]) / "metrics.jsonl").read_text().splitlines()]


def test_sft_and_grpo_run_end_to_end_with_tiny_moe(tiny_ckpt, tmp_path):
    """SFT then GRPO (--rollout-engine local) on the tiny Qwen3.5-MoE as transformers' save_pretrained
    writes it (experts per expert; SFT's checkpoint keeps them so, the local engine takes them at every
    weight update): the expert load is logged every step, and the trainer's logprobs equal the rollout
    engine's (transformers') ones."""
    from tools import synth
    synth.write_synth(tmp_path / "d", 8, n_test=2, seed=0)
    d = tiny_ckpt("qwen3_5_moe", per_expert=True)
    sft = run_entry("sft.py", "--hf-checkpoint", d, "--prompt-data", tmp_path / "d", "--save", tmp_path / "sft",
                    "--global-batch-size", "4", "--num-epoch", "1", "--lr", "1e-3")
    grpo = run_entry("train_grpo.py", "--hf-checkpoint", tmp_path / "sft" / "iter_0000002", "--prompt-data",
                     tmp_path / "d", "--save", tmp_path / "grpo", "--rollout-engine", "local", "--rollout-batch-size",
                     "2", "--n-samples-per-prompt", "2", "--num-rollout", "2", "--rollout-max-response-len", "16",
                     "--global-batch-size", "4")
    saved = source_tensors(tmp_path / "sft" / "iter_0000002")
    assert "model.language_model.layers.1.mlp.experts.3.down_proj.weight" in saved
    steps = [m for m in sft if "loss" in m] + [m for m in grpo if "reward" in m]
    assert len(steps) == 4
    for m in steps:
        assert len(m["expert_load"]) == 4 and abs(sum(m["expert_load"]) - 1) < 1e-3 and m["expert_load_max"] >= 1
    assert all(m["logprob_diff_mean"] <= 1e-5 for m in grpo if "reward" in m)


@pytest.mark.slow
def test_ep2_sft_equals_one_process(tiny_ckpt, tmp_path):
    """EP2 (2 processes, 5 samples a step: 3 and 2 per rank, 100-token micro-batches, so one rank
    runs idle micro-batches) takes the same steps as one process: loss, grad norm, final weights;
    each EP rank saves its experts' optimizer state."""
    from tools import synth
    from test_grpo import assert_same_weights
    synth.write_synth(tmp_path / "d", 8, n_test=2, seed=0)
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_5_moe"), "--prompt-data", tmp_path / "d", "--global-batch-size",
              "5", "--num-epoch", "1", "--lr", "1e-3", "--max-tokens-per-gpu", "100"]
    one = run_entry("sft.py", *common, "--save", tmp_path / "one")
    ep2 = run_entry("sft.py", *common, "--save", tmp_path / "ep2", "--expert-model-parallel-size", "2", nproc=2)
    for a, b in zip([m for m in one if "loss" in m], [m for m in ep2 if "loss" in m], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]
    final = "iter_0000002"
    assert_same_weights(load_file(tmp_path / "ep2" / final / "model.safetensors"),
                        load_file(tmp_path / "one" / final / "model.safetensors"), "ep2")
    assert sorted(p.name for p in (tmp_path / "ep2" / final / "train_state").glob("*.pt")) == ["tp_00_ep_00.pt",
                                                                                              "tp_00_ep_01.pt"]


@pytest.mark.slow
def test_ep2_resume_equals_one_process_resume(tiny_ckpt, tmp_path):
    """One epoch, then --load for a second: at EP2 each EP rank reloads its experts' optimizer state
    (tp_00_ep_0R.pt), so the resumed steps equal one process resumed the same way (the schedule
    differs from an uninterrupted run, the comparison does not)."""
    from tools import synth
    synth.write_synth(tmp_path / "d", 8, n_test=2, seed=0)
    common = ["--hf-checkpoint", tiny_ckpt("qwen3_5_moe"), "--prompt-data", tmp_path / "d", "--global-batch-size",
              "6", "--lr", "1e-3", "--max-tokens-per-gpu", "120"]
    runs = {}
    for name, extra, n in (("one", [], 1), ("ep2", ["--expert-model-parallel-size", "2"], 2)):
        run_entry("sft.py", *common, *extra, "--num-epoch", "1", "--save", tmp_path / name, nproc=n)
        runs[name] = [m for m in run_entry("sft.py", *common, *extra, "--num-epoch", "2", "--save", tmp_path / name,
                                           "--load", tmp_path / name, nproc=n) if "loss" in m]
    assert [m["step"] for m in runs["ep2"]] == [1, 2, 3, 4]
    for a, b in zip(runs["one"], runs["ep2"], strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-5 * a["grad_norm"]


@pytest.mark.slow
def test_moe_sft_reads_the_picture_and_the_shuffled_control_does_not(tiny_ckpt, tmp_path):
    """test_learning's SFT check on the tiny Qwen3.5-MoE: two epochs on the synthetic "how many
    sides?" set. Measured (load ~13, 2 cores, 7.5 min a run): greedy accuracy 1.0, the shuffled-image
    control 0.30 (chance 0.25); final losses 0.0004 and 0.19."""
    from tools import synth
    from test_learning import SFT, accuracy, finish, launch, shuffled_twin
    real = synth.write_synth(tmp_path / "data", 1024, n_test=64, seed=0, kinds=("sides",))
    shuffled = shuffled_twin(real, tmp_path / "shuffled")
    base = tiny_ckpt("qwen3_5_moe")
    finish(launch("sft.py", tmp_path / "sft", "--hf-checkpoint", base, "--prompt-data", real, *SFT),
           launch("sft.py", tmp_path / "sft_shuffled", "--hf-checkpoint", base, "--prompt-data", shuffled, *SFT))
    got = accuracy(tmp_path / "sft" / "iter_0000128", real, tmp_path / "eval")
    ctrl = accuracy(tmp_path / "sft_shuffled" / "iter_0000128", real, tmp_path / "eval_shuffled")
    assert got >= 0.9 and ctrl <= 0.4, (got, ctrl)


@pytest.mark.slow
def test_moe_grpo_reward_rises_from_a_picture_blind_start(tiny_ckpt, tmp_path):
    """test_learning's fast GRPO check on the tiny Qwen3.5-MoE (SFT on shuffled images for the
    format, then 60 GRPO steps, --rollout-engine local). Measured, reward per 10 steps (about 7 min
    under load ~13): real 0.30 0.24 0.23 0.36 0.49 0.55, shuffled control 0.28 0.26 0.19 0.25 0.26 0.24."""
    from test_learning import fast_grpo_check
    real, _ = fast_grpo_check(tiny_ckpt("qwen3_5_moe"), tmp_path, sft_timeout=1800, grpo_timeout=3600)
    assert all("expert_load" in m for m in real)


def fresh_qwen3_5(tmp_path, monkeypatch, fla):
    """qwen3_5.py imported anew, under another name (the loaded module and its classes stay as they are),
    where causal_conv1d is a broken build (its extension's ImportError) and FLA imports or does not."""
    (tmp_path / "causal_conv1d").mkdir(exist_ok=True)
    (tmp_path / "causal_conv1d" / "__init__.py").write_text(
        'raise ImportError("causal_conv1d_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    fake = types.ModuleType("fla.ops.gated_delta_rule")  # FLA's module: qwen3_5 imports only this name
    fake.chunk_gated_delta_rule = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fake if fla else None)  # None: ImportError
    spec = importlib.util.spec_from_file_location("qwen3_5_fresh", ROOT / "qwen3_5.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_missing_gdn_kernels_are_said_at_model_build(tiny_ckpt, tmp_path, monkeypatch, recwarn):
    """A broken causal-conv1d leaves FLA on (each imports on its own); on CUDA, building the model says
    which kernel is missing, its ImportError and the install command: a warning for the conv (its torch
    fallback is cheap), an error for FLA unless --transformer-impl local (te=False) asked for the
    unfused path. Importing says nothing, and nothing is said on CPU."""
    from transformers import AutoConfig
    tc = AutoConfig.from_pretrained(tiny_ckpt("qwen3_5")).text_config
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    q = fresh_qwen3_5(tmp_path, monkeypatch, fla=True)
    assert q.chunk_gated_delta_rule is sys.modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule
    assert q.causal_conv1d_fn is None and not recwarn.list  # import: nothing said
    with pytest.warns(UserWarning, match=r"causal-conv1d cannot be imported \(ImportError: causal_conv1d_cuda.so: "
                      r"undefined symbol.*pip install --no-build-isolation causal-conv1d==1.7.0.*conv in torch"):
        q.block_spec(tc, te=False)
    q.check_kernels(te=True)  # FLA present: a warning only, no exit
    q = fresh_qwen3_5(tmp_path, monkeypatch, fla=False)
    with pytest.raises(SystemExit, match=r"flash-linear-attention cannot be imported \(ModuleNotFoundError.*"
                       r"pip install flash-linear-attention==0.6.0.*--transformer-impl local"):
        q.check_kernels(te=True)
    with pytest.warns(UserWarning) as said:
        q.block_spec(tc, te=False)
    assert len(said) == 2 and all(any(f"{pkg} cannot be imported" in str(w.message) for w in said)
                                  for pkg in ("causal-conv1d", "flash-linear-attention"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    recwarn.clear()
    q.block_spec(tc, te=False)
    assert not recwarn.list


if __name__ == "__main__" and sys.argv[1:] == ["gdn-collectives"]:
    gdn_collectives()
