"""Per-prompt acceptance of a drafter on held-out text, and bootstrap intervals over prompts.

Greedy (primary, deterministic): ``exact_greedy_tau`` on the target's own greedy text of each prompt (its
regenerated response, stopped at EOS or ``max_new_tokens``), at any window policy, from one teacher-forced
drafter pass per prompt. Per prompt we keep sums, not means, so that aggregates are ratios of sums:

    tau  = sum_prompts tokens   / sum_prompts rounds        (tokens per target verification forward)
    E[A] = sum_prompts accepted / sum_prompts rounds        (drafted tokens accepted per round)

Sampling (T = 1): one window of ``K`` tokens sampled from the drafter after one context of each prompt, its
closed-form ``P(A >= k | y) = prod_{i<=k} min(1, p_i / q_i)`` from one target forward
(``calibration_rollouts``), so ``E[A | y] = sum_{k <= L} P(A >= k | y)`` for any policy's length ``L``: an
unbiased estimate of the live loop's accepted tokens per round with far less variance than running it.

Intervals: percentile bootstrap over prompts (resampling prompts with replacement, recomputing the ratio
of sums); a ratio between two arms resamples the same prompts for both (paired).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..serving.calibration import calibration_rollouts, held_out_contexts
from ..serving.generation import exact_greedy_tau
from ..core.windowing import AdaptiveWindowPolicy, expected_accepted_within


# T = 1 windows per test prompt of the converged study: E[A|y] averaged over 8 drafted windows (one sample gave
# intervals of +-60%); its report leaves out T = 1 records drawn with fewer.
SAMPLES_PER_CONTEXT = 8


@torch.no_grad()
def greedy_records(target, drafter, dataset, policy: AdaptiveWindowPolicy, *, max_new_tokens: int,
                   eos_token_ids: Sequence[int], vocab_size: int) -> list[dict]:
    """Per prompt: ``tokens``, ``rounds``, ``accepted`` (sum over rounds) and ``histogram`` (rounds by A)."""
    records = []
    for prompt, response in zip(dataset["prompt_ids"], dataset["response_ids"]):
        result = exact_greedy_tau(target, drafter, torch.tensor([list(prompt)]), policy=policy,
                                  max_new_tokens=max_new_tokens, eos_token_id=list(eos_token_ids),
                                  vocab_size=vocab_size, continuation=list(response))
        records.append({"tokens": len(result.new_tokens), "rounds": result.num_rounds,
                        "accepted": sum(result.accepted_per_round), "histogram": result.acceptance_histogram()})
    return records


@torch.no_grad()
def sampled_records(target, drafter, dataset, policies: dict[str, AdaptiveWindowPolicy], *, max_window: int,
                    vocab_size: int, pad_id: int, temperature: float = 1.0, seed: int = 0,
                    samples_per_context: int = 1) -> dict[str, list[dict]]:
    """Per prompt and policy: ``{"accepted": E[A | y], "rounds": 1}`` of a window sampled at ``temperature`` (the mean
    over ``samples_per_context`` windows: less sampling noise in the intervals, same expectation).

    The context of each prompt is its prompt plus the first third of its response (one context per prompt).
    """
    contexts = [held_out_contexts([p], [r], per_response=3)[1 if len(r) > 3 else 0]
                for p, r in zip(dataset["prompt_ids"], dataset["response_ids"])]
    confidences, prefix = calibration_rollouts(target, drafter, contexts, max_window=max_window, greedy=False,
                                               temperature=temperature, vocab_size=vocab_size, pad_id=pad_id,
                                               seed=seed, samples_per_context=samples_per_context,
                                               confidence_temperature=next(iter(policies.values())).confidence_temperature)
    out = {}
    for name, policy in policies.items():
        if policy.max_window > max_window:
            raise ValueError(f"Policy {name} has K = {policy.max_window} > the sampled windows' {max_window}.")
        lengths = policy.window_lengths(confidences)
        expected = expected_accepted_within(prefix, lengths).view(-1, samples_per_context).mean(-1)
        drafted = lengths.float().view(-1, samples_per_context).mean(-1)
        out[name] = [{"accepted": float(e), "rounds": 1, "drafted": float(n) if samples_per_context > 1 else int(n)}
                     for e, n in zip(expected, drafted)]
    return out


def ratio_of_sums(records: list[dict], numerator: str, denominator: str = "rounds") -> float:
    return sum(r[numerator] for r in records) / max(sum(r[denominator] for r in records), 1)


def bootstrap_interval(records: list[dict], numerator: str, denominator: str = "rounds", *, plus: float = 0.0,
                       samples: int = 2000, seed: int = 0, level: float = 0.95) -> list[float]:
    """Percentile bootstrap interval over prompts of ``sum num / sum den + plus``."""
    index = torch.randint(len(records), (samples, len(records)), generator=torch.Generator().manual_seed(seed))
    return _percentiles(_resampled(records, index, numerator, denominator) + plus, level)


def paired_ratio_interval(arm: list[dict], baseline: list[dict], numerator: str, denominator: str = "rounds", *,
                          plus: float = 0.0, samples: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """``(sum num_a / sum den_a + plus) / (sum num_b / sum den_b + plus)`` and its paired bootstrap interval.

    Both lists hold the same prompts in the same order; each bootstrap sample resamples them jointly.
    """
    if len(arm) != len(baseline):
        raise ValueError(f"Paired intervals need the same prompts: {len(arm)} vs {len(baseline)} records.")
    index = torch.randint(len(arm), (samples, len(arm)), generator=torch.Generator().manual_seed(seed))
    a = _resampled(arm, index, numerator, denominator) + plus
    b = _resampled(baseline, index, numerator, denominator) + plus
    reference = ratio_of_sums(baseline, numerator, denominator) + plus
    if reference == 0:  # nothing accepted by the baseline: no ratio to report
        return {"ratio": None, "ci": None, "p_ratio_above_1": None}
    point = (ratio_of_sums(arm, numerator, denominator) + plus) / reference
    ratios = a / b.clamp_min(1e-12)
    return {"ratio": point, "ci": _percentiles(ratios, level), "p_ratio_above_1": float((ratios > 1).double().mean())}


def _resampled(records: list[dict], index: torch.Tensor, numerator: str, denominator: str) -> torch.Tensor:
    """``sum num / sum den`` of each bootstrap sample (rows of ``index``: prompt indices drawn with replacement)."""
    num = torch.tensor([float(r[numerator]) for r in records], dtype=torch.float64)
    den = torch.tensor([float(r[denominator]) for r in records], dtype=torch.float64)
    return num[index].sum(-1) / den[index].sum(-1).clamp_min(1)


def _percentiles(values: torch.Tensor, level: float) -> list[float]:
    low = (1 - level) / 2
    return [float(torch.quantile(values, low)), float(torch.quantile(values, 1 - low))]


def summarize(records: list[dict], max_window: int | None = None) -> dict:
    """tau, E[A] (point and 95% interval) and, for greedy records, the acceptance histogram and P(A >= k)."""
    summary = {"prompts": len(records), "rounds": sum(r["rounds"] for r in records)}
    summary["expected_accepted"] = ratio_of_sums(records, "accepted")
    summary["expected_accepted_ci"] = bootstrap_interval(records, "accepted")
    if "tokens" in records[0]:
        summary["tau"] = ratio_of_sums(records, "tokens")
        summary["tau_ci"] = bootstrap_interval(records, "tokens")
        width = max(len(r["histogram"]) for r in records)
        histogram = [sum(r["histogram"][a] for r in records if a < len(r["histogram"])) for a in range(width)]
        summary["histogram"] = histogram
        total = max(sum(histogram), 1)
        summary["p_accept_at_least"] = [sum(histogram[k:]) / total for k in range(1, width)]
    else:
        summary["tau"] = summary["expected_accepted"] + 1.0
        summary["tau_ci"] = [v + 1.0 for v in summary["expected_accepted_ci"]]
    return summary
