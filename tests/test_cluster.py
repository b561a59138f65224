"""cluster.py: a server per node behind SGLang's real router (sglang-router's own binary), here with
fake servers (tests/fake_sglang.py): the router spreads requests and passes the per-run API key, a
server refuses a request without it, the key is in no file, a multi-turn sample's turns stay on one
server; two nodes simulated on this machine (`torchrun --nnodes 2`, one process each), or two servers
on one node (--rollout-num-gpus-per-engine), train with every server updated before each rollout."""
import json
import os
import re
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import launch
import fakes
from conftest import ROOT, grpo_args, rollout_args
from sglang_engine import SGLangEngine

FAKE = str(Path(__file__).with_name("fake_sglang.py"))
pytest.importorskip("sglang_router", reason="sglang-router (requirements.txt) runs SGLang's router")


def refused(url, key=None):
    """The HTTP status of a /generate to `url` (with `key` as the bearer token, if any)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        urllib.request.urlopen(urllib.request.Request(url + "/generate", data=b"{}", headers=headers, method="POST"))
    except urllib.error.HTTPError as e:
        return e.code
    return 200


def healthy_workers(url):
    """The servers the router at `url` counts healthy now (/readiness answers 503 while it has none)."""
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=5) as r:
            return json.loads(r.read())["healthy_workers"]
    except urllib.error.HTTPError as e:
        return json.loads(e.read() or b"{}").get("healthy_workers", 0)


def test_router_spreads_requests_and_every_server_wants_the_key(ckpt, processor, records, tmp_path):
    rec, key = tmp_path / "requests.jsonl", "k3y-" + os.urandom(8).hex()
    # slow to describe itself, as a real server on busy cores: the router registers it seconds after its /health
    kw = dict(server_args=["--fake-record", str(rec), "--fake-info-delay", "2"], launch_cmd=[sys.executable, FAKE],
              timeout=30, api_key=key)
    a = SGLangEngine(ckpt, tmp_path, name="node00", **kw)
    b = SGLangEngine(ckpt, tmp_path, name="node01", **kw)
    try:
        # round_robin: cache_aware sends a burst of 8 to one server when they all race past its empty trees (CI saw
        # it once); where cache_aware spreads is test_a_samples_later_turns_go_where_its_first_went's
        a.attach_router([a.server.url, b.server.url], ["--policy", "round_robin"])
        # ready only once both servers are registered (its /health says 200 before: requests then get 503)
        assert healthy_workers(a.front.url) == 2
        samples = fakes.run_episodes(a, processor, records, rollout_args(n_samples_per_prompt=2))
        assert all(s.status == "completed" for s in samples), [s.fail_reason for s in samples]
        served = {json.loads(line)["pid"] for line in rec.read_text().splitlines() if '"/generate"' in line}
        assert len(served) == 2  # both servers answered the router
        for url in (a.server.url, b.server.url, a.front.url):  # no key, a wrong key: 401
            assert refused(url) == 401 and refused(url, "wrong") == 401
    finally:
        a.shutdown()
        b.shutdown()
    logs = sorted(p.name for p in tmp_path.glob("*.log"))
    assert logs == ["sglang_node00.log", "sglang_node01.log", "sglang_router.log"]
    assert "--api-key ***" in (tmp_path / "sglang_node00.log").read_text()
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and key in p.read_text(errors="replace")]


def test_a_samples_later_turns_go_where_its_first_went(ckpt, tmp_path):
    """cache_aware at the router's defaults keys a /generate by its input_ids (sglang-router's
    GenerateRequest.extract_text_for_routing joins them as text): a multi-turn sample's next turn,
    whose ids extend its last turn's, goes to the server that holds that turn in its radix cache.
    16 samples x 3 turns, each later turn the last one's ids + its output + an observation."""
    import random
    rec, rng = tmp_path / "requests.jsonl", random.Random(0)
    kw = dict(server_args=["--fake-record", str(rec)], launch_cmd=[sys.executable, FAKE], timeout=30)
    a = SGLangEngine(ckpt, tmp_path, name="node00_0", **kw)
    b = SGLangEngine(ckpt, tmp_path, name="node00_1", **kw)
    try:
        a.attach_router([a.server.url, b.server.url])
        turns = [[rng.randrange(100, 5000) for _ in range(40)] for _ in range(16)]
        for _ in range(3):
            outs = a.generate([{"input_ids": ids, "images": []} for ids in turns], dict(max_new_tokens=8))
            assert all(o["ids"] for o in outs), outs
            turns = [ids + o["ids"] + [rng.randrange(100, 5000) for _ in range(10)] for ids, o in zip(turns, outs)]
    finally:
        a.shutdown()
        b.shutdown()
    gens = [json.loads(line) for line in rec.read_text().splitlines() if '"/generate"' in line]
    firsts = [g for g in gens if len(g["json"]["input_ids"]) == 40]
    assert len(gens) == 48 and len({g["pid"] for g in firsts}) == 2  # the first turns spread over both
    for g in gens:
        ids = g["json"]["input_ids"]
        first = next(f for f in firsts if ids[:40] == f["json"]["input_ids"])
        assert g["pid"] == first["pid"], "a later turn left its sample's server"


