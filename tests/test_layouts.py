"""The reference every parallel layout is held to: the same samples give the same GRPO gradient,
parameter by parameter, in one process and under TP, DP, CP, EP and PP, for each loss term (policy
gradient, entropy, KL; GSPO's per-sequence ratio) with the vision tower trained and frozen, dense and MoE.

The checkpoints are the tiny ones with their weights redrawn large (2-D weights N(0, 0.08^2), norm
scales 1 + 0.2 N(0, 1)): the logits are far from uniform there, unlike the default tiny checkpoint's
(N(0, 0.02^2)), which is where issue 30 saw one process and two disagree. tests/_grad_worker.py
computes and writes the gradients; this file compares them.
"""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor

import _grad_worker
import launch
from conftest import GEO3K_REAL, ROOT

pytestmark = pytest.mark.cores  # every test here runs two to seven ranks at once

# Per tensor (L2 over its elements): |g_layout - g_one| <= REL |g_one| + ABS |whole gradient|.
# Measured: 3.3e-6 relative at worst for dense tensors (a QK-norm scale at TP=2). Qwen3.5's first
# Gated DeltaNet decay gate (A_log, dt_bias: a sum over every token's decay, mostly cancelling, ~1e-5
# of the whole gradient) moves 1.5e-4 relative in ONE process when only the thread count changes
# and 3.2e-4 when only the micro-batch budget does: float32 reduction order, which ABS covers
# (those moves are ~1e-9 of the whole gradient's ~1). A wrong shard, a missing or doubled reduce
# or a 1/DP scale is off by O(1) relative.
REL, ABS = 2e-5, 1e-7


