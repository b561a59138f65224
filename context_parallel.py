"""context_parallel.py: context parallelism (--context-parallel-size CP): Megatron's zigzag layout of packed
sequences (CP rank r holds chunks r and 2 CP - 1 - r of each) and the collectives that give what needs whole
sequences its tokens (docs/layouts.md)."""
import functools

import torch
import torch.distributed as dist
from megatron.core import tensor_parallel
from torch.distributed.nn.functional import all_to_all_single


def padded(n, cp):
    """Tokens a sequence of n takes under CP: n rounded up to a multiple of 2 CP (n when CP is 1)."""
    m = 2 * cp if cp > 1 else 1
    return -(-n // m) * m


@functools.lru_cache(maxsize=64)
def held(lens, cp, rank):
    """(sum(lens) / CP,) positions of the packed row (sequences of `lens`, a tuple of multiples of 2 CP) that CP
    rank `rank` holds, in its order: per sequence, chunk rank, then chunk 2 CP - 1 - rank. Cached: every layer
    of a micro-batch asks for the same (a cached tensor is never written to)."""
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


@functools.lru_cache(maxsize=64)
def token_order(lens, cp):
    """The index that puts the ranks' local rows, concatenated in rank order, back in token order (cached)."""
    return rank_order(lens, cp).argsort()


def _all_gather(x, group, sum_grads):
    """Equal-size x of every rank in `group`, concatenated along dim 0. Backward: this rank's rows of the
    gradients summed over the ranks (sum_grads), else of its own gradient (docs/layouts.md)."""
    return tensor_parallel.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=sum_grads, group=group)


def gather_sequence(x, lens, cp, group):
    """This rank's rows x (T / CP, ...) -> every rank's, in token order (T, ...); gradients summed back."""
    return _all_gather(x, group, True)[token_order(lens, cp).to(x.device)]


def gather_rows(x, group, sum_grads=False):
    """This rank's x (n_r, ...) -> every rank's, concatenated in rank order (sum n_r, ...); n_r may differ.
    Backward: _all_gather's."""
    counts = torch.zeros(dist.get_world_size(group), dtype=torch.long, device=x.device)
    dist.all_gather_into_tensor(counts, torch.tensor([x.shape[0]], device=x.device), group=group)
    most = int(counts.max())
    full = _all_gather(torch.cat([x, x.new_zeros((most - x.shape[0], *x.shape[1:]))]), group, sum_grads)
    return full[torch.cat([torch.arange(r * most, r * most + int(c)) for r, c in enumerate(counts.tolist())])]


def scored_here(lens, cp, rank, rows):
    """rows (N,): positions of the packed row to score -> (local, pick, back): this rank's indices of the rows
    it holds, which of the N they are, and the index that puts every rank's scores (gather_rows) back in order."""
    n = sum(lens) // cp  # rows a rank holds
    where = token_order(lens, cp)[rows]  # each row's place among every rank's rows, in rank order
    owner = where // n
    pick = (owner == rank).nonzero()[:, 0]
    return where[pick] - rank * n, pick, owner.argsort(stable=True).argsort()


def images_here(tokens, cp, rank):
    """Image j on CP rank j % CP; tokens: feature rows of each. -> (this rank's images, the index that puts
    all features, gathered in rank order, in image order)."""
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
