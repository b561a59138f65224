"""SGLangEngine: engines.Engine on a stock SGLang server (rank 0 only; its process and HTTP:
sglang_server.py), and make_engine: the engine, GPUs and server flags that the trainer's flags ask for.

    engine = SGLangEngine(hf_dir, run_dir, server_args=["--mem-fraction-static", "0.5"])
    outs = engine.generate([{"input_ids": ids, "images": [pil]}], sampling)   # engines.Engine API
    engine.release(); ...train...; engine.resume(); engine.update_weights(buckets); engine.shutdown()

The request format, errors and restarts, the weight-sync modes (`weight_sync`), with citations: docs/sglang.md."""
import base64
import datetime
import importlib.util
import io
import json
import os
import shlex
import time
from contextlib import suppress
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing

import convert
import data
from engines import Engine, LocalEngine, finish_reason
from sglang_server import Router, Server, ServerDown, ServerError, free_port

GROUP = "geo3k_weight_sync"  # the process-group name for "distributed"
COLOCATE_MEM_FRACTION = 0.4  # SGLang's share of each GPU when it shares them with training (README)
OFFLOAD_MEM_FRACTION = 0.7  # the same with --offload-train: the recipe's (the trainer waits in host memory)
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's memory regions
ABORT_TIMEOUT = 5.0  # seconds an /abort_request may take: the rollout repeats it while requests are out


def read_config(hf_dir):
    return json.loads((Path(hf_dir) / "config.json").read_text())


def read_image_token_id(hf_dir):
    """The checkpoint's image pad id (151655 for Qwen2.5/3-VL, 248056 for Qwen3.5); None without images."""
    value = read_config(hf_dir).get("image_token_id")
    return None if value is None else int(value)


def flag_value(args, names, default):
    """The value after the first of `names` in a flag list, else default."""
    args = list(args)
    return next((args[args.index(n) + 1] for n in names if n in args[:-1]), default)