def redraw(ckpt, out, seed):
    """A copy of `ckpt` with its weights redrawn: every 2-D (and 3-D fused expert) weight from
    N(0, 0.08^2), every norm scale from 1 + 0.2 N(0, 1) (Qwen3.5's zero-centred text norms: 0.2 N)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    centred = cfg["model_type"].startswith("qwen3_5")
    out.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    g = torch.Generator().manual_seed(seed)
    sd = load_file(ckpt / "model.safetensors")
    for k in sorted(sd):
        v = sd[k]
        if v.ndim == 2 or "experts" in k:
            sd[k] = 0.08 * torch.randn(v.shape, generator=g)
        elif "norm" in k and k.endswith("weight"):
            zero = centred and "visual" not in k and "linear_attn.norm" not in k
            sd[k] = (0.0 if zero else 1.0) + 0.2 * torch.randn(v.shape, generator=g)
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def peaked(tiny_ckpt, tmp_path_factory):
    """peaked(arch, seed) -> a redrawn tiny checkpoint of that family (Qwen3-VL: 4 layers, hidden
    96, 6 query / 2 KV heads, a depth-3 vision tower feeding deepstack layers, the LM head tied to the
    embedding as Qwen3-VL-2B's is)."""
    made = {}

    def get(arch, seed=1234):
        if (arch, seed) not in made:
            sizes = dict(hidden=96, heads=6, kv_heads=2, layers=4, vit_depth=3, tie=True) if arch == "qwen3_vl" else {}
            made[arch, seed] = redraw(tiny_ckpt(arch, **sizes), tmp_path_factory.mktemp(f"{arch}_{seed}"), seed)
        return made[arch, seed]
    return get


def samples_file(ckpt, out):
    """tests/_grad_worker.py's samples (real geo3k prompts and images, random responses) through `ckpt`'s processor,
    made here once for every launch -> the file they are saved in."""
    torch.save(_grad_worker.samples(AutoProcessor.from_pretrained(ckpt), GEO3K_REAL / "test.parquet"), out)
    return out


def launch_layouts(ckpt, samples, out, nproc, layouts, ref=None):
    """Start tests/_grad_worker.py (one process or torchrun) on `layouts` {name: its flags}, all in the one launch."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return launch.start(ROOT / "tests" / "_grad_worker.py", ckpt, samples, "--out", out,
                        *(["--ref", ref] if ref else []), *(f"{name}={flags}" for name, flags in layouts.items()),
                        nproc=nproc, env=env)


def computed(job, out, nproc, layouts):
    """Wait for `job` (launch_layouts) -> {name: its folder}, each layout checked to have run at the sizes its
    flags ask for: a layout left on the last one's parallel state would equal the reference without testing."""
    r = job.wait(600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for name, flags in layouts.items():
        lay = _grad_worker.layout_flags().parse_args(flags.split())
        want = dict(tp=lay.tp, cp=lay.cp, pp=lay.pp, ep=lay.ep, dp=nproc // (lay.tp * lay.cp * lay.pp), sp=lay.sp)
        assert json.loads((out / name / "layout.json").read_text()) == want, (name, flags)
    return {name: out / name for name in layouts}


def grads(folder):
    """{term: (HF name -> gradient, stats)} of one layout's folder."""
    return {f.stem: (load_file(f), json.loads(f.with_suffix(".json").read_text())) for f in folder.glob("*.safetensors")}


def both(ckpt, samples, tmp_path, one, layouts, ref=None):
    """The one-process reference layouts `one` and the two-rank `layouts`, the two launches side by side ->
    ({name: gradients} of `one`, {name: folder} of `layouts`)."""
    jobs = [launch_layouts(ckpt, samples, tmp_path / "one", 1, one, ref),
            launch_layouts(ckpt, samples, tmp_path / "many", 2, layouts, ref)]
    try:
        ref_dirs = computed(jobs[0], tmp_path / "one", 1, one)
        return {name: grads(d) for name, d in ref_dirs.items()}, computed(jobs[1], tmp_path / "many", 2, layouts)
    finally:
        for job in jobs:
            job.kill()


def norm(grads):
    return sum(float(torch.linalg.vector_norm(t, dim=-1).double().square().sum()) for t in grads.values()) ** 0.5


def assert_same(got, want, name):
    assert got.keys() == want.keys(), (name, got.keys() ^ want.keys())
    for term, (g, stats) in got.items():
        w, wstats = want[term]
        assert g.keys() == w.keys(), (name, term, g.keys() ^ w.keys())
        total = norm(w)
        bad = {k: float((g[k] - w[k]).norm() / w[k].norm().clamp(min=1e-30)) for k in w
               if (g[k] - w[k]).norm() > REL * w[k].norm() + ABS * total}
        assert not bad, (name, term, dict(sorted(bad.items(), key=lambda kv: -kv[1])[:6]))
        assert abs(norm(g) - total) <= 1e-5 * total, (name, term, norm(g), total)
        for k in ("loss", "entropy", "kl"):
            assert abs(stats[k] - wstats[k]) <= 1e-6 * max(1.0, abs(wstats[k])), (name, term, k, stats, wstats)


# GSPO's one ratio a sequence: CP splits its tokens. PP: stages of 3 + 1 layers (deepstack's 3 on the first)
# through 1F1B, the reference model a pipeline too, the tied embedding's gradient the sum of the first stage's
# and the head copy's. CP: each sequence in zigzag chunks over two ranks (the tower's gradient from both).
DENSE = {"dp2": "--gspo", "tp2": "--tp 2 --gspo", "cp2": "--cp 2 --gspo", "pp2": "--pp 2 --first-stage-layers 3 --gspo",
         "dp2_frozen": "--freeze-vit", "tp2_frozen": "--tp 2 --freeze-vit"}


def test_dense_gradients_equal_in_one_process_tp2_dp2_cp2_and_pp2(peaked, tmp_path):
    """Every term's gradient with the vision tower trained (and GSPO's) and frozen, at TP2, DP2, CP2 and PP2 (frozen:
    TP2 and DP2), equals one process's."""
    ckpt, ref = peaked("qwen3_vl"), peaked("qwen3_vl", seed=99)
    samples = samples_file(ckpt, tmp_path / "samples.pt")
    one, many = both(ckpt, samples, tmp_path, {"trained": "--gspo", "frozen": "--freeze-vit"}, DENSE, ref=ref)
    for name, freeze in (("trained", False), ("frozen", True)):
        assert set(one[name]) == {"pg", "entropy", "kl"} | (set() if freeze else {"gspo"})
        for term, (g, stats) in one[name].items():  # every term has a gradient, and only trained tensors have one
            assert sum(float(t.norm()) for t in g.values()) > 0, (name, term)
            assert any(k.startswith("model.visual.") for k in g) != freeze, (name, term)
        assert 0 < one[name]["pg"][1]["clipfrac"] < 1 and one[name]["kl"][1]["kl"] > 0
    for name, folder in many.items():
        assert_same(grads(folder), one["frozen" if name.endswith("_frozen") else "trained"], name)


def test_moe_gradients_equal_in_one_process_and_ep2(peaked, tmp_path):
    """Qwen3.5-MoE: experts split over two ranks (EP2 x DP2), TP2 with sequence parallel, CP2 x EP2
    (Gated DeltaNet head-parallel over the CP ranks, which also hold the experts), and PP2 x EP2 x DP2
    (four processes: the stages split between a Gated DeltaNet and an attention layer, the alltoall
    dispatcher, a DP rank's idle micro-batch inside the 1F1B schedule). Every run replays fixed engine
    routes (R3) at half the tokens and lets the routers choose at the rest: each layout must cut the
    routes as it cuts the tokens (CP's chunks, SP's shards, PP's layers)."""
    ckpt = peaked("qwen3_5_moe")
    # 540 tokens a micro-batch: DP rank 0 packs its samples in 3, rank 1 in 2 and one idle
    four = {"pp2ep2": "--pp 2 --ep 2 --max-tokens-per-gpu 540 --replay"}
    samples = samples_file(ckpt, tmp_path / "samples.pt")
    job = launch_layouts(ckpt, samples, tmp_path / "four", 4, four)
    try:
        ref, many = both(ckpt, samples, tmp_path, {"replay": "--replay", "own": ""},
                         {"ep2": "--ep 2 --replay", "tp2sp": "--tp 2 --sp --replay", "cp2ep2": "--cp 2 --ep 2 --replay"})
        many.update(computed(job, tmp_path / "four", 4, four))
    finally:
        job.kill()
    one, own = ref["replay"], ref["own"]["pg"][0]
    assert any(".experts." in k for k in one["pg"][0])
    assert norm({k: own[k] - one["pg"][0][k] for k in own}) > 0.05 * norm(own)  # the replay is not a no-op
    for name, folder in many.items():
        assert_same(grads(folder), one, name)


DDP_WORKER = """
import sys, types
sys.path.insert(0, sys.argv[2])
import torch, optim, parallel, model as M
par = parallel.init_distributed(1)
rank = par.rank
m = M.load_model(sys.argv[1])
args = types.SimpleNamespace(accumulate_allreduce_grads_in_fp32=False, use_distributed_optimizer=False)
ddp = optim.megatron_ddp(m, args)  # the CUDA path's reduce (it runs on CPU over gloo too)
for p in m.parameters():
    p.main_grad.fill_(rank + 1.0)
with parallel.megatron_on_cpu():
    ddp.finish_grad_sync()
grads = [(p, torch.full_like(p, rank + 1.0)) for p in m.parameters()]  # the CPU path's reduce
optim.allreduce_grads(grads, par)
assert all(torch.equal(p.main_grad, g) for p, g in grads), "the paths differ"
sys.stdout.write(f"summed {float(next(m.parameters()).main_grad.flatten()[0])}\\n")  # one write: ranks share the pipe
"""


def test_megatron_ddp_sums_gradients_as_the_cpu_path_does(tiny_ckpt, tmp_path):
    """Our loss is divided by the global token count, so DP ranks' gradients are summed: on the CUDA
    path (megatron-core's DDP, which averages unless told otherwise) as on the CPU path."""
    script = tmp_path / "ddp_worker.py"
    script.write_text(DDP_WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    r = launch.python(script, tiny_ckpt("qwen3_vl"), ROOT, nproc=2, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("summed 3.0") == 2, r.stdout  # ranks held 1 and 2
