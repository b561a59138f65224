"""The GRPO step's maths as pure tensor functions in registries keyed by their flags' choices: advantage estimators
(ESTIMATORS) and policy losses (LOSSES), chosen apart, KL estimators (KL), TIS. A policy loss takes a micro-batch's
scored tokens (logp with gradient, old, adv: each (N,)), its sequences' token counts `lens`, the clip range and its own
flags -> (each token's loss, {each of its entry's `stats`: per token}). Layouts: docs/extending.md, "A loss"."""
import collections

import torch

import flags as F


def ppo_clip(logp, old, adv, lens, eps_low, eps_high):
    """PPO-clip per token: ratio = exp(logp - old), loss -min(ratio A, clip(ratio, 1 - eps_low, 1 + eps_high) A)."""
    ratio = torch.exp(logp - old)
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -torch.minimum(ratio * adv, clipped * adv), {"clipfrac": clipped * adv < ratio * adv}


def gspo(logp, old, adv, lens, eps_low, eps_high):
    """GSPO (Qwen, arXiv 2507.18071): PPO-clip of one log-ratio a sequence, the mean over its tokens of logp - old,
    which each of its tokens carries."""
    per_seq = torch.stack([d.sum() / max(1, len(d)) for d in (logp - old).split(lens)])
    return ppo_clip(per_seq.repeat_interleave(torch.tensor(lens, device=logp.device)), 0, adv, lens, eps_low, eps_high)


def cispo(logp, old, adv, lens, eps_low, eps_high):
    """CISPO (MiniMax-M1, arXiv 2506.13585): -sg(clip(ratio, 1 - eps_low, 1 + eps_high)) A logp per token: the
    clipped IS weight takes no gradient, so a clipped token still learns (canonically --eps-clip 1: no lower bound)."""
    ratio = torch.exp(logp - old).detach()
    weight = ratio.clamp(1 - eps_low, 1 + eps_high)
    return -weight * adv * logp, {"clipfrac": weight != ratio}


def sapo(logp, old, adv, lens, eps_low, eps_high, sapo_tau_pos, sapo_tau_neg):
    """SAPO (Qwen, arXiv 2511.20347): a soft gate, no clip: -4 / tau sigmoid(tau (r - 1)) A, tau --sapo-tau-pos where A > 0
    else --sapo-tau-neg, log r clamped to +-20 (verl trainer/ppo/core_algos.py:1330-1388). Its gradient: the policy
    gradient's times w r, w = 4 p (1 - p), p = sigmoid(tau (r - 1)): the plain one at r = 1. Statistic `gate`: w."""
    tau = torch.where(adv > 0, sapo_tau_pos, sapo_tau_neg)
    p = torch.sigmoid(tau * (torch.exp((logp - old).clamp(-20, 20)) - 1))
    return -4 / tau * p * adv, {"gate": (4 * p * (1 - p)).detach()}


def grpo(r):
    """GRPO's group-normalised advantage (arXiv 2402.03300): (r - mean) / (std + eps)."""
    return (r - r.mean()) / (r.std() + 1e-6)


def dr_grpo(r):
    """Dr. GRPO's (arXiv 2503.20783): no division by the group's std."""
    return r - r.mean()


# A group's rewards (G,) float64, its own flags' values -> advantages (G,); `flags` as a loss's (--advantage-estimator)
Estimator = collections.namedtuple("Estimator", ["advantage", "flags"], defaults=({},))
ESTIMATORS = {"grpo": Estimator(grpo), "dr_grpo": Estimator(dr_grpo)}
Loss = collections.namedtuple("Loss", ["policy", "stats", "flags"], defaults=(("clipfrac",), {}))  # stats: its names
LOSSES = {"ppo_clip": Loss(ppo_clip), "gspo": Loss(gspo), "cispo": Loss(cispo),  # verl's policy_loss.loss_mode
          "sapo": Loss(sapo, ("gate",), {  # the paper's defaults (verl trainer/config/actor/actor.yaml:46-49)
              "--sapo-tau-pos": dict(type=F.at_least(1e-3), default=1.0, help="SAPO's gate temperature where A > 0"),
              "--sapo-tau-neg": dict(type=F.at_least(1e-3), default=1.05, help="SAPO's temperature where A <= 0")})}


def advantages(rewards, groups, estimator, **flags):
    """Each sample's advantage in its group (groups[i]) by ESTIMATORS[estimator] with its `flags`' values (by dest);
    exactly 0.0 for one or equal rewards."""
    out = [0.0] * len(rewards)
    for g in set(groups):
        idx = [i for i, x in enumerate(groups) if x == g]
        r = torch.tensor([rewards[i] for i in idx], dtype=torch.float64)
        if len(idx) > 1 and not bool((r == r[0]).all()):
            for i, v in zip(idx, ESTIMATORS[estimator].advantage(r, **flags).tolist()):
                out[i] = v
    return out


def _k3(d):  # d = ref - logp
    return torch.exp(d) - d - 1


# Per-token estimates of KL(policy || ref) (Schulman's k1, k2, k3); low_var_kl: k3 clamped, for stability.
KL = {"k1": lambda logp, ref: logp - ref, "k2": lambda logp, ref: 0.5 * (ref - logp) ** 2,
      "k3": lambda logp, ref: _k3(ref - logp),
      "low_var_kl": lambda logp, ref: _k3((ref - logp).clamp(-20, 20)).clamp(max=10)}


def tis(old, rollout, cap):
    """Truncated importance sampling's per-token weight: the trainer's old policy over the engine's, capped."""
    return torch.exp(old - rollout).clamp(max=cap)
