"""Never slower: K = 0 (no speculation) and the online guard, the same rule on every route.

The guard (``SpeculationGuard``) pauses drafting once the drafting rounds (``b`` steps each, ``A + 1`` tokens) have lost
more than a budget of steps against plain decoding since they last broke even, and resumes after ``N`` plain rounds. Tests: the state machine against a direct statement of
the rule, the fast loop lossless with exact greedy tau replaying it exactly, HF's own loop (``target.generate(
assistant_model=...)``) making the same decisions round by round, and K = 0 decoding plainly on every route.
"""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch

from conftest import make_target_and_drafters
from ppow_trl import exact_greedy_tau, speculative_generate
from ppow_trl.serving.assisted import load_assistant, save_assistant
from ppow_trl.serving.calibration import calibrate_policy, guard_for_rule, guard_loss_budget
from ppow_trl.core.cost import CostModel
from ppow_trl.core.custom_generate.generate import SpeculationGuard, WindowBudget, guard_of
from ppow_trl.core.windowing import AdaptiveWindowPolicy, accepted_spread_within, search_window_grid

GUARD = {"break_even_tokens": 1.5, "loss_budget": 2.0, "probe_every": 4, "max_pause": 16}


def make_models(seed=0):
    models = make_target_and_drafters(seed, noise=0.01)
    for model in models:
        model.generation_config.eos_token_id = None  # long generations: the guard has rounds to act on
    return models


@pytest.fixture(scope="module")
def models():
    return make_models()


def prompts(n=6, seed=0, vocab=64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab, (1, int(torch.randint(2, 8, (1,), generator=g))), generator=g) for _ in range(n)]


def reference_decisions(accepted_of_round, num_rounds, b, budget, probe_every, max_pause):
    """The rule written out directly: which rounds draft, given the accepted length each drafting round would get and
    its cost (``b``: a number, every round's, or a function of the round).

    Outcomes count from the second decision after their round (the protocol HF's loop imposes): when a drafting
    round starts, the previous drafting round's outcome is added to the loss ``S = max(0, S + c - (A + 1))``. When
    ``S > budget`` a pause starts (the round being drafted then is not counted) and ``S`` restarts at ``budget / 2``.
    A pause lasts ``probe_every`` rounds; it lasts twice the last one (at most ``max_pause``) when the resumption before
    it neither brought ``S`` back to 0 nor drafted ``probe_every`` counted rounds.
    """
    cost_of_round = b if callable(b) else (lambda r: b)
    decisions, pending, paused, skip = [], None, 0, False
    loss, pause, held, since = 0.0, probe_every, True, 0
    for r in range(num_rounds):
        draft = paused == 0
        paused = max(paused - 1, 0) if not draft else 0
        decisions.append(draft)
        if not draft:
            continue
        if pending is not None:
            if skip:
                skip = False
            else:
                loss = max(0.0, loss + cost_of_round(pending_round) - (pending + 1))
                since += 1
                if loss == 0.0 or since >= probe_every:
                    held = True
                if loss > budget:
                    pause = probe_every if held else min(2 * pause, max_pause)
                    paused, loss, held, since, skip = pause, budget / 2, False, 0, True
        pending, pending_round = accepted_of_round(r), r
    return decisions


