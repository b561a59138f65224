"""SGLangEngine against the REAL SGLang 0.5.23 server on CPU (opt-in: marker `sglang_real`).

    bash ../shared/sglang_cpu/setup.sh /tmp/sglang-cpu                       # once: ~9 min, ~11 GB
    .venv/bin/python -m pytest -m sglang_real tests/test_sglang_real.py -s   # -s prints timings
    SGLANG_CPU_DIR=/elsewhere .venv/bin/python -m pytest -m sglang_real ...  # harness elsewhere

The harness (../shared/sglang_cpu/README.md) is stock sglang in its own venv with two stand-ins;
its env.sh is the one source of the environment the server needs, handed to SGLangEngine(env=).
One server serves the TestRealServer class (one more comes up when its kill test restarts it),
and it is stopped before the trainer runs start theirs: one ~5 GB server at a time. Checked too,
in the harness python: the fake server's field whitelists are subsets of sglang's own request
classes, every request our engine sent parses with those classes, and SGLang's own request
processing (TokenizerManager._tokenize_one_request, private API) turns our requests into exactly
the expanded ids the rollout holds.
"""
import json
import os
import re
import signal
import subprocess
import time
import types
from pathlib import Path

import pytest
import torch

import data
import engines
import launch
import chat
import rollout
import fakes
from conftest import rollout_args
from sglang_engine import SGLangEngine

ROOT = Path(__file__).resolve().parents[1]
HARNESS = Path(os.environ.get("SGLANG_CPU_DIR", "/tmp/sglang-cpu"))
PY = HARNESS / "venv" / "bin" / "python"
pytestmark = [pytest.mark.sglang_real]
if not ((HARNESS / "env.sh").exists() and PY.exists()):
    # a skip mark (not pytest.skip in a fixture): pytest folds it into ONE summary line
    pytestmark.append(pytest.mark.skip(reason=f"real SGLang harness not set up in {HARNESS}: run `bash "
                                              f"../shared/sglang_cpu/setup.sh {HARNESS}` or set SGLANG_CPU_DIR"))
# The launch flags that work on CPU (../shared/sglang_cpu/README.md).
FLAGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--skip-server-warmup",
         "--mem-fraction-static", "0.5", "--disable-radix-cache", "--max-total-tokens", "8192", "--dtype", "float32"]
GREEDY = dict(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def harness_env():
    """The variables the harness's env.sh sets, as bash leaves them after sourcing it."""
    env_sh = HARNESS / "env.sh"
    names = re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", "\n".join(
        line for line in env_sh.read_text().splitlines() if line.startswith("export ")))
    out = subprocess.run(["bash", "-c", f'source "{env_sh}" && env -0'], capture_output=True, check=True).stdout
    after = dict(entry.partition("=")[::2] for entry in out.decode().split("\0") if "=" in entry)
    return {name: after[name] for name in names}


def test_the_env_of_a_colocated_server_is_sglangs_own(harness_env):
    """The variables sglang_placement sets for a colocated server are fields of this SGLang's `envs` (a name SGLang does
    not define would be ignored in silence), default on but the graphs' (issue 75 item 8): read from the harness's
    sglang/srt/environ.py."""
    import train_grpo as G
    from sglang_engine import sglang_placement
    args = G.parse_args(["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--rollout-engine", "sglang",
                         "--sglang-launch-cmd", "x", "--colocate"])
    names = sorted(k for k in sglang_placement(args, True, 1, 1)[1] if k.startswith("SGLANG_"))
    code = "import sglang.srt.environ as e; print(open(e.__file__).read())"
    text = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=dict(os.environ, **harness_env)).stdout
    assert len(names) == 3 and all(f"{n} = EnvBool(" in text for n in names), names  # each a field SGLang reads
    graphs = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"  # off by default: set so that releasing cuda_graph frees its pool
    assert f"{graphs} = EnvBool(False)" in text and all(f"{n} = EnvBool(True)" in text for n in names if n != graphs)


