"""The optimizer: AdamW with its LR schedule, and one optimizer step over the parallel ranks. fp32: torch
AdamW; --bf16 / --use-distributed-optimizer: MasterAdamW on CPU, megatron-core's DDP and optimizer on CUDA.
Parameters with `allreduce == False` (MoE experts, Megatron's mark) are never sharded. docs/optimizer.md."""
import math

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer

import parallel
import pipeline


def param_groups(model, args):
    """[(lr, weight_decay, [params])]: no decay on norms and biases; the token embedding and the
    output layer take --decoupled-lr when it is set. The same order on every rank."""
    groups = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            edge = args.decoupled_lr is not None and ("word_embeddings" in n or "output_layer" in n)
            decay = p.ndim >= 2 and "norm" not in n
            groups.setdefault((edge, decay), []).append(p)
    return [(args.decoupled_lr if edge else args.lr, args.weight_decay if decay else 0.0, ps)
            for (edge, decay), ps in sorted(groups.items())]


def build_optimizer(model, args, total_steps):
    """(optimizer, LR scheduler): linear warmup then constant or cosine decay of every group's lr."""
    def factor(step):  # multiplies --lr
        if step < args.lr_warmup_iters:
            return (step + 1) / args.lr_warmup_iters
        if args.lr_decay_style == "constant":
            return 1.0
        t = min(1.0, (step - args.lr_warmup_iters) / max(1, total_steps - args.lr_warmup_iters))
        floor = args.min_lr / args.lr if args.lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    if not (args.bf16 or args.use_distributed_optimizer):
        opt = adamw(param_groups(model, args), args)
    elif torch.cuda.is_available():
        opt = megatron_optimizer(model, args)
    else:
        opt = MasterAdamW(param_groups(model, args), args, model.par)
    return opt, Schedule(opt, factor)


def adamw(groups, args):
    """torch's fused AdamW (one pass a tensor: 5x the default loop's speed on CPU) over [(lr, weight_decay, [tensors])]."""
    return torch.optim.AdamW([{"params": ps, "lr": lr, "weight_decay": wd} for lr, wd, ps in groups],
                             lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=1e-8, fused=True)


class Schedule:
    """torch's LambdaLR for any optimizer with param_groups (megatron's ChainedOptimizer, MoE's, is no torch
    Optimizer): group i's lr = its peak lr, kept as "initial_lr", x factor(steps taken)."""

    def __init__(self, opt, factor):
        self.opt, self.factor, self.last_epoch = opt, factor, 0
        self.base = [g["lr"] for g in opt.param_groups]
        self._apply()

    def _apply(self):
        for g, lr in zip(self.opt.param_groups, self.base):
            g["lr"] = g.setdefault("initial_lr", lr) * self.factor(self.last_epoch)

    def step(self):
        self.last_epoch += 1
        self._apply()

    def state_dict(self):  # LambdaLR's key: checkpoints of either load in the other
        return {"last_epoch": self.last_epoch}

    def load_state_dict(self, state):
        self.last_epoch = state["last_epoch"]
        self._apply()


def megatron_optimizer(model, args):
    """CUDA: megatron-core's DDP and optimizer (fp32 masters; sharded over DP with
    --use-distributed-optimizer), its groups' lr and weight decay set as param_groups sets ours."""
    for n, p in model.named_parameters():  # megatron's --decoupled-lr selects params by this mark
        p.is_embedding_or_output_parameter = "word_embeddings" in n or "output_layer" in n
    ddp, dtype = megatron_ddp(model, args), torch.bfloat16 if args.bf16 else torch.float32
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, decoupled_lr=args.decoupled_lr,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=1e-8, clip_grad=args.clip_grad or 0.0, bf16=args.bf16, params_dtype=dtype,
        use_distributed_optimizer=args.use_distributed_optimizer, optimizer_cpu_offload=args.optimizer_cpu_offload,
        optimizer_offload_fraction=args.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=args.overlap_cpu_optimizer_d2h_h2d), [ddp])
    opt.ddp, opt.sharded = ddp, args.use_distributed_optimizer
    for g in opt.param_groups:  # over every part of a ChainedOptimizer (MoE experts get their own)
        g["lr"], g["weight_decay"] = g["max_lr"], args.weight_decay * g["wd_mult"]
    return opt


