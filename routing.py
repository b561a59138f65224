"""routing.py: what the trainer's MoE routers do beyond Megatron's own: count the tokens each expert took
(expert_load), and rollout routing replay (R3, --use-rollout-routing-replay): each router takes the experts
the engine chose for each token, their probabilities still from its own logits (docs/routing.md). Routes
travel as (T, all decoder layers, top_k) int16 per sequence, NONE where the router chooses."""
import functools
import re

import torch

NONE = -1  # no engine route for this (token, layer): a sequence's last token, padding, a dense layer


def routers(module):
    """{decoder layer index: Megatron TopKRouter} of a GPTModel's (this stage's) layers."""
    return {int(re.search(r"layers\.(\d+)\.", name).group(1)): m for name, m in module.named_modules()
            if type(m).__name__ == "TopKRouter"}


class RouteCounter:
    """Tokens each MoE layer's router sent to each expert (forward hooks on Megatron's TopKRouter), one row per
    decoder layer of the whole model (a PP stage fills its own, from `offset`): every rank's table has one shape."""

    def __init__(self, language_model, offset, layers):
        self.counts = None  # (decoder layers, experts), since the last take(); zeros where no router
        for i, m in routers(language_model).items():
            m.register_forward_hook(functools.partial(self._count, offset + i, layers))

    def _count(self, i, n, module, inputs, out):
        routing_map = out[1]  # (tokens, experts) bool: Megatron's TopKRouter.forward -> (probs, routing_map)
        if self.counts is None:
            self.counts = torch.zeros(n, routing_map.shape[1], dtype=torch.float64, device=routing_map.device)
        self.counts[i] += routing_map.sum(0).detach().double()

    def take(self):
        out, self.counts = self.counts, None
        return out


class Replay:
    """One router's router_replay: `target` (tokens, k), the engine's experts of the tokens it sees next (None:
    its own top-k); `stats`: (rows whose own top-k set differs from the target's, rows with a target)."""

    def __init__(self):
        self.target, self.stats = None, None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        values, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.target is None:
            return values, own
        t = self.target.to(scores.device, torch.long)
        if t.shape != own.shape:
            raise ValueError(f"routing replay: {tuple(t.shape)} engine routes for a router that sees "
                             f"{tuple(own.shape)} tokens x top-k")
        have = (t >= 0).all(1)
        with torch.no_grad():
            differ = (own.sort(1).values != t.sort(1).values).any(1) & have
            s = torch.stack([differ.sum(), have.sum()]).double()
            self.stats = s if self.stats is None else self.stats + s
        idx = torch.where(have[:, None], t, own)
        return scores.gather(1, idx), idx  # the chosen experts' scores: their gradient flows to the logits


def install(language_model):
    """A Replay on every router of this stage -> {layer index: Replay}."""
    out = {}
    for i, r in routers(language_model).items():
        r.router_replay = out[i] = Replay()
    return out


def take_mismatch(replays):
    """(2,) float64: (differing, replayed) (token, layer) rows of this rank's routers since the last call."""
    total = torch.zeros(2, dtype=torch.float64)
    for r in replays.values():
        if r.stats is not None:
            total += r.stats.cpu()
            r.stats = None
    return total


def packed(routes, seqs, lens, held, sp_rank, sp):
    """Per-sequence engine routes ((len_i, layers, k) or None) -> (T_local, layers, k): the rows this rank's
    routers see: model.packed_row's row, this CP rank's `held` positions, then SP rank sp_rank's 1/sp."""
    shape = next(r.shape[1:] for r in routes if r is not None)
    full, off = torch.full((sum(lens), *shape), NONE, dtype=torch.int16), 0
    for r, s, n in zip(routes, seqs, lens):  # the dummy sequence at the end, if any, keeps NONE
        if r is not None:
            if r.shape[0] != len(s) or r.shape[1:] != shape:
                raise ValueError(f"routing replay: routes {tuple(r.shape)} for a sequence of {len(s)} tokens "
                                 f"(want ({len(s)}, {', '.join(map(str, shape))}))")
            full[off:off + len(s)] = r
        off += n
    full = full[held]
    return full.chunk(sp)[sp_rank] if sp > 1 else full
