"""Calibrating the window rule (K, h) on held-out target-generated contexts: the one library function.

``calibrate_policy`` drafts windows of ``K_max`` tokens after held-out contexts (threshold 0, so every
shorter window the rule could pick is a prefix of the drafted one), verifies them with the target in the
regime the policy will be served in, and picks the ``(K, h)`` that maximises the cost-model speedup
``sum_n (E[A_n] + 1) t_t / sum_n (L_n t_d + t_v(L_n))`` (``windowing.search_window_grid``):

- ``"greedy"``: greedy drafting, greedy verification (``P(A >= k)`` is 0/1; exact, since a greedy window
  cut to ``L`` tokens is what the rule would have drafted);
- ``"sampling"``: drafting and verification at ``temperature``; ``P(A >= k | y) = prod_{i<=k} alpha_i``;
- ``"both"``: the mean of the two speedups.

Confidences are the policy's (``max softmax(z / T_c)``) in every regime, the same as every generation
route computes them. The trainer, the recipe, the demo and the benchmarks all call this function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..drafting import family_of
from ..utils import unwrap_model
from ..core.cost import CostModel
from ..core.rollout import verify_windows
from ..core.windowing import (AdaptiveWindowPolicy, accepted_spread_within, chosen_rule, expected_accepted_within,
                              policy_speedup, search_window_grid)

REGIMES = ("greedy", "sampling", "both")
DEFAULT_THRESHOLDS = tuple(i / 20 for i in range(20))
GUARD_SETTINGS = ("loss_spreads", "probe_every", "max_pause", "across_generations")
"""The online guard's settings a calibration takes (``DEFAULT_GUARD``); the break-even and the budget are computed."""


def guard_loss_budget(break_even: float, spread: float, spreads: float) -> float:
    """``H = max(1, 2 (b - 1), c sigma_A)`` target steps (``guard_for_rule``)."""
    return max(1.0, 2.0 * (break_even - 1.0), spreads * spread)


def guard_for_rule(settings: dict, policy: AdaptiveWindowPolicy, rollout, cost_model: CostModel) -> dict:
    """The online guard of ``policy`` (``SpeculationGuard``'s saved settings) from its rollouts on the calibration
    contexts, ``rollout = (confidences, prefix_acceptance, charged)``:

    - round costs ``round_costs[L] = CostModel.round_time(L)`` for ``L = 0..K`` (``L = 0``: a drafting round that
      drafted nothing, ``empty_windows``) and ``free_token_saving = t_d / (1 +
      o_0)`` (0 for a block drafter): each drafting round is charged its own window's cost, less the drafter steps
      its free tokens (a hybrid's lookups) did not take;
    - break-even ``b = mean_n (M_n t_d + t_v(L_n)) / t_t``, the rule's mean round time on the calibration contexts
      (informational, and what a route that cannot tell ``L`` charges);
    - loss budget ``H = max(1, 2 (b - 1), c sigma_A)`` target steps, ``c = settings["loss_spreads"]`` standard
      deviations of the accepted length per round (``accepted_spread_within``): the time speculation may lose before a
      pause, in units of its own noise, so that a rule that pays is seldom paused by a run of misses; at least one
      step, and at least two missed rounds (a miss loses ``b - 1``), so that one miss never pauses a rule;
    - ``probe_every``, ``max_pause`` and ``across_generations`` as given.
    """
    unknown = set(settings) - set(GUARD_SETTINGS)
    if "loss_spreads" not in settings or unknown:
        raise ValueError(f"The online guard's calibration settings are {GUARD_SETTINGS} (loss_spreads required), got "
                         f"{sorted(settings)}: pass ppow_trl.serving.rule.DEFAULT_GUARD, or guard=None for none.")
    settings = dict(settings)
    spreads = float(settings.pop("loss_spreads"))
    confidences, prefix, charged = rollout
    lengths = policy.window_lengths(confidences)
    break_even = float(cost_model.round_time(lengths, policy.drafter_forwards(lengths, charged),
                                             policy.drafting_rounds(lengths)).mean())
    budget = guard_loss_budget(break_even, accepted_spread_within(prefix, lengths), spreads)
    # every round the guard is handed went through drafting: L = 0 is an empty window's round (its loop work, no
    # drafter step; a dropped first token's step is charged on top, SpeculationGuard.record)
    lengths = torch.arange(policy.max_window + 1)
    round_costs = cost_model.round_time(lengths, drafting=torch.ones_like(lengths, dtype=torch.bool)).tolist()
    saving = 0.0 if cost_model.drafter_per_round else cost_model.drafter_cost / (1.0 + cost_model.plain_overhead)
    return {**settings, "break_even_tokens": break_even, "loss_budget": budget,
            "round_costs": [round(c, 6) for c in round_costs], "free_token_saving": round(saving, 6)}


