"""loss.py by hand: advantage estimators, the policy losses (PPO-clip, GSPO, CISPO, SAPO) with their gradients, KL
estimators, TIS, on tiny tensors with no model and no process group; the flags' choices are the registries.

    .venv/bin/pytest tests/test_loss.py -q
"""
import math

import pytest
import torch

import loss as L
import reward
import train_grpo as G

# Two sequences: A (2 tokens, adv +1) and B (1 token, adv -1); eps 0.2 below, 0.28 above
LOGP, OLD, ADV, LENS = [-0.6, -0.7, -2.0], [-1.0, -0.5, -2.0], [1.0, 1.0, -1.0], [2, 1]


def run(fn, logp=LOGP, old=OLD, adv=ADV, lens=LENS, eps=(0.2, 0.28)):
    """-> (per-token loss, clipped, d sum(loss) / d logp) as lists."""
    x = torch.tensor(logp, requires_grad=True)
    out, stats = fn(x, torch.tensor(old), torch.tensor(adv), lens, *eps)
    out.sum().backward()
    return out.tolist(), stats["clipfrac"].tolist(), x.grad.tolist()


def test_ppo_clip_by_hand():
    # ratios e^0.4 = 1.4918 (clipped to 1.28, no gradient), e^-0.2 = 0.8187, 1
    loss, clipped, grad = run(L.ppo_clip)
    assert loss == pytest.approx([-1.28, -math.exp(-0.2), 1.0])
    assert clipped == [True, False, False]
    assert grad == pytest.approx([0.0, -math.exp(-0.2), 1.0])  # d(-ratio A)/dlogp = -ratio A


def test_gspo_one_ratio_a_sequence_by_hand():
    # A: exp(mean(0.4, -0.2)) = e^0.1 on both tokens; d/dlogp_t of the 2 tokens' -e^mean A: 2 x (-e^0.1 A / 2)
    loss, clipped, grad = run(L.gspo)
    assert loss == pytest.approx([-math.exp(0.1)] * 2 + [1.0]) and clipped == [False] * 3
    assert grad == pytest.approx([-math.exp(0.1)] * 2 + [1.0])
    # A's tokens at 0.9 and 0.5 above old: e^0.7 = 2.01 is clipped for the whole sequence, where PPO clips one token
    loss, clipped, grad = run(L.gspo, logp=[-0.1, 0.0, -2.0])
    assert loss == pytest.approx([-1.28, -1.28, 1.0]) and clipped == [True, True, False]
    assert grad == pytest.approx([0.0, 0.0, 1.0])
    assert run(L.ppo_clip, logp=[-1.0, 0.0, -2.0])[1] == [False, True, False]
    # an empty sequence (every token masked off-policy) takes no part
    assert run(L.gspo, logp=LOGP, lens=[2, 0, 1])[0] == pytest.approx(run(L.gspo)[0])


def test_cispo_clipped_stop_gradient_weight_by_hand():
    # -sg(clip(ratio)) A logp: weights 1.28 (clipped), e^-0.2, 1; a clipped token keeps its gradient -w A
    loss, clipped, grad = run(L.cispo)
    w = [1.28, math.exp(-0.2), 1.0]
    assert loss == pytest.approx([-w[0] * -0.6, -w[1] * -0.7, -w[2] * -1 * -2.0])
    assert clipped == [True, False, False] and grad == pytest.approx([-1.28, -w[1], 1.0])
    # canonical CISPO (--eps-clip 1): no lower bound; a ratio of e^-3 keeps its weight
    loss, clipped, _ = run(L.cispo, logp=[-4.0, -0.5, -2.0], eps=(1.0, 0.28))
    assert loss[0] == pytest.approx(-math.exp(-3.0) * -4.0) and clipped == [False, False, False]


def test_sapo_soft_gate_by_hand():
    """SAPO (arXiv 2511.20347): loss -4 / tau sigmoid(tau (r - 1)) A, tau_pos where A > 0, tau_neg where not; its
    gradient is -4 p (1 - p) r A, p = sigmoid(tau (r - 1)): at r = 1 the plain policy gradient -A; statistic 4 p (1 - p)."""
    def sig(x):
        return 1 / (1 + math.exp(-x))
    x = torch.tensor(LOGP, requires_grad=True)
    out, stats = L.sapo(x, torch.tensor(OLD), torch.tensor(ADV), LENS, 0.2, 0.28, sapo_tau_pos=2.0, sapo_tau_neg=3.0)
    gate = stats["gate"]
    out.sum().backward()
    r, tau = [math.exp(a - b) for a, b in zip(LOGP, OLD)], [2.0, 2.0, 3.0]
    p = [sig(t * (x_ - 1)) for t, x_ in zip(tau, r)]
    assert out.tolist() == pytest.approx([-4 / t * q * a for t, q, a in zip(tau, p, ADV)])
    assert x.grad.tolist() == pytest.approx([-4 * q * (1 - q) * x_ * a for q, x_, a in zip(p, r, ADV)])
    assert gate.tolist() == pytest.approx([4 * q * (1 - q) for q in p]) and not gate.requires_grad
    assert x.grad[2].item() == pytest.approx(-ADV[2]) and gate[2].item() == 1.0  # B: r = 1, the plain gradient
    # on policy everywhere: SAPO's gradient is the policy gradient, whatever the temperatures
    y = torch.tensor(OLD, requires_grad=True)
    L.sapo(y, torch.tensor(OLD), torch.tensor(ADV), LENS, 0.2, 0.28, 1.0, 1.05)[0].sum().backward()
    assert y.grad.tolist() == pytest.approx([-a for a in ADV])


