"""A small local HTTP server that speaks the part of SGLang's protocol the trainer uses.

    python tests/fake_sglang.py --model-path DIR --host 127.0.0.1 --port P [--fake-record F.jsonl]
        [--fake-delay S] [--fake-token-delay S] [--fake-hold queue|N [--fake-gate FILE]] [--fake-abort-delay S]
        [--fake-startup S] [--fake-hung FILE] [any --real-sglang-flag value ...]

Started by SGLangEngine through its `launch_cmd` in place of `python -m sglang.launch_server`.
Every request is appended to the --fake-record file as {"path", "json", "pid"}; a request
with a field outside the whitelists below is refused with HTTP 400 (so the client's paths and
field names are checked on every call; tests/test_sglang_real.py checks the whitelists are
subsets of sglang's own request classes). Stock behaviour kept where it matters, as measured on
the real 0.5.23 server (tests/test_sglang_real.py, ../shared/sglang_cpu):
- input_ids carry ONE image pad per image, expanded here to the count the checkpoint's own
  image processor gives that image's grid (tests/image_counts.py: under pytest, counted by a warm processor
  in the pytest process); meta_info.prompt_tokens is that expanded length.
  A pad run already expanded, or more pads than images, gets HTTP 500 "Internal Server Error"
  with the IndexError / AssertionError in the log, as stock's build_input_ids gives
  (multimodal/processors/base_processor.py:586). More images than pads: stock answers 200 and
  ignores the extra images, and so does this.
- a failed /update_weights_from_disk answers HTTP 400 {"success": false, "message": ...}.
- /abort_request by rid or abort_all (every request then generating); a request aborted while it waits
  (--fake-delay: SGLang's queue) answers no tokens, no routes and no prompt_tokens; one aborted while it
  decodes still writes one more token, whatever it is (a stop token, the max_new_tokens-th), and answers
  finish "abort" (scheduler.py:5797-5811, schedule_batch.py:2007-2014).
A test makes its races with --fake-hold, never with a delay: each /generate holds in the queue ("queue") or
before its turn's token N (N = 6: before the <|im_end|>), records {"path": "(held)"} once it holds, and holds
until an abort names it, or (--fake-gate FILE) until the test deletes FILE.
/generate answers with deterministic tokens: a function of the expanded input ids and of the
weights the server loaded (`fake_output`), so a test can predict each answer and see weight
updates take effect. Unknown flags (the pass-through `--mem-fraction-static 0.7` etc.) are
accepted and printed.
"""
import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from image_counts import IMAGES_SOCKET, ask_image_counts, load_image_processor, processor_counts

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: shadows nothing
import proc  # noqa: E402 - the project's launcher that arms PR_SET_PDEATHSIG

# Fields of SGLang's GenerateReqInput / SamplingParams / UpdateWeightFromDiskReqInput /
# (Release|Resume)MemoryOccupationReqInput (sglang 0.5.23 srt/managers/io_struct.py:177, 1970,
# 2177, 2187; srt/sampling/sampling_params.py:140). Stock ignores unknown top-level fields; we
# refuse them, so a misspelt field of ours cannot pass silently.
GENERATE_FIELDS = {"input_ids", "text", "image_data", "sampling_params", "return_logprob",
                   "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream", "rid",
                   "return_routed_experts", "routed_experts_start_len"}
# what sglang-router 0.3.2 adds to each /generate it forwards (its own defaults; stock ignores those
# it does not know), accepted only from it: test_sglang_real checks which GenerateReqInput knows
ROUTER_FIELDS = {"background", "log_metrics", "model", "no_logs", "return_bytes", "return_entropy",
                 "return_hidden_states"}
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "min_p", "max_new_tokens", "stop", "stop_token_ids",
                   "skip_special_tokens", "no_stop_trim", "ignore_eos", "repetition_penalty",
                   "frequency_penalty", "presence_penalty", "min_new_tokens", "n"}
DISK_FIELDS = {"model_path", "load_format", "abort_all_requests", "weight_version"}
ABORT_FIELDS = {"rid", "abort_all"}  # AbortReq (io_struct.py:2285)
MEMORY_FIELDS = {"tags"}
# UpdateWeightsFromTensorReqInput, UpdateWeightsFromDistributedReqInput, InitWeightsUpdateGroupReqInput,
# (Begin|End)WeightUpdateReqInput (io_struct.py:2027, 2002, 2126, 2197, 2208)
TENSOR_FIELDS = {"serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests", "weight_version",
                 "selector", "torch_empty_cache"}