GUARD_TABLE = {**GUARD, "round_costs": [1.0, 1.2, 1.5, 1.9], "free_token_saving": 0.15}
"""A guard charging each drafting round its own window's cost (``c_L``, less 0.15 a free token)."""


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("table", [False, True])
def test_guard_state_machine_equals_the_rule_written_out(seed, table):
    g = torch.Generator().manual_seed(seed)
    accepted = torch.randint(0, 3, (300,), generator=g).tolist()  # A per round, mixing good and bad stretches
    accepted[60:200] = [0] * 140
    # L >= A (a rejected window drafted one or two tokens past its accepted ones), some of them free
    drafted = [min(a + int(torch.randint(0, 3, (1,), generator=g)), 3) or 1 for a in accepted]
    free = [int(torch.randint(0, length + 1, (1,), generator=g)) if r < 60 else 0 for r, length in enumerate(drafted)]
    drafted[60:200] = torch.randint(2, 4, (140,), generator=g).tolist()  # the bad stretch misses 1.5-1.9 step rounds
    settings = GUARD_TABLE if table else GUARD
    guard = SpeculationGuard(**settings)
    last = None
    for r in range(300):
        if guard.decide():
            if last is not None:
                guard.record(*last)
            last = (accepted[r], drafted[r], free[r])
    cost = ((lambda r: GUARD_TABLE["round_costs"][drafted[r]] - 0.15 * free[r]) if table
            else GUARD["break_even_tokens"])
    expected = reference_decisions(lambda r: accepted[r], 300, cost, GUARD["loss_budget"], GUARD["probe_every"],
                                   GUARD["max_pause"])
    assert guard.decisions == expected
    assert not all(expected) and any(expected[200:])  # it paused on the bad stretch and came back
    pauses = [len(run) for run in "".join("d" if d else "p" for d in expected[60:200]).split("d") if run]
    assert pauses[:4] == [4, 8, 16, 16]  # failed resumptions doubled the pause, up to max_pause


def test_a_rule_whose_windows_grew_longer_than_calibrated_is_paused():
    """A rule calibrated where the drafter's confidence ended most windows after one token (rounds of 1.08 steps on
    average) meets text where it drafts three (1.40 steps each) and yields 1.2 tokens a round. Charged the
    calibration's mean, every round seems to gain 0.12 steps and the rule is never paused; charged its own window,
    each round loses 0.2 steps and the guard pauses it."""
    costs = {"break_even_tokens": 1.08, "loss_budget": 3.1, "round_costs": [1.0, 1.05, 1.22, 1.40]}
    mean_charged = SpeculationGuard(**{**costs, "round_costs": None})
    own_charged = SpeculationGuard(**costs)
    rng = random.Random(0)
    rounds = [(int(rng.random() < 0.2), 3) for _ in range(200)]
    for guard in (mean_charged, own_charged):
        outcomes = iter(rounds)
        run_guard(guard, lambda: next(outcomes))
    assert all(mean_charged.decisions)
    assert not all(own_charged.decisions[:40]) and own_charged.decisions.count(False) > 100
    # rounds of one drafted token at the same acceptance pay (1.2 tokens for 1.05 steps): never paused
    cheap = SpeculationGuard(**costs)
    run_guard(cheap, lambda: (int(rng.random() < 0.2), 1))
    assert all(cheap.decisions)


def test_round_costs_extrapolate_past_the_table_and_free_tokens_cost_less():
    guard = SpeculationGuard(**GUARD_TABLE)
    assert guard.round_cost(2) == 1.5 and guard.round_cost(5) == pytest.approx(1.9 + 2 * 0.4)
    assert guard.round_cost(3, free=2) == pytest.approx(1.9 - 0.3)
    assert guard.round_cost(None) == GUARD["break_even_tokens"]  # a route that cannot tell L
    with pytest.raises(ValueError, match="round_costs"):
        SpeculationGuard(1.2, round_costs=[1.0])


def run_guard(guard, accepted, rounds=200):
    """Decisions of ``guard`` over ``rounds`` rounds whose drafting rounds accept ``accepted()`` tokens each (or give
    ``(A, L)``)."""
    last = None
    for _ in range(rounds):
        if guard.decide():
            if last is not None:
                guard.record(*last) if isinstance(last, tuple) else guard.record(last)
            last = accepted()
    return guard.decisions


def bernoulli_rounds(p, seed):
    rng = random.Random(seed)
    return lambda: int(rng.random() < p)


