"""Empty windows (``AdaptiveWindowPolicy.empty_windows``): a round drafts nothing when its first token's confidence is
under ``h``. The rule against its definition written out, the drafter step an empty round still spends (cost model and
guard), the loop lossless and replayed exactly, and the hybrid's lookups-alone variant predicted from the hybrid's own
rollouts exactly as a rollout of the lookups alone measures it."""

from __future__ import annotations

import pytest
import torch
from conftest import make_target_and_drafters

from ppow_trl.drafters.hybrid import hybrid_drafter
from ppow_trl.serving.calibration import calibration_rollouts, family_variants
from ppow_trl.core.cost import CostModel
from ppow_trl.core.custom_generate.generate import SpeculationGuard
from ppow_trl.serving.generation import exact_greedy_tau, greedy_continuation, speculative_generate
from ppow_trl.core.windowing import AdaptiveWindowPolicy, policy_speedup, search_window_grid


@pytest.fixture(scope="module")
def models():
    target, random_drafter, close = make_target_and_drafters(seed=0, noise=0.3)
    return target, random_drafter, close


def _repeating(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(8, 64, (5,), generator=g)
    return torch.cat([phrase, torch.randint(8, 64, (3,), generator=g), phrase[:3]])


@pytest.mark.parametrize("seed", range(3))
def test_window_lengths_equal_the_rule_written_out(seed):
    g = torch.Generator().manual_seed(seed)
    confidences = torch.rand(64, 4, generator=g)
    for max_window in (1, 2, 4):
        for threshold in (0.1, 0.4, 0.7):
            plain = AdaptiveWindowPolicy(max_window, threshold)
            empty = AdaptiveWindowPolicy(max_window, threshold, empty_windows=True)
            for row, conf in enumerate(confidences.tolist()):
                # drafted while the product of the confidences before it is >= h; the first one always, or only
                # when its own confidence is >= h
                length, running = 0, 1.0
                while length < max_window and (running >= threshold or length == 0):
                    running *= conf[length]
                    length += 1
                assert int(plain.window_lengths(confidences[row : row + 1])[0]) == length
                expected = length if conf[0] >= threshold else 0
                assert int(empty.window_lengths(confidences[row : row + 1])[0]) == expected
            # an empty round computed its first token: one drafter forward, charged unless it came free
            lengths = empty.window_lengths(confidences)
            assert torch.equal(empty.drafter_forwards(lengths), lengths.clamp(min=1).float())
            free_first = torch.zeros_like(confidences)
            free_first[:, 1:] = 1.0
            assert torch.equal(empty.drafter_forwards(lengths, free_first), (lengths - 1).clamp(min=0).float())


def test_an_empty_round_costs_a_step_and_a_drafter_step():
    """The cost model prices an empty round at ``1 + t_d`` (``t_d`` alone for a free proposer), the guard charges it
    the same; a search that may draft nothing picks it where first tokens under ``h`` lose."""
    cost = CostModel(drafter_cost=0.2, verify_cost=[1.0, 1.3, 1.6])
    empty = AdaptiveWindowPolicy(2, 0.5, empty_windows=True)
    confidences = torch.tensor([[0.2, 0.9], [0.9, 0.9]])
    never = torch.zeros(2, 2)  # the second row's tokens are accepted, the first row's never
    prefix = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    # row 1: empty, 1 + 0.2, 1 token; row 2: 2 drafted and accepted, 2 * 0.2 + 1.6, 3 tokens
    assert policy_speedup(empty, confidences, prefix, cost).item() == pytest.approx(4 / (1.2 + 2.0))
    assert policy_speedup(empty, confidences, never, cost).item() == pytest.approx(2 / (1.2 + 2.0))
    guard = SpeculationGuard(1.3, 5.0, round_costs=[1.0, 1.5, 1.8], free_token_saving=0.2)
    guard.record(0, 0, 0, dropped=1)
    assert guard.lost == pytest.approx(0.2)
    guard.record(0, 0, 0)  # an empty round that ran no drafter (a lookup found nothing): a plain step
    assert guard.lost == pytest.approx(0.2)
    _, grid = search_window_grid(confidences, prefix, cost, thresholds=(0.0, 0.5), empty_windows=(False, True))
    assert [row.get("empty_windows", False) for row in grid] == [False, False, False, False, True, True]
    best = max(grid, key=lambda row: row["speedup"])
    assert best["empty_windows"] and best["threshold"] == 0.5


def test_the_loop_with_empty_windows_is_lossless_and_exact_tau_replays_it(models):
    target, random_drafter, close = models
    for drafter in (random_drafter, close):
        policy = AdaptiveWindowPolicy(3, 0.6, empty_windows=True)
        empty_rounds = 0
        for seed in range(4):
            prompt = _repeating(seed).view(1, -1)
            plain = greedy_continuation(target, prompt[0].tolist(), 24, 64)
            out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=24, eos_token_id=[])
            assert out.new_tokens == plain
            empty_rounds += sum(1 for length in out.drafted_per_round[:-1] if length == 0)
            replay = exact_greedy_tau(target, drafter, prompt, policy=policy, max_new_tokens=24, eos_token_id=[])
            assert replay.accepted_per_round == out.accepted_per_round
        assert empty_rounds > 0