class Recording(SGLangEngine):
    """Keeps every (path, body) its server is sent, for the check against sglang's request classes."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sent, post = [], self.server.post

        def record(path, payload, timeout=None, url=None):
            self.sent.append((path, payload))
            return post(path, payload, timeout, url)
        self.server.post = record


class CropFirst(engines.Engine):
    """A prompt with one image is answered by a scripted crop call; later turns, which carry
    the problem's image and the crop, go to the real server."""

    def __init__(self, inner, processor):
        tok = processor.tokenizer
        self.inner, self.call = inner, tok.encode(fakes.CROP_CALL) + [tok.convert_tokens_to_ids("<|im_end|>")]

    def generate(self, batch, sampling):
        outs, rest = [None] * len(batch), []
        for i, item in enumerate(batch):
            if len(item["images"]) == 1:
                outs[i] = {"ids": list(self.call), "logprobs": [-1.0] * len(self.call), "finish": "stop",
                           "prompt_tokens": len(item["input_ids"])}
            else:
                rest.append(i)
        for i, out in zip(rest, self.inner.generate([batch[i] for i in rest], sampling)):
            outs[i] = out
        return outs


def prompt_item(processor, rec):
    ids = chat.encode_prompt(processor, data.prompt_messages(rec), rec["images"])
    return {"input_ids": ids, "images": list(rec["images"])}


def image_pad(processor):
    return processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")


