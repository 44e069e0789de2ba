"""The rule a drafter is served with, decided on the drafter as saved: merged, eval mode, serving dtype.

``calibrate_for_serving`` is what the recipe runs after training and before saving (and what anyone should run on a
drafter they are about to ship): it measures the cost model on *this* drafter on *this* machine (``t_d``,
``t_v(L)``; the training wrapper's costs are not the served drafter's: a LoRA-wrapped drafter step cost 2x the
merged one's in the issue that introduced this module), then calibrates ``(K, h)`` with ``K = 0`` allowed (plain
decoding wins unless a rule is predicted at least ``SERVED_MIN_SPEEDUP``, 1.05x) and attaches the online guard
(``SpeculationGuard``) whose break-even is the chosen rule's mean round time. ``describe_serving_rule`` says in one
sentence what was chosen and why, with the machine's ``t_v(L)/t_t``; the model card and the benchmarks print it.
"""

from __future__ import annotations

import torch

from ..utils import is_peft_model
from .calibration import calibrate_policy, guard_for_rule
from ..core.cost import CostModel
from .runtime import ServingRuntime
from ..core.windowing import SERVED_MIN_SPEEDUP, AdaptiveWindowPolicy

DEFAULT_GUARD = {"loss_spreads": 5.0, "probe_every": 32, "max_pause": 512, "across_generations": True}
"""The online guard's settings (``SpeculationGuard``, ``guard_for_rule``): pause once speculation has lost
``H = max(1, 2 (b - 1), 5 sigma_A)`` target steps against plain decoding (5 standard deviations of the rule's accepted
length per round, at least two missed rounds), for 32 rounds, doubling up to 512 while resumptions keep losing; the
time lost and a pause under way carry over from one generation to the next.
Chosen on simulated rounds (``benchmarks/guard_simulation.py``, rules K = 1..4 on compiled costs): a rule that pays
keeps 99.2-99.6% of its unguarded speedup over 128 tokens and 98.6-99.5% over 1,024, where the windowed guard it
replaces (pause when 8 rounds averaged under 0.95 b) kept 93-96% and 90-95%. The price: a drafter whose acceptance
collapses runs 0.86-0.97x plain speed over 128 tokens (windowed: 0.88-0.99x; unguarded: 0.48-0.91x) and
0.97-0.99x over 1,024 (windowed: 0.93-0.99x)."""


def _check_servable(drafter) -> None:
    if is_peft_model(drafter):
        raise ValueError("calibrate_for_serving measures the drafter as it will be served: merge the adapter first "
                         "(`drafter = peft_model.merge_and_unload()`).")