def test_a_rule_that_pays_is_not_paused_by_its_runs_of_misses():
    """K = 1 accepted 19% of the time at b = 1.11 (the data-scaling curve's served rule at 100k: 1.19 tokens a round,
    1.07x): eight misses in a row come by chance every few dozen rounds, and the windowed guard this replaced paused
    on them, drafting 30% of the rounds (benchmarks/guard_simulation.py). The loss budget from the rule's own spread
    (5 sigma_A) drafts 85% of them (99% of the unguarded speedup: a pause of a marginal rule costs little); the same guard on a drafter whose acceptance fell to 0 pauses, and pauses longer each time."""
    spread = (0.19 * 0.81) ** 0.5
    settings = {"break_even_tokens": 1.11, "loss_budget": 5 * spread}
    drafted = [run_guard(SpeculationGuard(**settings), bernoulli_rounds(0.19, seed), rounds=110)
               for seed in range(200)]
    assert sum(map(sum, drafted)) / sum(map(len, drafted)) > 0.8
    collapsed = run_guard(SpeculationGuard(**settings), lambda: 0, rounds=400)
    first_pause = collapsed.index(False)
    assert first_pause == int(5 * spread / 0.11) + 2  # S grows 0.11 a miss; the outcome is recorded a round late
    # each resumption starts at H / 2 and pauses after int(H / 2 / 0.11) + 1 more misses (+1: the round drafting when
    # the pause began is not counted), then waits twice as long
    runs = "".join("d" if d else "p" for d in collapsed).split("p")
    resumptions = [len(run) for run in runs[1:] if run]
    assert resumptions[:2] == [int(2.5 * spread / 0.11) + 2] * 2
    pauses = [len(run) for run in "".join("d" if d else "p" for d in collapsed).split("d") if run]
    assert pauses[:3] == [32, 64, 128] and sum(collapsed) / len(collapsed) < 0.2


def test_a_resumption_that_lasts_as_long_as_a_pause_resets_the_pause():
    """A marginal rule takes long to bring S from H / 2 back to 0; once it has drafted ``probe_every`` rounds after a
    pause, a later pause is ``probe_every`` again, not twice the last one."""
    guard = SpeculationGuard(1.5, loss_budget=2.05, probe_every=4, max_pause=64)
    pattern = [0] * 6 + [0, 1] * 10 + [0] * 6  # lose, then break even for 20 rounds (S stays at H / 2), then lose
    rounds = iter(pattern + [0] * 40)
    decisions = run_guard(guard, lambda: next(rounds), rounds=60)
    pauses = [len(run) for run in "".join("d" if d else "p" for d in decisions).split("d") if run]
    assert pauses[:2] == [4, 4]


def test_a_proposer_that_costs_a_step_per_miss_is_paused_late():
    """Prompt lookup: a missed round costs about one step (b ~ t_v(1)/t_t ~ 1.04), so misses lose little and the budget
    lasts long (pausing would save under 5% and forfeit the next hits); a missed round that costs 1.3 steps spends
    the same budget in a few rounds."""
    cheap = run_guard(SpeculationGuard(1.04, loss_budget=2.9), lambda: 0)
    # over budget at the 73rd miss (2.9 / 0.04 = 72.5), recorded when round 73 starts: round 74 is the first paused
    assert cheap.index(False) == 74
    costly = run_guard(SpeculationGuard(1.3, loss_budget=2.9), lambda: 0)
    assert costly.index(False) == 11  # over budget at the 10th miss (2.9 / 0.3 = 9.7)


