"""Rewards and the cost model against brute-force versions of their formulas."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppow_trl.core.cost import CostModel, calibrate_cost_model, overall_speedup, speedup
from ppow_trl.core.rewards import (divergence, js_divergence, kl_divergence, proximity_reward, total_variation,
                                   window_reward)
from ppow_trl.core.verification import lengths_to_mask

from conftest import make_tiny_llama


def dist(seed, *shape):
    return torch.softmax(2 * torch.randn(*shape, generator=torch.Generator().manual_seed(seed)), -1)


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 10_000), vocab=st.integers(2, 9))
def test_divergences_against_brute_force(seed, vocab):
    p, q = dist(seed, vocab).double(), dist(seed + 1, vocab).double()
    pl, ql = p.tolist(), q.tolist()
    tv = 0.5 * sum(abs(a - b) for a, b in zip(pl, ql))
    kl = sum(a * math.log(a / b) for a, b in zip(pl, ql) if a > 0)
    m = [(a + b) / 2 for a, b in zip(pl, ql)]
    js = 0.5 * sum(a * math.log(a / c) for a, c in zip(pl, m) if a > 0) + 0.5 * sum(
        b * math.log(b / c) for b, c in zip(ql, m) if b > 0
    )
    assert total_variation(p, q).item() == pytest.approx(tv, abs=1e-5)
    # 1 - TV = sum min(p, q): the acceptance rate of speculative sampling
    assert 1 - total_variation(p, q).item() == pytest.approx(sum(min(a, b) for a, b in zip(pl, ql)), abs=1e-5)
    assert kl_divergence(p, q).item() == pytest.approx(kl, rel=1e-4, abs=1e-5)
    assert js_divergence(p, q).item() == pytest.approx(js, rel=1e-4, abs=1e-5)
    assert 0 <= js <= math.log(2) + 1e-9
    assert js_divergence(p, q).item() == pytest.approx(js_divergence(q, p).item(), abs=1e-6)


def test_identical_distributions_have_zero_divergence_and_full_proximity():
    p = dist(0, 3, 4, 10)
    mask = torch.ones(3, 4, dtype=torch.bool)
    for kind in ("tv", "kl", "js"):
        assert torch.allclose(divergence(p, p, kind), torch.zeros(3, 4), atol=1e-6)
    assert torch.allclose(proximity_reward(p, p, mask, "tv"), torch.ones(3))
    assert torch.allclose(proximity_reward(p, p, mask, "kl"), torch.zeros(3), atol=1e-6)


def test_kl_is_finite_when_drafter_gives_zero_mass():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([1.0, 0.0, 0.0])  # e.g. a reduced draft vocabulary missing token 1
    value = kl_divergence(p, q)
    assert torch.isfinite(value) and value > 10
    assert torch.isfinite(js_divergence(p, q)) and total_variation(p, q).item() == pytest.approx(0.5)


def test_proximity_reward_averages_valid_positions_only():
    p = dist(1, 2, 4, 6)  # K + 1 positions; the bonus one is ignored
    q = dist(2, 2, 3, 6)
    mask = lengths_to_mask(torch.tensor([2, 0]), 3)
    reward = proximity_reward(p, q, mask, "tv")
    manual = (1 - total_variation(p[0, :2], q[0, :2])).mean()
    assert reward[0].item() == pytest.approx(manual.item(), abs=1e-6)
    assert reward[1].item() == 0.0  # empty window
    assert torch.allclose(proximity_reward(p, q, mask, "js")[0], -js_divergence(p[0, :2], q[0, :2]).mean())
    with pytest.raises(ValueError, match="tv"):
        proximity_reward(p, q, mask, "hellinger")
    assert torch.allclose(window_reward(torch.tensor([2.0]), torch.tensor([0.5]), 0.2), torch.tensor([2.1]))


def test_speedup_formula_and_extrapolation():
    cost = CostModel(drafter_cost=0.25, verify_cost=[1.0, 1.5, 1.7, 1.9])
    expected = torch.tensor([0.0, 2.0, 3.0, 0.5, 4.0])
    lengths = torch.tensor([0, 2, 3, 1, 5])
    want = [(e + 1) / (l * 0.25 + t) for e, l, t in zip([0, 2, 3, 0.5, 4], [0, 2, 3, 1, 5], [1.0, 1.7, 1.9, 1.5, 2.3])]
    assert torch.allclose(speedup(expected, lengths, cost), torch.tensor(want))
    # an empty window is a plain target step
    assert speedup(torch.tensor([0.0]), torch.tensor([0]), cost).item() == pytest.approx(1.0)
    # tokens per time over many rounds is a ratio of sums
    total = overall_speedup(expected, lengths, cost).item()
    assert total == pytest.approx(sum(e + 1 for e in [0, 2, 3, 0.5, 4]) / sum((e + 1) / s for e, s in zip([0, 2, 3, 0.5, 4], want)))
    # long windows rejected early are penalised: same accepted length, longer window, lower reward
    assert speedup(torch.tensor([1.0]), torch.tensor([1]), cost) > speedup(torch.tensor([1.0]), torch.tensor([3]), cost)


def test_speedup_charges_the_loops_host_work():
    """With the loop's host work measured, S = (A + 1)(1 + o_0) / (L t_d + t_v(L) + o_r + L o_d): a plain step stays
    1x, and host work per drafting round lowers every speculative round's speedup (a margin a rule must clear)."""
    bare = CostModel(drafter_cost=0.1, verify_cost=[1.0, 1.02, 1.05])
    loop = CostModel(drafter_cost=0.1, verify_cost=[1.0, 1.02, 1.05], plain_overhead=0.03, round_overhead=0.06,
                     drafted_token_overhead=0.01)
    accepted, lengths = torch.tensor([0.0, 1.0, 0.4, 2.0]), torch.tensor([0, 1, 2, 2])
    want = [(a + 1) * 1.03 / (l * 0.1 + t + (0.06 + 0.01 * l if l else 0.03))
            for a, l, t in zip([0.0, 1.0, 0.4, 2.0], [0, 1, 2, 2], [1.0, 1.02, 1.05, 1.05])]
    assert torch.allclose(speedup(accepted, lengths, loop), torch.tensor(want))
    assert speedup(torch.tensor([0.0]), torch.tensor([0]), loop).item() == pytest.approx(1.0)
    assert (speedup(accepted[1:], lengths[1:], loop) < speedup(accepted[1:], lengths[1:], bare)).all()
    with pytest.raises(ValueError, match="overheads"):
        CostModel(drafter_cost=0.1, verify_cost=[1.0], round_overhead=-0.1)


