"""sglang_engine.py on CPU against tests/fake_sglang.py: protocol, weight sync (server processes:
tests/test_sglang_processes.py; aborts: test_sglang_abort.py). The same engine against the REAL server:
tests/test_sglang_real.py (opt-in). The fake server's helpers here are shared with those files.

    .venv/bin/pytest tests/test_sglang_engine.py -q
"""
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

import launch
import rollout
import fakes
from fake_sglang import fake_output, weights_digest
from sglang_engine import collapse_image_pads, read_image_token_id, sglang_server_args
from conftest import rollout_args
from test_rollout import load_model

FAKE = str(Path(__file__).with_name("fake_sglang.py"))

def test_sglang_server_args():
    assert sglang_server_args([]) == []
    assert sglang_server_args(["--sglang-mem-fraction-static", "0.7", "--sglang-tp-size=2",
                                       "--sglang-cuda-graph-bs", "1", "2", "4", "--sglang-enable-memory-saver",
                                       "--sglang-mm-attention-backend", "sdpa"]) == [
        "--mem-fraction-static", "0.7", "--tp-size", "2", "--cuda-graph-bs", "1", "2", "4",
        "--enable-memory-saver", "--mm-attention-backend", "sdpa"]
    with pytest.raises(SystemExit, match="--lr-typo"):
        sglang_server_args(["--lr-typo", "1"])
    import argparse
    p = rollout.add_args(argparse.ArgumentParser(allow_abbrev=False))
    a, rest = p.parse_known_args(["--max-turns", "3", "--sglang-tp-size", "2"])
    assert a.max_turns == 3 and sglang_server_args(rest) == ["--tp-size", "2"]


# ---------------------------------------------------------------------------------- SGLang engine
def group_members(pgid, wait=5.0):
    """Live pids whose process group is `pgid`, from /proc; waits up to `wait` s for it to empty.
    (Zombies are dead: an orphan's wait status is reaped by PID 1, if this container's does.)"""
    deadline = time.time() + wait
    while True:
        out = []
        for d in Path("/proc").iterdir():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split() if d.name.isdigit() else None
            except OSError:
                continue
            if fields and int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(d.name))
        if not out or time.time() > deadline:
            return out