def test_guard_rejects_bad_settings_and_loads_the_windowed_guards_settings():
    with pytest.raises(ValueError, match="break_even_tokens"):
        SpeculationGuard(0.0)
    with pytest.raises(ValueError, match="loss_budget"):
        AdaptiveWindowPolicy(4, 0.3, guard={"break_even_tokens": 1.2, "loss_budget": 0.0})
    with pytest.raises(ValueError, match="max_pause"):
        SpeculationGuard(1.2, probe_every=32, max_pause=16)
    with pytest.raises(TypeError, match="loss_spread"):  # a calibration setting is not a guard's
        AdaptiveWindowPolicy(4, 0.3, guard={"break_even_tokens": 1.2, "loss_spreads": 5.0})
    with pytest.raises(ValueError, match="loss_spreads"):  # and a guard's, or the windowed guard's, not a calibration's
        guard_for_rule({"window": 8, "probe_every": 32}, AdaptiveWindowPolicy(1, 0.0), None, None)
    # a rule saved with the windowed guard ({"window", "margin"}) loads with the loss-budget guard
    with pytest.warns(UserWarning, match="windowed online guard"):
        legacy = AdaptiveWindowPolicy(4, 0.3, guard={"break_even_tokens": 1.2, "window": 8, "probe_every": 32,
                                                     "margin": 0.05}).new_guard()
    assert legacy.break_even_tokens == 1.2 and legacy.probe_every == 32 and legacy.loss_budget == 3.0


def test_the_loss_budget_outlasts_one_missed_round():
    """H = max(1, 2 (b - 1), c sigma_A): a rule of a tiny spread still pauses only after two misses (each loses b - 1),
    or after losing a step, whichever is more."""
    assert guard_loss_budget(1.1, 0.0, 5.0) == 1.0
    assert guard_loss_budget(2.2, 0.1, 5.0) == pytest.approx(2.4)
    assert guard_loss_budget(1.2, 0.4, 5.0) == pytest.approx(2.0)
    decisions = run_guard(SpeculationGuard(2.2, guard_loss_budget(2.2, 0.1, 5.0)), lambda: 0, rounds=10)
    assert decisions.index(False) == 4  # misses lose 1.2 each: over 2.4 at the 3rd, recorded a round late


def test_accepted_spread_is_the_standard_deviation_of_a():
    g = torch.Generator().manual_seed(0)
    prefix = torch.rand(40, 4, generator=g).cumprod(dim=1)  # P(A >= k), non-increasing in k
    lengths = torch.randint(0, 5, (40,), generator=g)
    values, weights = [], []
    for row, length in zip(prefix.tolist(), lengths.tolist()):
        survive = [1.0] + row[:length] + [0.0]
        for a in range(length + 1):  # P(A = a) = P(A >= a) - P(A >= a + 1), A <= L
            values.append(a)
            weights.append((survive[a] - survive[a + 1]) / len(prefix))
    mean = sum(v * w for v, w in zip(values, weights))
    brute = sum((v - mean) ** 2 * w for v, w in zip(values, weights)) ** 0.5
    assert accepted_spread_within(prefix, lengths) == pytest.approx(brute, rel=1e-6)
    greedy = (torch.rand(40, 4, generator=g) < 0.5).long().cumprod(dim=1).float()
    leading = greedy.sum(dim=1)
    assert accepted_spread_within(greedy, torch.full((40,), 4)) == pytest.approx(float(leading.std(unbiased=False)))


@pytest.mark.parametrize("drafter_index", [1, 2])
def test_fast_loop_with_guard_is_lossless_and_exact_tau_replays_it(models, drafter_index):
    target, drafter = models[0], models[drafter_index]
    policy = AdaptiveWindowPolicy(3, 0.0, guard=GUARD)
    plain_rounds = 0
    for ids in prompts():
        reference = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                    pad_token_id=0)[0, ids.shape[1]:].tolist()
        out = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=40, eos_token_id=[])
        assert out.new_tokens == reference
        exact = exact_greedy_tau(target, drafter, ids, policy=policy, max_new_tokens=40, eos_token_id=[])
        assert exact.accepted_per_round == out.accepted_per_round
        assert exact.tau == pytest.approx(out.tau)
        # plain rounds draft nothing and cost no drafter forward
        assert [length > 0 for length in out.drafted_per_round[:-1]] == out.guard_decisions[:-1]
        plain_rounds += out.guard_decisions.count(False)
    # the random drafter (first tokens rarely accepted) spends most rounds paused, the close one few
    assert (plain_rounds > 100) if drafter_index == 1 else (plain_rounds < 40)