def server_dtype(hf_dir, server_args):
    """The torch dtype the server holds its weights in: its --dtype, else the checkpoint's (which
    SGLangEngine then passes as --dtype: SGLang's own auto would not keep float32)."""
    name = flag_value(server_args, ("--dtype",), "auto")
    if name == "auto":
        cfg = read_config(hf_dir)
        text = cfg.get("text_config") or {}
        name = cfg.get("torch_dtype") or cfg.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "float32"
    name = {"half": "float16", "float": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if not isinstance(getattr(torch, name, None), torch.dtype):
        raise ValueError(f"--dtype {name!r}: not a torch dtype")
    return getattr(torch, name)


def serialize_tensors(named):
    """[(name, tensor)] -> base64 text in SGLang's MultiprocessingSerializer form: CUDA tensors as IPC
    handles naming their GPU by UUID (an index would be ours, not the server's), CPU ones as /dev/shm files."""
    def reduce(t):
        fn, args = torch.multiprocessing.reductions.reduce_tensor(t)
        if t.is_cuda:  # args[6]: the device index
            args = (*args[:6], str(torch.cuda.get_device_properties(args[6]).uuid), *args[7:])
        return fn, args
    if any(not v.is_cuda for _, v in named):
        torch.multiprocessing.set_sharing_strategy("file_system")  # an fd cannot reach a process not forked from us
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


def serialize_on_ranks(buckets, rank, ranks, dtype, group=None, dst=0):
    """Colocated "tensor" sync into a server of TP `ranks` > 1, on every trainer rank of the node (`group`,
    None: the job; its leader: global rank `dst`): local rank i < `ranks` serialises its own GPU's copy of
    each bucket for server TP rank i; the leader gets Serialized buckets, the others None."""
    for bucket in buckets:
        bucket = [(k, v.to(dtype, copy=True)) for k, v in bucket] if rank < ranks else bucket  # copies: update_weights
        blobs = [None] * dist.get_world_size(group) if rank == 0 else None
        dist.gather_object(serialize_tensors(bucket) if rank < ranks else None, blobs, dst=dst, group=group)
        yield Serialized([k for k, _ in bucket], blobs[:ranks]) if rank == 0 else None
        dist.barrier(group)  # the leader's post has returned: the server has copied every blob's tensors


def collapse_image_pads(ids, pad):
    """Each run of `pad` ids -> one `pad`: the form SGLang expands by itself."""
    return [t for i, t in enumerate(ids) if not (t == pad and i and ids[i - 1] == pad)]


def route_shape(hf_dir):
    """R3: (all layers, top_k) of the routes a server of this checkpoint returns."""
    cfg = read_config(hf_dir)
    tc = cfg.get("text_config") or cfg
    return int(tc["num_hidden_layers"]), int(tc["num_experts_per_tok"])


class SGLangEngine(Engine):
    concurrent = True  # rollout.py sends each episode's turn on its own: the server batches continuously

    def __init__(self, hf_dir, run_dir, server_args=(), timeout=900.0, launch_cmd=None, max_restarts=3,
                 request_timeout=3600.0, env=None, config_dir=None, weight_sync="disk", routed_experts=False,
                 host="127.0.0.1", api_key=None, name=""):
        # config_dir (default hf_dir): synced folders' config and tokenizer files (--save-keep may prune hf_dir)
        self.hf_dir, self.image_pad = str(config_dir or hf_dir), read_image_token_id(hf_dir)
        self.weight_sync, self.group, self.stale = weight_sync, None, False
        self.released = set()  # the server's memory regions freed by release(), not yet resumed
        self.server_tp = int(flag_value(server_args, ("--tp-size", "--tp"), 1))
        self.route_shape = route_shape(hf_dir) if routed_experts else None  # R3: the routes it returns
        if weight_sync == "distributed" and int(flag_value(server_args, ("--dp-size", "--dp"), 1)) > 1:
            raise ValueError("weight sync over a process group takes a server with one data-parallel "
                             "replica (rank = 1 + TP rank); use --dp-size 1 or weight_sync disk")
        self.dtype = server_dtype(config_dir or hf_dir, server_args)
        if flag_value(server_args, ("--dtype",), None) is None:  # SGLang's auto serves float32 in float16
            server_args = [*server_args, "--dtype", str(self.dtype).removeprefix("torch.")]
        # flags we add unless given: R3's routes; a 16-bit server's LM head in fp32 (docs/sglang.md, "LM head")
        own = {"--enable-return-routed-experts": routed_experts, "--enable-fp32-lm-head": self.dtype.itemsize == 2}
        server_args = [*server_args, *(f for f, on in own.items() if on and f not in server_args)]
        # env: added to ours for the server and its restarts; SGLang's vision cache outlives weight updates: size 0
        env = {"SGLANG_VLM_CACHE_SIZE_MB": os.environ.get("SGLANG_VLM_CACHE_SIZE_MB", "0"), **(env or {})}
        self.server = Server(hf_dir, run_dir, server_args, env, launch_cmd, timeout, request_timeout,
                             max_restarts, on_restart=self._restarted, host=host, api_key=api_key, name=name)
        self.front = self.server  # where generate goes: this server, or the router in front of every node's

    def attach_router(self, workers, args=(), launch_cmd=None):
        """Generate through SGLang's router in front of `workers` (every server's URL, this one's too);
        weight updates, release and resume stay with this server."""
        self.front = Router(workers, self.server.run_dir, self.server.timeout, self.server.request_timeout,
                            api_key=self.server.api_key, launch_cmd=launch_cmd, args=args)

    def _restarted(self):
        # it holds its launch weights: stale unless synced from disk; its process group is gone
        self.stale, self.group = self.weight_sync != "disk", None
        if self.released:  # it came back holding all its memory, the trainer's meanwhile: free it again
            self.server.post("/release_memory_occupation", {"tags": sorted(self.released)})

    def shutdown(self):
        if self.front is not self.server:
            self.front.stop()
        self.server.stop()

    def generate(self, batch, sampling):
        if len(batch) == 1:  # an episode's own thread (rollout._Episodes): no hop through the pool
            return [self._generate_one(batch[0], sampling)]
        return list(self.front.pool.map(lambda item: self._generate_one(item, sampling), batch))

    def _generate_one(self, item, sp):
        payload = self.generate_payload(item, sp)
        try:
            r = self.front.call("/generate", payload)
        except ServerError as e:  # e.g. an image the server refuses: this sample fails, not the run
            return {"ids": [], "logprobs": [], "finish": "abort", "error": str(e)}
        meta, params = r["meta_info"], payload["sampling_params"]
        pairs = meta.get("output_token_logprobs") or []
        ids = [int(p[1]) for p in pairs]
        # an aborted request runs one more decode step, keeps its token and checks the abort first (scheduler.py:
        # 5797-5811, schedule_batch.py:2007-2014): finish "abort", but a stop token or the cap may end the turn
        out = {"ids": ids, "logprobs": [float(p[0]) for p in pairs], "prompt_tokens": meta.get("prompt_tokens"),
               "finish": finish_reason(ids, params["stop_token_ids"], params["max_new_tokens"],
                                       (meta.get("finish_reason") or {}).get("type", "abort"))}
        if self.stale:  # restarted since the last sync: not the policy being trained
            out.update(finish="abort", error="the SGLang server restarted with its launch weights; "
                                             "its answers until the next weight sync are dropped")
        elif "output_ids" in r and list(r["output_ids"]) != out["ids"]:
            out["error"] = "output_ids differ from the ids in output_token_logprobs"
        elif self.route_shape and (ids or out["finish"] != "abort"):  # an abort before any token has no routes
            out.update(self.routes(meta))  # (one cut queued or mid-prefill: scheduler.py:5685-5702, 3807-3827)
        return out

    def routes(self, meta):
        """R3: meta_info -> {"routed_experts": int16 (rows, layers, top_k)}, or an error for the sample."""
        raw = meta.get("routed_experts")
        if raw is None:
            return {"error": "the SGLang server returned no routed_experts (not started with "
                             "--enable-return-routed-experts?)"}
        flat = np.frombuffer(base64.b64decode(raw), dtype=np.int32)
        if flat.size % (self.route_shape[0] * self.route_shape[1]):
            return {"error": f"routed_experts of {flat.size} ids: not rows of {self.route_shape} (layers, top_k)"}
        return {"routed_experts": flat.reshape(-1, *self.route_shape).astype(np.int16)}

    def generate_payload(self, item, sp):
        """The /generate body for one batch item: one image pad per image, images as data URIs."""
        params = {"temperature": float(sp.get("temperature", 1.0)), "top_p": float(sp.get("top_p", 1.0)),
                  "top_k": int(sp.get("top_k", -1)), "stop_token_ids": list(sp.get("stop_token_ids") or []),
                  "max_new_tokens": int(item.get("max_new_tokens", sp["max_new_tokens"])),
                  "skip_special_tokens": False, "no_stop_trim": True}
        ids = list(item["input_ids"])  # one pad an image: the server expands each pad itself
        ids = ids if self.image_pad is None else collapse_image_pads(ids, self.image_pad)
        payload = {"input_ids": ids, "sampling_params": params, "return_logprob": True}
        if self.route_shape:  # R3: positions counted in the server's expanded ids, as ours
            payload.update(return_routed_experts=True, routed_experts_start_len=int(item.get("routed_experts_start", 0)))
        if item.get("images"):
            payload["image_data"] = [data.image_to_data_uri(im) for im in data.views(item["images"])]  # as the trainer's
        return payload

    def abort(self):
        """--partial-rollout: every /generate on every server answers now with what it has (finish "abort"). By
        abort_all: one by rid that finds its request being tokenized is lost and latches that rid against the
        rollout's repeats (tokenizer_manager.py:926, 2246-2253). Each server at once, for ABORT_TIMEOUT at most."""
        def tell(url):
            with suppress(ServerError, ServerDown):  # a server gone or hung: the rollout's repeat tries again
                self.server.post("/abort_request", {"abort_all": True}, ABORT_TIMEOUT, url)
        list(self.server.pool.map(tell, getattr(self.front, "workers", [self.server.url])))

    def update_weights(self, buckets):
        """Load (HF name, full tensor) buckets into the server by self.weight_sync (docs/sglang.md);
        -> number of tensors. A load the server refuses raises RuntimeError with its message."""
        # "tensor" shares copies: each CUDA IPC share wraps the storage in one more ref-counted context, freed with it
        # (torch/csrc/StorageSharing.cpp THPStorage_shareCuda): a parameter's would grow a chain every sync
        buckets = (b if isinstance(b, Serialized) else [(k, v.to(self.dtype, copy=self.weight_sync == "tensor"))
                                                       for k, v in b] for b in buckets)
        if self.weight_sync == "disk":
            return sync_disk(self.server, buckets, self.hf_dir)
        weight_update(self.server, "/begin_weight_update", {})
        try:
            if self.weight_sync == "tensor":
                n = sync_tensor(self.server, buckets, self.server_tp)
            else:
                self.group = self.group or join_group(self.server, self.server_tp)
                n = sync_distributed(self.server, buckets, self.group)
        finally:
            weight_update(self.server, "/end_weight_update", {})
        flush_cache(self.server)
        self.stale = False
        return n

    def sync_plan(self):
        return (self.server_tp, self.dtype) if self.weight_sync == "tensor" and self.server_tp > 1 else (1, None)

    def release(self, tags=MEMORY_TAGS):
        """Free the server's GPU memory regions `tags`."""
        self.server.call("/release_memory_occupation", {"tags": list(tags)})
        self.released |= set(tags)
        self.server.released = True

    def resume(self, tags=MEMORY_TAGS):
        """Take back those of `tags` that release() freed: SGLang raises on a region resumed twice."""
        if tags := [t for t in tags if t in self.released]:
            self.server.call("/resume_memory_occupation", {"tags": tags})
            self.released -= set(tags)
            self.server.released = bool(self.released)


def weight_update(server, path, body):
    try:
        r = server.call(path, body)
    except ServerError as e:  # HTTP 400 {"success": false, "message": ...}
        raise RuntimeError(f"SGLang {path} failed (HTTP {e.code}): {e.message()}") from None
    if not (isinstance(r, dict) and r.get("success", True)):
        raise RuntimeError(f"SGLang {path} failed: {r}")


def flush_cache(server):
    for _ in range(60):  # SGLang refuses to flush while requests are running
        try:
            server.call("/flush_cache", {})
            return
        except ServerError as e:
            if e.code != 400:
                raise
            time.sleep(0.5)
    raise RuntimeError("SGLang /flush_cache kept refusing (requests still running?)")


def sync_disk(server, buckets, config_dir):
    # two folders in turn: a refused or interrupted sync leaves the last good weights loadable (docs/sglang.md)
    folder = server.run_dir / "weights" / server.name  # a node's own: the run folder may be shared
    out = folder / ("b" if server.model_path == str(folder / "a") else "a")
    n = convert.write_hf(buckets, out, config_dir)
    weight_update(server, "/update_weights_from_disk", {"model_path": str(out)})
    server.model_path = str(out)  # a restarted server comes back with these weights
    return n


def sync_tensor(server, buckets, tp):
    n = 0
    for bucket in buckets:
        own = isinstance(bucket, Serialized)  # each TP rank its own copy (cluster.Servers.sync, TP > 1)
        blobs, names = (bucket.blobs, bucket.names) if own else ([serialize_tensors(bucket)] * tp, bucket)
        weight_update(server, "/update_weights_from_tensor", {"serialized_named_tensors": blobs, "flush_cache": False})
        n += len(names)
    return n


def sync_distributed(server, buckets, group):
    pg, device, _ = group
    n = 0
    for bucket in buckets:
        tensors = [v.to(device).contiguous() for _, v in bucket]
        body = {"names": [k for k, _ in bucket], "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": GROUP, "flush_cache": False}
        answer = server.pool.submit(weight_update, server, "/update_weights_from_distributed", body)
        opts = dist.BroadcastOptions()  # rank 0 (us) to the server's ranks, in `names` order
        for t in tensors:
            pg.broadcast([t], opts).wait()
        answer.result()
        n += len(bucket)
    return n


def join_group(server, tp):
    """Rank 0 of a group whose other ranks are the server's TP ranks (rank_offset 1) -> (group, device, store)."""
    world, cuda, port = 1 + tp, torch.cuda.is_available(), free_port()
    timeout = datetime.timedelta(seconds=server.timeout)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False, timeout=timeout)
    body = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world,
            "group_name": GROUP, "backend": "nccl" if cuda else "gloo"}
    answer = server.pool.submit(weight_update, server, "/init_weights_update_group", body)
    # the store's keys as the server's ranks see them (docs/sglang.md)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    keys = dist.PrefixStore(f"{device.type}/", dist.PrefixStore(f"{GROUP}/", dist.PrefixStore(GROUP, store)))
    pg = (dist.ProcessGroupNCCL(keys, 0, world) if cuda else dist.ProcessGroupGloo(keys, 0, world, timeout))
    answer.result()
    return pg, device, store


