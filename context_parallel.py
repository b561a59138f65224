"""context_parallel.py: context parallelism (--context-parallel-size CP), the layout and its collectives.

Each packed sequence, padded to a multiple of 2 CP tokens, is cut into 2 CP chunks; CP rank r holds
chunks r and 2 CP - 1 - r (Megatron's zigzag layout, as TE's thd_get_partitioned_indices partitions a
THD batch), so every rank has as much causal attention work as the others. What works per token
(embedding, MLP, MoE, norms, the LM head) runs on the local tokens; what needs the whole sequence
gets it here:
- attention (attention.py on CPU): the keys and values all-gathered over CP (on CUDA Transformer
  Engine's THD attention does its own CP exchange);
- Gated DeltaNet (qwen3_5.py): an all-to-all to head-parallel (every rank runs the whole sequence for
  1/CP of the heads: its conv and recurrent state cross chunk boundaries) and back;
- logprobs: all-gathered back to token order; every CP rank then computes the same loss;
- the vision tower: each distinct image runs on one CP rank, its features are all-gathered.
Gradients of the parameters are summed over DP x CP (optim.allreduce_grads).
"""
import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from torch.distributed.nn.functional import all_to_all_single


def padded(n, cp):
    """Tokens a sequence of n takes under CP: n rounded up to a multiple of 2 CP (n when CP is 1)."""
    m = 2 * cp if cp > 1 else 1
    return -(-n // m) * m


def held(lens, cp, rank):
    """(sum(lens) / CP,) positions in the packed row of sequences of lengths `lens` (each a multiple of
    2 CP) that CP rank `rank` holds, in its order: per sequence, chunk rank, then chunk 2 CP - 1 - rank."""
    if cp == 1:
        return torch.arange(sum(lens))
    out, off = [], 0
    for n in lens:
        c = n // (2 * cp)
        out += [torch.arange(off + rank * c, off + (rank + 1) * c),
                torch.arange(off + (2 * cp - 1 - rank) * c, off + (2 * cp - rank) * c)]
        off += n
    return torch.cat(out)


def rank_order(lens, cp):
    """Positions of the ranks' local rows concatenated in rank order: x_gathered = x_full[rank_order]."""
    return torch.cat([held(lens, cp, r) for r in range(cp)])


def token_order(lens, cp):
    """The index that puts the ranks' local rows, concatenated in rank order, back in token order."""
    return rank_order(lens, cp).argsort()


def _all_gather(x, group, sum_grads):
    """Equal-size x of every rank in `group`, concatenated along dim 0 (megatron-core's autograd
    all-gather, for any group). Backward, sum_grads=True: this rank's rows of the gradients summed
    over the ranks (a reduce-scatter: each rank used them, as attention's keys and values); False: its
    rows of this rank's gradient (each rank computed the same loss from all the rows)."""
    return tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=sum_grads, group=group)


def gather_sequence(x, lens, cp, group):
    """This rank's rows x (T / CP, ...) -> every rank's, in token order (T, ...); gradients summed back."""
    return _all_gather(x, group, True)[token_order(lens, cp).to(x.device)]


def gather_rows(x, group, sum_grads=False):
    """This rank's x (n_r, ...) -> every rank's, concatenated in rank order (sum n_r, ...); n_r may differ.
    Backward as _all_gather's: by default this rank's rows of its own gradient (all ranks must compute
    the same loss from them)."""
    n = dist.get_world_size(group)
    counts = torch.zeros(n, dtype=torch.long, device=x.device)
    dist.all_gather_into_tensor(counts, torch.tensor([x.shape[0]], device=x.device), group=group)
    most = int(counts.max())
    full = _all_gather(torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]), group, sum_grads)
    return full[torch.cat([torch.arange(r * most, r * most + int(c)) for r, c in enumerate(counts.tolist())])]


def scored_here(lens, cp, rank, rows):
    """rows (N,): positions of the packed row to score -> (local, pick, back): this rank's indices of
    the rows it holds, which of the N they are, and the index that puts every rank's scores, gathered
    in rank order (gather_rows), back in the order of rows."""
    owner, local = torch.empty(sum(lens), dtype=torch.long), torch.empty(sum(lens), dtype=torch.long)
    for r in range(cp):
        mine = held(lens, cp, r)
        owner[mine], local[mine] = r, torch.arange(len(mine))
    by_rank = [(owner[rows] == r).nonzero()[:, 0] for r in range(cp)]
    pick = by_rank[rank]
    return local[rows[pick]], pick, torch.cat(by_rank).argsort()


def images_here(tokens, cp, rank):
    """Distinct images spread over the CP ranks, image j on rank j % CP; tokens: feature rows of each.
    -> (this rank's images, the index that puts all features, gathered in rank order, in image order)."""
    ran = [j for r in range(cp) for j in range(len(tokens)) if j % cp == r]
    start = dict(zip(ran, torch.tensor([0] + [tokens[j] for j in ran]).cumsum(0).tolist()))
    back = torch.cat([torch.arange(start[j], start[j] + tokens[j]) for j in range(len(tokens))])
    return [j for j in range(len(tokens)) if j % cp == rank], back


def to_heads(x, lens, cp, group):
    """(T / CP, CP x C) this rank's tokens with every rank's channels (rank j's are the j-th C) ->
    (T, C) every token, in token order, with this rank's channels. Its backward is the reverse exchange."""
    send = x.unflatten(-1, (cp, -1)).transpose(0, 1).contiguous()  # (CP, T / CP, C): part j goes to rank j
    got = all_to_all_single(torch.empty_like(send), send, group=group)  # part r: rank r's tokens, my channels
    return got.flatten(0, 1)[token_order(lens, cp).to(x.device)]


def from_heads(y, lens, cp, group):
    """The inverse of to_heads: (T, C) every token with this rank's channels -> (T / CP, CP x C)."""
    send = y[rank_order(lens, cp).to(y.device)].unflatten(0, (cp, -1)).contiguous()  # part r: rank r's tokens
    got = all_to_all_single(torch.empty_like(send), send, group=group)  # part j: my tokens, rank j's channels
    return got.transpose(0, 1).flatten(1)