def calibrate_for_serving(
    target,
    drafter,
    contexts: list[torch.Tensor],
    *,
    max_window: int,
    regime: str = "greedy",
    temperature: float = 1.0,
    confidence_temperature: float = 1.0,
    guard: dict | None = DEFAULT_GUARD,
    vocab_size: int | None = None,
    pad_id: int = 0,
    cost_repeats: int = 15,
    seed: int = 0,
    runtime=None,
    min_speedup: float = SERVED_MIN_SPEEDUP,
) -> tuple[AdaptiveWindowPolicy, CostModel, dict]:
    """The served ``(policy, cost_model, report)`` of a merged ``drafter`` (module docstring).

    The cost model is timed on top of a KV cache of the median-length held-out context (what is served looks like
    it; a random 128-token context underestimates ``t_v`` on long chats), in the drafter's and target's current
    dtype and device, with the drafter in eval mode. ``guard=None`` serves without the online guard. ``min_speedup``:
    the least predicted speedup a speculative rule needs to be served (``SERVED_MIN_SPEEDUP``; 1.0: any rule above 1x).

    ``runtime``: the ``ppow_trl.serving.runtime.ServingRuntime`` that will serve (its models are timed, and the cost model
    names it); ``None`` times ``target`` and ``drafter`` as they are (eager). Acceptance statistics come from the
    runtime's verifier (``runtime.verifier``: the target at the serving precision, uncompiled; greedy tokens do not
    depend on the runtime, up to near ties, but they do on the precision) and ``drafter``.
    """
    _check_servable(drafter)
    if not contexts:
        raise ValueError("calibrate_for_serving needs held-out contexts (prompt + part of a target response).")
    drafter.eval()
    lengths = [len(c) for c in contexts]
    typical = contexts[lengths.index(sorted(lengths)[len(lengths) // 2])]
    runtime = runtime or ServingRuntime(target, drafter, "eager", "eager")
    room = getattr(runtime.target, "max_cache_len", None)
    if room is not None and len(typical) + max_window + 1 > room:  # a static cache: time its last positions
        typical = typical[-(room - max_window - 1):]
    cost_model = runtime.measure_cost_model(max_window, context_ids=typical.view(1, -1), repeats=cost_repeats,
                                            seed=seed, vocab_size=vocab_size)
    cost_model.description += f"; served drafter (eval, merged); context = median held-out ({len(typical)} tokens)"
    # acceptance of the drafter as it proposes when served (a converted copy where serving_runtime converted it)
    proposer = getattr(runtime, "proposer", None) or drafter
    policy, report = calibrate_policy(runtime.verifier, proposer, contexts, cost_model, max_window=max_window, regime=regime,
                                      temperature=temperature, confidence_temperature=confidence_temperature,
                                      vocab_size=vocab_size, pad_id=pad_id, seed=seed, allow_no_speculation=True,
                                      min_speedup=min_speedup, guard=guard, search_variants=True)
    rows = next(iter(report["grid"].values()))  # every regime's grid lists the same (K, h) in the same order
    speed, best = max(((speed, row) for row, speed in zip(rows, report["mean_speedup"]) if row["max_window"] > 0),
                      key=lambda pair: pair[0])  # the first of equal speedups (rows are dicts: never compared)
    policy.calibration["best_speculative_speedup"] = speed
    # The best rule that does speculate, with its own guard: what serving would run if this machine's costs
    # were lower (benchmarks/speedup.py measures it next to the served rule).
    alternative = policy.with_window(best["max_window"], best["threshold"], best.get("empty_windows", False))
    if guard is not None:
        alternative.guard = guard_for_rule(guard, alternative, (report["confidences"], report["prefix_acceptance"],
                                                                report["charged"]), cost_model)
    policy.calibration["best_speculative_rule"] = {"max_window": alternative.max_window,
                                                   "threshold": alternative.threshold,
                                                   "empty_windows": alternative.empty_windows, "guard": alternative.guard}
    policy.calibration["serving_rule"] = describe_serving_rule(policy, cost_model)
    return policy, cost_model, report


def describe_serving_rule(policy: AdaptiveWindowPolicy, cost_model: CostModel | None) -> str:
    """One sentence: the rule chosen, the predicted speedup, and the machine's costs that decided it."""
    costs = "cost model not measured" if cost_model is None else (
        f"{cost_model.runtime} runtime: t_d/t_t = {cost_model.drafter_cost:.3f}, t_v(L)/t_t for L = 1..{len(cost_model.verify_cost) - 1} = "
        + " / ".join(f"{c:.2f}" for c in cost_model.verify_cost[1:])
        + (f", loop host work per plain step / per round / per drafted token = {cost_model.plain_overhead:.3f} / "
           f"{cost_model.round_overhead:.3f} / {cost_model.drafted_token_overhead:.3f}"
           if cost_model.plain_overhead or cost_model.round_overhead or cost_model.drafted_token_overhead else ""))
    calibration = policy.calibration or {}
    predicted = calibration.get("predicted_speedup")
    fitted = (calibration.get("fitted_confidences") or {}).get("match_confidences")
    fitted_text = ("" if not fitted else "; lookups proposed at their n-gram length's hit rate, "
                   + "/".join(str(n + 1) for n in range(len(fitted))) + " = " + "/".join(f"{p:.2f}" for p in fitted))
    as_built = (calibration.get("fitted_confidences") or {}).get("predicted_as_built")
    if as_built is not None:
        fitted_text += f"; lookups alone, its trained drafter proposing nothing (with it: best {as_built:.3f}x)"
    if policy.max_window == 0:
        best = calibration.get("best_speculative_speedup")
        least = calibration.get("min_speedup", 1.0)
        return ("No speculation (K = 0, plain decoding): no window rule was predicted "
                + ("above 1x" if least <= 1.0 else f"at least {least:g}x") + " on this machine"
                + (f" (best {best:.3f}x)" if best is not None else "") + f"{fitted_text}; {costs}.")
    guard = policy.new_guard(fresh=True)
    guard_text = "no online guard" if guard is None else (
        f"online guard: drafting pauses for {guard.probe_every} tokens (doubling while resumptions keep losing) once "
        + (f"rounds that cost {guard.break_even_tokens:.2f} steps each" if guard.round_costs is None else
           "rounds charged their own window's cost (L = 1.." + f"{len(guard.round_costs) - 1}: "
           + " / ".join(f"{c:.2f}" for c in guard.round_costs[1:]) + " steps)")
        + f" have lost {guard.loss_budget:.2f} steps against plain decoding since they last broke even"
        + (", carried across generations" if guard.across_generations else ""))
    return (f"K = {policy.max_window}, h = {policy.threshold:.2f}"
            + (", a round drafts nothing when its first confidence is under h" if policy.empty_windows else "")
            + (f", predicted {predicted:.3f}x on {calibration.get('num_contexts')} held-out contexts"
               if predicted is not None else "")
            + f"{fitted_text}; {guard_text}; {costs}.")
