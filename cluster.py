"""cluster.py: the trainer's side of the SGLang servers, on every rank (Servers): where they run (one on
127.0.0.1; a server per node, or per --rollout-num-gpus-per-engine GPUs, behind SGLang's router), and each
step's moves around training: to_rollout, step_aside, step_back, sync. A step on the servers runs on every
holder and fails on every rank if it fails on one (on_leaders). Mechanism: docs/cluster.md."""
import os
import secrets
import shlex
import socket
import time

import torch
import torch.distributed as dist

import convert
import offload
import sglang_engine


def node_address():
    """The address other nodes reach this one at: the source of its route to MASTER_ADDR (a UDP
    socket's connect sends nothing; it only picks the interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
        return s.getsockname()[0]


def on_leaders(par, engine, fn, what):
    """fn(engine) on every rank that holds an engine, then every rank learns how it went: the first
    failure raises SystemExit on all, naming its node and server. -> fn's result here (None elsewhere)."""
    out, error = None, None
    if engine is not None:
        try:
            out = fn(engine)
        except Exception as e:  # noqa: BLE001 - any failure of a node's server stops the step everywhere
            server = getattr(getattr(engine, "server", None), "url", "its server")
            error = f"{what} on node {par.node} ({server}): {type(e).__name__}: {e}"
    if par.world > 1:
        errors = [None] * par.world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise SystemExit(f"[cluster] {error}")
    return out


