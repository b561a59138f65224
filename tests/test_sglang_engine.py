"""sglang_engine.py on CPU against tests/fake_sglang.py: protocol, weight sync, restarts, process
hygiene. The same engine against the REAL server: tests/test_sglang_real.py (opt-in).

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
import chat
import reward
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


def test_fake_expands_like_stock(ckpt, processor, records, tmp_path):
    """The fake server expands one pad per image by the checkpoint's processor and refuses what
    stock refuses: an expanded run (IndexError), a pad after an image's pads (AssertionError)."""
    import data
    from sglang_server import ServerError
    eng, rec = sglang(ckpt, tmp_path)
    try:
        pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        ims = records[0]["images"][:1]
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
    finally:
        eng.shutdown()


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


def test_sglang_killed_mid_rollout_restarts_and_retries(ckpt, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()  # the first server holds every request in its queue until it is killed
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "queue", "--fake-gate", str(gate), "--fake-children", "2",
                      env={"CUDA_VISIBLE_DEVICES": "1"})
    pgids = [eng.server.proc.pid]
    try:
        items = [(k, v * 1.01) for k, v in load_model(ckpt).state_dict().items()]
        eng.update_weights([items])
        digest = weights_digest(tmp_path / "weights" / "a")
        batch = [{"input_ids": [151644, 100 + i, 151645], "images": []} for i in range(8)]
        def kill():
            held(rec, 8)
            os.killpg(pgids[0], signal.SIGKILL)
            gate.unlink()
        killer = threading.Thread(target=kill)
        killer.start()
        outs = eng.generate(batch, dict(temperature=1.0, max_new_tokens=16))
        killer.join()
        assert eng.server.restarts == 1
        pgids.append(eng.server.proc.pid)
        for item, out in zip(batch, outs):  # every request answered once, in order, by the new weights
            assert out["ids"] == fake_output(item["input_ids"], 16, digest)[0] and out["finish"] == "stop"
        gens = [r for r in read_record(rec) if r["path"] == "/generate"]
        assert len({r["pid"] for r in gens}) == 2 and len(gens) == 16  # every one retried on the new server
        assert eng.server.model_path == str(tmp_path / "weights" / "a")  # restarted from the synced weights
        assert b"CUDA_VISIBLE_DEVICES=1" in Path(f"/proc/{eng.server.proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        eng.shutdown()
    assert all(group_members(g) == [] for g in pgids), [group_members(g) for g in pgids]


def test_a_server_restarted_while_released_is_released_again(ckpt, tmp_path):
    """Colocated, the server is released while the trainer trains. One that dies then comes back holding
    all its memory: the engine frees it again at once, so the resume (here the very call that found it
    dead, retried on the new server) names only regions the server freed: SGLang raises KeyError on
    another (weight_updater.py:389-390; the fake answers HTTP 500)."""
    eng, rec = sglang(ckpt, tmp_path)
    try:
        eng.release()
        first = eng.server.proc
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        eng.resume()
        assert eng.server.restarts == 1 and not eng.released
        calls = [(r["path"], r["json"]["tags"], r["pid"]) for r in read_record(rec) if "memory" in r["path"]]
        every = ["weights", "kv_cache", "cuda_graph"]
        assert [(p, sorted(t)) for p, t, _ in calls] == [("/release_memory_occupation", sorted(every))] * 2 + [
            ("/resume_memory_occupation", sorted(every))]
        assert calls[0][2] != calls[1][2] == calls[2][2]  # released again by the new server, then resumed
    finally:
        eng.shutdown()



def thread_gone(tid, timeout=30):
    """Wait until thread `tid` of this process has left the kernel's task list: PR_SET_PDEATHSIG, if armed for
    it, has been sent by then."""
    deadline = time.time() + timeout
    while Path(f"/proc/self/task/{tid}").exists():
        assert time.time() < deadline, f"thread {tid} still runs"
        time.sleep(0.05)


def test_a_child_started_from_a_pool_thread_outlives_the_pool():
    """proc.popen: PR_SET_PDEATHSIG follows the THREAD that forked the child (prctl(2)), so the launcher's
    child, forked by a pool's thread, would be SIGKILLed when that pool shuts down (rc -9); popen forks
    every child from a thread that lives as long as the process."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    import proc
    pool = ThreadPoolExecutor(1)
    child, tid = pool.submit(lambda: (proc.popen(["sleep", "60"], subprocess.DEVNULL), threading.get_native_id())).result()
    try:
        deadline = time.time() + 20  # armed once the launcher has exec'd sleep
        while Path(f"/proc/{child.pid}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
            assert time.time() < deadline and child.poll() is None, child.returncode
            time.sleep(0.05)
        pool.shutdown(wait=True)
        thread_gone(tid)
        with pytest.raises(subprocess.TimeoutExpired):  # alive: a SIGKILL sent at the thread's exit ends it at once
            pytest.fail(f"the child ended with its pool's thread: rc {child.wait(1.0)}")
    finally:
        child.kill()
        child.wait()


def test_a_server_an_episode_restarted_outlives_the_pause(ckpt, processor, records, tmp_path):
    """The server killed mid-rollout is restarted by the episode thread whose request failed; Rollout.pause()
    shuts the episodes' pool down, and the restarted server still serves: one restart in all."""
    gate = tmp_path / "gate"  # every request held in the queue until the server is killed with one
    gate.touch()
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "queue", "--fake-gate", str(gate))
    try:
        ro = rollout.Rollout(eng, processor, rollout_args(), target=len(records))
        killed = eng.server.proc.pid
        ro.resume(records, 0)
        held(rec)
        os.killpg(killed, signal.SIGKILL)
        gate.unlink()
        assert len(ro.take(len(records))) == 2 * len(records)
        episodes = [t for t in threading.enumerate() if t.name.startswith("episode")]
        ro.pause()
        for t in episodes:
            t.join(30)
            thread_gone(t.native_id)
        assert eng.server.proc.pid != killed and eng.server.proc.poll() is None
        out = eng.generate([{"input_ids": [151644, 100, 151645], "images": []}], dict(max_new_tokens=16))[0]
        assert out["finish"] == "stop" and eng.server.restarts == 1, (out, eng.server.log_tail())
        assert eng.server.log_path.read_text().count("starting:") == 2
    finally:
        eng.shutdown()