def fake_servers_run(ckpt, tmp_path, *more):
    """-> (save, the fake servers' request record, train_grpo flags): two GRPO steps on synthetic problems, every
    server a fake one recording its requests, `more` flags on top."""
    from tools import synth
    synth.write_synth(tmp_path / "d", 32, n_test=0, seed=0, kinds=("sides",))
    save, rec = tmp_path / "run", tmp_path / "requests.jsonl"
    return save, rec, ["--hf-checkpoint", str(ckpt), "--prompt-data", str(tmp_path / "d"), "--save", str(save),
                       "--rollout-engine", "sglang", "--sglang-launch-cmd", f"{sys.executable} {FAKE}",
                       "--sglang-fake-record", str(rec), "--num-rollout", "2", "--n-samples-per-prompt", "2",
                       "--rollout-max-response-len", "12", "--max-tokens-per-gpu", "512",
                       # cache_aware balances only past a load gap of 64 (its default); here at any gap
                       "--sglang-router-args", "--balance-abs-threshold 0 --balance-rel-threshold 1.0", *more]


@pytest.mark.cores
@pytest.mark.parametrize("nodes", [2, 1], ids=["two_nodes", "one_node_two_servers"])
def test_every_server_serves_and_takes_every_steps_weights(tiny_ckpt, tmp_path, nodes):
    """Two servers, two GRPO steps: two torchrun launches (--nnodes 2 on 127.0.0.1, one process a
    node), each node's rank starting its own server; or one launch of two processes with
    --rollout-num-gpus-per-engine 1 (on CPU: a server a rank), both servers on 127.0.0.1 without a
    key. Rank 0 starts the router; both servers serve, each gets every step's weights in a folder of
    its own, and before any rollout of the next step."""
    save, rec, args = fake_servers_run(tiny_ckpt("qwen3_vl"), tmp_path, "--rollout-batch-size", "4", "--entropy-coef",
                                       "0.01")
    names = ["node00", "node01"] if nodes == 2 else ["node00_0", "node00_1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if nodes == 2:  # torchrun itself: its multi-node rendezvous and agents
        runs = launch.torchrun_nodes(2, 1, [ROOT / "train_grpo.py", *args], timeout=600, env=env)
    else:  # one node: two ranks as `torchrun --standalone` starts them, from the tests' forkserver
        runs = [launch.python(ROOT / "train_grpo.py", *args, "--rollout-num-gpus-per-engine", "1", nproc=2, env=env)]
    outs = [r.stdout + r.stderr for r in runs]
    assert [r.returncode for r in runs] == [0] * len(runs), "".join(o[-3000:] for o in outs)
    assert "2 SGLang servers behind SGLang's router" in outs[0]
    steps = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["failed_frac"] == 0 for m in steps), steps
    calls = [json.loads(line) for line in rec.read_text().splitlines()]
    gens = [c["pid"] for c in calls if c["path"] == "/generate"]
    updates = [(i, c["pid"], c["json"]["model_path"]) for i, c in enumerate(calls)
               if c["path"] == "/update_weights_from_disk"]
    assert len(set(gens)) == 2 and len(updates) == 4 and len({pid for _, pid, _ in updates}) == 2
    assert {Path(p).parent.name for _, _, p in updates} == set(names)  # a folder a server
    first_of_step2 = next(i for i, c in enumerate(calls) if c["path"] == "/generate" and i > updates[0][0])
    assert all(i < first_of_step2 for i, _, _ in updates[:2])  # both servers updated before step 2 generates
    for log in [f"sglang_{n}.log" for n in names] + ["sglang_router.log"]:
        text = (save / log).read_text()
        if nodes == 2:
            assert "--api-key ***" in text and not re.search(r"--api-key (?!\*\*\*)", text), log
        else:
            assert "--api-key" not in text, log
    assert "--host 127.0.0.1" in (save / f"sglang_{names[1]}.log").read_text()  # 2 nodes: the route to MASTER_ADDR


