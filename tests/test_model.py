"""model.py against transformers on tiny random checkpoints: CPU, fp32, gloo.

TP=1 runs in this process (a world of one); TP=2 runs `torchrun --nproc_per_node 2 tools/check.py`.
"""
import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from conftest import ROOT

import convert
import launch
import model as M
from tools import check
import parallel
from _model_tp_worker import grad_errors

ARCHS = ["qwen3_vl", "qwen2_5_vl"]
# Qwen3.5's logits are checked here too; its other checks (gradients with their own tolerances,
# TP/SP/EP, Gated DeltaNet) are in test_qwen3_5.py.
QWEN3_5 = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def setup(tiny_ckpt):
    """arch -> (checkpoint dir, Megatron model, transformers model, (seqs, pixel_values, grid))."""
    from transformers import AutoModelForImageTextToText
    parallel.init_distributed(1)
    made = {}

    def get(arch, **sizes):
        key = (arch, tuple(sorted(sizes.items())))
        if key not in made:
            d = tiny_ckpt(arch, **sizes)
            hf = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32)
            made[key] = d, M.load_model(d), hf, check.check_inputs(d)
        return made[key]
    return get


def source_tensors(d):
    files = convert.weight_files(d)
    return {n: safe_open(f, "pt").get_tensor(n) for n, f in files.items()}


@pytest.mark.parametrize("arch", ARCHS + QWEN3_5)
def test_logits_match_transformers(setup, arch):
    d, model, hf, (seqs, pv, grid) = setup(arch)
    assert len(seqs) >= 3 and len(grid) == 3 and len({tuple(g) for g in grid.tolist()}) == 2
    assert any((s == hf.config.image_token_id).sum() == 0 for s in seqs)  # a text-only sequence
    with torch.no_grad():
        ours, ref = model.logits(seqs, pv, grid), check.hf_logits(hf, seqs, pv, grid)
    diff = max((a - b).abs().max().item() for a, b in zip(ours, ref))
    print(f"{arch} TP=1 max_abs_logit_diff={diff:.3g}")
    assert diff <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_grads_match_transformers(setup, arch):
    """A token-level loss (weighted logprobs at temperature 0.7 + entropy bonus): the gradient of
    every tensor, vision tower included, within relative error 1e-4 of transformers'."""
    d, model, hf, inputs = setup(arch)
    rel, ref, lp_diff, _ = grad_errors(model, hf, *inputs)
    assert rel.keys() == ref.keys() and any(n.startswith("V.") for n in rel)
    assert all(g.abs().sum() > 0 for g in ref.values())
    worst = max(rel, key=rel.get)
    print(f"{arch} TP=1 max grad rel err {rel[worst]:.3g} ({worst}), logprob/entropy diff {lp_diff:.3g}")
    assert rel[worst] <= 1e-4 and lp_diff <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_entropy_equal_full_logits(setup, arch):
    d, model, hf, (seqs, pv, grid) = setup(arch)
    masks = [(torch.rand(len(s), generator=torch.Generator().manual_seed(i)) < 0.5) for i, s in enumerate(seqs)]
    for m in masks:
        m[0] = False
    with torch.no_grad():
        lp, ent = model(seqs, pv, grid, masks, temperature=0.7, with_entropy=True)
        logp = [F.log_softmax(z[:-1] / 0.7, -1)[m[1:]] for z, m in zip(model.logits(seqs, pv, grid), masks)]
        lp2, none = model(seqs, pv, grid, masks, temperature=0.7)
    ref = torch.cat([x.gather(1, s[1:][m[1:], None])[:, 0] for x, s, m in zip(logp, seqs, masks)])
    assert lp.shape == (sum(int(m.sum()) for m in masks),) and none is None
    torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, torch.cat([-(x.exp() * x).sum(-1) for x in logp]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp2, lp, rtol=0, atol=0)


