"""Parallel state: torchrun's environment -> one frozen `Parallel` context (rank, world, device, the
node, and the size, rank and group of every parallelism), megatron-core's parallel state underneath;
nothing else reaches for a group. How Megatron runs on CPU, sockets and the torchrun watch: docs/parallel.md.

    par = parallel.init_distributed(tp=2)   # under torchrun, or a plain process (a world of one)
    par.rank, par.world, par.device, par.node, par.tp_group, par.dp_rank, par.ep, ...
    with parallel.megatron_on_cpu():          # only where Megatron code runs
        ..."""
import atexit
import contextlib
import dataclasses
import datetime
import os
import signal

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps, tensor_parallel
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.transformer.moe import token_dispatcher

import proc


@dataclasses.dataclass(frozen=True)
class Parallel:
    """Who this process is in each parallelism: size, rank and process group of TP, PP, CP, DP
    (data-parallel: the ranks holding the same model shard) and EP; expert_dp_group holds the ranks
    with the same experts (MoE gradients are reduced there)."""
    rank: int
    world: int
    device: torch.device
    local_rank: int  # torchrun's LOCAL_RANK: this rank on its node (0 without torchrun)
    local_world: int  # torchrun's LOCAL_WORLD_SIZE: the trainer ranks of a node (the world without torchrun)
    node: int  # this rank's node: rank // local_world
    tp: int
    tp_rank: int
    tp_group: object
    pp: int
    pp_rank: int
    pp_group: object
    cp: int
    cp_rank: int
    cp_group: object
    dp: int
    dp_rank: int
    dp_group: object
    dp_ranks: tuple  # every global rank's DP rank, in rank order
    dp_cp_group: object  # DP x CP: the ranks whose gradients are summed (CP ranks hold parts of each sequence)
    ep: int
    ep_rank: int
    ep_group: object
    expert_dp_group: object


class _CpuStream:
    """megatron_on_cpu's torch.cuda.Stream: waits for nothing; its events are already done."""

    def wait_stream(self, other):
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self):
        pass


_CPU_STREAM = _CpuStream()


def _to_host(tensor, as_numpy=False, record_stream=False):
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


@contextlib.contextmanager
def megatron_on_cpu():
    """Within the block, the CUDA calls megatron-core 0.16 makes while building and running its layers
    answer for the CPU (each patch and the Megatron code that needs it: docs/parallel.md); without CUDA only."""
    if torch.cuda.is_available():
        yield
        return
    patches = [(torch.cuda, "current_device", lambda: "cpu"),
               (torch.cuda, "manual_seed", torch.manual_seed),
               (torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state()),
               (torch.cuda, "synchronize", lambda *a, **k: None),
               (torch, "zeros", _zeros_on_cpu),
               (torch.cuda, "Stream", lambda *a, **k: _CPU_STREAM),
               (torch.cuda, "current_stream", lambda *a, **k: _CPU_STREAM),
               (torch.cuda, "stream", lambda s: contextlib.nullcontext()),
               (token_dispatcher, "maybe_move_tensor_to_cpu", _to_host),
               (mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
               (mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, fn in patches:
        setattr(obj, name, fn)
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def init_distributed(tp=1, seed=1234, timeout_minutes=60, ep=1, pp=1, cp=1):
    """torchrun's environment (or a plain single process) -> the Parallel context, with Megatron's
    parallel state at TP=tp, CP=cp, PP=pp (DP = world / (tp cp pp)) and EP=ep (expert-TP 1: expert-DP =
    world / ep). A second call returns the context the first one set up."""
    cuda = torch.cuda.is_available()
    if not cuda:  # for good: backward passes, outside megatron_on_cpu, ask it too (docs/parallel.md)
        torch.cuda.current_device = lambda: "cpu"
    local_rank, world = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(device)
        timeout, backend = datetime.timedelta(minutes=timeout_minutes), "nccl" if cuda else "gloo"
        if local_world == world:  # one node: listen on 127.0.0.1, not the host's address
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                os.environ.setdefault(var, "lo")
        if "RANK" in os.environ:  # torchrun: SIGTERM when it dies (if it died already, stop here); its store
            proc.die_with_parent(signal.SIGTERM)
            if os.getppid() == 1:
                raise SystemExit("[parallel] the launcher (torchrun) is gone: not starting")
            dist.init_process_group(backend, timeout=timeout)
        else:  # a plain process: a world of one, no network port
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        # a gloo rank exiting with its group alive may abort in teardown and stall torchrun's exit barrier
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    rank, world = dist.get_rank(), dist.get_world_size()
    if not ps.model_parallel_is_initialized():
        if min(tp, cp, pp) < 1 or world % (tp * cp * pp):
            raise SystemExit(f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp} x "
                             f"--pipeline-model-parallel-size {pp} must divide the world size {world}")
        if ep < 1 or world // pp % ep:
            raise SystemExit(f"--expert-model-parallel-size {ep} must divide the ranks of a pipeline stage "
                             f"(world size {world} / --pipeline-model-parallel-size {pp})")
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                     pipeline_model_parallel_size=pp, context_parallel_size=cp,
                                     expert_tensor_parallel_size=1)
        with megatron_on_cpu():
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    dp_ranks = tuple(r // (tp * cp) % dp for r in range(world))  # Megatron's rank order: TP fastest, then CP, DP, PP
    assert dp_ranks[rank] == dp_rank, "megatron-core's rank order is not TP, CP, DP, PP"
    return Parallel(
        rank=rank, world=world, device=device, local_rank=local_rank, local_world=local_world,
        node=rank // local_world, dp_ranks=dp_ranks,
        tp=tp, tp_rank=ps.get_tensor_model_parallel_rank(), tp_group=ps.get_tensor_model_parallel_group(),
        pp=ps.get_pipeline_model_parallel_world_size(), pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        cp=cp, cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group(),
        dp=dp, dp_rank=dp_rank, dp_group=ps.get_data_parallel_group(),
        dp_cp_group=ps.get_data_parallel_group(with_context_parallel=True),
        ep=ps.get_expert_model_parallel_world_size(), ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(), expert_dp_group=ps.get_expert_data_parallel_group())


_zeros = torch.zeros


def _zeros_on_cpu(*a, device=None, **k):
    return _zeros(*a, device="cpu" if device == "cuda" else device, **k)


def all_reduce(t, group, op=dist.ReduceOp.SUM):
    """In-place all-reduce over `group` that returns its tensor. It runs in a group of one too:
    cheap, and a one-GPU run then meets NCCL's rules (CUDA tensors only) as a multi-GPU run does."""
    dist.all_reduce(t, op, group=group)
    return t
