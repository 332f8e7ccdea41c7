"""The sampler draws from the tempered softmax exactly, never picks a masked token, and a seed
reproduces its choices."""

from collections import Counter

import pytest
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


def test_top_p_keeps_the_nucleus_and_the_callers_logits_are_unchanged():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 3.0])  # softmax ≈ .24 .09 .03 .01 .64
    before = logits.clone()
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.8, top_k=4, repetition_penalty=1.3, seed=5))
    drawn = {sampler(logits, [0, 4]) for _ in range(300)}
    # penalised: 2 → 1.54, 3 → 2.31 (seen tokens 0 and 4); the 0.8 nucleus is then {4, 0, 1}
    assert drawn == {0, 1, 4}
    assert torch.equal(logits, before)


def test_repetition_penalty_turns_greedy_away_from_a_seen_token():
    logits = torch.tensor([1.0, 1.2, -0.5])
    greedy = Sampler(SamplingParams(greedy=True, repetition_penalty=1.5))
    assert greedy(logits, []) == 1 and greedy(logits, [1]) == 0  # 1.2 / 1.5 = 0.8 < 1.0
    assert greedy.uses_history and not Sampler(SamplingParams()).uses_history


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_a_seed_draws_what_it_draws_on_the_cpu():
    logits = torch.randn(151936, generator=torch.Generator().manual_seed(1))
    params = dict(temperature=0.8, top_p=0.95, top_k=50, seed=11)
    on_cpu = [Sampler(SamplingParams(**params))(logits, []) for _ in range(3)]
    gpu = Sampler(SamplingParams(**params)), Sampler(SamplingParams(**params))
    assert [gpu[0](logits.cuda(), []) for _ in range(3)] == [gpu[1](logits, []) for _ in range(3)]
    assert on_cpu[0] == Sampler(SamplingParams(**params))(logits.cuda(), [])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_choosing_a_token_does_not_wait_for_the_gpu():
    # The decode loop queues the next step behind the sample; a host sync here stalls the GPU.
    logits = torch.randn(1000, device="cuda")
    sampler = Sampler(SamplingParams(temperature=0.8, top_k=50, top_p=0.9, repetition_penalty=1.2, seed=3))
    sampler.choose(logits, [1, 2, 3])  # first-call work (pinned pool, kernels) outside the check
    torch.cuda.set_sync_debug_mode("error")
    try:
        chosen = sampler.choose(logits, [1, 2, 3, 4])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert 0 <= int(chosen) < 1000


def test_a_tiny_temperature_is_greedy_not_nan():
    """logits / 1e-38 overflowed to inf, the softmax turned NaN and the draw returned the last id."""
    from engine.runtime.sampling import MIN_TEMPERATURE

    logits = torch.tensor([0.5, 3.0, 2.9, -1.0, 0.0])
    for t in (1e-38, 1e-30, MIN_TEMPERATURE / 2):
        assert {Sampler(SamplingParams(temperature=t, seed=s))(logits, []) for s in range(20)} == {1}


def test_out_of_range_settings_are_refused_before_sampling():
    from engine.errors import ConfigError

    for bad in (dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300), dict(repetition_penalty=0.0),
                dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
                dict(seed=2**64), dict(seed=-1), dict(seed=1.5), dict(top_k=-1)):
        with pytest.raises(ConfigError):
            Sampler(SamplingParams(**bad))
    Sampler(SamplingParams(seed=2**64 - 1, repetition_penalty=0.01))  # the edges themselves are fine


def test_unusable_probabilities_fall_back_to_the_best_finite_logit():
    """A row whose logits are NaN or all -inf has no distribution to draw from: the best finite
    logit (or id 0), never the vocabulary's last id by default."""
    nan_row = torch.tensor([0.1, float("nan"), 2.0, 0.3])
    masked = torch.full((5,), float("-inf"))
    s = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert s(nan_row, []) == 2
    assert s(masked, []) == 0