def family_variants(drafter, rollouts: dict) -> list[tuple[dict, dict]]:
    """``DrafterFamily.variants`` of ``drafter``'s family: other ways it can propose, each with the calibration
    rollouts it would have had (``[]`` for most drafters; a hybrid: lookups alone)."""
    family = _family_or_none(drafter)
    return [] if family is None else family.variants(unwrap_model(drafter), rollouts)


def apply_fitted(drafter, policy: AdaptiveWindowPolicy) -> None:
    """Put back on ``drafter`` what its calibration fitted in place and recorded in ``policy.calibration
    ["fitted_confidences"]`` (prompt lookup's hit rates, a hybrid's ``model_proposes``): a rule read back from disk
    serves the drafter as it was calibrated."""
    fitted = (policy.calibration or {}).get("fitted_confidences") or {}
    config = getattr(unwrap_model(drafter), "config", None)
    for key in ("match_confidences", "min_match_confidence", "model_proposes"):
        if key in fitted and hasattr(config, key):
            setattr(config, key, fitted[key])


def fit_drafter_confidences(drafter, contexts) -> dict:
    """``DrafterFamily.fit_confidences`` of ``drafter``'s family on ``contexts`` (in place; ``{}`` for a trained
    drafter, or a model no family owns)."""
    family = _family_or_none(drafter)
    return {} if family is None else family.fit_confidences(unwrap_model(drafter), [list(map(int, c)) for c in contexts])


def _family_or_none(drafter):
    """The family owning ``drafter``, ``None`` for a model no family owns."""
    try:
        return family_of(drafter)
    except (ValueError, TypeError):
        return None


def held_out_contexts(
    prompt_ids: Sequence[Sequence[int]],
    response_ids: Sequence[Sequence[int]],
    per_response: int = 4,
    max_contexts: int | None = None,
) -> list[torch.Tensor]:
    """Contexts ``prompt + response[:t]`` at ``per_response`` evenly spaced ``t`` of each held-out response.

    Taken response by response, round-robin over positions (all first positions, then all second...), so a
    ``max_contexts`` cut keeps every response represented.
    """
    if per_response < 1:
        raise ValueError(f"per_response must be >= 1, got {per_response}.")
    by_response = []
    for prompt, response in zip(prompt_ids, response_ids):
        if not len(prompt) or len(response) < 2:
            continue
        starts = sorted({int(i * (len(response) - 1) / per_response) for i in range(per_response)})
        by_response.append([torch.tensor(list(prompt) + list(response[:t]), dtype=torch.long) for t in starts])
    contexts = [row[i] for i in range(per_response) for row in by_response if i < len(row)]
    if not contexts:
        raise ValueError("No held-out context: the calibration data needs prompts and responses of >= 2 tokens.")
    return contexts[:max_contexts] if max_contexts else contexts


