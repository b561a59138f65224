"""Pipeline parallelism (--pipeline-model-parallel-size): the decoder layers split over PP stages,
megatron-core's schedules (1F1B: get_forward_backward_func) over our packed micro-batches, and the
tied embedding's copy on the last stage. The first stage embeds and runs the vision tower; the last
holds the final norm and LM head, computes the logprobs and the loss; every stage runs its layers on
what the previous one sent (model.MegatronVLM.set_input_tensor). Packed rows differ in length, so
each send carries its shape first (TransformerConfig.variable_seq_lengths).

    out = pipeline.run(model, batches, step, loss)   # every rank: the last stage's results
"""
import copy

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

import parallel

__all__ = ["ModelType", "run", "stage_layers", "schedule_config", "sum_tied_grads"]


def stage_layers(cfg, par, hf_config):
    """(first layer, number of layers) of this rank's stage, as megatron-core splits them (evenly, or
    --decoder-first/last-pipeline-num-layers). Qwen3-VL adds deepstack features after its first layers:
    they must be on the first stage."""
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


def schedule_config(cfg):
    """The config megatron's schedules read (model.config): the model's, with calculate_per_token_loss
    so that they neither divide our loss (already over the global token count) by the micro-batch
    count nor by the token count (schedules.py:257-269). A copy: on the model's own it would rescale
    the MoE aux loss too."""
    out = copy.copy(cfg)
    out.calculate_per_token_loss = True
    return out


def run(model, batches, step, loss=None, forward_only=False):
    """Megatron's schedule over `batches` [(items, model inputs)]: `step(model, inputs)` is the model
    call (on every stage: it returns the hidden states to send, on the last what `loss` takes);
    `loss(items, out)` -> (scalar loss to backpropagate, {stat: float}) on the last stage. -> on every
    rank, [per micro-batch: loss's stats, or step's output where loss is None (forward only)]; a stage
    before the last receives them from the last (stats only: outputs stay on the last stage, [] elsewhere).
    An idle micro-batch (items [], trainer.micro_batches under EP) takes a zero loss and reports nothing.
    Without PP, the plain loop: forward, loss, backward a micro-batch at a time, `batches` read lazily."""
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
        return step(m, inputs), lambda o: _loss_triple(*loss_of(items, o))
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


def _loss_triple(value, stats):
    # megatron's 3-tuple (loss, tokens, reported): tokens unused with calculate_per_token_loss
    return value, torch.ones((), dtype=torch.int), stats


def sum_tied_grads(model, grads):
    """A tied LM head under PP: the first stage's embedding and the last stage's copy of it take the
    sum of their gradients, so that the two stay equal after each step (megatron's
    finalize_model_grads does this over the same embedding group). grads: [(param, grad)]."""
    if not (model.tie and model.par.pp > 1):
        return
    lm = model.language_model
    weight = lm.embedding.word_embeddings.weight if model.pre else lm.output_layer.weight if model.post else None
    if weight is None:
        return
    g = next(g for p, g in grads if p is weight)
    parallel.all_reduce(g, ps.get_embedding_group())