def test_hf_assisted_route_makes_the_same_guard_decisions(tmp_path, models):
    target, drafter = models[0], models[1]
    policy = AdaptiveWindowPolicy(3, 0.0, guard=GUARD)
    assistant = load_assistant(save_assistant(copy.deepcopy(drafter), tmp_path / "d", policy=policy))
    assistant.generation_config.eos_token_id = None
    guard = guard_of(assistant)
    assert isinstance(assistant.generation_config.num_assistant_tokens, WindowBudget)
    # written as K: the saved generation config is an ordinary one
    saved = json.loads((tmp_path / "d" / "generation_config.json").read_text())
    assert saved["num_assistant_tokens"] == 3
    for ids in prompts():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, do_sample=False,
                              max_new_tokens=40, pad_token_id=0)[0, ids.shape[1]:].tolist()
        fast = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=40, eos_token_id=[])
        assert out == fast.new_tokens
        assert guard.decisions == fast.guard_decisions  # reset per generate call, same rounds, same decisions


def recorded_rounds(monkeypatch):
    """Every ``(A, L, F)`` handed to a guard, in order (a spy on ``SpeculationGuard.record``)."""
    calls = []
    record = SpeculationGuard.record

    def spy(self, accepted, drafted=None, free=0, dropped=0):
        assert dropped == 0  # no empty windows here: every drafting round kept its first token
        calls.append((int(accepted), drafted, int(free)))
        return record(self, accepted, drafted, free, dropped)

    monkeypatch.setattr(SpeculationGuard, "record", spy)
    return calls


def test_every_route_charges_each_round_its_own_window(tmp_path, models, monkeypatch):
    """Adaptive windows (h > 0) of 1-3 tokens, each charged ``c_L``: the fast loop hands the guard the drafted length
    of every round, HF's loop the same ``(A, L, F)`` round by round, so both pause at the same rounds."""
    target, drafter = models[0], models[1]
    policy = AdaptiveWindowPolicy(3, 0.05, guard=GUARD_TABLE)
    assistant = load_assistant(save_assistant(copy.deepcopy(drafter), tmp_path / "d", policy=policy))
    assistant.generation_config.eos_token_id = None
    guard = guard_of(assistant)
    calls = recorded_rounds(monkeypatch)
    lengths, paused = set(), 0
    for ids in prompts():
        calls.clear()
        fast = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=40, eos_token_id=[])
        fast_calls = list(calls)
        drafting = [(a, length, 0) for a, length in zip(fast.accepted_per_round, fast.drafted_per_round) if length]
        # each drafting round is recorded when the next one starts, but the last one and one drafted as a pause began
        rest = iter(drafting)
        assert all(call in rest for call in fast_calls) and len(drafting) - len(fast_calls) <= 1 + fast.guard_decisions.count(False)
        calls.clear()
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, do_sample=False,
                              max_new_tokens=40, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert out == fast.new_tokens and calls == fast_calls and guard.decisions == fast.guard_decisions
        lengths |= {length for _, length, _ in fast_calls}
        paused += fast.guard_decisions.count(False)
    assert len(lengths) > 1 and paused > 0  # the windows did vary, and the guard did act


def test_across_generations_a_losing_drafter_starts_the_next_answer_paused():
    """Short answers of a drafter that misses every round (rounds of 1.3 steps, budget 2.9): reset per answer, each
    answer loses the budget again before its pause; carried over, the answers after the first start where the last
    one left off, and the guard drafts far fewer of their rounds."""
    def answers(guard, count=8, rounds=30):
        drafted = []
        for _ in range(count):
            guard.new_generation()
            drafted.append(sum(run_guard(guard, lambda: (0, 1), rounds=rounds)))
        return drafted

    settings = {"break_even_tokens": 1.3, "loss_budget": 2.9, "round_costs": [1.0, 1.3]}
    per_answer = answers(SpeculationGuard(**settings))
    carried = answers(SpeculationGuard(**settings, across_generations=True))
    assert per_answer == [11] * 8  # over budget at the 10th miss (recorded a round late), in every answer
    assert carried[0] == per_answer[0] and sum(carried[1:]) < sum(per_answer[1:]) / 2
    # a drafter that pays is never paused, carried over or not
    paying = SpeculationGuard(**settings, across_generations=True)
    for _ in range(4):
        paying.new_generation()
        assert all(run_guard(paying, lambda: (1, 1), rounds=30))