def test_sglang_start_failures_quote_log_and_leave_nothing(ckpt, tmp_path):
    with pytest.raises(RuntimeError, match="failing to start as asked"):
        sglang(ckpt, tmp_path / "a", "--fake-startup", "-1")
    from sglang_server import _LIVE
    before = set(_LIVE)
    # 15 s: time for the fake to start and print its children on a loaded machine (2 s was flaky)
    with pytest.raises(RuntimeError, match="not healthy after 15s") as e:
        sglang(ckpt, tmp_path / "b", "--fake-startup", "120", "--fake-children", "1", timeout=15)
    assert "fake sglang children=" in str(e.value)
    log = (tmp_path / "b" / "sglang.log").read_text()
    pid = int(log.split("pid=")[1].split()[0])
    assert group_members(pid) == [] and set(_LIVE) <= before


CHILD = """
import signal, sys, time
sys.path[:0] = [{root!r}]
# Ctrl-C as a terminal delivers it: a job started in the background (`cmd &`, CI) inherits SIGINT
# ignored, which Python and the trainer keep, and this child would sleep through the test's SIGINT
signal.signal(signal.SIGINT, signal.default_int_handler)
from sglang_engine import SGLangEngine
eng = SGLangEngine({ckpt!r}, sys.argv[2], server_args=["--fake-children", "1"],
                   launch_cmd=[sys.executable, {fake!r}], timeout=60)
print(eng.server.proc.pid, flush=True)
if sys.argv[1] == "exit":
    sys.exit(0)
if sys.argv[1] == "error":
    raise RuntimeError("trainer crashed")
time.sleep(120)
"""


def test_sglang_server_dies_with_its_parent(ckpt, tmp_path):
    """Normal exit, an exception, Ctrl-C and SIGTERM in the trainer all end the server's group. The trainers
    are forked from the tests' forkserver (tests/launch.py): they start without importing torch again."""
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(Path(rollout.__file__).parent), ckpt=str(ckpt), fake=FAKE))
    modes = {"exit": None, "error": None, "sigint": signal.SIGINT, "sigterm": signal.SIGTERM,
             "sigkill": signal.SIGKILL}  # SIGKILL (OOM): no handler runs; PR_SET_PDEATHSIG does it
    jobs = {m: launch.start(script, m, tmp_path / m) for m in modes}
    try:
        for mode, job in jobs.items():
            deadline = time.time() + 60
            while not job.printed().endswith("\n"):  # the server's group, once it is up
                assert job.poll() is None and time.time() < deadline, (mode, job.wait(5).stderr[-2000:])
                time.sleep(0.1)
            pgid = int(job.printed())
            if modes[mode] is not None:
                assert group_members(pgid, wait=0)  # the server is up until we signal its parent
                os.kill(job.pid, modes[mode])
            job.wait(60)
            assert group_members(pgid) == [], (mode, group_members(pgid))
    finally:
        for job in jobs.values():
            job.kill()