def sglang_server_args(argv):
    """Unknown trainer flags -> SGLang server flags: `--sglang-<name> [values]` -> `--<name> [values]`.
    Anything else is an error (a typo must not pass silently)."""
    out = []
    for a in argv:
        if a.startswith("--sglang-"):
            name, eq, value = a[len("--sglang-"):].partition("=")
            out += ["--" + name, value] if eq else ["--" + name]
        elif a.startswith("--") or not out:
            raise SystemExit(f"unknown argument {a!r} (server flags are passed as --sglang-<name> <value>)")
        else:
            out.append(a)  # a flag's value; nargs='+' flags take several: --cuda-graph-bs 1 2 4
    return out


def servers_per_node(args, cuda, local_world):
    """How many servers each node runs: its serving GPUs (--colocate or CPU: its trainer ranks; else
    --rollout-num-gpus) / --rollout-num-gpus-per-engine, one when that is unset."""
    k = args.rollout_num_gpus_per_engine
    if not k:
        return 1
    gpus = args.rollout_num_gpus if cuda and not args.colocate else local_world
    what = "--rollout-num-gpus" if cuda and not args.colocate else "the trainer ranks a node runs (--nproc_per_node)"
    if not gpus or gpus % k:
        raise SystemExit(f"--rollout-num-gpus-per-engine {k}: a node's {gpus} serving GPUs ({what}) "
                         f"are not a multiple of {k}")
    if gpus // k > local_world:
        raise SystemExit(f"--rollout-num-gpus-per-engine {k}: {gpus // k} servers a node, but only {local_world} "
                         "trainer ranks a node to hold them (one each); raise it")
    return gpus // k