def test_the_loop_carries_the_guard_across_generations_and_exact_tau_replays_a_first_one(models):
    """A policy whose guard carries over hands the fast loop one guard for all its generations: a generation that
    ended paused makes the next one start paused; lossless throughout. exact_greedy_tau replays a generation as the
    first one served (a fresh guard), so it equals the loop's first generation."""
    target, drafter = models[0], models[1]  # the random drafter: mostly paused
    policy = AdaptiveWindowPolicy(3, 0.0, guard={**GUARD, "across_generations": True})
    assert policy.new_guard() is policy.new_guard() and policy.new_guard(fresh=True) is not policy.new_guard()
    starts_paused = 0
    for index, ids in enumerate(prompts()):
        reference = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                                    pad_token_id=0)[0, ids.shape[1]:].tolist()
        out = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=40, eos_token_id=[])
        assert out.new_tokens == reference
        starts_paused += not out.guard_decisions[0]
        if index == 0:
            exact = exact_greedy_tau(target, drafter, ids, policy=policy, max_new_tokens=40, eos_token_id=[])
            assert exact.accepted_per_round == out.accepted_per_round
    assert starts_paused > 0


def test_hf_route_carries_its_guard_across_generate_calls_as_the_loop_does(tmp_path, models):
    target, drafter = models[0], models[1]
    policy = AdaptiveWindowPolicy(3, 0.0, guard={**GUARD, "across_generations": True})
    assistant = load_assistant(save_assistant(copy.deepcopy(drafter), tmp_path / "d", policy=policy))
    assistant.generation_config.eos_token_id = None
    guard = guard_of(assistant)
    assert guard.across_generations
    for ids in prompts():
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, do_sample=False,
                              max_new_tokens=40, pad_token_id=0)[0, ids.shape[1]:].tolist()
        fast = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=40, eos_token_id=[])
        assert out == fast.new_tokens
        assert guard.decisions == fast.guard_decisions  # each route's guard carried over the same way


def test_no_speculation_decodes_plainly_on_every_route(tmp_path, models):
    target, drafter = models[0], models[2]
    policy = AdaptiveWindowPolicy(0, 0.0)
    assistant = load_assistant(save_assistant(copy.deepcopy(drafter), tmp_path / "k0", policy=policy))
    calls = []
    hook = assistant.generate
    assistant.generate = lambda *a, **k: calls.append(1) or hook(*a, **k)
    for ids in prompts(3):
        reference = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=20,
                                    pad_token_id=0)[0, ids.shape[1]:].tolist()
        out = speculative_generate(target, drafter, ids, policy=policy, max_new_tokens=20, eos_token_id=[])
        assert out.new_tokens == reference and out.drafter_forwards == 0 and out.tau == 1.0
        assert exact_greedy_tau(target, drafter, ids, policy=policy, max_new_tokens=20, eos_token_id=[]).tau == 1.0
        hf = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=assistant, do_sample=False,
                             max_new_tokens=20, pad_token_id=0)[0, ids.shape[1]:].tolist()
        assert hf == reference
    assert calls == []  # HF's loop never asked the drafter for a candidate