def test_proc_launcher_dies_with_its_parent(tmp_path):
    """proc.py: the launched command is SIGKILLed when its parent dies; a launcher whose parent is
    already gone (not the pid it was given) exits without running the command."""
    import subprocess
    launcher = str(Path(rollout.__file__).with_name("proc.py"))
    flag = tmp_path / "ran"
    r = subprocess.run([sys.executable, launcher, "1", "touch", str(flag)], timeout=30)
    assert r.returncode == 0 and not flag.exists()
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, subprocess, sys, time\n"
        f"c = subprocess.Popen([sys.executable, {launcher!r}, str(os.getpid()), 'sleep', '60'])\n"
        "print(c.pid, flush=True)\ntime.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    deadline = time.time() + 20  # the launcher execs sleep (slow under load: it failed once at 0.5 s)
    while time.time() < deadline and Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] != b"sleep":
        time.sleep(0.1)
    assert Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")[0] == b"sleep"
    parent.kill()
    parent.wait()
    deadline = time.time() + 10
    while time.time() < deadline and group_members(os.getpgid(0), wait=0).count(child):
        time.sleep(0.1)
    assert child not in group_members(os.getpgid(0), wait=0)


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


def test_an_abort_lands_mid_generation_and_the_rest_continues_it(ckpt, processor, records, tmp_path):
    """--partial-rollout's abort is SGLang's abort_all (AbortReq); the server answers each /generate in flight
    with what it had (finish "abort"), and a request for the rest continues it into the answer the server
    gives uninterrupted (the fake's, like greedy decoding's, a function of the ids before each token)."""
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "3")  # each request holds before its turn's token 3
    try:
        messages, _, _ = chat.prompt(processor, records[0])
        prompt = chat.encode_prompt(processor, messages, records[0]["images"])
        item, sp, box = {"input_ids": prompt, "images": records[0]["images"]}, dict(max_new_tokens=16), []
        t = threading.Thread(target=lambda: box.append(eng.generate([item, item], sp)))
        t.start()
        held(rec, 2)
        eng.abort()
        t.join(60)
        assert [c["finish"] for c in box[0]] == ["abort"] * 2 and [len(c["ids"]) for c in box[0]] == [4, 4], box
        cut = box[0][0]
        rest = eng.generate([dict(item, input_ids=prompt + cut["ids"])], sp)[0]
        ids, lps, finish = fake_output(prompt, 16, weights_digest(ckpt))
        assert (cut["ids"] + rest["ids"], cut["logprobs"] + rest["logprobs"], rest["finish"]) == (ids, lps, finish)
        assert [r["json"] for r in read_record(rec) if r["path"] == "/abort_request"] == [{"abort_all": True}]
    finally:
        eng.shutdown()


def aborted_answer(eng, rec, item, sp):
    """The engine's answer to `item` once the server holds it (--fake-hold) and an abort comes."""
    box = []
    t = threading.Thread(target=lambda: box.append(eng.generate([item], sp)[0]))
    t.start()
    held(rec)
    eng.abort()
    t.join(60)
    return box[0]


def parked(processor, rec, args, n):
    """(record, prompt, [episode]): a --partial-rollout group parked with n tokens of a turn (not FAKE_IDS)."""
    prompt = chat.prompt(processor, rec, args.max_turns > 1)
    ep = rollout.new_episode(processor, rec, args, prompt)
    s = ep.sample
    s.response_ids, s.loss_mask, s.rollout_logprobs, s.versions = [100] * n, [1] * n, [-1.0] * n, [0] * n
    return rec, prompt, [ep]


def test_an_abort_that_lands_on_a_turns_last_token_ends_the_turn(ckpt, processor, records, tmp_path, monkeypatch):
    """SGLang answers finish "abort" for a request its abort caught one decode step before its end: that step's
    token is kept, and the abort is checked before the stop and length checks (schedule_batch.py:2007-2014).
    The engine reports what ended the turn. Here --partial-rollout stops (a parked group needs one token) while
    record 1's sample is held before its <|im_end|> (--fake-hold 6; the parked group's request goes once it is):
    its turn ends there, decoded and scored, every token trained, and the next rollout sends nothing more for it.
    At the length cap: "length"."""
    args = rollout_args(n_samples_per_prompt=1, rollout_batch_size=1, partial_rollout=True, over_sampling_batch_size=2,
                        rollout_max_response_len=11)
    recs = [dict(r, index=i, images=[]) for i, r in enumerate(records[:2])]  # text: no image processor to load
    eng, rec = sglang(ckpt, tmp_path / "stop", "--fake-hold", "6")
    try:
        parked_goes_after(eng, lambda: held(rec))
        monkeypatch.setitem(reward.SHAPING, "length", reward.Shaping(lambda s, rec, cfg: len(s.response_text), {}))
        ro = rollout.Rollout(eng, processor, args, target=1, cap=2)
        ro.groups = {0: parked(processor, recs[0], args, 10)}
        ro.resume(recs[1:], 0)
        first = ro.take(1)
        ro.pause()
        assert [(s.index, s.status) for s in first] == [(0, "truncated")]  # its one token: the length cap
        [(_, _, [ep])] = ro.groups.values()  # complete too, beyond the batch: it waits for the next step
        s, (ids, lps, _) = ep.sample, fake_output(ep.sample.prompt_ids, 11, weights_digest(ckpt))
        text = processor.tokenizer.decode(ids[:-1], skip_special_tokens=False)
        assert ep.done and ids[-1] == 151645 and (s.status, s.turns, s.response_ids, s.rollout_logprobs) == (
            "completed", 1, ids, lps)
        assert s.loss_mask == [1] * 7 and s.response_text == text and s.metadata["shaping"]["length"] == len(text)
        n = len(read_record(rec))
        ro.resume([], 1)
        assert [x.index for x in ro.take(1)] == [1]
        ro.pause()
        assert len(read_record(rec)) == n and ro.groups == {}  # nothing generated after its <|im_end|>
    finally:
        eng.shutdown()
    eng, rec = sglang(ckpt, tmp_path / "length", "--fake-hold", "0")
    try:
        item = {"input_ids": [151644, 100, 151645], "images": []}
        out = aborted_answer(eng, rec, item, dict(max_new_tokens=1))
        assert (len(out["ids"]), out["finish"]) == (1, "length")
    finally:
        eng.shutdown()


