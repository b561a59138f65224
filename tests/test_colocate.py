"""The SGLang server's placement beside training: which GPUs and memory share, --colocate's refusals at parse time,
and a colocated engine that steps aside for every rank before training."""
import sys
from pathlib import Path

import pytest

import cluster
import train_grpo as G
from sglang_engine import COLOCATE_MEM_FRACTION, servers_per_node, sglang_placement

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def test_placement_of_the_sglang_server():
    """--colocate: the training GPUs, memory saver, default memory share; --rollout-num-gpus: GPUs
    after the training ones, never a training GPU; neither on GPUs: an error naming both flags."""
    def args(*flags, extra=()):  # the SGLang engine (not auto: a CPU machine's is local) started by some command
        a = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rollout-engine", "sglang",
                          "--sglang-launch-cmd", "x", *flags, *extra])
        return a
    flags, env = sglang_placement(args("--colocate"), True, 8, 4)  # released: no /health generation (SGLang 0.5.23's
    # http_server.py:721-760); a restart meets the trainer's uneven memory: the TP balance check a warning; CUDA graphs
    # captured under the memory saver, else releasing "cuda_graph" frees nothing (full_cuda_graph_backend.py:121-124)
    assert env == {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0", "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
                   "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert flags == ["--enable-memory-saver", "--mem-fraction-static", str(COLOCATE_MEM_FRACTION), "--tp-size", "4"]
    flags, _ = sglang_placement(args("--colocate", "--offload-train"), True, 8, 4)  # the trainer waits on the host
    assert flags[:3] == ["--enable-memory-saver", "--mem-fraction-static", "0.7"]
    flags, env = sglang_placement(args("--rollout-num-gpus", "2", extra=["--sglang-dp-size", "2"]), True, 8, 6,
                                  visible="3,4,5,6,7,0,1,2")
    assert env == {"CUDA_VISIBLE_DEVICES": "1,2"} and flags == ["--dp-size", "2"]
    with pytest.raises(SystemExit, match="--rollout-num-gpus 4: this node has 8 GPUs and torchrun trains on 6"):
        sglang_placement(args("--rollout-num-gpus", "4"), True, 8, 6)
    with pytest.raises(SystemExit, match="--colocate .* --rollout-num-gpus"):
        sglang_placement(args(), True, 8, 4)
    assert sglang_placement(args(extra=["--sglang-device", "cpu"]), False, 0, 1) == (["--device", "cpu"], {})
    with pytest.raises(SystemExit, match="--colocate needs CUDA"):  # release would kill a CPU server
        sglang_placement(args("--colocate"), False, 0, 1)
    # --rollout-num-gpus-per-engine K: the node's serving GPUs in slices of K, a server (TP K) each
    two = args("--colocate", "--rollout-num-gpus-per-engine", "2")
    assert servers_per_node(two, True, 8) == 4
    flags, env = sglang_placement(two, True, 8, 8, index=1)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "0"
    assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
    assert flags[-2:] == ["--tp-size", "2"]
    split = args("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "2")
    assert servers_per_node(split, True, 4) == 2
    assert sglang_placement(split, True, 8, 4, index=1)[1] == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert servers_per_node(args("--rollout-num-gpus-per-engine", "1"), False, 2) == 2  # CPU: a server per rank
    assert servers_per_node(args("--colocate"), True, 8) == 1
    with pytest.raises(SystemExit, match="--rollout-num-gpus-per-engine 3: a node's 8 serving GPUs"):
        servers_per_node(args("--colocate", "--rollout-num-gpus-per-engine", "3"), True, 8)
    with pytest.raises(SystemExit, match="4 servers a node, but only 2 trainer ranks"):
        servers_per_node(args("--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1"), True, 2)


def test_colocated_distributed_weight_sync_is_refused_at_parse_time(capsys):
    """Rank 0 and the colocated server's TP rank 0 share GPU 0: NCCL refuses such a group."""
    with pytest.raises(SystemExit):
        G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--colocate",
                      "--weight-sync", "distributed"])
    assert "--colocate --weight-sync distributed" in capsys.readouterr().err


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offload_train"])
def test_colocated_engine_steps_aside_for_every_rank(monkeypatch, offload):
    """The release is seen by every rank before training (a barrier after it); the resume comes
    only after every rank emptied PyTorch's cache (empty_cache, then a barrier). --offload-train: the
    trainer's state comes back after the release, its optimizer states and gradients leave before the
    server's weights return, its parameters only after the weight sync (the next to_rollout), and
    only then do the KV cache and CUDA graphs come back."""
    import types
    events = []
    engine = types.SimpleNamespace(release=lambda: events.append("release"),
                                   resume=lambda tags=G.sglang_engine.MEMORY_TAGS: events.append(f"resume {','.join(tags)}"))
    off = types.SimpleNamespace(restore=lambda: events.append("restore"),
                                release=lambda kinds=("params", "grads", "optimizer"): events.append(f"park {','.join(kinds)}"))
    monkeypatch.setattr(G.torch.distributed, "barrier", lambda *a, **k: events.append("barrier"))
    # cluster.on_leaders: the release or resume on the engine's rank, then every rank learns how it went
    monkeypatch.setattr(G.cluster.dist, "all_gather_object",
                        lambda out, obj: (events.append("barrier"), out.__setitem__(slice(None), [obj] * len(out))))
    monkeypatch.setattr(G.torch.cuda, "is_available", lambda: True)
    held = [40 * 2**30]  # the caching allocator's peak, until empty_cache hands it back
    monkeypatch.setattr(G.torch.cuda, "empty_cache", lambda: (events.append("empty_cache"), held.__setitem__(0, 2**30)))
    monkeypatch.setattr(G.torch.cuda, "max_memory_reserved", lambda: 40 * 2**30)
    monkeypatch.setattr(G.torch.cuda, "memory_reserved", lambda: held[0])
    monkeypatch.setattr(G.torch.cuda, "reset_peak_memory_stats", lambda: None)
    if offload:
        want0 = ["release", "barrier", "restore", "park optimizer,grads", "empty_cache", "barrier", "resume weights",
                 "barrier", "park params,grads,optimizer", "barrier", "resume weights,kv_cache,cuda_graph", "barrier"]
    else:
        want0 = ["release", "barrier", "empty_cache", "barrier", "resume weights,kv_cache,cuda_graph", "barrier"]
    for rank, want in ((0, want0), (1, [e for e in want0 if not e.startswith(("release", "resume"))])):
        events.clear()
        servers = cluster.Servers.__new__(cluster.Servers)  # as __init__ leaves it, without starting a server
        servers.par, servers.colocate, servers.off = types.SimpleNamespace(rank=rank, world=2), True, off if offload else None
        servers.engine = engine if rank == 0 else None  # the engine's rank (cluster.py: each node's leader)
        servers.step_aside()
        assert servers.step_back() == {"gpu_train_peak_gib": 40.0, "gpu_held_at_resume_gib": 1.0}
        servers.to_rollout()
        assert events == want, (rank, events)


