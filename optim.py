"""The optimizer: AdamW with its LR schedule, and one optimizer step over data/tensor parallel
ranks (gradient reduction over DP, global-norm clipping over TP). sft.py and train_grpo.py call
build_optimizer once and optimizer_step after each global batch's backward passes.
"""
import math

import torch
import torch.distributed as dist

import parallel


def build_optimizer(model, args, total_steps):
    """AdamW (no decay on norms and biases) with linear warmup then constant or cosine decay;
    the token embedding and output layer take --decoupled-lr when it is set."""
    groups = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            edge = args.decoupled_lr is not None and ("word_embeddings" in n or "output_layer" in n)
            decay = p.ndim >= 2 and "norm" not in n
            groups.setdefault((edge, decay), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "lr": args.decoupled_lr if edge else args.lr,
                              "weight_decay": args.weight_decay if decay else 0.0}
                             for (edge, decay), ps in sorted(groups.items())],
                            lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=1e-8)

    def factor(step):  # multiplies --lr
        if step < args.lr_warmup_iters:
            return (step + 1) / args.lr_warmup_iters
        if args.lr_decay_style == "constant":
            return 1.0
        t = min(1.0, (step - args.lr_warmup_iters) / max(1, total_steps - args.lr_warmup_iters))
        floor = args.min_lr / args.lr if args.lr else 0.0
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)


def grad_norm_and_clip(model, run, clip):
    """Global L2 norm of the gradients: TP-sharded parameters (Megatron marks them with
    `tensor_model_parallel`) are summed over the TP group, replicated ones counted once."""
    sharded = torch.zeros((), dtype=torch.float64, device=run.device)
    replicated = torch.zeros((), dtype=torch.float64, device=run.device)
    grads = []
    for p in model.parameters():
        if p.grad is None:
            continue
        grads.append(p.grad)
        sq = p.grad.detach().double().pow(2).sum()
        if getattr(p, "tensor_model_parallel", False):
            sharded += sq
        else:
            replicated += sq
    parallel.all_reduce(sharded, run.tp_group)
    norm = math.sqrt((sharded + replicated).item())
    if clip and norm > clip:
        for g in grads:
            g.mul_(clip / (norm + 1e-6))
    return norm


def allreduce_grads(model, run):
    """Sum gradients over data-parallel ranks (the loss is already divided by the global token
    count, so the sum is the global-batch gradient, equal to one rank holding the whole batch).
    Every trainable parameter takes part, with a zero gradient where this rank had none (no
    sample, or no image in its batch), so every rank sends the same tensors in the same order;
    at any DP size, as Megatron's gradient buffers do, so DP=1 and DP=2 take the same step."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if run.dp <= 1:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, group=run.dp_group)
    off = 0
    for p in params:
        p.grad.copy_(flat[off:off + p.numel()].view_as(p))
        off += p.numel()


def optimizer_step(model, opt, sched, run, args):
    allreduce_grads(model, run)
    norm = grad_norm_and_clip(model, run, args.clip_grad)
    lr = opt.param_groups[0]["lr"]
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return {"grad_norm": norm, "lr": lr}