DIST_FIELDS = {"names", "dtypes", "shapes", "group_name", "flush_cache", "abort_all_requests", "weight_version",
               "load_format", "selector", "torch_empty_cache"}
GROUP_FIELDS = {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
SESSION_FIELDS = {"selector"}
STOP = 151645  # <|im_end|>: ends every fake answer
FAKE_IDS = range(150000, 151000)  # the tokens of fake answers: plain vocabulary, rare in prompts


def weights_digest(model_path):
    h = hashlib.sha1()
    for f in sorted(Path(model_path).glob("*.safetensors")):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def fake_output(input_ids, max_new_tokens, digest, length=6, cut=None):
    """-> (ids, logprobs, finish): `length` tokens from FAKE_IDS, then <|im_end|>, cut at max_new_tokens. Each
    token and logprob is a function of the weights and of every id before it, and the tokens of a turn
    already given (FAKE_IDS at the end of input_ids) count towards `length`: an answer cut short and
    continued is the uninterrupted answer, as greedy decoding gives. cut(n): called before each token (the turn's
    n-th; n == length: the <|im_end|>); True: an abort came, and as stock's the answer ends after that token,
    finish "abort"."""
    ids, lps = [], []
    done = len(input_ids) - next((i + 1 for i in range(len(input_ids) - 1, -1, -1) if input_ids[i] not in FAKE_IDS), 0)
    while len(ids) < max_new_tokens:
        stop = done + len(ids) >= length
        aborted = cut is not None and cut(done + len(ids))
        seed = int(hashlib.sha1(f"{digest}:{input_ids + ids}".encode()).hexdigest(), 16)
        ids.append(STOP if stop else FAKE_IDS.start + seed % len(FAKE_IDS))
        lps.append(-0.05 - (seed >> 16) % 100 / 50.0)
        if aborted or stop:
            return ids, lps, "abort" if aborted else "stop"
    return ids, lps, "length"


def expand_image_pads(ids, counts, pad):
    """One `pad` per image -> `counts[k]` pads for image k, walking the ids as stock's
    build_input_ids does: each pad starts an image; running out of images is its IndexError,
    a pad right after an image's pads its AssertionError; images beyond the pads are ignored."""
    out, cur, k = [], 0, 0
    for j in range(1, len(ids)):  # stock looks at prompt[i + 1] for i < len - 1
        if ids[j] != pad:
            continue
        if k >= len(counts):
            raise IndexError(f"index {k} is out of bounds for dimension 0 with size {len(counts)}")
        if cur > j - 1:
            raise AssertionError("pad right after an image's pads (assert cur_idx <= mm_start_idx)")
        out += ids[cur:j] + [pad] * counts[k]
        cur, k = j + 1, k + 1
    return out + ids[cur:]


def fake_routes(start, end, layers, k, experts):
    """R3: stock's meta_info.routed_experts form (base64 of int32 (end - start, layers, k)) for the
    positions start..end-1; the experts of position p at layer l are (p + l + j) % experts, j < k."""
    import numpy as np  # here: its import is most of a fake server's start (~0.16 of ~0.26 CPU s)
    p, layer, j = np.meshgrid(np.arange(start, end), np.arange(layers), np.arange(k), indexing="ij")
    return base64.b64encode(((p + layer + j) % experts).astype(np.int32).tobytes()).decode()


def check_generate(body, routed=False):
    """None if `body` is a /generate request whose fields and types we accept, else why not. routed:
    it came through sglang-router (ROUTER_FIELDS allowed)."""
    unknown = set(body) - GENERATE_FIELDS - (ROUTER_FIELDS if routed else set())
    if unknown:
        return f"unknown fields {sorted(unknown)}"
    ids = body.get("input_ids")
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and t >= 0 for t in ids)):
        return "input_ids must be a non-empty list of token ids"
    sp = body.get("sampling_params")
    if not isinstance(sp, dict) or set(sp) - SAMPLING_FIELDS:
        return f"bad sampling_params {sp}"
    if not isinstance(sp.get("max_new_tokens"), int) or sp["max_new_tokens"] < 1:
        return "sampling_params.max_new_tokens must be a positive int"
    if body.get("return_logprob") is not True:
        return "return_logprob must be true"
    images = body.get("image_data", [])
    if not isinstance(images, list) or not all(isinstance(u, str) and u.startswith("data:image/") for u in images):
        return "image_data must be a list of data URIs"
    return None