def test_an_abort_before_any_token_leaves_an_r3_sample_open(ckpt, processor, records, tmp_path):
    """R3 + --partial-rollout: a request aborted in SGLang's queue (or mid chunked prefill) answers no tokens and no
    routed_experts (scheduler.py:5685-5702, 3807-3827): nothing generated yet, not an error; the sample stays
    open and its continuation asks routes from where they end (routed_rows)."""
    eng, rec = sglang(ckpt, tmp_path, "--fake-hold", "queue", "--enable-return-routed-experts")
    try:
        eng.route_shape = (json.loads((Path(ckpt) / "config.json").read_text())["text_config"]["num_hidden_layers"], 2)
        out = aborted_answer(eng, rec, {"input_ids": [151644, 100, 151645], "images": []}, dict(max_new_tokens=8))
        assert out == {"ids": [], "logprobs": [], "finish": "abort", "prompt_tokens": None}
        args = rollout_args()
        _, _, [ep] = parked(processor, records[0], args, 0)
        assert rollout._finish_turn(ep, out, processor, args, [151645, 151643], ours=True)
        assert ep.sample.status == "completed" and rollout.routed_rows(ep.sample) == 0
    finally:
        eng.shutdown()


def test_a_hung_abort_holds_no_lock_of_the_rollout(ckpt, processor, records, tmp_path):
    """--partial-rollout's abort goes to each server with a short timeout and never under the rollout's lock:
    here the server takes 60 s to answer it (--fake-abort-delay), the abort never lands, and the request it
    meant to cut (record 1's, held before its token 4 until the abort has come: --fake-hold 4 with a gate) ends on
    its own; the rollout ends once it has, after one ABORT_TIMEOUT, not after 60 s."""
    args = rollout_args(n_samples_per_prompt=1, rollout_batch_size=1, partial_rollout=True, over_sampling_batch_size=2,
                        rollout_max_response_len=11)
    recs = [dict(r, index=i, images=[]) for i, r in enumerate(records[:2])]  # text: no image processor to load
    gate = tmp_path / "gate"
    gate.touch()
    eng, rec = sglang(ckpt, tmp_path, "--fake-abort-delay", "60", "--fake-hold", "4", "--fake-gate", str(gate))

    def release():  # the gate goes once the abort has reached the server (which answers it in 60 s)
        wait_for(lambda: any(r["path"] == "/abort_request" for r in read_record(rec)), "the abort at the server")
        gate.unlink()
    try:  # the parked group needs 3 tokens (never its token 4), record 1's group 7: held before its 4th
        parked_goes_after(eng, lambda: held(rec))
        ro, t = rollout.Rollout(eng, processor, args, target=1, cap=2), time.time()
        ro.groups = {0: parked(processor, recs[0], args, 8)}
        threading.Thread(target=release, daemon=True).start()
        ro.resume(recs[1:], 0)
        first = ro.take(1)
        ro.pause()
        took = time.time() - t
        assert [s.index for s in first] == [0] and [r["path"] for r in read_record(rec)].count("/abort_request") >= 1
        [(_, _, [ep])] = ro.groups.values()
        assert ep.done and ep.sample.status == "completed" and len(ep.sample.response_ids) == 7  # it ended on its own
        assert took < 30, f"the rollout waited {took:.0f} s for an abort the server took 60 s to answer"
    finally:
        eng.shutdown()


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