def megatron_ddp(model, args):
    """megatron-core's DDP around the model, SUMMING gradients over DP ranks as allreduce_grads does (model.config:
    calculate_per_token_loss, as our loss is already divided by the global token count), no overlapped reduce."""
    with parallel.megatron_on_cpu():  # on CPU only for the test that holds the two paths together
        return DistributedDataParallel(model.config, DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32, overlap_grad_reduce=False,
            use_distributed_optimizer=args.use_distributed_optimizer), model)


def inner_optimizers(opt):
    """The torch optimizers that hold the state: megatron's wrapped one, or one per part of a
    ChainedOptimizer (MoE experts); MasterAdamW's; or `opt` itself."""
    if isinstance(opt, MegatronOptimizer):
        return [o.optimizer for o in getattr(opt, "chained_optimizers", [opt])]
    return [opt.inner] if isinstance(opt, MasterAdamW) else [opt]


def params(o):
    """The tensors a torch optimizer steps, in its groups' order."""
    return [p for g in o.param_groups for p in g["params"]]


def state_of(opt):
    """The optimizer's checkpoint state; a sharded megatron optimizer's with its inner optimizers' masters
    and moments, which its state_dict() leaves out."""
    if not isinstance(opt, MegatronOptimizer) or not opt.sharded:
        return opt.state_dict()
    inner = inner_optimizers(opt)
    return {"megatron": opt.state_dict(), "inner": [o.state_dict() for o in inner],
            "masters": [[p.detach().clone() for p in params(o)] for o in inner]}


def load_state(opt, state):
    if not isinstance(opt, MegatronOptimizer) or not opt.sharded:
        return opt.load_state_dict(state)
    opt.load_state_dict(state["megatron"])
    for o, inner, masters in zip(inner_optimizers(opt), state["inner"], state["masters"]):
        o.load_state_dict(inner)
        for p, saved in zip(params(o), masters):
            p.data.copy_(saved)