def read_record(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []


def wait_for(ready, what, timeout=60):
    """Until ready() (the test's event: read every 10 ms); failing after `timeout` s, naming `what`."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"not within {timeout}s: {what}"
        time.sleep(0.01)


def held(rec, n=1, pid=None):
    """Until the fake server holds `n` requests (--fake-hold; of server `pid`, if given) -> their records."""
    def now():
        return [r for r in read_record(rec) if r["path"] == "(held)" and pid in (None, r["pid"])]
    wait_for(lambda: len(now()) >= n, f"{n} requests held by the fake server")
    return now()


def parked_goes_after(eng, ready):
    """eng.generate, but a parked group's request (its ids end with parked()'s 100s) goes only once ready()."""
    plain = eng.generate

    def generate(batch, sp):
        if batch[0]["input_ids"][-1] == 100:
            wait_for(ready, "the test's event before the parked group's request")
        return plain(batch, sp)
    eng.generate = generate


def sglang(ckpt, run_dir, *extra, **kw):
    from sglang_engine import SGLangEngine
    rec = Path(run_dir) / "requests.jsonl"
    eng = SGLangEngine(ckpt, run_dir, server_args=["--fake-record", str(rec), *extra],
                       launch_cmd=[sys.executable, FAKE], timeout=kw.pop("timeout", 30), **kw)
    return eng, rec


def test_sglang_protocol_and_weight_sync(ckpt, processor, records, tmp_path):
    eng, rec = sglang(ckpt, tmp_path, "--mem-fraction-static", "0.5", "--cuda-graph-bs", "1", "2")
    try:
        # the dtype said explicitly (SGLang's auto would serve this float32 checkpoint in float16), and
        # the vision-feature cache off (it would outlive weight updates)
        assert ("passthrough=[\"--mem-fraction-static\", \"0.5\", \"--cuda-graph-bs\", \"1\", \"2\", "
                "\"--dtype\", \"float32\"]") in eng.server.log_tail()
        assert "starting: SGLANG_VLM_CACHE_SIZE_MB=0 " in eng.server.log_tail()
        samples = fakes.run_episodes(eng, processor, records[:2], rollout_args(rollout_max_response_len=64))
        digest = weights_digest(ckpt)
        for s in samples:
            ids, lps, finish = fake_output(s.prompt_ids, 64, digest)
            assert s.response_ids == ids and s.rollout_logprobs == lps and s.status == "completed"
        gens = [r for r in read_record(rec) if r["path"] == "/generate"]
        assert len(gens) == 4
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        sent = sorted(r["json"]["input_ids"] for r in gens)
        assert sent == sorted(collapse_image_pads(s.prompt_ids, pad) for s in samples)  # one pad per image
        for r in gens:
            body = r["json"]
            assert body["input_ids"].count(pad) == 1
            assert set(body) == {"input_ids", "image_data", "sampling_params", "return_logprob"}
            assert len(body["image_data"]) == 1 and body["image_data"][0].startswith("data:image/png;base64,")
            assert body["sampling_params"] == {"temperature": 0.8, "top_p": 1.0, "top_k": -1, "max_new_tokens": 64,
                                               "stop_token_ids": [151645, 151643], "skip_special_tokens": False,
                                               "no_stop_trim": True}
        state = load_model(ckpt).state_dict()
        items = [(k, v + 0.01) for k, v in state.items()]
        assert eng.update_weights([items[:30], items[30:]]) == len(items)
        paths = [r["path"] for r in read_record(rec)]
        assert paths[-1] == "/update_weights_from_disk"  # the server flushes by itself: no /flush_cache
        # two image pads for one image: stock's IndexError, HTTP 500; that sample fails, not the run
        bad = eng.generate([{"input_ids": [1, pad, 2, pad, 3], "images": samples[0].images}],
                           dict(max_new_tokens=4))[0]
        assert bad["finish"] == "abort" and "HTTP 500" in bad["error"]
        assert "IndexError: index 1 is out of bounds" in eng.server.log_tail()
        sync = [r for r in read_record(rec) if r["path"] == "/update_weights_from_disk"][-1]["json"]
        assert sync == {"model_path": str(tmp_path / "weights" / "a")}
        new = eng.generate([{"input_ids": samples[0].prompt_ids, "images": samples[0].images}],
                           dict(temperature=1.0, max_new_tokens=64))[0]
        assert new["ids"] == fake_output(samples[0].prompt_ids, 64, weights_digest(tmp_path / "weights" / "a"))[0]
        assert new["ids"] != samples[0].response_ids  # the server now runs the new weights
        eng.release()
        eng.resume()
        every = ["weights", "kv_cache", "cuda_graph"]  # SGLang's memory tags (sglang/srt/constants.py)
        assert [(r["path"], r["method"], r["json"]) for r in read_record(rec)][-2:] == [
            ("/release_memory_occupation", "POST", {"tags": every}),
            ("/resume_memory_occupation", "POST", {"tags": every})]
        # --offload-train's two-part resume; a region is never resumed twice (SGLang raises), and a
        # resume with nothing released sends nothing
        n = len(read_record(rec))
        eng.release()
        eng.resume(["weights"])
        eng.resume()
        eng.resume()
        assert [r["json"] for r in read_record(rec)][n:] == [{"tags": every}, {"tags": ["weights"]},
                                                             {"tags": ["kv_cache", "cuda_graph"]}]
    finally:
        eng.shutdown()



def test_a_16_bit_server_computes_its_lm_head_in_fp32(ckpt, tmp_path, monkeypatch):
    """SGLang 0.5.23 multiplies the LM head in the weights' dtype (logits_processor.py:1198-1201): every 16-bit
    server (bf16 and fp16, each spelling --dtype takes, or the checkpoint's own dtype) gets --enable-fp32-lm-head,
    once if the user gave it; a float32 one needs none."""
    import torch
    import sglang_engine
    made = []
    monkeypatch.setattr(sglang_engine, "Server", lambda path, run_dir, args, *a, **kw: made.append(args))
    spellings = {"bfloat16": ["bf16"], "float16": ["half", "fp16"], "float32": ["float"]}
    for dtype, names in spellings.items():
        fp32_head = ["--enable-fp32-lm-head"] if getattr(torch, dtype).itemsize == 2 else []
        for name in (dtype, *names):
            made.clear()
            sglang_engine.SGLangEngine(ckpt, "unused", server_args=["--dtype", name])
            sglang_engine.SGLangEngine(ckpt, "unused", server_args=["--enable-fp32-lm-head", "--dtype", name])
            assert made[0] == ["--dtype", name, *fp32_head], made
            assert made[1] == ["--enable-fp32-lm-head", "--dtype", name], made
        cfg = json.loads((Path(ckpt) / "config.json").read_text())
        (tmp_path / dtype).mkdir()
        (tmp_path / dtype / "config.json").write_text(json.dumps(dict(cfg, torch_dtype=dtype, dtype=dtype)))
        made.clear()
        sglang_engine.SGLangEngine(tmp_path / dtype, "unused")  # no --dtype: the checkpoint's
        assert made == [["--dtype", dtype, *fp32_head]], (dtype, made)
    assert {d for d in spellings if getattr(torch, d).itemsize == 2} == {"bfloat16", "float16"}


def test_image_pad_id_from_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"image_token_id": 248056}))  # Qwen3.5's
    assert read_image_token_id(tmp_path) == 248056
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 10}))  # a text-only model
    assert read_image_token_id(tmp_path) is None
    assert collapse_image_pads([1, 7, 7, 7, 2, 7, 3, 7, 7], 7) == [1, 7, 2, 7, 3, 7]
    assert collapse_image_pads([1, 2], 7) == [1, 2]


@pytest.mark.parametrize("counts", ["image service", "own processor"])
def test_fake_expands_like_stock(ckpt, processor, records, tmp_path, monkeypatch, counts):
    """The fake server expands one pad per image by the checkpoint's processor and refuses what
    stock refuses: an expanded run (IndexError), a pad after an image's pads (AssertionError). Under pytest the
    processor is conftest's image service's (tests/image_counts.py); a fake server run by hand loads its own."""
    import data
    import image_counts
    from sglang_server import ServerError
    if counts == "own processor":
        monkeypatch.delenv(image_counts.IMAGES_SOCKET)
    eng, rec = sglang(ckpt, tmp_path)
    try:
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        ims = data.views(records[0]["images"][:1])
        text = "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>\n<|im_start|>assistant\n"
        expanded = list(processor(text=[text], images=ims)["input_ids"][0])
        one = collapse_image_pads(expanded, pad)
        assert len(expanded) > len(one) and one.count(pad) == 1
        uris = [data.image_to_data_uri(im) for im in ims]

        def post(ids, images):
            return eng.server.post("/generate", {"input_ids": ids, "image_data": images, "return_logprob": True,
                                                  "sampling_params": {"max_new_tokens": 2}})
        assert post(one, uris)["meta_info"]["prompt_tokens"] == len(expanded)
        assert post(one, uris * 2)["meta_info"]["prompt_tokens"] == len(expanded)  # stock ignores extras
        at = one.index(pad)
        twice = one[:at] + [pad] + one[at:]  # two images, their pads adjacent: an expanded run
        for ids, images, error in ((expanded, uris, "IndexError"), (twice, uris * 2, "AssertionError")):
            with pytest.raises(ServerError, match="HTTP 500: Internal Server Error"):
                post(ids, images)
            assert error in eng.server.log_tail(2)
        torch_loaded = "libtorch" in Path(f"/proc/{eng.server.proc.pid}/maps").read_text()  # the processor's import
        assert torch_loaded == (counts == "own processor"), f"{counts}: torch loaded in the fake server {torch_loaded}"
    finally:
        eng.shutdown()


def test_the_image_service_outlives_an_asker_killed_and_names_what_failed(ckpt, tmp_path, monkeypatch):
    """tests/image_counts.py: an asker gone before its answer (a fake server killed mid-request) raises nothing in
    the service, which answers the next; a checkpoint it cannot load comes back to the asker, named."""
    import socket
    import data
    import image_counts
    from PIL import Image
    raised = []
    monkeypatch.setattr(threading, "excepthook", raised.append)
    uri = data.image_to_data_uri(Image.new("RGB", (64, 48)))
    name = f"test_images.{os.getpid()}.{os.urandom(4).hex()}"
    listener = image_counts.serve_image_counts(name)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # asks, and is gone before the answer
            s.connect("\0" + name)
            s.sendall(json.dumps({"model_path": str(ckpt), "images": [uri]}).encode() + b"\n")
        with pytest.raises(RuntimeError, match=f"{name}: the image service failed: .*{tmp_path}"):
            image_counts.ask_image_counts(name, str(tmp_path), [uri])
        want = image_counts.processor_counts(image_counts.load_image_processor(ckpt), [uri])
        assert image_counts.ask_image_counts(name, str(ckpt), [uri]) == want
        wait_for(lambda: image_counts.ANSWER not in [t.name for t in threading.enumerate()], "the answers sent")
        assert raised == []
    finally:
        listener.close()


def test_failed_weight_update_raises_the_servers_message(ckpt, tmp_path):
    eng, rec = sglang(ckpt, tmp_path, env={"CUDA_VISIBLE_DEVICES": "3", "FAKE_TAG": "x y"})
    try:
        environ = Path(f"/proc/{eng.server.proc.pid}/environ").read_bytes().split(b"\0")
        assert b"CUDA_VISIBLE_DEVICES=3" in environ and b"FAKE_TAG=x y" in environ  # env reaches the server
        state = load_model(ckpt).state_dict()
        eng.update_weights([[(k, v * 1.01) for k, v in state.items()]])
        good = eng.server.model_path
        digest = weights_digest(good)
        with pytest.raises(RuntimeError, match=r"HTTP 400\): \S+ is not a checkpoint folder"):
            eng.update_weights([])  # no tensors: the fake refuses the folder, as stock refuses a bad one
        # a restart would still come up from the last good weights, untouched by the failed sync
        assert eng.server.model_path == good == str(tmp_path / "weights" / "a") and weights_digest(good) == digest
        assert [r["path"] for r in read_record(rec)] == ["/update_weights_from_disk"] * 2
        eng.update_weights([list(state.items())])  # the next sync takes the other folder again
        assert eng.server.model_path == str(tmp_path / "weights" / "b")
    finally:
        eng.shutdown()


def test_sync_after_the_start_checkpoint_is_pruned(ckpt, tmp_path):
    """A resumed run's server starts from iter_N, which --save-keep later deletes: syncs take their
    config/tokenizer files from config_dir (the run's --hf-checkpoint), not from that folder."""
    import shutil
    start = tmp_path / "iter_0000002"
    shutil.copytree(ckpt, start)
    eng, rec = sglang(start, tmp_path / "run", config_dir=ckpt)
    try:
        shutil.rmtree(start)  # pruned
        items = [(k, v * 1.01) for k, v in load_model(ckpt).state_dict().items()]
        assert eng.update_weights([items]) == len(items)
        synced = Path(eng.server.model_path)
        assert (synced / "config.json").read_bytes() == (Path(ckpt) / "config.json").read_bytes()
    finally:
        eng.shutdown()


@pytest.mark.parametrize("mode", ["tensor", "distributed"])
def test_weight_sync_without_the_disk_is_bit_exact(mode, ckpt, tmp_path):
    """The tensors that reach the server are export_hf's, bit for bit, in the server's dtype; the
    session is begin ... end with one flush; nothing is written under weights/. A restarted server
    holds its launch weights, so its answers are dropped until the next sync."""
    import torch
    import convert
    import model as M
    from safetensors.torch import load_file
    dump = tmp_path / "dump"
    dump.mkdir()
    eng, rec = sglang(ckpt, tmp_path / "run", "--fake-dump", str(dump), "--dtype", "bfloat16", weight_sync=mode)
    try:
        model = M.load_model(ckpt)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)  # values bf16 must round
        want = {k: v.to(torch.bfloat16) for b in convert.export_hf(model, bucket_bytes=1 << 16) for k, v in b}
        n = eng.update_weights(convert.export_hf(model, bucket_bytes=1 << 16))
        got = load_file(str(dump / "update_0.safetensors"))
        assert n == len(want) and got.keys() == want.keys()
        assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
        paths = [r["path"] for r in read_record(rec)]
        call = f"/update_weights_from_{mode}"
        assert paths[0] == "/begin_weight_update" if mode == "tensor" else paths[:2] == [
            "/begin_weight_update", "/init_weights_update_group"]
        assert paths[-2:] == ["/end_weight_update", "/flush_cache"] and paths.count(call) > 1  # buckets
        assert not (tmp_path / "run" / "weights").exists()
        bodies = [r["json"] for r in read_record(rec) if r["path"] == call]
        assert all(b["flush_cache"] is False for b in bodies)
        item = {"input_ids": [151644, 100, 151645], "images": []}
        assert "error" not in eng.generate([item], dict(max_new_tokens=4))[0]
        os.killpg(eng.server.proc.pid, signal.SIGKILL)
        out = eng.generate([item], dict(max_new_tokens=4))[0]  # restart + retry: launch weights
        assert eng.server.restarts == 1 and out["finish"] == "abort" and "launch weights" in out["error"]
        eng.update_weights(convert.export_hf(model))  # a new group too, for "distributed"
        assert "error" not in eng.generate([item], dict(max_new_tokens=4))[0]
        assert torch.equal(load_file(str(dump / "update_1.safetensors"))[next(iter(want))], want[next(iter(want))])
    finally:
        eng.shutdown()


IPC_WORKER = """
import sys
sys.path.insert(0, sys.argv[1])
import torch, cluster, parallel, model as M
from sglang_engine import SGLangEngine
ckpt, run_dir, fake, servers = *sys.argv[2:5], int(sys.argv[5])
par = parallel.init_distributed(1)
rank, world = par.rank, par.world
m = M.load_model(ckpt)
eng = None
if rank % (world // servers) == 0:  # each server's TP is 2: one blob a server TP rank
    d = f"{run_dir}/{rank}"
    eng = SGLangEngine(ckpt, d, server_args=["--fake-record", d + "/requests.jsonl", "--fake-dump", d + "/dump",
                       "--tp-size", "2"], launch_cmd=[sys.executable, fake], weight_sync="tensor")
plan = [eng.sync_plan() if eng else None]
torch.distributed.broadcast_object_list(plan)
servers_ = cluster.Servers.__new__(cluster.Servers)  # as Servers.start leaves it, with these servers
servers_.par, servers_.engine, servers_.off, servers_.per_node, servers_.group, servers_.plan = par, eng, None, servers, None, plan[0]
servers_.sync(m)
if eng:
    eng.shutdown()
"""


@pytest.mark.cores
@pytest.mark.parametrize("world,servers", [(2, 1), (4, 2)], ids=["one_server", "two_servers"])
def test_tensor_sync_to_a_tp2_server_sends_each_ranks_own_copy(ckpt, tmp_path, world, servers):
    """Server TP rank i opens only blob i (sglang tp_worker.py:194-201): trainer rank i serialises its
    own (GPU's) copy, so the two blobs differ (CPU: each names its own process's /dev/shm file) while
    their tensors are export_hf's, bit for bit. Two servers of TP 2 on one node's four ranks
    (--rollout-num-gpus-per-engine 2): ranks 0-1 feed the first, held by rank 0; ranks 2-3 the second."""
    import torch
    import convert
    import model as M
    from safetensors.torch import load_file
    holders = [r for r in range(world) if r % (world // servers) == 0]
    for r in holders:
        (tmp_path / str(r) / "dump").mkdir(parents=True)
    script = tmp_path / "ipc_worker.py"
    script.write_text(IPC_WORKER)
    r = launch.python(script, Path(__file__).parents[1], ckpt, tmp_path, FAKE, servers, nproc=world, timeout=300,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    want = {k: v for b in convert.export_hf(M.load_model(ckpt)) for k, v in b}
    blobs = []
    for h in holders:
        bodies = [x["json"] for x in read_record(tmp_path / str(h) / "requests.jsonl")
                  if x["path"] == "/update_weights_from_tensor"]
        assert bodies and all(len(set(b["serialized_named_tensors"])) == 2 for b in bodies)
        blobs += [blob for b in bodies for blob in b["serialized_named_tensors"]]
        got = load_file(str(tmp_path / str(h) / "dump" / "update_0.safetensors"))
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert len(set(blobs)) == len(blobs)  # every trainer rank sent its own copy, to its own server


def test_rollout_engine_sglang_without_sglang_stops_before_anything_loads(tmp_path, monkeypatch):
    import importlib.util
    import train_grpo
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "sglang" else find(name, *a))
    argv = ["--hf-checkpoint", str(tmp_path / "none"), "--prompt-data", "x", "--save", str(tmp_path / "run"),
            "--rollout-engine", "sglang"]
    with pytest.raises(SystemExit) as e:
        train_grpo.main(argv)
    assert e.value.code == ("--rollout-engine sglang: sglang is not installed in this python (`GPU=1 bash setup.sh` "
                            "installs it); or --rollout-engine local")
    assert not (tmp_path / "run").exists()  # stopped at the arguments: no run folder, no model


def test_watch_tries_again_after_a_failed_restart_while_restarts_are_left():
    """Server.watch(): a restart whose start fails (_recover raises RuntimeError: the new process died starting) is
    tried again at the next tick while restarts are left (a server only the router calls has no other restarter);
    out of restarts the watch ends, having said why."""
    import types
    from sglang_server import Server
    for max_restarts, fails in ((3, 2), (2, 5)):
        s = object.__new__(Server)
        s.name, s.epoch, s.restarts, s.max_restarts = f"t{max_restarts}", 0, 0, max_restarts
        s.proc = types.SimpleNamespace(poll=lambda: 1, returncode=1)  # dead
        up = threading.Event()

        def recover(epoch, error, s=s, fails=fails):
            if s.restarts >= s.max_restarts:
                raise RuntimeError("out of restarts")
            s.restarts += 1
            if s.restarts <= fails:
                raise RuntimeError("SGLang server exited with code 1 while starting")
            s.proc = types.SimpleNamespace(poll=lambda: None)  # up: the loop watches it from now on
            up.set()
        s._recover = recover
        s.watch(every=0.01)
        watcher = next(t for t in threading.enumerate() if t.name == f"sglang-watch-{s.name}")
        if fails < max_restarts:
            assert up.wait(30) and s.restarts == fails + 1
            s.proc = None  # stop(): the loop ends
        watcher.join(30)
        assert not watcher.is_alive() and s.restarts == min(fails + 1, max_restarts)
