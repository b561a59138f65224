"""engines.Sampler on CPU: its draws follow softmax(logits / T) after top-k / top-p (a chi-square
test of frequencies, like torch.multinomial's), and its logprobs are the raw logits' log-softmax.
The engine end to end (logprobs vs a teacher-forced forward): tests/test_rollout.py.

    .venv/bin/pytest tests/test_engines.py -q
"""
import pytest
import torch

import engines

N = 40000  # draws per case
# Chi-square critical values at p = 0.001 by degrees of freedom (tables): a correct sampler fails
# a case once in a thousand seeds; the seed is fixed, so the test is deterministic.
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, float("-inf")])  # the last: never


def target(logits, T, top_p=1.0, top_k=-1):
    """The distribution a sampler should draw from, in fp64, by the textbook rule."""
    p = torch.softmax(logits.double() / T, -1)
    order = p.argsort(descending=True)
    keep = torch.zeros_like(p, dtype=torch.bool)
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k > 0 and rank >= top_k) or mass >= top_p or p[i] == 0:
            break
        keep[i], mass = True, mass + p[i].item()
    p = p * keep
    return p / p.sum()


def chi2(counts, p):
    live = p > 0
    assert counts[~live].sum() == 0, f"drew a token of probability 0: {counts.tolist()}"
    expect = p[live] * counts.sum()
    return float(((counts[live] - expect) ** 2 / expect).sum()), int(live.sum()) - 1


def draw(sampler, logits, n=N):
    out = sampler(torch.zeros(n, 1, dtype=torch.long), logits.expand(n, -1).clone())   # (n, V)
    assert bool((out.isfinite().sum(-1) == 1).all())  # exactly one token left for argmax
    return out.argmax(-1)


@pytest.mark.parametrize("block", [1024, 3])  # one block; or two full blocks and a tail of two
@pytest.mark.parametrize("T,top_p,top_k", [(1.0, 1.0, -1), (0.7, 1.0, -1), (1.3, 1.0, 3), (1.0, 0.8, -1)])
def test_sampler_frequencies(T, top_p, top_k, block, monkeypatch):
    monkeypatch.setattr(engines, "BLOCK", block)
    torch.manual_seed(0)
    p = target(LOGITS, T, top_p, top_k)
    counts = torch.bincount(draw(engines.Sampler(T, top_p, top_k), LOGITS), minlength=len(LOGITS)).double()
    stat, df = chi2(counts, p)
    ref, _ = chi2(torch.bincount(torch.multinomial(p.float(), N, replacement=True), minlength=len(p)).double(), p)
    print(f"T={T} top_p={top_p} top_k={top_k} block={block}: chi2 {stat:.1f} (torch.multinomial {ref:.1f}), df {df}")
    assert stat < CHI2_999[df]


def test_each_call_leaves_one_token_a_row_whatever_the_calls_before():
    """The Sampler returns one -inf tensor a generate with its 0 moved (no fresh (B, V) tensor a token): at every call
    exactly one token a row is left, this call's, never one taken before."""
    torch.manual_seed(0)
    s = engines.Sampler(0.0)
    for step in range(4):
        logits = torch.randn(3, 50)
        out = s(torch.zeros(3, 1 + step, dtype=torch.long), logits.clone())
        assert torch.equal(out.isfinite().sum(-1), torch.ones(3, dtype=torch.long)), step
        assert torch.equal(out.argmax(-1), logits.argmax(-1)), step


def test_sampler_greedy_and_logprobs():
    torch.manual_seed(0)
    logits = torch.randn(4, 151665) * 5                             # a real vocabulary, logits over tens of nats
    for T in (0.0, 0.8):
        s = engines.Sampler(T)
        first = s(torch.zeros(4, 3, dtype=torch.long), logits.clone()).argmax(-1)
        if T == 0:
            assert torch.equal(first, logits.argmax(-1))
        forced = torch.tensor([5, 6, 7, 8])                          # a later processor may force others
        s(torch.cat([torch.zeros(4, 3, dtype=torch.long), forced[:, None]], 1), logits.clone())
        s.settle(first)
        ref = torch.log_softmax(logits.double() / (T or 1.0), -1)
        want = torch.stack([ref.gather(1, forced[:, None])[:, 0], ref.gather(1, first[:, None])[:, 0]], 1)
        got = torch.stack(s.logprobs, 1).double()                    # (B, 2)
        assert (got - want).abs().max() < 2e-6