def test_the_hybrids_lookups_alone_are_predicted_from_its_own_rollouts(models):
    """``HybridFamily.variants``: the hybrid's rollouts cut at the first token its trained drafter proposed give the
    same predicted speedup, rule by rule (h > 0, empty windows or not), as rollouts of the hybrid with
    ``model_proposes=False``, which drafts no model token (charged nothing)."""
    target, random_drafter, _ = models
    hybrid = hybrid_drafter(random_drafter, target)
    contexts = [_repeating(seed) for seed in range(6)]
    contexts += [torch.randperm(56, generator=torch.Generator().manual_seed(seed))[:9] + 8 for seed in range(3)]
    rollouts = {"greedy": calibration_rollouts(target, hybrid, contexts, max_window=3, greedy=True, return_charged=True)}
    [(settings, variant)] = family_variants(hybrid, rollouts)
    assert settings == {"model_proposes": False}
    lookups_alone = hybrid_drafter(random_drafter, target)
    lookups_alone.config.model_proposes = False
    measured = calibration_rollouts(target, lookups_alone, contexts, max_window=3, greedy=True, return_charged=True)
    assert not measured[2].any()  # no token charged: the trained drafter never proposed
    cost = CostModel(drafter_cost=0.3, verify_cost=[1.0, 1.1, 1.2, 1.3])
    for max_window in (1, 2, 3):
        for threshold in (0.05, 0.5):
            for empty in (False, True):
                policy = AdaptiveWindowPolicy(max_window, threshold, empty_windows=empty)
                confidences, prefix, charged = variant["greedy"]
                assert policy_speedup(policy, confidences, prefix, cost, charged).item() == pytest.approx(
                    policy_speedup(policy, measured[0], measured[1], cost, measured[2]).item())
    # and served lookups alone: lossless, the trained drafter never run
    prompt = contexts[0].view(1, -1)
    plain = greedy_continuation(target, prompt[0].tolist(), 20, 64)
    out = speculative_generate(target, lookups_alone, prompt, policy=AdaptiveWindowPolicy(3, 0.05, empty_windows=True),
                               max_new_tokens=20, eos_token_id=[])
    assert out.new_tokens == plain and out.free_drafted == sum(out.drafted_per_round) > 0
    # transformers' loop needs a candidate every drafting round: where no lookup matches, the trained drafter gives it
    from ppow_trl.drafting import family_of

    family_of(lookups_alone).attach(lookups_alone, target, AdaptiveWindowPolicy(3, 0.05, empty_windows=True))
    settings = dict(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    for context in (contexts[0], contexts[-1]):  # a repeating prompt, and one without repeats
        ids = context.view(1, -1)
        with torch.no_grad():
            assert torch.equal(target.generate(ids, assistant_model=lookups_alone, **settings),
                               target.generate(ids, **settings))


def test_the_calibration_compares_the_hybrid_as_built_every_time_and_a_saved_rule_restores_its_choice(models):
    """A random trained drafter whose tokens are never accepted and contexts that repeat: the calibration serves the
    lookups alone, and says so; calibrated again (a copy sharing the config, as the compiled runtime's), it starts
    from the hybrid as built and compares both again; ``apply_fitted`` puts the choice back on a fresh hybrid."""
    from ppow_trl.serving.calibration import apply_fitted, calibrate_policy

    target, random_drafter, _ = models
    hybrid = hybrid_drafter(random_drafter, target)
    contexts = []  # the target's own greedy text, which repeats itself here and there
    for seed in range(6):
        prompt = torch.randint(8, 64, (4,), generator=torch.Generator().manual_seed(seed)).tolist()
        text = greedy_continuation(target, prompt, 40, 64)
        contexts += [torch.tensor(prompt + text[:cut]) for cut in (10, 20, 30)]
    cost = CostModel(drafter_cost=0.3, verify_cost=[1.0, 1.1, 1.2, 1.3])
    for _ in range(2):
        policy, _ = calibrate_policy(target, hybrid, contexts, cost, max_window=3, allow_no_speculation=True,
                                     search_variants=True)
        fitted = policy.calibration["fitted_confidences"]
        assert fitted["model_proposes"] is False and fitted["predicted_as_built"] < policy.calibration["predicted_speedup"]
        assert hybrid.config.model_proposes is False and policy.max_window > 0
    fresh = hybrid_drafter(random_drafter, target)
    assert fresh.config.model_proposes is True
    apply_fitted(fresh, policy)
    assert fresh.config.model_proposes is False and fresh.config.match_confidences == hybrid.config.match_confidences
    # without search_variants (training's calibration) the hybrid is calibrated as built
    policy, _ = calibrate_policy(target, hybrid, contexts, cost, max_window=3, allow_no_speculation=True)
    assert policy.calibration["fitted_confidences"]["model_proposes"] is True and hybrid.config.model_proposes