def test_cost_model_scale_invariance_and_round_trip(tmp_path):
    slow = CostModel.from_seconds(target_step=0.2, drafter_step=0.05, verify=[0.2, 0.3, 0.34])
    fast = CostModel.from_seconds(target_step=0.02, drafter_step=0.005, verify=[0.02, 0.03, 0.034])
    e, l = torch.tensor([1.0, 2.0]), torch.tensor([1, 2])
    assert torch.allclose(speedup(e, l, slow), speedup(e, l, fast))
    slow.save_pretrained(tmp_path)
    assert CostModel.from_pretrained(tmp_path) == slow
    with pytest.raises(ValueError, match="ratios"):
        CostModel(drafter_cost=-1.0, verify_cost=[1.0])
    with pytest.raises(FileNotFoundError, match="calibrate"):
        CostModel.from_pretrained(tmp_path / "missing")


def test_calibration_measures_a_bigger_target_as_slower():
    target = make_tiny_llama(num_layers=6, hidden_size=128, vocab_size=64)
    drafter = make_tiny_llama(num_layers=1, hidden_size=32, vocab_size=64)
    cost = calibrate_cost_model(target, drafter, max_window=3, context_length=16, repeats=5, warmup=1)
    assert len(cost.verify_cost) == 4 and cost.verify_cost[0] == 1.0
    assert all(c > 0 for c in cost.verify_cost)
    # six wide layers vs one narrow layer: robustly cheaper even on a noisy machine
    assert 0 < cost.drafter_cost < 1.0
    assert cost.raw_seconds["target_step"] > 0 and "median of 5" in cost.description
    with pytest.raises(ValueError, match="max_window"):
        calibrate_cost_model(target, drafter, max_window=0)
    # a reduced-vocabulary drafter (its config has no vocab_size of its own) calibrates too
    from ppow_trl.models import make_drafter

    reduced = make_drafter(target, num_layers=1, draft_vocab_ids=list(range(0, 64, 4)))
    assert calibrate_cost_model(target, reduced, max_window=2, context_length=8, repeats=2, warmup=1).drafter_cost > 0