@pytest.mark.slow
def test_fully_async_cuts_on_every_server_and_each_takes_every_steps_weights(tiny_ckpt, tmp_path):
    """--fully-async across two nodes (a fake server each, 3 s a token: a request is still in flight when the step
    that began with it ends, whatever the machine's load; ~1 min): the pause before each weight
    update cuts the requests on both servers (the router does not say which holds one), both take every step's
    weights, and the cut turns go on after it: every step trains B complete groups, some of whose tokens an earlier
    version wrote."""
    save, rec, args = fake_servers_run(tiny_ckpt("qwen3_vl"), tmp_path, "--sglang-fake-token-delay", "3",
                                       "--rollout-batch-size", "2", "--fully-async", "--over-sampling-batch-size", "4",
                                       "--max-weight-staleness", "2")
    runs = launch.torchrun_nodes(2, 1, [ROOT / "train_grpo.py", *args], timeout=600,
                                 env=dict(os.environ, OMP_NUM_THREADS="1"))
    outs = [r.stdout + r.stderr for r in runs]
    assert [r.returncode for r in runs] == [0, 0], "".join(o[-3000:] for o in outs)
    steps = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps] == [1, 2] and all(m["samples"] == 4 and m["failed_frac"] == 0 for m in steps)
    assert sum(m["rollout_aborted"] for m in steps) > 0 and max(m["offpolicy_token_frac"] for m in steps) > 0, steps
    calls = [json.loads(line) for line in rec.read_text().splitlines()]
    updates = [c["pid"] for c in calls if c["path"] == "/update_weights_from_disk"]
    assert len(set(updates)) == 2 and len(updates) == 4  # each server, each step
    assert len({c["pid"] for c in calls if c["path"] == "/abort_request"}) == 2  # both servers were told


FAILING = """
import sys, types
sys.path.insert(0, sys.argv[1])
import torch.distributed as dist, cluster
dist.init_process_group("gloo")
par = types.SimpleNamespace(rank=dist.get_rank(), world=dist.get_world_size(), node=dist.get_rank())  # a node each
engine = types.SimpleNamespace(server=types.SimpleNamespace(url=f"http://10.0.0.{par.rank}:30000"))
def update(e):
    if par.rank == 1:
        raise RuntimeError("SGLang /update_weights_from_disk failed (HTTP 400): out of disk")
    return "done"
try:
    cluster.on_leaders(par, engine, update, "the weight update")
except SystemExit as e:
    print(f"rank {par.rank}: {e}", flush=True)
# gloo's threads left to interpreter exit sometimes abort it (SIGABRT, "terminate called without an
# active exception"), and that rank fails
dist.destroy_process_group()
"""