@pytest.mark.parametrize("rewards,groups,est,want", [
    ([1, 1, 1, 1], [0, 0, 0, 0], "grpo", [0.0, 0.0, 0.0, 0.0]),          # equal rewards: exactly 0
    ([0.9] * 8, [0] * 8, "grpo", [0.0] * 8),                                # even where fp32 mean is not exact
    ([0, 0, 0, 0], [0, 0, 1, 1], "dr_grpo", [0.0] * 4),
    ([1, 0, 1, 0], [0, 0, 1, 1], "dr_grpo", [0.5, -0.5, 0.5, -0.5]),
    ([1, 0], [0, 0], "grpo", [0.5 / (math.sqrt(0.5) + 1e-6), -0.5 / (math.sqrt(0.5) + 1e-6)]),
    ([1, 0, 0, 0, 1, 1], [0, 0, 0, 1, 1, 1], "grpo", None),
    ([1], [3], "grpo", [0.0]),                                              # a group of one learns nothing
])
def test_advantages(rewards, groups, est, want):
    got = L.advantages(rewards, groups, est)
    if want is None:  # per group: zero mean, unit (sample) std
        for g in set(groups):
            a = torch.tensor([x for x, k in zip(got, groups) if k == g], dtype=torch.float64)
            assert abs(a.mean().item()) < 1e-12 and abs(a.std().item() - 1) < 1e-5
    else:
        assert got == pytest.approx(want, abs=1e-12)
        assert all(x == 0.0 for x, w in zip(got, want) if w == 0.0)  # exact zeros, no residue


@pytest.mark.parametrize("kind,fn", [
    ("k1", lambda lp, ref: lp - ref),
    ("k2", lambda lp, ref: 0.5 * (ref - lp) ** 2),
    ("k3", lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1),
    ("low_var_kl", lambda lp, ref: min(10.0, math.exp(ref - lp) - (ref - lp) - 1)),
])
def test_kl_estimators(kind, fn):
    lp = torch.tensor([-0.1, -2.0, -5.0, -0.7, -30.0])
    ref = torch.tensor([-0.3, -1.0, -5.0, -3.0, -0.1])
    got = L.KL[kind](lp, ref)
    assert got.tolist() == pytest.approx([fn(a, b) for a, b in zip(lp.tolist(), ref.tolist())], rel=1e-5)
    assert got[2] == 0.0  # identical policies: no KL


def test_tis_weight_is_capped():
    got = L.tis(torch.tensor([-1.0, -0.5, -2.0]), torch.tensor([-1.5, -0.5, -1.0]), 1.2)
    assert got.tolist() == pytest.approx([1.2, 1.0, math.exp(-1.0)])


def test_flag_choices_are_the_registries(capsys):
    """The estimator and the loss chosen apart; a loss's name as the estimator (slime's `--advantage-estimator gspo`,
    this trainer's gspo, cispo, sapo before) is GRPO's advantage with that loss, refused beside another loss."""
    actions = {a.dest: a for a in G.build_parser()._actions}
    assert actions["advantage_estimator"].choices == [*L.ESTIMATORS, *L.LOSSES]
    assert actions["policy_loss"].choices == list(L.LOSSES) and {"ppo_clip", "gspo", "sapo"} <= set(L.LOSSES)
    base = ["--hf-checkpoint", "x", "--prompt-data", "x", "--save", "x", "--advantage-estimator"]
    for est, loss in (("dr_grpo", "cispo"), ("gspo", "gspo"), ("sapo", "sapo")):
        args = G.parse_args(base + [est] + (["--policy-loss", loss] if est == "dr_grpo" else []))
        assert (args.advantage_estimator, args.policy_loss) == ("grpo" if est == loss else est, loss)
    with pytest.raises(SystemExit):
        G.parse_args(base + ["gspo", "--policy-loss", "cispo"])
    assert "--advantage-estimator gspo names a loss: give it as --policy-loss" in capsys.readouterr().err
    assert actions["kl_loss_type"].choices == list(L.KL)
    assert actions["rm_type"].choices == list(reward.REWARDS)
