"""SGLangEngine: a stock `python -m sglang.launch_server` subprocess driven over HTTP (rank 0 only).

    engine = SGLangEngine(hf_dir, run_dir, server_args=["--mem-fraction-static", "0.5"])
    outs = engine.generate([{"input_ids": ids, "images": [pil]}], sampling)   # engines.Engine API
    engine.release(); ...train...; engine.resume(); engine.update_weights(buckets); engine.shutdown()

POST /generate with "input_ids", images as data URIs and "return_logprob". SGLang wants ONE image
pad per image and expands it itself (sglang 0.5.23 multimodal/processors/base_processor.py:586
build_input_ids; an expanded run makes it index past the image grids: HTTP 500 IndexError), so each
run of pads is collapsed here, and the server's meta_info.prompt_tokens (its own expansion) is
returned for the rollout to check against the expanded length it holds.

Weight sync (`weight_sync`; the modes: README, "Where SGLang runs"), buckets cast to the server's
dtype: "tensor" (serialize_tensors; a server of TP > 1 gets each trainer rank's own copy,
serialize_on_ranks) and "distributed" run inside
/begin_weight_update ... /end_weight_update (refused outside it: scheduler_components/
weight_updater.py:192, 234) with flush_cache off and one /flush_cache at the end; "disk"'s
/update_weights_from_disk flushes the cache itself (io_struct.py:1970). A refused load (HTTP 400
{"success": false, "message"}) raises with the message.

The server leads its own process group and logs to <run_dir>/sglang.log. It is started through
`python proc.py <our pid> cmd...`, which arms PR_SET_PDEATHSIG (create the engine in the main
thread: the signal follows the thread that started it); shutdown(), atexit and SIGINT/SIGTERM end
the group (proc.kill_group). A dead server is restarted and the requests in flight retried; an
HTTP error fails only its sample. release()/resume() (io_struct.py:2177/2187, `tags` unset = all
memory) need --sglang-enable-memory-saver.
"""
import atexit
import base64
import datetime
import http.client
import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing

import convert
import data
import proc
from engines import Engine

WEIGHT_SYNC = ("disk", "tensor", "distributed")
GROUP = "geo3k_weight_sync"  # the process-group name for "distributed"
_LIVE = weakref.WeakSet()  # engines whose servers must die with us
_HANDLERS = []


class ServerDown(Exception):
    """The server did not answer (dead, restarting, connection reset)."""


class ServerError(RuntimeError):
    """The server answered with an HTTP error: a bad request of ours, not a crash."""

    def __init__(self, path, code, body):
        super().__init__(f"SGLang {path} -> HTTP {code}: {body[:2000]}")
        self.code, self.body = code, body

    def message(self):
        """The server's own "message" field when the body is JSON carrying one, else the body."""
        try:
            obj = json.loads(self.body)
        except ValueError:
            obj = None
        return str(obj["message"]) if isinstance(obj, dict) and obj.get("message") else self.body


_LAUNCHER = str(Path(__file__).resolve().with_name("proc.py"))  # SGLang's own children arm PDEATHSIG too


def read_image_token_id(hf_dir):
    """The checkpoint's image pad id (config.json `image_token_id`: 151655 for Qwen2.5/3-VL,
    248056 for Qwen3.5), or None for a checkpoint without images."""
    value = json.loads((Path(hf_dir) / "config.json").read_text()).get("image_token_id")
    return None if value is None else int(value)


def flag_value(args, names, default):
    """The value after the first of `names` in a flag list, else default."""
    args = list(args)
    for n in names:
        if n in args[:-1]:
            return args[args.index(n) + 1]
    return default


def server_dtype(hf_dir, server_args):
    """The torch dtype the server holds its weights in: its --dtype, else the checkpoint's config
    dtype, which SGLangEngine then passes as --dtype (SGLang's own auto would not keep float32)."""
    name = flag_value(server_args, ("--dtype",), "auto")
    if name == "auto":
        cfg = json.loads((Path(hf_dir) / "config.json").read_text())
        text = cfg.get("text_config") or {}
        name = cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float32"
    name = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"--dtype {name!r}: not a torch dtype")
    return getattr(torch, name)