class Servers:
    """The trainer's side of the rollout engines, on every rank: this rank's engine (rank 0's generates; a
    server's holder updates it; None elsewhere), --offload-train's Offload, and each step's moves (grpo_step)."""

    def __init__(self, args, par, model, opt, ref, hf_dir, run_dir, processor=None):
        self.par, self.colocate, self.off = par, args.colocate, None
        if args.offload_train:  # parked before the server starts: its --mem-fraction-static counts what is free
            self.off = offload.Offload(model, opt, ref)
            self.off.release()
            if par.rank == 0:
                print(f"[offload] --offload-train: {self.off.host_bytes() / 2**30:.2f} GiB of host memory per rank "
                      "for the trainer's parameters, more once the optimizer states exist (offload_host_gib)", flush=True)
        if self.colocate:  # every rank parked or loaded, its cache emptied: SGLang's TP ranks compare free memory
            torch.cuda.empty_cache()  # at start (docs/sglang.md, "Where the server runs"); a no-op without CUDA
            dist.barrier()
        self.per_node, self.group = 1, None  # servers a node; the process group of the ranks one server holds
        self.engine = self.start(args, hf_dir, run_dir, processor)
        # every rank takes part in a sync that serialises on several ranks (sync_plan): rank 0's engine says
        self.plan = self.agree(self.engine.sync_plan() if self.engine is not None else None)

    def start(self, args, hf_dir, run_dir, processor=None):
        """-> this rank's engine, started on every rank together: rank 0's generates (through the router
        when there are several servers); each other server's holder (a node's local rank 0, or the first
        rank of its j-th slice with --rollout-num-gpus-per-engine) keeps it to update, release and resume."""
        par = self.par
        local = sglang_engine.engine_kind(args) != "sglang"
        if not local:
            self.per_node = sglang_engine.servers_per_node(args, torch.cuda.is_available(), par.local_world)
        many = par.world // par.local_world > 1
        if local or (not many and self.per_node == 1):
            return sglang_engine.make_engine(args, hf_dir, run_dir, local_world=par.local_world,
                                             processor=processor) if par.rank == 0 else None
        if args.use_rollout_routing_replay:  # every rank alike, before any server starts
            raise SystemExit("--use-rollout-routing-replay with several SGLang servers: SGLang's router (sglang-router "
                             "0.3.2) drops return_routed_experts from the requests it forwards; train R3 with one server")
        key = self.agree(secrets.token_urlsafe(24) if many else None)  # one node: 127.0.0.1, no key
        stride = par.local_world // self.per_node
        index = par.local_rank // stride

        def serve(_):
            e = sglang_engine.make_engine(args, hf_dir, run_dir, index=index, local_world=par.local_world, api_key=key,
                                          host=node_address() if many else "127.0.0.1",
                                          name=f"node{par.node:02d}" + (f"_{index}" if self.per_node > 1 else ""))
            if e.weight_sync == "disk":  # it comes back with the last synced weights: restart it at once
                e.server.watch()
            return e
        engine = on_leaders(par, True if par.local_rank % stride == 0 and index < self.per_node else None, serve,
                            "starting the SGLang server")
        urls = [None] * par.world
        dist.all_gather_object(urls, engine.server.url if engine is not None else None)
        urls = [u for u in urls if u]
        if par.rank == 0:
            engine.attach_router(urls, shlex.split(args.sglang_router_args or ""))
            print(f"[cluster] {len(urls)} SGLang servers behind SGLang's router: {', '.join(urls)}", flush=True)
        return engine

    def agree(self, value):
        """Rank 0's `value` on every rank."""
        box = [value]
        if self.par.world > 1:
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def to_rollout(self):
        """Before a rollout or an evaluation (every rank): --offload-train parks the whole trainer in host
        memory; then a colocated server takes back what it still lacks (its KV cache and CUDA graphs).
        Repeating it changes nothing."""
        if self.off is None:
            return
        self.off.release()
        if self.colocate:
            dist.barrier()
            on_leaders(self.par, self.engine, lambda e: e.resume(), "the server's resume")

    def step_aside(self):
        """Colocated: the server frees the GPUs before any rank trains (ranks other than 0 would otherwise
        start their forwards, --recompute-logprobs first, while SGLang still holds them); then the
        trainer's state comes back from host memory (--offload-train)."""
        if self.colocate:
            on_leaders(self.par, self.engine, lambda e: e.release(), "the server's release")
        if self.off is not None:
            self.off.restore()

    def step_back(self):
        """Colocated: every rank empties its CUDA cache before the server takes the GPUs again; --offload-train
        parks the optimizer states and gradients and resumes only the server's weights (the sync still reads the
        trainer's parameters; to_rollout() does the rest): docs/cluster.md. -> memory metrics."""
        if not self.colocate:
            return {}
        held = {}
        if self.off is not None:
            self.off.release(("optimizer", "grads"))
        if torch.cuda.is_available():  # what training took at its peak, and what this rank still holds
            held["gpu_train_peak_gib"] = torch.cuda.max_memory_reserved() / 2**30
            torch.cuda.empty_cache()
            held["gpu_held_at_resume_gib"] = torch.cuda.memory_reserved() / 2**30
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        on_leaders(self.par, self.engine, lambda e: e.resume(["weights"] if self.off is not None else sglang_engine.MEMORY_TAGS),
                   "the server's resume")
        return held

    def sync(self, model):
        """Full HF tensors to every server (the export gathers over TP on every rank; each holder sends):
        a colocated server of TP > 1 gets its TP rank i's copy from trainer rank i's GPU. -> metrics."""
        t, par = time.perf_counter(), self.par
        buckets = convert.export_hf(model)
        if self.plan[0] > 1:  # each server from the ranks on its GPUs: new_subgroups is collective, made once
            size = par.local_world // self.per_node
            if self.group is None and size < par.world:
                self.group = dist.new_subgroups(size)[0]
            holder = par.rank - par.rank % size
            buckets = sglang_engine.serialize_on_ranks(buckets, par.rank - holder, *self.plan, self.group, holder)

        def update(e=None):
            try:
                if e is not None:
                    e.update_weights(buckets)
            finally:  # a failed update, and a rank with no server, take part in the export's collectives to the end
                for _ in buckets:
                    pass
        if self.engine is None:
            update()
        on_leaders(par, self.engine, update, "the weight update")  # every server holds the new weights
        out = {"sync_s": time.perf_counter() - t}
        if self.off is not None:
            out["offload_host_gib"] = self.off.host_bytes() / 2**30
        return out

    def for_checkpoint(self):
        """A checkpoint is due: --offload-train parked the optimizer states at the sync; they come back."""
        if self.off is not None:
            self.off.restore(("optimizer",))

    def shutdown(self):
        if self.engine is not None:
            self.engine.shutdown()
