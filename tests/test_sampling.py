"""The sampler draws from the tempered softmax exactly, never picks a masked token, and a seed
reproduces its choices."""

from collections import Counter

import torch

from engine.runtime.sampling import Sampler, SamplingParams


def test_draws_follow_the_softmax_and_skip_masked_tokens():
    logits = torch.tensor([0.0, 1.0, float("-inf"), 2.0, -30.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    n = 20000
    counts = Counter(sampler(logits.clone(), []) for _ in range(n))
    probs = torch.softmax(logits, 0)
    assert 2 not in counts  # probability zero
    for token in (0, 1, 3):
        p = float(probs[token])
        assert abs(counts[token] / n - p) < 4 * (p * (1 - p) / n) ** 0.5 + 1e-3


def test_top_k_and_temperature_zero():
    logits = torch.tensor([0.5, 3.0, 2.9, -1.0])
    top2 = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {top2(logits.clone(), []) for _ in range(200)} == {1, 2}
    assert Sampler(SamplingParams(temperature=0.0))(logits.clone(), []) == 1


def test_a_seed_reproduces_the_draws():
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(0))
    a, b = Sampler(SamplingParams(seed=7)), Sampler(SamplingParams(seed=7))
    assert [a(logits, []) for _ in range(20)] == [b(logits, []) for _ in range(20)]