def test_grid_search_chooses_no_speculation_when_nothing_pays():
    confidences = torch.full((50, 3), 0.9)
    prefix = torch.zeros(50, 3)
    prefix[:10, 0] = 1.0  # the first token is accepted 20% of the time
    cheap = CostModel(drafter_cost=0.02, verify_cost=[1.0, 1.02, 1.1, 1.2])
    costly = CostModel(drafter_cost=0.1, verify_cost=[1.0, 1.6, 1.8, 2.0])
    policy, _ = search_window_grid(confidences, prefix, cheap, allow_no_speculation=True)
    assert policy.max_window == 1  # 1.2 tokens for 1.04 steps
    policy, grid = search_window_grid(confidences, prefix, costly, allow_no_speculation=True)
    assert policy.max_window == 0 and max(row["speedup"] for row in grid if row["max_window"]) < 1.0
    policy, _ = search_window_grid(confidences, prefix, costly)
    assert policy.max_window >= 1  # without the option the best speculative rule is kept


def test_a_rule_predicted_within_the_margin_of_1x_serves_plain_decoding():
    """``min_speedup``: a speculative rule replaces plain decoding only when predicted at least that much; the grid's
    predictions do not change, and without plain decoding as a candidate the margin does not apply."""
    confidences = torch.full((50, 3), 0.9)
    prefix = torch.zeros(50, 3)
    prefix[:6, 0] = 1.0  # the first token is accepted 12% of the time: a small gain at these costs
    cost = CostModel(drafter_cost=0.03, verify_cost=[1.0, 1.04, 1.3, 1.5])
    policy, grid = search_window_grid(confidences, prefix, cost, allow_no_speculation=True)
    best = max(row["speedup"] for row in grid if row["max_window"])
    assert policy.max_window == 1 and 1.0 < best < 1.1
    for least, speculates in ((best - 1e-6, True), (best + 1e-6, False), (1.1, False)):
        policy, margin_grid = search_window_grid(confidences, prefix, cost, allow_no_speculation=True,
                                                 min_speedup=least)
        assert (policy.max_window > 0) == speculates and margin_grid == grid
    policy, _ = search_window_grid(confidences, prefix, cost, min_speedup=1.1)
    assert policy.max_window == 1  # no plain candidate: the best rule is served whatever the margin
    for bad in (0.9, float("nan")):
        with pytest.raises(ValueError, match="min_speedup"):
            search_window_grid(confidences, prefix, cost, allow_no_speculation=True, min_speedup=bad)


def test_calibration_with_a_margin_no_rule_meets_says_so(models):
    from ppow_trl.serving.rule import describe_serving_rule

    target, _, drafter = models
    contexts = [ids[0] for ids in prompts(4)]
    cost = CostModel(drafter_cost=0.01, verify_cost=[1.0, 1.0, 1.0, 1.0])
    policy, report = calibrate_policy(target, drafter, contexts, cost, max_window=3, allow_no_speculation=True,
                                      min_speedup=50.0)
    assert policy.max_window == 0 and policy.calibration["min_speedup"] == 50.0
    assert max(report["mean_speedup"]) > 1.0  # a rule did pay, but not 50x
    assert "predicted at least 50x" in describe_serving_rule(policy, cost)
    policy, _ = calibrate_policy(target, drafter, contexts, CostModel(drafter_cost=5.0, verify_cost=[1.0, 9, 9, 9]),
                                 max_window=3, allow_no_speculation=True)  # no margin: nothing above 1x either
    assert policy.max_window == 0 and "predicted above 1x" in describe_serving_rule(policy, cost)


def test_calibration_sets_the_guard_from_the_cost_of_the_chosen_rule(models):
    target, _, drafter = models
    contexts = [ids[0] for ids in prompts(8)]
    cost = CostModel(drafter_cost=0.05, verify_cost=[1.0, 1.05, 1.1, 1.6])
    policy, report = calibrate_policy(target, drafter, contexts, cost, max_window=3, allow_no_speculation=True,
                                      guard={"loss_spreads": 5.0, "probe_every": 32})
    if policy.max_window == 0:
        assert policy.guard is None
    else:
        lengths = torch.tensor(report["window_lengths"])
        expected = float(cost.round_time(lengths).mean())
        assert policy.guard["break_even_tokens"] == pytest.approx(expected)
        # greedy: A of each context is its leading accepted tokens within its window
        accepted = [int(row[:length].cumprod(0).sum()) for row, length in zip(report["prefix_acceptance"], lengths)]
        spread = torch.tensor(accepted, dtype=torch.float64).std(unbiased=False)
        assert policy.guard["loss_budget"] == pytest.approx(max(1.0, 2 * (expected - 1), 5.0 * float(spread)))
        assert policy.guard["probe_every"] == 32 and "loss_spreads" not in policy.guard
        # each round is charged its own window: the cost model's round time of every length the rule can draft
        expected_costs = cost.round_time(torch.arange(policy.max_window + 1)).tolist()
        assert policy.guard["round_costs"] == pytest.approx(expected_costs, abs=1e-6)
        assert policy.guard["free_token_saving"] == pytest.approx(0.05)


