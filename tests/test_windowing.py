"""Divergence-aware window selection and the adaptive window-length rule."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppow_trl.core.cost import CostModel
from ppow_trl.core.rewards import kl_divergence
from ppow_trl.core.windowing import (
    AdaptiveWindowPolicy,
    search_window_grid,
    divergence_scores,
    policy_speedup,
    sample_window_starts,
    window_start_probabilities,
)


def simulate_policy(policy, confidences):
    """The rule applied token by token, as a decoding loop does."""
    lengths = []
    for row in confidences.tolist():
        running, drafted = 1.0, 0
        while True:
            running *= row[drafted]
            drafted += 1
            if not policy.keep_drafting(torch.tensor(running), drafted):
                break
        lengths.append(drafted)
    return lengths


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    max_window=st.integers(1, 8),
    threshold=st.floats(0.0, 1.0),
)
def test_window_lengths_equal_token_by_token_rule(seed, max_window, threshold):
    policy = AdaptiveWindowPolicy(max_window=max_window, threshold=threshold)
    conf = torch.rand(16, max_window, generator=torch.Generator().manual_seed(seed))
    lengths = policy.window_lengths(conf)
    assert lengths.tolist() == simulate_policy(policy, conf)
    assert ((lengths >= 1) & (lengths <= max_window)).all()


def test_threshold_extremes():
    conf = torch.full((3, 6), 0.9)
    assert AdaptiveWindowPolicy(6, 0.0).window_lengths(conf).tolist() == [6, 6, 6]  # fixed K
    assert AdaptiveWindowPolicy(6, 1.0).window_lengths(conf).tolist() == [1, 1, 1]
    # 0.9^k >= 0.7 for k <= 3: draft 3 tokens above the threshold, the 4th ends the window
    assert AdaptiveWindowPolicy(6, 0.7).window_lengths(conf).tolist() == [4, 4, 4]
    assert AdaptiveWindowPolicy(1, 0.0).window_lengths(conf).tolist() == [1, 1, 1]


@pytest.mark.parametrize("kwargs", [{"max_window": -1}, {"max_window": 2.5}, {"threshold": -0.1}, {"threshold": 1.5}])
def test_invalid_window_settings_raise(kwargs):
    with pytest.raises(ValueError, match="max_window|threshold"):
        AdaptiveWindowPolicy(**kwargs)


def test_policy_round_trip(tmp_path):
    policy = AdaptiveWindowPolicy(max_window=7, threshold=0.35)
    policy.save_pretrained(tmp_path)
    assert AdaptiveWindowPolicy.from_pretrained(tmp_path) == policy
    with pytest.raises(FileNotFoundError):
        AdaptiveWindowPolicy.from_pretrained(tmp_path / "nope")


def test_divergence_scores_are_confidence_times_divergence():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(2, 5, 7, generator=g), -1)
    q = torch.softmax(3 * torch.randn(2, 5, 7, generator=g), -1)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 3:] = False
    scores = divergence_scores(p, q, mask)
    manual = q.max(-1).values * kl_divergence(p, q) * mask
    assert torch.allclose(scores, manual)
    # confident-and-wrong beats unsure-and-wrong
    target = torch.tensor([[[1.0, 0.0]]]).expand(1, 2, 2)
    drafter = torch.tensor([[[0.01, 0.99], [0.4, 0.6]]])
    s = divergence_scores(target, drafter, kind="tv")
    assert s[0, 0] > s[0, 1]


def test_window_start_sampling_follows_the_weights():
    scores = torch.tensor([[0.0, 1.0, 3.0, 0.0], [2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, True, False, False]])
    probs = window_start_probabilities(scores, mask, beta=1.0, eps=1e-6, uniform_share=0.0)
    assert probs[~mask].sum() == 0 and probs.sum().item() == pytest.approx(1.0)
    assert probs[0, 2].item() == pytest.approx(3 / 6, rel=1e-4)
    uniform = window_start_probabilities(scores, mask, beta=0.0)
    assert torch.allclose(uniform[mask], torch.full((6,), 1 / 6))
    mixed = window_start_probabilities(scores, mask, beta=1.0, eps=1e-6, uniform_share=0.5)
    assert mixed[0, 0].item() == pytest.approx(0.5 / 6, rel=1e-3)  # zero score, still reachable
    draws = sample_window_starts(probs, 30_000, generator=torch.Generator().manual_seed(0))
    counts = torch.zeros_like(probs)
    counts.index_put_((draws[:, 0], draws[:, 1]), torch.ones(len(draws)), accumulate=True)
    assert torch.allclose(counts / 30_000, probs, atol=0.01)
    with pytest.raises(ValueError, match="masked"):
        window_start_probabilities(scores, torch.zeros_like(mask))
    with pytest.raises(ValueError, match="beta"):
        window_start_probabilities(scores, mask, beta=-1)


def test_policy_speedup_and_calibration_pick_the_best_threshold():
    cost = CostModel(drafter_cost=0.3, verify_cost=[1.0, 1.4, 1.6, 1.8, 2.0, 2.2])
    # two kinds of context: easy (confident, accepted) and hard (unsure, rejected at once)
    easy_conf = torch.full((50, 5), 0.95)
    hard_conf = torch.tensor([[0.3, 0.9, 0.9, 0.9, 0.9]]).expand(50, 5)
    conf = torch.cat([easy_conf, hard_conf])
    prefix = torch.cat([torch.ones(50, 5), torch.zeros(50, 5)])
    fixed = policy_speedup(AdaptiveWindowPolicy(5, 0.0), conf, prefix, cost)
    adaptive = policy_speedup(AdaptiveWindowPolicy(5, 0.5), conf, prefix, cost)
    # adaptive drafts 5 on easy contexts, 1 on hard ones: same accepted tokens, less time
    want_fixed = (50 * 6 + 50 * 1) / (100 * (5 * 0.3 + 2.2))
    want_adaptive = (50 * 6 + 50 * 1) / (50 * (5 * 0.3 + 2.2) + 50 * (0.3 + 1.4))
    assert fixed.item() == pytest.approx(want_fixed, rel=1e-5)
    assert adaptive.item() == pytest.approx(want_adaptive, rel=1e-5)
    best, grid = search_window_grid(conf, prefix, cost)
    assert best.max_window == 5 and 0.3 < best.threshold <= 0.95
    assert max(row["speedup"] for row in grid) == pytest.approx(adaptive.item(), rel=1e-5)