def serialize_tensors(named):
    """[(name, tensor)] -> base64 text: SGLang's MultiprocessingSerializer (utils/common.py:3060) form.
    CUDA tensors become IPC handles naming their GPU by UUID (sglang utils/patch_torch.py:80 reads
    either; an index would be ours, not the server's numbering); CPU tensors become /dev/shm files."""
    def reduce(t):
        fn, args = torch.multiprocessing.reductions.reduce_tensor(t)
        if t.is_cuda:  # args[6]: the device index (reductions.reduce_tensor's CUDA branch)
            args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
        return fn, args
    if any(not v.is_cuda for _, v in named):
        torch.multiprocessing.set_sharing_strategy("file_system")  # an fd cannot be passed to a process not forked from us
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    pickler.dispatch_table[torch.Tensor] = reduce
    pickler.dump([(k, v.detach()) for k, v in named])
    return base64.b64encode(buf.getvalue()).decode()


@dataclass
class Serialized:
    """A bucket the trainer ranks serialised: blobs[i] is server TP rank i's copy."""
    names: list
    blobs: list


def serialize_on_ranks(buckets, rank, ranks, dtype):
    """Colocated "tensor" sync into a server of TP `ranks` > 1, run on every trainer rank: rank i <
    `ranks` serialises its own GPU's copy of each bucket for server TP rank i (the same GPU: both take
    the node's GPUs in order), gathered on rank 0, which gets Serialized buckets (the others: None).
    Each server rank opens only blobs[tp_rank] (sglang 0.5.23 managers/tp_worker.py:194-201); one
    blob for all would open a CUDA context on GPU 0 in every server rank, outside its memory saver,
    and copy each bucket across GPUs. Each bucket stays alive until rank 0 has posted it."""
    for bucket in buckets:
        bucket = [(k, v.to(dtype)) for k, v in bucket] if rank < ranks else bucket  # the others only wait
        blobs = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(serialize_tensors(bucket) if rank < ranks else None, blobs, dst=0)
        yield Serialized([k for k, _ in bucket], blobs[:ranks]) if rank == 0 else None
        dist.barrier()  # rank 0's post has returned: the server has copied every blob's tensors


def collapse_image_pads(ids, pad):
    """Each run of `pad` ids -> one `pad`: the form SGLang expands by itself."""
    return [t for i, t in enumerate(ids) if not (t == pad and i and ids[i - 1] == pad)]


def _shutdown_all():
    for engine in list(_LIVE):
        engine.shutdown()


def _install_handlers():
    if _HANDLERS or threading.current_thread() is not threading.main_thread():
        return
    atexit.register(_shutdown_all)
    for sig in (signal.SIGINT, signal.SIGTERM):
        prev = signal.getsignal(sig)
        if prev == signal.SIG_IGN:
            continue

        def handler(signum, frame, prev=prev):
            _shutdown_all()
            if callable(prev):
                prev(signum, frame)  # SIGINT's default raises KeyboardInterrupt
            else:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
        signal.signal(sig, handler)
    _HANDLERS.append(True)