def sglang_placement(args, cuda, n_gpus, local_world, visible=None, index=0):
    """-> (server flags, server environment) of the node's SGLang server `index`: the node's serving GPUs, or
    its slice of them (README, "Where SGLang runs"); on CPU (the test harness) it runs where it is started."""
    flags = list(args.sglang_args)
    if not cuda:
        if args.colocate:
            raise SystemExit("--colocate needs CUDA (SGLang's memory release kills a CPU server); on CPU leave it out")
        return flags, {}
    ids, env = visible.split(",") if visible else [str(i) for i in range(n_gpus)], {}
    if args.colocate:  # released, no /health token; a restart meets the trainer's memory (docs/sglang.md, "Where")
        gpus, env = ids[:local_world], {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
                                        "SGLANG_ENABLE_TP_MEMORY_INBALANCE_CHECK": "0",
                                        "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}  # else a release keeps its CUDA graphs
        if "--enable-memory-saver" not in flags:
            flags.append("--enable-memory-saver")
        if "--mem-fraction-static" not in flags:
            flags += ["--mem-fraction-static", str(OFFLOAD_MEM_FRACTION if args.offload_train else COLOCATE_MEM_FRACTION)]
    elif args.rollout_num_gpus > 0:
        gpus = ids[local_world:local_world + args.rollout_num_gpus]
        if len(gpus) < args.rollout_num_gpus:
            raise SystemExit(f"--rollout-num-gpus {args.rollout_num_gpus}: this node has {len(ids)} GPUs and "
                             f"torchrun trains on {local_world}; lower --nproc_per_node or the rollout GPUs")
    else:
        raise SystemExit("--rollout-engine sglang on GPUs: say where the server runs, --colocate (on the training "
                         "GPUs, released while they train) or --rollout-num-gpus N (N GPUs of its own)")
    if k := args.rollout_num_gpus_per_engine:
        servers_per_node(args, cuda, local_world)  # refuses a count that does not divide
        gpus = gpus[index * k:(index + 1) * k]
    if not {"--tp-size", "--tp", "--dp-size", "--dp"} & set(flags):
        flags += ["--tp-size", str(len(gpus))]
    return flags, {**env, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}


def engine_kind(args):
    """--rollout-engine: local or sglang; auto = SGLang if importable and CUDA is present. Called by parse_args:
    sglang not installed (and no --sglang-launch-cmd to start it) stops the run there, before any model loads."""
    found = importlib.util.find_spec("sglang")
    if args.rollout_engine == "sglang" and not (found or args.sglang_launch_cmd):
        raise SystemExit("--rollout-engine sglang: sglang is not installed in this python (`GPU=1 bash setup.sh` "
                         "installs it); or --rollout-engine local")
    if args.rollout_engine != "auto":
        return args.rollout_engine
    return "sglang" if found and torch.cuda.is_available() else "local"


def make_engine(args, hf_dir, run_dir, index=0, local_world=1, processor=None, **where):
    """The engine --rollout-engine names (the local one with the trainer's processor). index: which of the node's
    servers (servers_per_node); local_world: its trainer ranks (Parallel.local_world); where: host, api_key, name."""
    cuda = torch.cuda.is_available()
    if engine_kind(args) == "local":  # SGLang flags with it: refused by parse_args
        return LocalEngine(hf_dir, "cuda" if cuda else "cpu", processor=processor,
                           routed_experts=args.use_rollout_routing_replay)
    flags, env = sglang_placement(args, cuda, torch.cuda.device_count() if cuda else 0, local_world,
                                  os.environ.get("CUDA_VISIBLE_DEVICES"), index)
    if cuda and torch.cuda.get_device_capability()[0] >= 10 and "--mm-attention-backend" not in flags:
        flags += ["--mm-attention-backend", "sdpa"]  # Blackwell: the published recipe's setting
    sync = args.weight_sync
    if sync == "auto":  # on CPU (the test harness): the disk, which any layout can use
        sync = "tensor" if cuda and args.colocate else "distributed" if cuda and args.rollout_num_gpus else "disk"
    return SGLangEngine(hf_dir, run_dir, server_args=flags, timeout=args.sglang_server_timeout, env=env,
                        config_dir=args.hf_checkpoint, weight_sync=sync, routed_experts=args.use_rollout_routing_replay,
                        launch_cmd=shlex.split(args.sglang_launch_cmd) if args.sglang_launch_cmd else None, **where)
