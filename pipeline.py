"""pipeline.py: pipeline parallelism (--pipeline-model-parallel-size): the decoder layers split over stages,
megatron-core's 1F1B schedule over our packed micro-batches, the tied head's gradient (docs/layouts.md).

    out = pipeline.run(model, batches, step, loss)   # every rank: the last stage's results"""
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

import parallel


def stage_layers(cfg, par, hf_config):
    """(first layer, number of layers) of this rank's stage, as megatron-core splits them (evenly, or
    --decoder-first/last-pipeline-num-layers); Qwen3-VL's deepstack layers must be on the first stage."""
    n_layers = cfg.num_layers
    if par.pp == 1:
        return 0, n_layers
    if par.pp > n_layers:
        raise SystemExit(f"--pipeline-model-parallel-size {par.pp} is more than the model's {n_layers} decoder layers")
    counts = [get_num_layers_to_build(cfg, pp_rank=r) for r in range(par.pp)]
    if min(counts) < 1 or sum(counts) != n_layers:
        raise SystemExit(f"--pipeline-model-parallel-size {par.pp}: stages of {counts} layers do not split the "
                         f"model's {n_layers}; set --decoder-first/last-pipeline-num-layers so that they do")
    deep = len(getattr(hf_config.vision_config, "deepstack_visual_indexes", None) or [])
    if counts[0] < deep:
        raise SystemExit(f"--pipeline-model-parallel-size {par.pp}: the first stage holds {counts[0]} layers, "
                         f"fewer than the {deep} Qwen3-VL adds deepstack features to; give it more with "
                         "--decoder-first-pipeline-num-layers")
    return get_transformer_layer_offset(cfg, pp_rank=par.pp_rank), counts[par.pp_rank]


def run(model, batches, step, loss=None, forward_only=False):
    """Megatron's schedule over `batches` [(items, model inputs)]: `step(model, inputs)` is the model call (on
    a stage before the last it returns the hidden states to send); `loss(items, out)` -> (scalar loss to
    backpropagate, {stat: float}). -> on every rank, per micro-batch, loss's stats (a stage before the last
    receives them), or where loss is None step's outputs (on the last stage; [] elsewhere). An idle
    micro-batch (items []) takes a zero loss and reports nothing. Without PP: the plain loop, read lazily."""
    def loss_of(items, out):
        if loss is None:  # the outputs as what the loss reports: the MoE layers' loss scale reads the
            return torch.zeros((), device=model.par.device), out  # loss's device (schedules.py:281-286)
        if not items:
            return out[0].sum() * 0.0, None  # a backward through every layer: its collectives run
        return loss(items, out)
    if model.par.pp == 1:
        out = []
        for items, inputs in batches:
            value, o = loss_of(items, step(model, inputs))
            if not forward_only and loss is not None:
                value.backward()
            if o is not None:
                out.append(o)
        return out
    batches = list(batches)

    def forward_step(data_iterator, m):
        items, inputs = next(data_iterator)

        def reduce(o):  # megatron's (loss, tokens, reported): tokens unused with calculate_per_token_loss
            value, stats = loss_of(items, o)
            return value, torch.ones((), dtype=torch.int), stats
        return step(m, inputs), reduce
    with parallel.megatron_on_cpu():
        got = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
            num_microbatches=len(batches), seq_length=1, micro_batch_size=1,  # shapes travel with each send
            forward_only=forward_only or loss is None)
    got = [o for o in got if o is not None]
    if loss is None:
        return got if model.post else []
    box = [got if model.post else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(model.par.pp_group, model.par.pp - 1),
                               group=model.par.pp_group)
    return box[0]


def sum_tied_grads(model, grads):
    """A tied LM head under PP: the first stage's embedding and the last stage's copy take the sum of their
    gradients, so that they stay equal (as megatron's finalize_model_grads does). grads: [(param, grad)]."""
    if model.tie and model.par.pp > 1 and (model.pre or model.post):
        parallel.all_reduce(next(g for p, g in grads if p is model.head_weight()), ps.get_embedding_group())