@torch.no_grad()
def calibration_rollouts(
    target,
    drafter,
    contexts: list[torch.Tensor],
    *,
    max_window: int,
    confidence_temperature: float = 1.0,
    greedy: bool,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    pad_id: int = 0,
    batch_size: int = 16,
    seed: int = 0,
    samples_per_context: int = 1,
    return_charged: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Windows of ``max_window`` tokens after each context: ``(confidences, P(A >= k | y))``, both ``(N S, K)``, and
    with ``return_charged`` the drafter forwards each token cost (``DraftedWindows.charged``; ``None``: all 1).

    ``greedy``: greedy drafting and verification; else both at ``temperature``, ``S = samples_per_context`` windows
    per context (rows context-major; each context prefilled once). The sampling generator lives on the drafter's
    device and is seeded by ``seed``. ``batch_size`` counts rows (contexts x samples).
    """
    full = AdaptiveWindowPolicy(max_window, 0.0, confidence_temperature)
    device = next(drafter.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    confidences, prefixes, charged = [], [], []
    step = max(1, batch_size // samples_per_context)
    for start in range(0, len(contexts), step):
        chunk = contexts[start : start + step]
        verified = verify_windows(target, drafter, chunk, full, greedy=greedy, temperature=0.0 if greedy else temperature,
                                  pad_id=pad_id, vocab_size=vocab_size, generator=generator,
                                  num_samples_per_context=samples_per_context)
        # Rows of a batch stop together only when all stopped: with h = 0 every row drafts K tokens.
        confidences.append(verified.drafted.confidences.float().cpu())
        prefixes.append(verified.prefix.float().cpu())
        if verified.drafted.charged is not None:
            charged.append(verified.drafted.charged.float().cpu())
    if return_charged:
        return torch.cat(confidences), torch.cat(prefixes), (torch.cat(charged) if charged else None)
    return torch.cat(confidences), torch.cat(prefixes)


def calibrate_policy(
    target,
    drafter,
    contexts: list[torch.Tensor],
    cost_model: CostModel,
    *,
    max_window: int,
    regime: str = "greedy",
    temperature: float = 1.0,
    confidence_temperature: float = 1.0,
    thresholds: Sequence[float] = DEFAULT_THRESHOLDS,
    max_windows: Sequence[int] | None = None,
    vocab_size: int | None = None,
    pad_id: int = 0,
    batch_size: int = 16,
    seed: int = 0,
    allow_no_speculation: bool = False,
    min_speedup: float = 1.0,
    guard: dict | None = None,
    search_variants: bool = False,
) -> tuple[AdaptiveWindowPolicy, dict]:
    """Choose ``(K <= max_window, h)`` for ``drafter`` on held-out ``contexts`` in the served ``regime``.

    Returns the policy (with ``calibration`` filled: regime, temperature, contexts, predicted speedup, E[A])
    and a report with the grid (speedup of every ``(K, h)`` per regime), the fixed-``K`` speedup and the chosen
    rule's window lengths on the contexts (``window_lengths``, first regime).

    Serving (the recipe, ``save_assistant`` callers): ``allow_no_speculation=True`` lets the grid choose ``K = 0``
    when the measured cost model predicts no ``(K, h)`` above 1x, or at least ``min_speedup`` (``chosen_rule``:
    a margin for the prediction's error); ``guard={"loss_spreads": c, "probe_every": N}`` attaches the online guard
    (``SpeculationGuard``) of the chosen rule (``guard_for_rule``; under ``"both"``, the mean break-even over the two
    regimes and the larger loss budget, each regime's in ``report["guard_by_regime"]``).
    """
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 (the sampling regime's), got {temperature}.")
    regimes = ("greedy", "sampling") if regime == "both" else (regime,)
    # what the drafter's confidences mean, fitted on these contexts first (prompt lookup: the hit rate of each
    # n-gram length), so that the rollouts' confidences are the ones the rule will serve with
    fitted = fit_drafter_confidences(drafter, contexts)
    rollouts = {
        name: calibration_rollouts(target, drafter, contexts, max_window=max_window,
                                   confidence_temperature=confidence_temperature, greedy=name == "greedy",
                                   temperature=temperature, vocab_size=vocab_size, pad_id=pad_id,
                                   batch_size=batch_size, seed=seed, return_charged=True)
        for name in regimes
    }
    # Serving searches rules whose rounds may draft nothing (not a block drafter's: its round is one forward)
    empty = (False, True) if search_variants and not cost_model.drafter_per_round else (False,)

    def grids_of(rollouts):
        grids = {name: search_window_grid(conf, prefix, cost_model, thresholds=thresholds, max_windows=max_windows,
                                          confidence_temperature=confidence_temperature,
                                          allow_no_speculation=allow_no_speculation, charged=charged,
                                          min_speedup=min_speedup, empty_windows=empty)[1]
                 for name, (conf, prefix, charged) in rollouts.items()}
        # The grids list the same (K, h) in the same order; "both" maximises the mean speedup.
        mean = [sum(grids[name][i]["speedup"] for name in regimes) / len(regimes)
                for i in range(len(grids[regimes[0]]))]
        return grids, mean, chosen_rule(grids[regimes[0]], mean, min_speedup)

    grids, mean, best = grids_of(rollouts)
    if search_variants:  # a drafter that can propose in other ways (a hybrid without its trained drafter)
        for settings, variant in family_variants(drafter, rollouts):
            variant_grids, variant_mean, variant_best = grids_of(variant)
            if variant_mean[variant_best] > mean[best]:
                fitted = {**fitted, **family_of(drafter).use_variant(unwrap_model(drafter), settings),
                          "predicted_as_built": mean[best]}
                grids, mean, best, rollouts = variant_grids, variant_mean, variant_best, variant
    chosen = grids[regimes[0]][best]
    policy = AdaptiveWindowPolicy(chosen["max_window"], chosen["threshold"], confidence_temperature,
                                  empty_windows=chosen.get("empty_windows", False))
    expected = {}
    for name, (conf, prefix, _) in rollouts.items():
        expected[name] = float(expected_accepted_within(prefix, policy.window_lengths(conf)).mean())
    confidences, _, charged = rollouts[regimes[0]]
    lengths = policy.window_lengths(confidences)
    guards = {}
    if guard is not None and policy.max_window > 0:
        # One guard serves whichever regime the user decodes in ("both"): the rounds' mean cost over the regimes, and
        # the budget of the noisier one, so that neither regime's rule is paused by its own runs of misses.
        guards = {name: guard_for_rule(guard, policy, rollouts[name], cost_model) for name in regimes}
        policy.guard = {**guards[regimes[0]],
                        "break_even_tokens": sum(g["break_even_tokens"] for g in guards.values()) / len(guards),
                        "loss_budget": max(g["loss_budget"] for g in guards.values())}
        policy.new_guard(fresh=True)  # validates the settings
    fixed = AdaptiveWindowPolicy(max_window, 0.0, confidence_temperature)
    policy.calibration = {
        **({"fitted_confidences": fitted} if fitted else {}),
        "regime": regime,
        "temperature": None if regime == "greedy" else temperature,
        "num_contexts": len(contexts),
        "max_window_searched": max_window,
        "predicted_speedup": mean[best],
        "min_speedup": min_speedup,
        "expected_accepted": expected,
        "fixed_window_speedup": {name: float(policy_speedup(fixed, conf, prefix, cost_model, charged))
                                 for name, (conf, prefix, charged) in rollouts.items()},
    }
    report = {"policy": policy, "grid": {name: grids[name] for name in regimes}, "mean_speedup": mean,
              "window_lengths": lengths.tolist(), "confidences": confidences, "charged": charged,
              "prefix_acceptance": rollouts[regimes[0]][1], "guard_by_regime": guards}
    return policy, report
