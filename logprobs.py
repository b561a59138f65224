"""logprobs.py: token logprobs and entropy from the LM head (LogprobEntropy)."""
import torch
import torch.distributed as dist

from parallel import all_reduce as _all_reduce


CHUNK = 16384  # vocabulary columns per LM-head chunk on a GPU: bounds the (N, CHUNK) logits held at once
CPU_CHUNK = 1 << 19  # logits per chunk on a CPU (2 MB): the chunk's passes stay in cache (docs/model.md)


def _columns(n, device):
    return CHUNK if device.type != "cpu" else max(1, min(CHUNK, CPU_CHUNK // max(1, n)))


class LogprobEntropy(torch.autograd.Function):
    """z = h @ w.T / temp -> log_softmax(z)[target], entropy(softmax(z)), (N,) each; vocab-parallel over TP and
    in chunks of columns, recomputed chunk by chunk in backward: the (N, V) logits are never held at once."""

    @staticmethod
    def forward(ctx, h, w, target, temp, start, n_valid, group):
        # h (N, H) same on all TP ranks; w (V_local, H); target (N,) global ids; rows of w from
        # n_valid on are vocabulary padding; start = global id of w's first row.
        ctx.set_materialize_grads(False)
        h = h / temp if temp != 1 else h
        n, cols = h.shape[0], _columns(h.shape[0], h.device)
        m = h.new_full((n,), float("-inf"))  # running max, sum exp(z - m), sum exp(z - m) * z
        s, a, zt = h.new_zeros(n), h.new_zeros(n), h.new_zeros(n)
        for c in range(0, n_valid, cols):
            z = h @ w[c:min(c + cols, n_valid)].T.to(h.dtype)  # (N, C), fp32 (h is)
            local = target - start - c
            hit = (local >= 0) & (local < z.shape[1])
            zt += torch.where(hit, z.gather(1, local.clamp(0, z.shape[1] - 1)[:, None])[:, 0], 0.0)
            m_new = torch.maximum(m, z.amax(1))
            scale = torch.exp(m - m_new)
            z -= m_new[:, None]
            e = torch.exp(z)
            s_c = e.sum(1)
            # sum e * (z - m_new), one pass without a temporary; + m_new * s_c makes it sum e * z
            a = a * scale + torch.bmm(e[:, None], z[:, :, None])[:, 0, 0] + m_new * s_c
            s, m = s * scale + s_c, m_new
        big_m = _all_reduce(m.clone(), group, dist.ReduceOp.MAX)  # combine the TP shards
        stats = _all_reduce(torch.stack([s * torch.exp(m - big_m), a * torch.exp(m - big_m), zt]), group)
        lse, ez = big_m + stats[0].log(), stats[1] / stats[0]  # log-sum-exp, E_p[z]
        ctx.save_for_backward(h, w, target, lse, ez)
        ctx.args = (temp, start, n_valid, group)
        return stats[2] - lse, lse - ez

    @staticmethod
    def backward(ctx, g_lp, g_ent):  # None for an output the loss does not use
        h, w, target, lse, ez = ctx.saved_tensors
        temp, start, n_valid, group = ctx.args
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp
        gh, gw = torch.zeros_like(h), torch.zeros_like(w)
        cols = _columns(h.shape[0], h.device)
        for c in range(0, n_valid, cols):
            wc = w[c:min(c + cols, n_valid)].to(h.dtype)
            z = h @ wc.T
            z -= lse[:, None]  # log p
            # d logp/dz = onehot - p ; d entropy/dz = -p (z - E_p[z]) = -p (log p + lse - E_p[z])
            if g_ent is None:
                gz = z.exp_().mul_(-g_lp[:, None])
            else:
                p = torch.exp(z)
                gz = torch.addcmul((-(g_lp + g_ent * (lse - ez)))[:, None], z, -g_ent[:, None]).mul_(p)
            local = target - start - c
            hit = (local >= 0) & (local < z.shape[1])
            gz[hit, local[hit]] += g_lp[hit]
            gh.addmm_(gz, wc)
            if gw.dtype == h.dtype:
                torch.mm(gz.T, h, out=gw[c:c + wc.shape[0]])
            else:  # bf16 weights, fp32 logits: mm's out= needs one dtype
                gw[c:c + wc.shape[0]] = (gz.T @ h).to(gw.dtype)
        gh = gh / temp if temp != 1 else gh
        return _all_reduce(gh, group), gw, None, None, None, None, None  # each rank had part of the vocab