class SGLangEngine(Engine):
    def __init__(self, hf_dir, run_dir, server_args=(), timeout=900.0, launch_cmd=None, max_restarts=3,
                 request_timeout=3600.0, env=None, config_dir=None, weight_sync="disk"):
        # hf_dir: the weights the server starts from; config_dir (default hf_dir): where synced folders'
        # config and tokenizer files come from (a resumed run's checkpoint may be pruned by --save-keep)
        self.model_path = str(hf_dir)
        self.hf_dir = str(config_dir or hf_dir)
        self.image_pad = read_image_token_id(hf_dir)
        if weight_sync not in WEIGHT_SYNC:
            raise ValueError(f"weight_sync {weight_sync!r}: choose one of {', '.join(WEIGHT_SYNC)}")
        self.weight_sync, self.group, self.stale = weight_sync, None, False
        self.server_tp = int(flag_value(server_args, ("--tp-size", "--tp"), 1))
        if weight_sync == "distributed" and int(flag_value(server_args, ("--dp-size", "--dp"), 1)) > 1:
            raise ValueError("weight sync over a process group takes a server with one data-parallel "
                             "replica (rank = 1 + TP rank); use --dp-size 1 or weight_sync disk")
        self.dtype = server_dtype(config_dir or hf_dir, server_args)
        if flag_value(server_args, ("--dtype",), None) is None:  # say it: SGLang's auto serves a float32
            # config in float16 (sglang 0.5.23 configs/model_config.py:2303-2319), not the dtype we sync in
            server_args = [*server_args, "--dtype", str(self.dtype).removeprefix("torch.")]
        self.env = dict(env or {})  # added to our environment for the server (and its restarts)
        # SGLang caches vision-encoder outputs by image content (100 MB LRU, mem_cache/multimodal_cache.py)
        # and no weight update or /flush_cache clears it: a trained vision tower would see an image it
        # met before encoded by old weights. Size 0 refuses every entry. The user's own setting wins.
        self.env.setdefault("SGLANG_VLM_CACHE_SIZE_MB", os.environ.get("SGLANG_VLM_CACHE_SIZE_MB", "0"))
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.run_dir / "sglang.log"
        self.server_args = list(server_args)
        self.launch_cmd = list(launch_cmd or [sys.executable, "-m", "sglang.launch_server"])
        self.timeout, self.request_timeout = timeout, request_timeout
        self.max_restarts, self.restarts, self.epoch = max_restarts, 0, 0
        self.pool = ThreadPoolExecutor(256, thread_name_prefix="sglang-req")  # requests in flight at most
        self.lock = threading.Lock()
        self.proc = None
        _install_handlers()
        _LIVE.add(self)
        try:
            self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self):
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [*self.launch_cmd, "--model-path", self.model_path, "--host", "127.0.0.1",
               "--port", str(self.port), *self.server_args]
        if sys.platform == "linux":
            cmd = [sys.executable, _LAUNCHER, str(os.getpid()), *cmd]
        env = dict(os.environ, **{k: str(v) for k, v in self.env.items()}) if self.env else None
        with open(self.log_path, "ab") as log:
            extra = " ".join(f"{k}={v}" for k, v in self.env.items())
            log.write(f"\n=== {time.strftime('%H:%M:%S')} starting: {extra} {' '.join(cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + self.timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                proc.kill_group(self.proc)
                raise RuntimeError(f"SGLang server exited with code {self.proc.returncode} while "
                                   f"starting; last lines of {self.log_path}:\n{self.log_tail()}")
            if self._healthy(5.0):
                return
            time.sleep(0.5)
        proc.kill_group(self.proc)
        raise RuntimeError(f"SGLang server not healthy after {self.timeout:.0f}s (raise "
                           f"--sglang-server-timeout?); last lines of {self.log_path}:\n{self.log_tail()}")

    def log_tail(self, n=40):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError as e:
            return f"(no log: {e})"

    def _healthy(self, timeout):
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=timeout) as r:
                return r.status == 200
        except (OSError, http.client.HTTPException):
            return False

    def _recover(self, epoch, error):
        """Called by a request that found the server gone: restart it once per failure epoch
        (concurrent requests that failed together share one restart), then they all retry."""
        with self.lock:
            if self.epoch != epoch or self.proc is None:
                return
            if self.proc.poll() is None and self._healthy(30.0):
                return  # a transient error: the server is fine, just retry
            if self.restarts >= self.max_restarts:
                raise RuntimeError(f"SGLang server died {self.restarts + 1} times ({error}); last lines "
                                   f"of {self.log_path}:\n{self.log_tail()}")
            self.restarts += 1
            print(f"[sglang] server down ({error}); restart {self.restarts}/{self.max_restarts} "
                  f"from {self.model_path}", file=sys.stderr)
            proc.kill_group(self.proc)
            self._start()
            self.epoch += 1
            # it holds its launch weights: stale unless synced from disk; its process group is gone
            self.stale, self.group = self.weight_sync != "disk", None

    def shutdown(self):
        server, self.proc = self.proc, None
        if server is not None:
            proc.kill_group(server)
        self.pool.shutdown(wait=False, cancel_futures=True)
        _LIVE.discard(self)

    def _post(self, path, payload, timeout=None):
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.request_timeout) as r:
                body = r.read().decode()
        except urllib.error.HTTPError as e:
            raise ServerError(path, e.code, e.read().decode(errors="replace")) from None
        except (OSError, http.client.HTTPException) as e:
            raise ServerDown(f"{type(e).__name__}: {e}") from None
        try:
            return json.loads(body)
        except ValueError:
            return body

    def _call(self, path, payload, timeout=None):
        """POST, surviving server deaths: restart and retry (at most max_restarts + 1 tries)."""
        for _ in range(self.max_restarts + 2):
            epoch = self.epoch
            try:
                return self._post(path, payload, timeout)
            except ServerDown as e:
                self._recover(epoch, e)
        raise RuntimeError(f"SGLang {path}: no answer after {self.max_restarts + 2} tries")

    concurrent = True  # rollout.py sends each episode's turn on its own: the server batches continuously

    def generate(self, batch, sampling):
        if len(batch) == 1:  # an episode's own thread (rollout._Pipeline): no hop through the pool
            return [self._generate_one(batch[0], sampling)]
        return list(self.pool.map(lambda item: self._generate_one(item, sampling), batch))

    def _generate_one(self, item, sp):
        try:
            r = self._call("/generate", self.generate_payload(item, sp))
        except ServerError as e:  # e.g. an image the server refuses: this sample fails, not the run
            return {"ids": [], "logprobs": [], "finish": "abort", "error": str(e)}
        meta = r["meta_info"]
        pairs = meta.get("output_token_logprobs") or []
        out = {"ids": [int(p[1]) for p in pairs], "logprobs": [float(p[0]) for p in pairs],
               "finish": (meta.get("finish_reason") or {}).get("type", "abort"),
               "prompt_tokens": meta.get("prompt_tokens")}
        if self.stale:  # restarted since the last sync: not the policy being trained
            out.update(finish="abort", error="the SGLang server restarted with its launch weights; "
                                             "its answers until the next weight sync are dropped")
        elif "output_ids" in r and list(r["output_ids"]) != out["ids"]:
            out["error"] = "output_ids differ from the ids in output_token_logprobs"
        return out

    def generate_payload(self, item, sp):
        """The /generate body for one batch item (see Engine.generate): image pads collapsed to
        one per image, images as data URIs, logprobs of the new tokens asked for."""
        params = {"temperature": float(sp.get("temperature", 1.0)), "top_p": float(sp.get("top_p", 1.0)),
                  "top_k": int(sp.get("top_k", -1)),
                  "max_new_tokens": int(item.get("max_new_tokens", sp["max_new_tokens"])),
                  "stop_token_ids": list(sp.get("stop_token_ids") or []),
                  "skip_special_tokens": False, "no_stop_trim": True}
        ids = list(item["input_ids"])
        if self.image_pad is not None:
            ids = collapse_image_pads(ids, self.image_pad)  # the server expands each pad itself
        payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
        if item.get("images"):
            payload["image_data"] = [data.image_to_data_uri(im) for im in item["images"]]
        return payload

    def update_weights(self, buckets):
        """Load (HF name, full tensor) buckets into the server by self.weight_sync (module doc);
        -> number of tensors. A load the server refuses raises RuntimeError with its message."""
        buckets = (b if isinstance(b, Serialized) else [(k, v.to(self.dtype)) for k, v in b] for b in buckets)
        if self.weight_sync == "disk":
            return self._sync_disk(buckets)
        self._update("/begin_weight_update", {})
        try:
            n = self._sync_tensor(buckets) if self.weight_sync == "tensor" else self._sync_distributed(buckets)
        finally:
            self._update("/end_weight_update", {})
        self.flush()
        self.stale = False
        return n

    def _update(self, path, body):
        try:
            r = self._call(path, body)
        except ServerError as e:  # HTTP 400 {"success": false, "message": ...}
            raise RuntimeError(f"SGLang {path} failed (HTTP {e.code}): {e.message()}") from None
        if not (isinstance(r, dict) and r.get("success", True)):
            raise RuntimeError(f"SGLang {path} failed: {r}")
        return r

    def _sync_disk(self, buckets):
        # Two folders in turn: the one the server runs (and a restart would load) is never the one
        # being rewritten, so a refused or interrupted sync leaves the last good weights loadable.
        out = self.run_dir / "weights" / "a"
        if self.model_path == str(out):
            out = self.run_dir / "weights" / "b"
        n = convert.write_hf(buckets, out, self.hf_dir)
        self._update("/update_weights_from_disk", {"model_path": str(out)})
        self.model_path = str(out)  # a restarted server comes back with these weights
        return n

    def _sync_tensor(self, buckets):
        n = 0
        for bucket in buckets:
            if isinstance(bucket, Serialized):
                blobs, names = bucket.blobs, bucket.names
            elif self.server_tp > 1 and any(v.is_cuda for _, v in bucket):
                raise ValueError("tensor sync into a server of TP > 1 takes each rank's own copy: "
                                 "pass sglang_engine.serialize_on_ranks buckets")
            else:  # the tensors stay alive until the server answers
                blobs, names = [serialize_tensors(bucket)] * self.server_tp, bucket
            self._update("/update_weights_from_tensor", {"serialized_named_tensors": blobs, "flush_cache": False})
            n += len(names)
        return n

    def _sync_distributed(self, buckets):
        if self.group is None:
            self.group = self._join_group()
        n = 0
        for bucket in buckets:
            tensors = [v.to(self.group_device).contiguous() for _, v in bucket]
            body = {"names": [k for k, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                    "shapes": [list(t.shape) for t in tensors], "group_name": GROUP, "flush_cache": False}
            answer = self.pool.submit(self._update, "/update_weights_from_distributed", body)
            opts = dist.BroadcastOptions()  # rank 0 (us) to the server's ranks, in `names` order
            for t in tensors:
                self.group.broadcast([t], opts).wait()
            answer.result()
            n += len(bucket)
        return n

    def _join_group(self):
        """Rank 0 of a process group whose other ranks are the server's TP ranks (rank_offset 1)."""
        world, cuda = 1 + self.server_tp, torch.cuda.is_available()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        timeout = datetime.timedelta(seconds=self.timeout)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False, timeout=timeout)
        body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
                "group_name": GROUP, "backend": "nccl" if cuda else "gloo"}
        answer = self.pool.submit(self._update, "/init_weights_update_group", body)
        # The server's ranks see the store as PrefixStore(group) (sglang utils/common.py:2905), then
        # torch adds "<group>/" and "<device>/" (torch 2.14 distributed_c10d.py:2734, 2764): the same here.
        self.group_device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        keys = dist.PrefixStore(f"{self.group_device.type}/", dist.PrefixStore(f"{GROUP}/", dist.PrefixStore(GROUP, store)))
        group = (dist.ProcessGroupNCCL(keys, 0, world) if cuda else dist.ProcessGroupGloo(keys, 0, world, timeout))
        answer.result()
        self.group_store = store  # the master store lives as long as the group
        return group

    def flush(self):
        for _ in range(60):  # SGLang refuses to flush while requests are running
            try:
                self._call("/flush_cache", {})
                return
            except ServerError as e:
                if "HTTP 400" not in str(e):
                    raise
                time.sleep(0.5)
        raise RuntimeError("SGLang /flush_cache kept refusing (requests still running?)")

    def sync_plan(self):
        return (self.server_tp, self.dtype) if self.weight_sync == "tensor" and self.server_tp > 1 else (1, None)

    def release(self):
        self._call("/release_memory_occupation", {})

    def resume(self):
        self._call("/resume_memory_occupation", {})