@pytest.mark.cores
def test_a_node_whose_update_fails_stops_the_step_on_every_rank(tmp_path):
    """Two ranks, each its own node to cluster.on_leaders (the script says so: the nodes need no torchrun here)."""
    script = tmp_path / "failing.py"
    script.write_text(FAILING)
    r = launch.python(script, ROOT, nproc=2, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank}: [cluster] the weight update on node 1 (http://10.0.0.1:30000): RuntimeError: "
                "SGLang /update_weights_from_disk failed (HTTP 400): out of disk") in r.stdout, r.stdout[-2000:]


def test_a_server_killed_mid_rollout_is_restarted_and_no_sample_is_lost(ckpt, processor, records, tmp_path):
    """Disk sync: a node's server killed while requests are in flight comes back at once (Server.watch)
    with the weights it had; the router retries what it held elsewhere, so every sample is accounted
    for (completed, or failed with its reason), and the restarted server serves the next rollout."""
    import signal
    import threading
    import time
    from test_sglang_engine import held, wait_for
    rec, gate = tmp_path / "requests.jsonl", tmp_path / "gate"
    gate.touch()  # every request held in its server's queue until b is killed with some of them; then 1 s there
    kw = dict(server_args=["--fake-record", str(rec), "--fake-hold", "queue", "--fake-gate", str(gate), "--fake-delay", "1"],
              launch_cmd=[sys.executable, FAKE], timeout=30, api_key="k")
    a = SGLangEngine(ckpt, tmp_path, name="node00", **kw)
    b = SGLangEngine(ckpt, tmp_path, name="node01", **kw)
    try:
        b.server.watch(every=0.2)
        # the router's health check and circuit breaker every second (defaults: 60 s), as a test can wait
        a.attach_router([a.server.url, b.server.url], ["--balance-abs-threshold", "0", "--balance-rel-threshold", "1.0",
                                                       "--health-check-interval-secs", "1", "--cb-timeout-duration-secs", "1"])
        killed, url = b.server.proc.pid, b.server.url

        def kill():
            held(rec, 1, pid=killed)
            os.killpg(killed, signal.SIGKILL)
            gate.unlink()
        threading.Thread(target=kill).start()
        args = rollout_args(n_samples_per_prompt=4)
        samples = fakes.run_episodes(a, processor, records, args)
        assert len(samples) == len(records) * 4
        assert all(s.status == "completed" or s.fail_reason for s in samples)
        calls = [json.loads(line) for line in rec.read_text().splitlines()]  # b had requests when it died
        assert any(c["pid"] == killed and c["path"] == "/generate" for c in calls)
        print(f"\nkilled mid-rollout: {sum(s.status == 'completed' for s in samples)} of {len(samples)} completed, "
              f"failed: {sorted({s.fail_reason[:80] for s in samples if s.fail_reason})}")
        wait_for(lambda: b.server.restarts == 1 and b.server._healthy(1.0), "b restarted")
        assert b.server.url == url  # the same port: the router knows it by its URL
        wait_for(lambda: healthy_workers(a.front.url) == 2, "the router's health checks see b again")
        time.sleep(3)  # the router's circuit breaker lets b in again (not its /readiness: that says 2 at once)
        n = len(rec.read_text().splitlines())
        assert all(s.status == "completed" for s in fakes.run_episodes(a, processor, records, args))
        pids = {json.loads(line)["pid"] for line in rec.read_text().splitlines()[n:]}
        assert b.server.proc.pid != killed and len(pids) == 2  # both serve again, the restarted one too
    finally:
        a.shutdown()
        b.shutdown()
    assert (tmp_path / "sglang_node01.log").read_text().count("starting:") == 2