class TestRealServer:
    @pytest.fixture(scope="class")
    def real(self, harness_env, ckpt, tmp_path_factory):
        t = time.time()
        eng = Recording(ckpt, tmp_path_factory.mktemp("real_sglang"), server_args=FLAGS, env=harness_env,
                        launch_cmd=[str(PY), "-m", "sglang.launch_server"], timeout=900)
        print(f"\n[sglang_real] server up in {time.time() - t:.0f}s")
        yield eng
        eng.shutdown()

    def test_single_turn_rollout(self, real, processor, records, ckpt):
        """rollout.run_episodes through the engine: nothing fails, the server's prompt_tokens is
        our expanded length, and its logprobs are transformers' own on the same tokens."""
        from test_rollout import load_model, teacher_logprobs
        t = time.time()
        samples = fakes.run_episodes(real, processor, records[:2],
                                       rollout_args(n_samples_per_prompt=2, rollout_max_response_len=16))
        print(f"\n[sglang_real] single-turn rollout, 4 samples: {time.time() - t:.1f}s")
        for s in samples:
            assert s.status in ("completed", "truncated") and s.turns == 1, s.fail_reason
            assert len(s.response_ids) == len(s.rollout_logprobs) > 0
        s = samples[0]
        out = real.generate([{"input_ids": s.prompt_ids, "images": s.images}], dict(GREEDY, max_new_tokens=2))[0]
        assert out["prompt_tokens"] == len(s.prompt_ids)  # SGLang's own expansion is ours
        body = real.sent[-1][1]
        assert body["input_ids"].count(image_pad(processor)) == 1 and len(body["input_ids"]) < len(s.prompt_ids)
        model = load_model(ckpt)
        diff = max(float((teacher_logprobs(model, processor, x, 0.8) - torch.tensor(x.rollout_logprobs)).abs().max())
                   for x in samples)
        print(f"[sglang_real] max |sglang - transformers teacher-forced| logprob: {diff:.2e}")
        assert diff < 1e-3

    def test_an_abort_lands_mid_generation_and_greedy_continues_it(self, real, processor, records):
        """--partial-rollout: /abort_request (abort_all) cuts a greedy request after a few tokens (finish "abort",
        the tokens so far with their logprobs); a request for the rest continues them into the answer the
        server gives uninterrupted."""
        import threading
        N = 1024
        item, sp = prompt_item(processor, records[0]), dict(GREEDY, max_new_tokens=N)  # 48 were done within 1 s
        whole = real.generate([item], sp)[0]
        box = []
        t = threading.Thread(target=lambda: box.append(real.generate([item], sp)[0]))
        t.start()
        time.sleep(1.0)
        real.abort()
        t.join(120)
        cut = box[0]
        print(f"\n[sglang_real] abort after 1 s: {len(cut['ids'])} of {len(whole['ids'])} tokens")
        assert cut["finish"] == "abort" and 0 < len(cut["ids"]) < len(whole["ids"]), cut
        rest = real.generate([dict(item, input_ids=item["input_ids"] + cut["ids"])],
                             dict(sp, max_new_tokens=N - len(cut["ids"])))[0]
        assert cut["ids"] + rest["ids"] == whole["ids"]
        got = torch.tensor(cut["logprobs"] + rest["logprobs"])
        assert (got - torch.tensor(whole["logprobs"])).abs().max() < 1e-3
        assert ("/abort_request", {"abort_all": True}) in real.sent

    def test_an_abort_ends_a_request_at_every_stage(self, real, processor, records):
        """--partial-rollout's abort as the rollout sends it (engine.abort() at the stop, again every 2 s while
        requests are out: rollout.Rollout._wait) ends each request promptly, whatever it is doing at the first:
        decoding (sent 3 s before); registered by the tokenizer manager but not at the scheduler yet, the state
        of one being tokenized (tokenizer_manager.py:926 registers it, the scheduler gets it after tokenizing):
        held there by /pause_generation until just after that abort; not arrived yet (sent after it), then
        queued or in prefill at a repeat (at 2048 new tokens each, --max-total-tokens 8192 admits a few). An
        abort by rid drops a held one and every later abort of that rid (tokenizer_manager.py:2246-2253): it
        decoded all its 2048 tokens. abort_all is not latched."""
        import threading
        from sglang_server import Server
        item, sp, ends, threads = prompt_item(processor, records[0]), dict(GREEDY, max_new_tokens=2048), {}, []
        real.generate([item], dict(GREEDY, max_new_tokens=1))  # the one-off first request

        def send(names):
            for name in names:
                def one(name=name):
                    ends[name] = (real.generate([item], sp)[0], time.time())
                threads.append(threading.Thread(target=one))
                threads[-1].start()
        send(["decoding_0", "decoding_1"])
        time.sleep(3.0)
        Server.post(real.server, "/pause_generation", {"mode": "in_place"})  # not recorded: no AbortReq check
        send(["held_0", "held_1"])
        time.sleep(1.0)
        t0 = time.time()
        real.abort()
        Server.post(real.server, "/continue_generation", {})
        send([f"after_{i}" for i in range(4)])
        while any(t.is_alive() for t in threads):
            time.sleep(2.0)
            real.abort()
        print("\n[sglang_real] aborted at t=0, each request's end: " + ", ".join(
            f"{name} {end - t0:.1f}s/{len(out['ids'])} tokens" for name, (out, end) in sorted(ends.items())))
        for name, (out, end) in ends.items():
            assert out["finish"] == "abort" and len(out["ids"]) < 2048 and "error" not in out, (name, out)
            assert end - t0 < 15, f"{name} ended {end - t0:.0f} s after the first abort"

    def test_a_weight_update_lands_while_requests_are_in_flight(self, real, processor, records, ckpt):
        """--fully-async: a run's greedy requests are cut by pause() (/abort_request by rid) mid-generation, the server
        takes other weights, and the next run goes on with each cut turn: the tokens after the update carry version
        1, and their logprobs are the new weights' (transformers on the same tokens, teacher-forced) to the level of
        an uninterrupted rollout (under 1e-3 in fp32). Each request after the update prefills its whole context anew
        at the new weights (SGLang's abort mode of /pause_generation; not in_place, which keeps the old KV)."""
        from safetensors.torch import load_file
        from test_rollout import load_model, teacher_logprobs
        state = load_file(str(Path(ckpt) / "model.safetensors"))
        gen = torch.Generator().manual_seed(3)
        noisy = [(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in state.items()]
        args = rollout_args(n_samples_per_prompt=2, rollout_max_response_len=256, rollout_temperature=0.0)
        real.generate([prompt_item(processor, records[0])], GREEDY)  # the server's first request is slow (~25 s)
        ro = rollout.Rollout(real, processor, args, cap=2)
        ro.resume(records[:2], 0)
        time.sleep(2.0)  # the four requests decode
        ro.pause()
        real.update_weights([noisy])
        try:
            ro.resume([], 1)
            done = ro.take(2)
            ro.pause()
        finally:
            real.update_weights([list(state.items())])
        new = load_model(ckpt, dict(noisy))
        mixed, worst = 0, 0.0
        for s in done:
            assert s.status in ("completed", "truncated") and s.versions == sorted(s.versions), (s.status, s.fail_reason)
            mixed += 0 in s.versions and 1 in s.versions
            at_new = torch.tensor([v == 1 for v in s.versions])
            if at_new.any():
                gap = teacher_logprobs(new, processor, s, 0.0)[at_new] - torch.tensor(s.rollout_logprobs)[at_new]
                worst = max(worst, gap.abs().max().item())
        print(f"\n[sglang_real] {mixed} of {len(done)} samples cut by the update ({[s.versions.count(0) for s in done]} "
              f"tokens before it, {[s.versions.count(1) for s in done]} after); logprob gap at the new weights {worst:.2e}")
        assert mixed and worst < 1e-3, (mixed, worst)

    def test_multi_turn_crop_sends_two_images(self, real, processor, records):
        t = time.time()
        args = rollout_args(max_turns=3, n_samples_per_prompt=2, rollout_max_response_len=160)
        samples = fakes.run_episodes(CropFirst(real, processor), processor, records[:1], args)
        print(f"\n[sglang_real] multi-turn crop rollout, 2 samples: {time.time() - t:.1f}s")
        for s in samples:
            assert s.status != "failed" and s.turns >= 2 and s.tool_calls >= 1, s.fail_reason
            assert len(s.images) == 2
        two = [body for path, body in real.sent if path == "/generate" and len(body.get("image_data", [])) == 2]
        assert len(two) == 2 and all(b["input_ids"].count(image_pad(processor)) == 2 for b in two)

    def test_weight_update_changes_and_restores(self, real, processor, records, ckpt):
        from safetensors.torch import load_file
        item = prompt_item(processor, records[0])
        before = real.generate([item], GREEDY)[0]
        state = load_file(str(Path(ckpt) / "model.safetensors"))
        gen = torch.Generator().manual_seed(0)
        noisy = [(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in state.items()]
        t = time.time()
        assert real.update_weights([noisy[:20], noisy[20:]]) == len(state)
        print(f"\n[sglang_real] weight update ({len(state)} tensors): {time.time() - t:.1f}s")
        changed = real.generate([item], GREEDY)[0]
        assert changed["logprobs"] != before["logprobs"]
        with pytest.raises(RuntimeError, match="update_weights_from_disk failed") as e:
            real.update_weights([])  # a folder without weights: the server refuses it
        print(f"[sglang_real] refused update: {e.value}")
        assert real.update_weights([list(state.items())]) == len(state)
        back = real.generate([item], GREEDY)[0]
        assert back["ids"] == before["ids"]
        assert max(abs(a - b) for a, b in zip(back["logprobs"], before["logprobs"])) < 1e-5

    def test_new_vision_weights_reach_an_image_seen_before(self, real, processor, records, ckpt):
        """Only the vision tower changes: an image the server met before must be encoded anew. SGLang
        caches vision features by image content (mem_cache/multimodal_cache.py) through weight updates
        and flushes; the engine starts it with SGLANG_VLM_CACHE_SIZE_MB=0. With the cache on (100), the
        answer after the update is the old one, logprob for logprob."""
        from safetensors.torch import load_file
        item = prompt_item(processor, records[2])
        before = real.generate([item], GREEDY)[0]
        state = load_file(str(Path(ckpt) / "model.safetensors"))
        gen = torch.Generator().manual_seed(2)
        vision = [(k, v + 0.5 * torch.randn(v.shape, generator=gen)) for k, v in state.items() if ".visual." in k]
        assert vision and real.update_weights([vision]) == len(vision)
        after = real.generate([item], GREEDY)[0]
        real.update_weights([list(state.items())])
        assert after["logprobs"] != before["logprobs"], "the server answered from vision features of the old weights"

    @pytest.mark.parametrize("mode", ["tensor", "distributed"])
    def test_weight_sync_without_the_disk(self, mode, real, processor, records, ckpt):
        """The same engine, switched to /update_weights_from_tensor (CPU tensors as /dev/shm files)
        or a gloo group + /update_weights_from_distributed, inside the server's begin/end session:
        new weights change the answers, the checkpoint's bring them back exactly."""
        from safetensors.torch import load_file
        item = prompt_item(processor, records[0])
        before = real.generate([item], GREEDY)[0]
        state = load_file(str(Path(ckpt) / "model.safetensors"))
        gen = torch.Generator().manual_seed(1)
        noisy = [(k, v + 0.05 * torch.randn(v.shape, generator=gen)) for k, v in state.items()]
        real.weight_sync = mode
        try:
            t = time.time()
            assert real.update_weights([noisy[:20], noisy[20:]]) == len(state)
            print(f"\n[sglang_real] {mode} weight update ({len(state)} tensors): {time.time() - t:.1f}s")
            assert real.generate([item], GREEDY)[0]["logprobs"] != before["logprobs"]
            assert real.update_weights([list(state.items())]) == len(state)
            back = real.generate([item], GREEDY)[0]
        finally:
            real.weight_sync = "disk"
        assert back["ids"] == before["ids"]
        assert max(abs(a - b) for a, b in zip(back["logprobs"], before["logprobs"])) < 1e-5

    def test_killed_server_restarts_and_retries(self, real, processor, records):
        item = prompt_item(processor, records[1])
        before = real.generate([item], GREEDY)[0]
        pgid = real.server.proc.pid
        os.killpg(pgid, signal.SIGKILL)
        deadline = time.time() + 30
        while time.time() < deadline and any_alive(pgid):
            real.server.proc.poll()
            time.sleep(0.2)
        assert not any_alive(pgid)  # SGLang's scheduler and detokenizer went with it
        t = time.time()
        after = real.generate([item], GREEDY)[0]  # meets a dead server: restart, then the retry
        print(f"\n[sglang_real] restart + retried request: {time.time() - t:.0f}s")
        assert real.server.restarts == 1 and real.server.proc.pid != pgid
        assert after["ids"] == before["ids"] and after["prompt_tokens"] == len(item["input_ids"])

    def test_requests_parse_with_sglangs_own_classes(self, real, harness_env, processor, records, ckpt,
                                                     crop_record, tmp_path):
        """Run last in the class: checks every request sent so far (real.sent)."""
        one = prompt_item(processor, records[0])
        two = {"input_ids": chat.encode_prompt(processor, data.prompt_messages(crop_record), crop_record["images"]),
               "images": crop_record["images"]}
        sampling = dict(temperature=0.8, top_p=1.0, top_k=-1, max_new_tokens=4, stop_token_ids=[151645, 151643])
        tokenize = [{"body": real.generate_payload(item, sampling), "expected": item["input_ids"]}
                    for item in (one, two)]
        real.route_shape = (2, 2)  # R3's request fields (--use-rollout-routing-replay), parsed below too
        try:
            tokenize.append({"body": real.generate_payload(dict(one, routed_experts_start=3), sampling),
                             "expected": one["input_ids"]})
        finally:
            real.route_shape = None
        assert tokenize[-1]["body"]["return_routed_experts"] and tokenize[-1]["body"]["routed_experts_start_len"] == 3
        sent = list(real.sent) + [("/generate", tokenize[-1]["body"])]
        # not called on the server (its release needs CUDA): the bodies of a release, --offload-train's
        # two-part resume, checked below against SGLang's own request classes
        stub = types.SimpleNamespace(server=types.SimpleNamespace(call=lambda p, body: sent.append((p, body))),
                                     released=set())
        SGLangEngine.release(stub)
        SGLangEngine.resume(stub, ["weights"])
        SGLangEngine.resume(stub)
        assert [b for p, b in sent[-3:]] == [{"tags": ["weights", "kv_cache", "cuda_graph"]}, {"tags": ["weights"]},
                                             {"tags": ["kv_cache", "cuda_graph"]}]
        job = tmp_path / "job.json"
        job.write_text(json.dumps({"sent": sent, "tokenize": tokenize, "argv": ["--model-path", str(ckpt), *FLAGS],
                                   "tests": str(ROOT / "tests")}))
        t = time.time()
        r = launch.run([PY, "-c", CHECK, job], timeout=900, env=dict(os.environ, **harness_env))
        print(f"\n[sglang_real] io_struct + TokenizerManager check: {time.time() - t:.0f}s: {r.stdout.strip()}")
        assert r.returncode == 0, r.stderr[-4000:]
        assert "requests parse" in r.stdout


@pytest.fixture(scope="module")
def crop_record(records):
    """records[0] with a second image (a crop of the first), as a multi-turn episode holds them: the row's Picture,
    then the zoom's PIL image (env_geo3k.crop)."""
    image = records[0]["images"][0]
    return dict(records[0], images=[image, image.original().crop((0, 0, 64, 64))])


def any_alive(pgid):
    """Live (not zombie) processes in group `pgid`, from /proc."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


# Run in the harness python: sglang importable, tests/ on the path for fake_sglang.
CHECK = r'''
import asyncio, dataclasses, json, sys, types
job = json.load(open(sys.argv[1]))
sys.path.insert(0, job["tests"])
import fake_sglang as fake
from sglang.srt.managers.io_struct import (GenerateReqInput, ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput, UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput, BeginWeightUpdateReqInput,
    EndWeightUpdateReqInput, AbortReq)
from sglang.srt.sampling.sampling_params import SamplingParams

real = {"generate": {f.name for f in dataclasses.fields(GenerateReqInput)},
        "sampling": set(SamplingParams.__struct_fields__),
        "disk": set(UpdateWeightFromDiskReqInput.__struct_fields__),
        "release": set(ReleaseMemoryOccupationReqInput.__struct_fields__),
        "resume": set(ResumeMemoryOccupationReqInput.__struct_fields__),
        "tensor": set(UpdateWeightsFromTensorReqInput.__struct_fields__),
        "distributed": set(UpdateWeightsFromDistributedReqInput.__struct_fields__),
        "group": set(InitWeightsUpdateGroupReqInput.__struct_fields__),
        "session": set(BeginWeightUpdateReqInput.__struct_fields__), "abort": set(AbortReq.__struct_fields__)}
for name, ours, theirs in (("GENERATE_FIELDS", fake.GENERATE_FIELDS, real["generate"]),
                           ("SAMPLING_FIELDS", fake.SAMPLING_FIELDS, real["sampling"]),
                           ("DISK_FIELDS", fake.DISK_FIELDS, real["disk"]),
                           ("MEMORY_FIELDS", fake.MEMORY_FIELDS, real["release"] & real["resume"]),
                           ("TENSOR_FIELDS", fake.TENSOR_FIELDS, real["tensor"]),
                           ("DIST_FIELDS", fake.DIST_FIELDS, real["distributed"]),
                           ("GROUP_FIELDS", fake.GROUP_FIELDS, real["group"]),
                           ("SESSION_FIELDS", fake.SESSION_FIELDS, real["session"]),
                           ("ABORT_FIELDS", fake.ABORT_FIELDS, real["abort"])):
    assert ours <= theirs, f"fake_sglang.{name} has fields sglang does not: {sorted(ours - theirs)}"

classes = {"/update_weights_from_disk": UpdateWeightFromDiskReqInput,
           "/release_memory_occupation": ReleaseMemoryOccupationReqInput,
           "/resume_memory_occupation": ResumeMemoryOccupationReqInput,
           "/update_weights_from_tensor": UpdateWeightsFromTensorReqInput,
           "/update_weights_from_distributed": UpdateWeightsFromDistributedReqInput,
           "/init_weights_update_group": InitWeightsUpdateGroupReqInput,
           "/begin_weight_update": BeginWeightUpdateReqInput, "/end_weight_update": EndWeightUpdateReqInput,
           "/abort_request": AbortReq}
paths = {}
for path, body in job["sent"]:
    paths[path] = paths.get(path, 0) + 1
    if path == "/generate":
        GenerateReqInput(**body).normalize_batch_and_arguments()
        SamplingParams(**body["sampling_params"]).verify(151936)
    elif path in classes:
        classes[path](**body)  # an unknown field is a TypeError
    elif path == "/flush_cache":
        assert body == {}, body
    else:
        raise SystemExit(f"unexpected request path {path}")

from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import PortArgs, prepare_server_args, set_global_server_args_for_tokenizer
server_args = prepare_server_args(job["argv"])
set_global_server_args_for_tokenizer(server_args)
manager = TokenizerManager(server_args, PortArgs.init_new(server_args))
for case in job["tokenize"]:
    req = GenerateReqInput(**case["body"])
    req.normalize_batch_and_arguments()
    # what generate_request would have registered; _tokenize_one_request stamps its time_stats
    stats = types.SimpleNamespace(set_tokenize_finish_time=lambda: None)
    manager.rid_to_state[req.rid] = types.SimpleNamespace(time_stats=stats)
    out = asyncio.run(manager._tokenize_one_request(req))
    got, want = list(out.input_ids), case["expected"]
    assert got == want, f"sglang runs {len(got)} ids, the rollout holds {len(want)}"
print(f"requests parse: {paths}; tokenized to our expanded ids: {[len(c['expected']) for c in job['tokenize']]}")
'''


