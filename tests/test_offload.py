"""--offload-train's bookkeeping on CPU (offload.py): what is moved, that nothing is left behind,
that it comes back bit for bit, and that training after a round trip takes the step it would have
taken. Its memory effect on a GPU: bench/gpu_smoke.sh. The order of the moves against a colocated
server: test_colocate.py::test_colocated_engine_steps_aside_for_every_rank."""
import argparse

import pytest
import torch

import model as M
import offload
import optim
import parallel


def setup(ckpt, mixed):
    par = parallel.init_distributed(1)
    args = argparse.Namespace(lr=1e-2, min_lr=0.0, decoupled_lr=None, weight_decay=0.1, adam_beta1=0.9,
                              adam_beta2=0.98, lr_warmup_iters=0, lr_decay_style="constant", clip_grad=1.0,
                              bf16=False, use_distributed_optimizer=mixed, accumulate_allreduce_grads_in_fp32=mixed)
    model = M.load_model(ckpt, M.ModelOptions(), par)
    ref = M.load_model(ckpt, M.ModelOptions(freeze_vit=True), par).eval()
    opt, sched = optim.build_optimizer(model, args, 10)
    return par, args, model, ref, opt, sched


def train_step(model, opt, sched, par, args, seed):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, 151_000, (12,), generator=g), torch.randint(0, 151_000, (7,), generator=g)]
    lp, _ = model(seqs)
    (-lp.mean()).backward()
    return optim.optimizer_step(model, opt, sched, par, args)


def everything(model, ref, opt):
    """Copies of every tensor the trainer holds: parameters, the reference model, optimizer state."""
    tensors = [*model.parameters(), *ref.parameters(), *offload.optimizer_tensors(opt)]
    return [t.detach().clone() for t in tensors]


