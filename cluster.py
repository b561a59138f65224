"""cluster.py: the rollout across nodes (README, "Several nodes").

With --rollout-engine sglang on one node nothing changes: rank 0 starts one server on 127.0.0.1. On
several nodes each node's local rank 0 (its leader) starts a server over its node's GPUs (on CPU, the
test harness, one server a node), logging to sglang_node<N>.log in the run folder (its synced weights
under weights/node<N>); global rank 0 puts SGLang's router (sglang_server.Router) in front of them all
and generates through it. Those servers
bind to the node's address (the one its route to MASTER_ADDR leaves from) and take a per-run API key
(secrets.token_urlsafe, handed to the ranks over the job's own process group, never written out; it is
on the server's and the router's command line, which other users of the node can read in /proc).

A server that dies is restarted by its node: at once where it comes back with the current weights
(disk sync: the last synced folder), else at the next weight update, which it then receives whole;
meanwhile the router sends elsewhere and retries what it held (what still fails is a failed sample).
Each leader releases, resumes and updates its own server from its own ranks (every rank holds the full
exported tensors; "tensor" sync into a server of TP > 1 gathers within the node). `on_leaders` runs
such a step on every leader and returns only when all have reported: a failure on any node stops the
step on every rank, naming the node and its server, and no rollout starts before every server holds
the new weights.
"""
import os
import secrets
import shlex
import socket

import torch.distributed as dist

import sglang_engine


def local_rank():
    return int(os.environ.get("LOCAL_RANK", 0))


def node_rank(par):
    return par.rank // int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def nodes(world):
    """Nodes of the job: torchrun's WORLD_SIZE / LOCAL_WORLD_SIZE (one node without torchrun)."""
    return max(1, world // int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def node_address():
    """The address other nodes reach this one at: the source of its route to MASTER_ADDR (a UDP
    socket's connect sends nothing; it only picks the interface)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((os.environ.get("MASTER_ADDR", "127.0.0.1"), 9))
        return s.getsockname()[0]


_NODE_GROUP = []


def node_group(par):
    """(this node's process group, its leader's global rank): (None, 0) on one node. Made once, by
    every rank at its first call (torch's new_subgroups is collective)."""
    if nodes(par.world) == 1:
        return None, 0
    if not _NODE_GROUP:
        _NODE_GROUP.append(dist.new_subgroups(int(os.environ["LOCAL_WORLD_SIZE"]))[0])
    return _NODE_GROUP[0], par.rank - local_rank()


def on_leaders(par, engine, fn, what):
    """fn(engine) on every rank that holds an engine, then every rank learns how it went: the first
    failure raises SystemExit on all, naming its node and server. -> fn's result here (None elsewhere)."""
    out, error = None, None
    if engine is not None:
        try:
            out = fn(engine)
        except Exception as e:  # noqa: BLE001 - any failure of a node's server stops the step everywhere
            server = getattr(getattr(engine, "server", None), "url", "its server")
            error = f"{what} on node {node_rank(par)} ({server}): {type(e).__name__}: {e}"
    if par.world > 1:
        errors = [None] * par.world
        dist.all_gather_object(errors, error)
        error = next((e for e in errors if e), None)
    if error:
        raise SystemExit(f"[cluster] {error}")
    return out


def start(args, par, hf_dir, run_dir):
    """-> this rank's engine, started on every rank together: rank 0's generates (through the router
    when there are several nodes); another node's leader holds its node's server for weight updates,
    release and resume; None elsewhere."""
    if sglang_engine.engine_kind(args) != "sglang" or nodes(par.world) == 1:
        return sglang_engine.make_engine(args, hf_dir, run_dir) if par.rank == 0 else None
    if args.use_rollout_routing_replay:  # every rank alike, before any server starts
        raise SystemExit("--use-rollout-routing-replay with several nodes: SGLang's router (sglang-router 0.3.2) "
                         "drops return_routed_experts from the requests it forwards; train R3 on one node")
    key = [secrets.token_urlsafe(24) if par.rank == 0 else None]
    dist.broadcast_object_list(key, src=0)
    node = node_rank(par)

    def serve(_):
        e = sglang_engine.make_engine(args, hf_dir, run_dir, host=node_address(), api_key=key[0],
                                      name=f"node{node:02d}")
        if e.weight_sync == "disk":  # it comes back with the last synced weights: restart it at once
            e.server.watch()
        return e
    engine = on_leaders(par, True if local_rank() == 0 else None, serve, "starting the SGLang server")
    urls = [None] * par.world
    dist.all_gather_object(urls, engine.server.url if engine is not None else None)
    urls = [u for u in urls if u]
    if par.rank == 0:
        engine.attach_router(urls, shlex.split(args.sglang_router_args or ""))
        print(f"[cluster] {len(urls)} SGLang servers behind SGLang's router: {', '.join(urls)}", flush=True)
    return engine