def test_chunked_logprob_grads_with_vocab_padding(setup, monkeypatch):
    """The hand-written backward (several chunks, padded rows ignored) equals autograd's."""
    setup("qwen3_vl")  # parallel state
    from megatron.core import parallel_state as ps
    import logprobs
    monkeypatch.setattr(logprobs, "CHUNK", 7)
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(5, 8, generator=g, requires_grad=True), torch.randn(30, 8, generator=g, requires_grad=True)
    tgt, gl, ge = torch.tensor([0, 3, 24, 13, 7]), torch.randn(5, generator=g), torch.randn(5, generator=g)
    lp, ent = logprobs.LogprobEntropy.apply(h, w, tgt, 0.8, 0, 25, ps.get_tensor_model_parallel_group())
    ours = torch.autograd.grad((lp * gl + ent * ge).sum(), (h, w))
    x = F.log_softmax(h @ w[:25].T / 0.8, -1)
    lp_ref, ent_ref = x.gather(1, tgt[:, None])[:, 0], -(x.exp() * x).sum(-1)
    ref = torch.autograd.grad((lp_ref * gl + ent_ref * ge).sum(), (h, w))
    torch.testing.assert_close(lp, lp_ref)
    torch.testing.assert_close(ent, ent_ref)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b)
    assert ours[1][25:].abs().sum() == 0


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_equals_unpacked(setup, arch):
    d, model, hf, (seqs, pv, grid) = setup(arch)
    with torch.no_grad():
        packed = model.logits(seqs, pv, grid)
        alone = [model.logits([s], p, g)[0] for s, (p, g) in zip(seqs, M.split_images(model.hf_config, seqs, pv, grid))]
    for a, b in zip(packed, alone):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch,sizes", [("qwen3_vl", {}), ("qwen2_5_vl", {}), ("qwen3_vl", {"tie": True})])
def test_export_reproduces_checkpoint_bit_exactly(setup, arch, sizes):
    d, model, hf, _ = setup(arch, **sizes)
    src = source_tensors(d)
    assert ("lm_head.weight" in src) != sizes.get("tie", False)
    bucket_bytes = 1 << 20
    buckets = list(convert.export_hf(model, bucket_bytes=bucket_bytes))
    got = [x for b in buckets for x in b]
    assert len(buckets) > 1 and all(sum(t.numel() * t.element_size() for _, t in b[:-1]) < bucket_bytes for b in buckets)
    assert sorted(n for n, _ in got) == sorted(src)
    for n, t in got:
        assert t.dtype == src[n].dtype and torch.equal(t, src[n]), n


@pytest.mark.parametrize("arch", ARCHS)
def test_save_hf_loads_in_transformers(setup, arch, tmp_path):
    from transformers import AutoModelForImageTextToText, AutoProcessor
    d, model, hf, (seqs, pv, grid) = setup(arch)
    other = tmp_path / "other"  # a --hf-checkpoint of another size (issue 58): its files, but not its config.json
    shutil.copytree(d, other, ignore=shutil.ignore_patterns("*.safetensors"))
    (other / "config.json").write_text((d / "config.json").read_text().replace('"hidden_size": 64', '"hidden_size": 128'))
    convert.save_hf(model, tmp_path / "one", src_dir=other)
    convert.save_hf(model, tmp_path / "sharded", shard_bytes=1 << 20)
    assert (tmp_path / "one" / "model.safetensors").exists()
    assert (tmp_path / "one" / "config.json").read_text() == (d / "config.json").read_text()
    assert len(json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]) == len(source_tensors(d))
    AutoProcessor.from_pretrained(tmp_path / "one")  # tokenizer, processor and template came along
    with torch.no_grad():
        ref = check.hf_logits(hf, seqs, pv, grid)
        for sub in ("one", "sharded"):
            again = AutoModelForImageTextToText.from_pretrained(tmp_path / sub, dtype=torch.float32)
            for a, b in zip(check.hf_logits(again, seqs, pv, grid), ref):
                assert torch.equal(a, b)
    src = source_tensors(d)  # and our own loader reads the sharded layout back
    assert all(torch.equal(t, src[n]) for n, t in convert.hf_tensors(M.load_model(tmp_path / "sharded")))


def test_image_token_mismatch_is_an_error(setup):
    d, model, _, (seqs, pv, grid) = setup("qwen3_vl")
    with pytest.raises(ValueError, match="image tokens"):
        model(seqs[:1])  # image tokens but no images
    with pytest.raises(ValueError, match="left over"):
        model(seqs[1:2], pv[:24], grid[:1])  # an image but no image tokens
    lp, _ = model(seqs[1:2])  # text only, loss_masks=None: every token but the first
    assert lp.shape == (len(seqs[1]) - 1,)