@pytest.mark.parametrize("mixed", [False, True], ids=["adamw", "master_adamw"])
def test_release_frees_every_storage_and_restore_is_bit_exact(tiny_ckpt, mixed):
    """torch's AdamW (its parameters are the model's) and MasterAdamW (fp32 masters of its shard,
    main_grad buffers): after release nothing of the trainer is left in device storage; after
    restore every tensor is what it was, gradients zero; the next step equals one never offloaded."""
    ckpt = tiny_ckpt("qwen3_vl")
    par, args, model, ref, opt, sched = setup(ckpt, mixed)
    _, _, model2, _, opt2, sched2 = setup(ckpt, mixed)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):
        train_step(m, o, s, par, args, seed=0)  # Adam's moments exist from here on
    before = everything(model, ref, opt)
    off = offload.Offload(model, opt, ref)
    held = off.storages()
    n_bytes = {k: sum(s.nbytes() for s in v) for k, v in held.items()}
    assert n_bytes["params"] > 0 and n_bytes["optimizer"] > 0 and (n_bytes["grads"] > 0) == mixed, n_bytes
    off.release(("optimizer", "grads"))  # after training: the weights stay for the sync
    assert not any(off.storages()[k] for k in ("optimizer", "grads")) and off.storages()["params"]
    off.restore(("optimizer",))  # a checkpoint is due: the states it saves come back, the rest stays
    assert off.storages()["optimizer"] and not off.storages()["grads"]
    assert all(torch.equal(a, b) for a, b in zip(everything(model, ref, opt), before))
    off.release()  # before the rollout: the rest, the optimizer again
    assert not any(off.storages().values()), {k: len(v) for k, v in off.storages().items()}
    assert all(t.untyped_storage().nbytes() == 0 for t in model.parameters())
    host = off.host_bytes()
    assert host == n_bytes["params"] + n_bytes["optimizer"]  # gradients are freed, not copied
    off.restore()
    after = everything(model, ref, opt)
    assert len(after) == len(before) and all(torch.equal(a, b) for a, b in zip(after, before))
    if mixed:
        assert all(p.main_grad.abs().sum() == 0 for p in model.parameters() if p.requires_grad)
    off.release()
    off.restore()  # a second round reuses the host buffers
    assert off.host_bytes() == host
    s1 = train_step(model, opt, sched, par, args, seed=1)
    s2 = train_step(model2, opt2, sched2, par, args, seed=1)
    assert s1["grad_norm"] == s2["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_host_buffers_are_pinned_at_their_exact_size(tiny_ckpt, monkeypatch):
    """On CUDA each parked storage waits in a host buffer of exactly its bytes, registered with CUDA
    (torch.empty(pin_memory=True) would round each up to a power of two: a 4.2 GB buffer holds 8 GiB),
    and host_bytes() is what is held; a dropped buffer is unregistered. CUDA stands in, recording the
    cudaHostRegister calls."""
    import gc
    import types
    par, args, model, ref, opt, sched = setup(tiny_ckpt("qwen3_vl"), False)
    train_step(model, opt, sched, par, args, seed=0)
    pinned = {}  # address -> bytes registered

    def register(ptr, n, flags):
        pinned[ptr] = n
        return 0

    def unregister(ptr):
        del pinned[ptr]
        return 0
    fake = types.SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregister)
    for name, fn in (("is_available", lambda: True), ("cudart", lambda: fake), ("synchronize", lambda: None),
                     ("empty_cache", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, fn)
    off = offload.Offload(model, opt)
    sizes = sorted(s.nbytes() for k in ("params", "optimizer") for s in off.storages()[k])
    off.release()
    off.restore()
    assert sorted(pinned.values()) == sizes and off.host_bytes() == sum(sizes)
    assert pinned == {h.data_ptr(): h.numel() for h in off.host.values()}
    off.host.clear()
    gc.collect()
    assert pinned == {}


def test_optimizer_cpu_offload_needs_the_distributed_optimizer(tmp_path):
    import sft
    import trainer as T
    args = sft.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", str(tmp_path), "--optimizer-cpu-offload"])
    with pytest.raises(SystemExit, match="--optimizer-cpu-offload needs --use-distributed-optimizer"):
        T.start(args, "sft")


def test_memory_takes_the_trainers_colocate_and_its_sglang_share(tmp_path, capsys):
    """Issue 68: bench/memory.py refused --colocate and estimated a rollout of 0.00 GiB at its default share."""
    import json
    import sys
    from pathlib import Path
    from tools import tiny
    (tmp_path / "config.json").write_text(tiny.tiny_config("qwen3_vl").to_json_string())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import memory
    got = {}
    for name, extra in (("colocate", ["--colocate"]), ("offload", ["--colocate", "--offload-train"]), ("own", [])):
        memory.main(["--hf-checkpoint", str(tmp_path), "--gpu-gib", "10", *extra])
        got[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rollout_gib"]
    assert abs(got["colocate"] - got["own"] - 4) < 0.02 and got["offload"] == 7, got  # 0.4, 0.7 of 10 GiB


def test_memory_phases_of_the_single_turn_recipe(capsys):
    """bench/memory.py on the real Qwen3.5-35B-A3B config, the recipe's layout on 8 x 80 GB (TP2 + SP,
    EP8, full recompute, SGLang at 0.7): the rollout fits only with the trainer parked, training only
    with Adam on the CPU (the experts' states are not sharded at expert-DP 1); the last line is JSON."""
    import json
    import sys
    from pathlib import Path
    real = Path(__file__).resolve().parents[2] / "shared" / "real_models" / "Qwen3.5-35B-A3B"
    if not (real / "config.json").exists():
        pytest.skip(f"reference data not here: {real}")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    import memory
    recipe = ["--hf-checkpoint", str(real), "--tensor-model-parallel-size", "2", "--sequence-parallel", "--dp", "4",
              "--expert-model-parallel-size", "8", "--bf16", "--accumulate-allreduce-grads-in-fp32",
              "--use-distributed-optimizer", "--recompute-granularity", "full", "--mem-fraction-static", "0.7"]
    got = {}
    for name, extra in (("resident", []), ("offload", ["--offload-train"]),
                        ("cpu_adam", ["--offload-train", "--optimizer-cpu-offload"])):
        capsys.readouterr()
        memory.main(recipe + extra)
        got[name] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(got["offload"]) == {"rollout_gib", "train_gib", "sync_gib", "gpu_gib", "host_gib"}
    assert got["resident"]["rollout_gib"] > 80 >= got["offload"]["rollout_gib"]  # the trainer's state is parked
    assert got["offload"]["train_gib"] > 80 >= got["cpu_adam"]["train_gib"]  # Adam's states on the host
    assert max(got["cpu_adam"][k] for k in ("rollout_gib", "train_gib", "sync_gib")) <= 80
    assert got["resident"]["host_gib"] == 0 < got["offload"]["host_gib"] < got["cpu_adam"]["host_gib"]