def image_token_counts(state, uris):
    """processor_counts by the image service that IMAGES_SOCKET names, else by this process' own processor."""
    if os.environ.get(IMAGES_SOCKET):
        return ask_image_counts(os.environ[IMAGES_SOCKET], state["model_path"], uris)
    with state["lock"]:
        if state["image_processor"] is None:  # loaded on first use: a fast start for the tests
            state["image_processor"] = load_image_processor(state["model_path"])
    return processor_counts(state["image_processor"], uris)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):  # quiet; the record file has everything
        pass

    def _reply(self, code, obj):
        data = (json.dumps(obj) if not isinstance(obj, str) else obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json" if not isinstance(obj, str) else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body, path=None):
        st = self.server.state
        with st["lock"]:
            with open(st["record"], "a") if st["record"] else open(os.devnull, "w") as f:
                f.write(json.dumps({"path": path or self.path, "method": self.command, "json": body,
                                    "pid": os.getpid()}) + "\n")

    def _refused(self):
        """--api-key as stock's (utils/auth.py:74-151): every path but /health* needs 'Bearer <key>'."""
        key = self.server.state["api_key"]
        if key is None or self.path.startswith("/health"):
            return False
        if self.headers.get("Authorization") == f"Bearer {key}":
            return False
        self._reply(401, {"error": "Unauthorized"})
        return True

    def do_GET(self):
        if self._refused():
            return
        if self.path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
            time.sleep(self.server.state["info_delay"])  # what sglang-router asks before it registers a server
            return self._reply(404, {"error": f"no route {self.path}"})
        if self.path == "/health" and os.environ.get("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION") == "0":
            return self._reply(200, "")  # stock's answer from its status alone (http_server.py:745-749)
        if self.path in ("/health", "/health_generate"):  # stock's: one token through the scheduler (721-795)
            if self.path == "/health_generate":
                self._record({"released": sorted(self.server.state["released"])})
            hung = self.server.state["hung"] and os.path.exists(self.server.state["hung"])
            return self._reply(503 if hung else 200, "")  # stock: 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s)
        if self.path == "/flush_cache":
            self._record(None)
            return self._reply(200, "Cache flushed.\n")
        return self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self):
        st = self.server.state
        n = int(self.headers.get("Content-Length", 0))
        try:
            body = json.loads(self.rfile.read(n) or b"{}")
        except ValueError:
            return self._reply(400, {"error": "body is not JSON"})
        if self._refused():
            return
        self._record(body)
        if self.path == "/generate":
            why = check_generate(body, routed="model" in body and "return_bytes" in body)
            if why:
                return self._reply(400, {"error": why})
            prompt = body["input_ids"]
            if body.get("image_data"):
                try:
                    counts = image_token_counts(st, body["image_data"])
                    prompt = expand_image_pads(prompt, counts, st["image_pad"])
                except (IndexError, AssertionError) as e:  # stock: a traceback in its log, a bare 500
                    print(f"Exception in /generate: {type(e).__name__}: {e}", flush=True)
                    return self._reply(500, "Internal Server Error")
            sp, rid = body["sampling_params"], body.get("rid") or os.urandom(8).hex()

            def wait(seconds):  # -> aborted? (an abort ends the wait at once)
                end = time.time() + seconds
                while rid not in st["aborted"] and time.time() < end:
                    time.sleep(0.005)
                return rid in st["aborted"]

            def hold():  # --fake-hold: until the test's event (an abort, or its gate file deleted) -> aborted?
                self._record({"rid": rid}, "(held)")
                while rid not in st["aborted"] and (st["gate"] is None or os.path.exists(st["gate"])):
                    time.sleep(0.005)
                return rid in st["aborted"]

            def cut(n):  # before the turn's token n: --fake-token-delay, or the hold
                return hold() if n == st["hold"] else wait(st["token_delay"])
            st["running"].add(rid)
            try:
                queued = (st["hold"] == "queue" and hold()) or wait(st["delay"])  # --fake-delay: SGLang's queue
                ids, lps, finish = ([], [], "abort") if queued else fake_output(prompt, sp["max_new_tokens"],
                                                                                st["digest"], cut=cut)
            finally:
                st["running"].discard(rid)
            reason = {"type": finish, "matched": STOP} if finish == "stop" else {"type": finish, "length": len(ids)}
            if finish == "abort":
                reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            meta = {"id": "fake", "prompt_tokens": len(prompt), "completion_tokens": len(ids),
                    "finish_reason": reason, "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}
            if queued:  # stock's answer to a request aborted in its queue (tokenizer_manager.py:3577-3634)
                meta = {"id": "fake", "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                        "completion_tokens": 0, "output_token_logprobs": []}
            elif body.get("return_routed_experts") and st["routes"]:  # stock without the flag: no field
                meta["routed_experts"] = fake_routes(body.get("routed_experts_start_len", 0),
                                                     len(prompt) + len(ids) - 1, *st["routes"])
            return self._reply(200, {"text": "", "output_ids": ids, "meta_info": meta})
        if self.path == "/update_weights_from_disk":
            if set(body) - DISK_FIELDS or not isinstance(body.get("model_path"), str):
                return self._reply(400, {"success": False, "message": f"bad fields {sorted(body)}"})
            path = Path(body["model_path"])
            if not (path / "config.json").exists() or not list(path.glob("*.safetensors")):
                return self._reply(400, {"success": False, "message": f"{path} is not a checkpoint folder"})
            st["digest"] = weights_digest(path)
            return self._reply(200, {"success": True, "message": "Succeeded to update model weights.",
                                     "num_paused_requests": 0})
        if self.path == "/flush_cache":
            return self._reply(200, "Cache flushed.\n")
        if self.path == "/abort_request":
            if set(body) - ABORT_FIELDS:
                return self._reply(400, {"error": f"bad fields {sorted(body)}"})
            time.sleep(st["abort_delay"])  # a server slow to answer it
            st["aborted"].update(set(st["running"]) if body.get("abort_all") else {body.get("rid")})
            return self._reply(200, "")
        if self.path in WEIGHT_ROUTES:
            fields, handler = WEIGHT_ROUTES[self.path]
            if set(body) - fields:
                return self._reply(400, {"success": False, "message": f"bad fields {sorted(set(body) - fields)}"})
            try:
                message = handler(st, body)
            except Exception as e:  # noqa: BLE001 - stock answers 400 with the message
                return self._reply(400, {"success": False, "message": f"{type(e).__name__}: {e}"})
            return self._reply(200, {"success": True, "message": message})
        if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
            if set(body) - MEMORY_FIELDS:
                return self._reply(400, {"error": f"bad fields {sorted(body)}"})
            tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
            if self.path.startswith("/release"):
                st["released"] |= tags
            elif tags - st["released"]:  # stock: offload_tags.remove(tag) raises (weight_updater.py:389-390)
                print(f"Exception in resume_memory_occupation: KeyError: {sorted(tags - st['released'])}", flush=True)
                return self._reply(500, "Internal Server Error")
            else:
                st["released"] -= tags
            return self._reply(200, "")
        return self._reply(404, {"error": f"no route {self.path}"})


# --- weight updates without the disk: what arrives is kept in state["received"] and, with
# --fake-dump DIR, written to DIR/update_<k>.safetensors when the session ends.
def begin_update(st, body):
    if st.get("session") is not None:
        raise RuntimeError("a weight-update session is already open")
    st["session"] = {}
    return "begun"


def end_update(st, body):
    import torch
    if st.get("session") is None:
        raise RuntimeError("no weight-update session is open")
    received, st["session"] = st["session"], None
    st["digest"] = hashlib.sha1(b"".join(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                                         for _, t in sorted(received.items()))).hexdigest()[:12]
    if st["dump"] and received:
        from safetensors.torch import save_file
        k = len(list(Path(st["dump"]).glob("update_*.safetensors")))
        save_file({n: t.contiguous() for n, t in received.items()}, str(Path(st["dump"]) / f"update_{k}.safetensors"))
    return "ended"


def from_tensor(st, body):
    import torch
    import torch.multiprocessing  # noqa: F401 - registers torch's reducers
    from multiprocessing.reduction import ForkingPickler
    if st.get("session") is None:  # stock 0.5.23: scheduler_components/weight_updater.py:234
        raise RuntimeError("update_weights_from_tensor must run between begin_weight_update() and end_weight_update()")
    copies = [ForkingPickler.loads(base64.b64decode(b)) for b in body["serialized_named_tensors"]]  # one a TP rank
    named = copies[0]
    if any([n for n, _ in c] != [n for n, _ in named] or not all(map(torch.equal, (t for _, t in c), (t for _, t in named)))
           for c in copies):
        raise RuntimeError("the TP ranks' copies of a bucket differ")
    st["session"].update({n: t.clone() for n, t in named})
    return "Success"


def init_group(st, body):
    import datetime
    import torch.distributed as dist
    g, rank, world = body["group_name"], body["rank_offset"], body["world_size"]
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore(body["master_address"], body["master_port"], world, is_master=False, timeout=timeout)
    keys = dist.PrefixStore("cpu/", dist.PrefixStore(f"{g}/", dist.PrefixStore(g, store)))
    st.setdefault("groups", {})[g] = (dist.ProcessGroupGloo(keys, rank, world, timeout), store)
    return "Succeeded to initialize custom process group."


def from_distributed(st, body):
    import torch
    import torch.distributed as dist
    if st.get("session") is None:
        raise RuntimeError("update_weights_from_distributed must run between begin and end")
    group = st["groups"][body["group_name"]][0]
    opts = dist.BroadcastOptions()
    for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
        t = torch.empty(shape, dtype=getattr(torch, dtype))
        group.broadcast([t], opts).wait()
        st["session"][name] = t
    return "Succeeded to update parameter online."


WEIGHT_ROUTES = {"/begin_weight_update": (SESSION_FIELDS, begin_update),
                 "/end_weight_update": (set(), end_update),
                 "/update_weights_from_tensor": (TENSOR_FIELDS, from_tensor),
                 "/init_weights_update_group": (GROUP_FIELDS, init_group),
                 "/update_weights_from_distributed": (DIST_FIELDS, from_distributed)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--fake-record", default=None, help="JSONL file to append every request to")
    p.add_argument("--fake-dump", default=None, help="folder for the tensors of tensor/distributed updates")
    p.add_argument("--fake-delay", type=float, default=0.0, help="seconds per /generate, queued (abortable)")
    p.add_argument("--fake-token-delay", type=float, default=0.0, help="seconds per generated token (abortable)")
    p.add_argument("--fake-hold", default=None, help="queue, or N: each /generate holds there (module docstring)")
    p.add_argument("--fake-gate", default=None, help="a held request goes on once this file is gone")
    p.add_argument("--fake-abort-delay", type=float, default=0.0, help="seconds before an /abort_request acts")
    p.add_argument("--fake-startup", type=float, default=0.0, help="seconds before listening")
    p.add_argument("--fake-children", type=int, default=0,
                   help="idle child processes to start, as SGLang's scheduler/detokenizer")
    p.add_argument("--api-key", default=None, help="as stock's: requests without it get HTTP 401")
    p.add_argument("--fake-info-delay", type=float, default=0.0, help="seconds before answering /get_server_info")
    p.add_argument("--fake-hung", default=None, help="while this file exists the scheduler is hung: a token probe "
                                                     "(/health_generate; /health unless generation is off) gets 503")
    a, passthrough = p.parse_known_args()
    print(f"fake sglang pid={os.getpid()} pgid={os.getpgid(0)} passthrough={json.dumps(passthrough)}", flush=True)
    if a.fake_startup < 0:  # a server that never comes up
        sys.exit("fake sglang: failing to start as asked (--fake-startup < 0)")
    # like SGLang's scheduler/detokenizer processes: SIGKILLed when their parent dies
    children = [subprocess.Popen(proc.armed(["sleep", "3600"])) for _ in range(a.fake_children)]
    print(f"fake sglang children={[c.pid for c in children]}", flush=True)
    time.sleep(a.fake_startup)
    server = ThreadingHTTPServer((a.host, a.port), Handler)
    server.daemon_threads = True
    config = json.loads((Path(a.model_path) / "config.json").read_text())
    server.state = {"lock": threading.Lock(), "record": a.fake_record, "delay": a.fake_delay,
                    "digest": weights_digest(a.model_path), "model_path": a.model_path,
                    "image_pad": config.get("image_token_id"), "image_processor": None, "dump": a.fake_dump,
                    "api_key": a.api_key, "info_delay": a.fake_info_delay, "released": set(),
                    "token_delay": a.fake_token_delay, "aborted": set(), "gate": a.fake_gate,
                    "hold": a.fake_hold if a.fake_hold in (None, "queue") else int(a.fake_hold),
                    "running": set(), "abort_delay": a.fake_abort_delay, "hung": a.fake_hung}
    tc = config.get("text_config") or config  # R3: a dense checkpoint's routes are made up (2 of 8 experts)
    server.state["routes"] = ((tc["num_hidden_layers"], tc.get("num_experts_per_tok", 2), tc.get("num_experts", 8))
                              if "--enable-return-routed-experts" in passthrough else None)
    print(f"fake sglang listening on {a.host}:{a.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