class MasterAdamW:
    """fp32 masters and AdamW for this DP rank's shard of the parameters laid end to end, as Megatron's
    distributed optimizer shards its gradient buffer; each step gathers the updated ranges into the parameters."""

    def __init__(self, groups, args, par):
        self.dp_rank, self.dp = (par.dp_rank, par.dp) if args.use_distributed_optimizer else (0, 1)
        self.group = par.dp_group
        self.params = [p for _, _, ps in groups for p in ps]
        n = sum(p.numel() for p in self.params if getattr(p, "allreduce", True))
        self.shard = -(-n // self.dp)
        lo, hi = self.dp_rank * self.shard, (self.dp_rank + 1) * self.shard
        self.pieces, master_groups, off = [], [], 0  # pieces: (param, a, b, fp32 master of p[a:b])
        for lr, wd, ps in groups:
            masters = []
            for p in ps:
                a, b = 0, p.numel()
                if getattr(p, "allreduce", True):  # in the sharded range; experts stay whole
                    a, b, off = min(max(lo - off, 0), b), min(max(hi - off, 0), b), off + b
                if b > a:
                    masters.append(p.detach().reshape(-1)[a:b].float().clone())
                    self.pieces.append((p, a, b, masters[-1]))
            master_groups.append((lr, wd, masters))
        self.inner = adamw(master_groups, args)
        grad_dtype = torch.float32 if args.accumulate_allreduce_grads_in_fp32 else self.params[0].dtype
        for p in self.params:  # each backward adds into main_grad and frees .grad
            p.main_grad = torch.zeros(p.shape, dtype=grad_dtype, device=p.device)
            p.register_post_accumulate_grad_hook(_to_main_grad)

    @property
    def param_groups(self):  # the inner optimizer's (load_state_dict replaces its list)
        return self.inner.param_groups

    def step(self):
        for p, a, b, m in self.pieces:
            m.grad = p.main_grad.reshape(-1)[a:b].float()
        self.inner.step()
        self.publish()

    def publish(self):
        """Masters -> parameters: the ranks' disjoint ranges summed over DP, an all-gather in one call."""
        flat = torch.zeros(self.shard * self.dp, dtype=torch.float32, device=self.params[0].device)
        off, base = 0, self.dp_rank * self.shard
        for p, a, b, m in self.pieces:
            if getattr(p, "allreduce", True):
                flat[base + off:base + off + b - a] = m
                off += b - a
            else:
                p.data.view(-1).copy_(m)
        if self.dp > 1:
            dist.all_reduce(flat, group=self.group)
        off = 0
        for p in self.params:
            if getattr(p, "allreduce", True):
                p.data.view(-1).copy_(flat[off:off + p.numel()])
                off += p.numel()

    def zero_grad(self, set_to_none=True):  # main_grad stays allocated, as Megatron's buffers do
        for p in self.params:
            p.main_grad.zero_()

    def state_dict(self):  # this rank's shard only
        return {"adam": self.inner.state_dict(), "master": [m for *_, m in self.pieces],
                "shard": (self.dp_rank, self.dp)}

    def load_state_dict(self, state):
        if tuple(state["shard"]) != (self.dp_rank, self.dp):
            raise SystemExit(f"--load: optimizer shard {tuple(state['shard'])} (DP rank, DP size) does not "
                             f"match this run's ({self.dp_rank}, {self.dp}): resume at the same DP size")
        self.inner.load_state_dict(state["adam"])
        for (*_, m), saved in zip(self.pieces, state["master"]):
            m.copy_(saved)
        self.publish()


def _to_main_grad(p):
    p.main_grad += p.grad
    p.grad = None


def grad_norm_and_clip(grads, par, clip):
    """Global L2 norm of [(param, grad)], each parameter counted once whatever holds it; grads scaled
    down to `clip` when over it. Row norms in fp32 summed in fp64: as exact as an fp64 copy, 25x faster on CPU."""
    sharded, replicated, experts = (torch.zeros((), dtype=torch.float64, device=par.device) for _ in range(3))
    for p, g in grads:
        if getattr(p, "shared", False):  # PP: the last stage's copy of a tied embedding (counted on the first)
            continue
        sq = torch.linalg.vector_norm(g.detach().float(), dim=-1).double().square().sum()
        if not getattr(p, "allreduce", True):
            experts += sq
        elif getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    parallel.all_reduce(sharded, par.tp_group)
    parallel.all_reduce(experts, par.ep_group)
    for part in (sharded, replicated, experts):  # PP: each stage holds other parameters
        parallel.all_reduce(part, par.pp_group)
    norm = math.sqrt((sharded + replicated + experts).item())
    if clip and norm > clip:
        for _, g in grads:
            g.mul_(clip / (norm + 1e-6))
    return norm


def allreduce_grads(grads, par):
    """Sum [(param, grad)] over data- and context-parallel ranks (MoE experts: over the ranks holding the
    same experts), one flat reduce per group: the loss is already divided by the global token count."""
    by_group = {}
    for p, g in grads:
        by_group.setdefault(par.dp_cp_group if getattr(p, "allreduce", True) else par.expert_dp_group, []).append(g)
    for group, gs in by_group.items():
        if dist.get_world_size(group) <= 1:
            continue
        flat = torch.cat([g.reshape(-1) for g in gs])
        dist.all_reduce(flat, group=group)
        for g, summed in zip(gs, flat.split([g.numel() for g in gs])):
            g.copy_(summed.view_as(g))


def optimizer_step(model, opt, sched, par, args):
    """Reduce, clip and apply the accumulated gradients; advance the LR schedule; clear grads."""
    lr = opt.param_groups[0]["lr"]
    if isinstance(opt, MegatronOptimizer):  # CUDA: its optimizer clips (config.clip_grad) and steps
        # tied grads summed before the DP reduce, which leaves a sharded rank only its part of the buffer
        pipeline.sum_tied_grads(model, [(p, p.main_grad) for p in model.parameters() if p.requires_grad])
        opt.ddp.finish_grad_sync()
        _, norm, _ = opt.step()
        opt.ddp.zero_grad_buffer()
        opt.zero_grad()
    else:
        if isinstance(opt, MasterAdamW):
            grads = [(p, p.main_grad) for p in opt.params]
        else:
            params = [p for p in model.parameters() if p.requires_grad]
            for p in (p for p in params if p.grad is None):
                p.grad = torch.zeros_like(p)
            grads = [(p, p.grad) for p in params]
        pipeline.sum_tied_grads(model, grads)
        allreduce_grads(grads, par)
        norm = grad_norm_and_clip(grads, par, args.clip_grad)
        opt.step()
        opt.zero_grad(set_to_none=True)
    sched.step()
    return {"grad_norm": norm, "lr": lr}