def test_an_abort_reaches_every_server_behind_the_router(ckpt, processor, records, tmp_path):
    """--partial-rollout with two servers: the router does not say which holds a request, so the abort
    names every request in flight to every server; each answers at once with what it had."""
    import threading
    from test_sglang_engine import held
    rec = tmp_path / "requests.jsonl"  # each request held before its token 3 until the abort
    kw = dict(server_args=["--fake-record", str(rec), "--fake-hold", "3"], launch_cmd=[sys.executable, FAKE], timeout=30)
    a = SGLangEngine(ckpt, tmp_path, name="node00", **kw)
    b = SGLangEngine(ckpt, tmp_path, name="node01", **kw)
    try:
        a.attach_router([a.server.url, b.server.url], ["--balance-abs-threshold", "0", "--balance-rel-threshold", "1.0"])
        items = [{"input_ids": [100 + i] * 20, "images": []} for i in range(8)]
        box = []
        t = threading.Thread(target=lambda: box.append(a.generate(items, dict(max_new_tokens=16))))
        t.start()
        assert len({h["pid"] for h in held(rec, 8)}) == 2  # every request at a server, on both servers
        a.abort()
        t.join(60)
        assert [(o["finish"], len(o["ids"])) for o in box[0]] == [("abort", 4)] * 8
    finally:
        a.shutdown()
        b.shutdown()
    calls = [json.loads(x) for x in rec.read_text().splitlines()]
    assert len({c["pid"] for c in calls if c["path"] == "/abort_request"}) == 2  # both servers were told


def test_routing_replay_with_several_servers_is_refused_before_any_starts(monkeypatch):
    """The router drops return_routed_experts: R3 with two servers on one node stops at start, by name."""
    import types
    import cluster
    import train_grpo as G
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rollout-engine", "sglang",
                         "--rollout-num-gpus-per-engine", "1", "--use-rollout-routing-replay",
                         "--sglang-launch-cmd", "x"])  # sglang need not be installed here
    monkeypatch.setattr(cluster.sglang_engine, "make_engine", lambda *a, **k: pytest.fail("a server started"))
    with pytest.raises(SystemExit, match="--use-rollout-routing-replay with several SGLang servers"):
        cluster.Servers(args, types.SimpleNamespace(rank=0, world=2, local_rank=0, local_world=2, node=0),
                        None, None, None, "x", "x")


def test_the_local_engine_takes_the_trainers_processor(ckpt, processor, tmp_path):
    """One processor a GRPO run: the local engine uses the trainer's (another load costs ~2 s of CPU a run)."""
    import types
    import cluster
    args = grpo_args(rollout_engine="local")
    servers = cluster.Servers(args, types.SimpleNamespace(rank=0, world=1, local_rank=0, local_world=1, node=0),
                              None, None, None, ckpt, tmp_path, processor)
    try:
        assert servers.engine.processor is processor
    finally:
        servers.shutdown()


@pytest.mark.parametrize("offload_train", [True, False])
def test_a_colocated_start_empties_each_ranks_cuda_cache_before_the_servers_start(monkeypatch, offload_train):
    """SGLang's TP ranks compare their GPUs' free memory at start and stop on a 10% gap (0.5.23's
    distributed/bootstrap.py:207-218): every rank parks its trainer (--offload-train) and empties PyTorch's cache
    before the barrier that precedes the start, with and without --offload-train."""
    import types
    import cluster
    import train_grpo as G
    calls = []
    monkeypatch.setattr(cluster.torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(cluster.dist, "barrier", lambda *a, **k: calls.append("barrier"))
    monkeypatch.setattr(cluster.Servers, "start", lambda self, *a: calls.append("start"))
    monkeypatch.setattr(cluster.offload, "Offload", lambda *a: types.SimpleNamespace(
        release=lambda: calls.append("park"), host_bytes=lambda: 0))
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rollout-engine", "sglang",
                         "--sglang-launch-cmd", "x", "--colocate",
                         "--offload-train" if offload_train else "--no-offload-train"])
    cluster.Servers(args, types.SimpleNamespace(rank=0, world=1, local_rank=0, local_world=1, node=0),
                    None, None, None, "x", "x")
    assert calls == (["park"] if offload_train else []) + ["empty_cache", "barrier", "start"]