def test_a_colocated_server_starts_once_every_rank_has_parked(monkeypatch):
    """--offload-train: each rank parks the trainer before the server starts, and the server starts only once every
    rank has (a barrier): SGLang's TP ranks compare their GPUs' free memory before loading and stop on an imbalance
    over 10% (sglang 0.5.23 srt/distributed/bootstrap.py:207-218, 441-452; SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK)."""
    import types
    events = []
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rollout-engine", "sglang",
                         "--sglang-launch-cmd", "x", "--colocate", "--offload-train"])  # sglang need not be installed
    monkeypatch.setattr(cluster.offload, "Offload",
                        lambda *a: types.SimpleNamespace(release=lambda: events.append("park"), host_bytes=lambda: 0))
    monkeypatch.setattr(cluster.dist, "barrier", lambda *a, **k: events.append("barrier"))
    monkeypatch.setattr(cluster.dist, "broadcast_object_list", lambda *a, **k: None)
    monkeypatch.setattr(cluster.sglang_engine, "make_engine",
                        lambda *a, **k: events.append("server") or types.SimpleNamespace(sync_plan=lambda: (1, None)))
    for rank in (0, 1):
        events.clear()
        cluster.Servers(args, types.SimpleNamespace(rank=rank, world=2, local_rank=rank, local_world=2, node=0),
                        None, None, None, "x", "x")
        assert events == ["park", "barrier", "server"][:3 - rank], (rank, events)