def test_a_rule_calibrated_for_both_regimes_gets_the_guard_of_the_noisier_one(models):
    """Greedy and sampled acceptance spread differently: one guard for both must not pause either on its own noise."""
    target, _, drafter = models
    contexts = [ids[0] for ids in prompts(8)]
    cost = CostModel(drafter_cost=0.05, verify_cost=[1.0, 1.05, 1.1, 1.6])
    policy, report = calibrate_policy(target, drafter, contexts, cost, max_window=3, regime="both", seed=1,
                                      guard={"loss_spreads": 5.0, "probe_every": 32})
    assert policy.max_window > 0 and set(report["guard_by_regime"]) == {"greedy", "sampling"}
    greedy, sampled = report["guard_by_regime"]["greedy"], report["guard_by_regime"]["sampling"]
    # the greedy entry is the greedy rollouts' guard, brute force as above
    lengths = torch.tensor(report["window_lengths"])
    accepted = [int(row[:length].cumprod(0).sum()) for row, length in zip(report["prefix_acceptance"], lengths)]
    spread = torch.tensor(accepted, dtype=torch.float64).std(unbiased=False)
    assert greedy["loss_budget"] == pytest.approx(max(1.0, 2 * (greedy["break_even_tokens"] - 1), 5.0 * float(spread)))
    assert sampled["loss_budget"] != pytest.approx(greedy["loss_budget"])  # the regimes do differ here
    assert policy.guard["loss_budget"] == max(greedy["loss_budget"], sampled["loss_budget"])
    assert policy.guard["break_even_tokens"] == pytest.approx(
        (greedy["break_even_tokens"] + sampled["break_even_tokens"]) / 2)
    assert SpeculationGuard.from_settings(policy.guard).loss_budget == policy.guard["loss_budget"]


def test_calibrate_for_serving_measures_the_served_drafter_and_picks_plain_decoding_when_nothing_pays(models):
    """On the drafter as served: its own cost model, the best speculative rule kept for reference (many (K, h) tie
    on a random drafter's windows), K = 0 exactly when that rule is predicted under the serving margin."""
    from ppow_trl.serving.rule import SERVED_MIN_SPEEDUP, calibrate_for_serving

    target, random_drafter, close_drafter = models
    contexts = [ids[0] for ids in prompts(8)]
    for drafter in (random_drafter, close_drafter):
        policy, cost, _ = calibrate_for_serving(target, drafter, contexts, max_window=3, cost_repeats=3)
        assert "served drafter" in cost.description and not drafter.training
        best = policy.calibration["best_speculative_speedup"]
        assert policy.calibration["min_speedup"] == SERVED_MIN_SPEEDUP > 1.0
        assert (policy.max_window == 0) == (best < SERVED_MIN_SPEEDUP)
        assert policy.calibration["best_speculative_rule"]["max_window"] >= 1
        assert policy.calibration["serving_rule"].startswith("No speculation" if policy.max_window == 0 else "K = ")
        if policy.max_window:
            # a measured round cost in target steps: positive, but not bounded by 1 on a loaded machine (timing noise
            # can make a measured verification cheaper than a measured step); its formula is tested above
            assert policy.guard["break_even_tokens"] > 0.0