def test_init_is_idempotent_and_tp_attributes(setup):
    d, model, _, _ = setup("qwen3_vl")
    first, second = parallel.init_distributed(1), parallel.init_distributed(2)
    assert first == second and (first.rank, first.world, first.device, first.tp) == (0, 1, torch.device("cpu"), 1)
    par = {n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", False)}
    assert any("linear_qkv.weight" in n for n in par) and any("word_embeddings" in n for n in par)
    assert not any(n.startswith("visual.") or "layernorm" in n for n in par)
    frozen = M.load_model(d, M.ModelOptions(freeze_vit=True))
    assert not any(p.requires_grad for p in frozen.visual.parameters())
    assert all(p.requires_grad for p in frozen.language_model.parameters())


def torchrun2(*args):
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = launch.python(*args, nproc=2, timeout=300, env=env)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    return r.stdout.strip().splitlines()


@pytest.mark.cores
@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_check_command(tiny_ckpt, arch):
    """Logits and the export round trip at TP=2 over gloo, through the user's command."""
    lines = torchrun2("tools/check.py", "--hf-checkpoint", tiny_ckpt(arch))
    assert lines[-3] == "PASS: logits within 0.0001: True, export exact: True", lines[-3:]
    assert "export_exact=True" in lines[-2] and "tp=2" in lines[-2]
    assert lines[-1].startswith("max_abs_logit_diff=") and float(lines[-1].split("=")[1]) <= 1e-4


@pytest.mark.cores
def test_tp2_grads_match_transformers(tiny_ckpt, tmp_path):
    out = tmp_path / "grads.json"
    torchrun2("tests/_model_tp_worker.py", "--out", out, tiny_ckpt("qwen3_vl"), tiny_ckpt("qwen2_5_vl"))
    rows = json.loads(out.read_text())
    assert len(rows) == 2
    for f in rows:
        assert f["tp"] == 2 and f["params"] == f["hf_params"] and f["max_rel_err"] <= 1e-4 and f["logprob_diff"] <= 1e-4
        assert f["replicas_agree"]


def test_transformer_engine_is_never_a_silent_fallback(monkeypatch):
    """--transformer-impl: local on CPU by default; asking for Transformer Engine where it cannot
    run is an error that says what to do (megatron-core alone would quietly use the local spec).
    On CUDA the default is TE, and a broken TE import fails the same way (bench/gpu_smoke.sh)."""
    assert M.layer_impl() == "local" and M.layer_impl("local") == "local"
    with pytest.raises(SystemExit, match="needs CUDA; use --transformer-impl local"):
        M.layer_impl("transformer_engine")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a CUDA machine without TE
    import builtins
    real_import = builtins.__import__

    def no_te(name, *a, **k):
        if name.startswith("transformer_engine"):
            raise ImportError("libtransformer_engine.so: undefined symbol")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_te)
    with pytest.raises(SystemExit, match="undefined symbol.*--no-build-isolation.*--transformer-impl local"):
        M.layer_impl()


REAL_MODELS = ROOT.parent / "shared" / "real_models"


@pytest.mark.cores
@pytest.mark.parametrize("name", ["Qwen3-VL-2B-Instruct", "Qwen2.5-VL-3B-Instruct"])
def test_tiny_with_a_real_configs_structure(tiny_ckpt, name):
    """A tiny checkpoint built like the real config (tied head, its GQA ratio: 2 and 8 query heads
    per KV head, its MRoPE sections scaled) matches transformers at TP=1 and TP=2, and exports
    bit-exactly (a tied checkpoint has no lm_head tensor to give back)."""
    if not (REAL_MODELS / name).exists():
        pytest.skip(f"reference configs not found ({REAL_MODELS}); they are not shipped with the repo")
    from tools import tiny
    arch, sizes = tiny.sizes_like(REAL_MODELS / name / "config.json")
    assert sizes["tie"] and sizes["heads"] // sizes["kv_heads"] == {"Qwen3-VL-2B-Instruct": 2}.get(name, 8)
    d = tiny_ckpt(arch, **sizes)
    assert "lm_head.weight" not in convert.weight_files(d)
    parallel.init_distributed(1)
    assert check.check(d) <= 1e-4
    if name.startswith("Qwen2.5"):  # 8 query heads per KV head, split over TP (the 2:1 case: test_tp2_*)
        lines = torchrun2("tools/check.py", "--hf-checkpoint", d)
        assert "export_exact=True" in lines[-2] and float(lines[-1].split("=")[1]) <= 1e-4
