"""Held-out measures of a drafter during training: exact greedy tau and the sampled windows' E[A|y] and speedup.

``PPOWTrainer.evaluate`` (``eval_tau``, ``eval_expected_accepted``...) wires these to its processes: tau is sharded
over prompts and summed; the window metrics run on the main process. Both run the package's one loop
(``exact_greedy_tau``) and one draft -> verify path (``ppow_trl.core.rollout.verify_windows``).
"""

from __future__ import annotations

import torch

from ..core.cost import CostModel, overall_speedup
from ..serving.generation import exact_greedy_tau, greedy_continuation
from ..core.rollout import verify_windows
from ..core.windowing import AdaptiveWindowPolicy


@torch.no_grad()
def held_out_tau_counts(target, drafter, prompts, rules: list[AdaptiveWindowPolicy], *, max_new_tokens: int,
                        vocab_size: int, continuations: dict | None = None) -> torch.Tensor:
    """``[tokens, rounds]`` of exact greedy tau per rule, summed over ``prompts``: ``(2 * len(rules),)`` float64
    (tau = tokens / rounds, a ratio of sums). ``continuations`` caches the target's greedy text per prompt
    (it does not depend on the drafter: computed once per prompt over a whole training run)."""
    continuations = {} if continuations is None else continuations
    counts = torch.zeros(2 * len(rules), dtype=torch.float64)
    for prompt in prompts:
        key = tuple(prompt)
        if key not in continuations:
            continuations[key] = greedy_continuation(target, list(prompt), max_new_tokens, vocab_size)
        for index, rule in enumerate(rules):
            result = exact_greedy_tau(target, drafter, torch.tensor([prompt]), policy=rule,
                                      max_new_tokens=max_new_tokens, vocab_size=vocab_size,
                                      continuation=continuations[key])
            counts[2 * index] += len(result.new_tokens)
            counts[2 * index + 1] += result.num_rounds
    return counts


@torch.no_grad()
def held_out_window_metrics(target, drafter, contexts: list[torch.Tensor], policy: AdaptiveWindowPolicy,
                            cost_model: CostModel, *, greedy: bool, temperature: float, verify_temperature: float,
                            pad_id: int, vocab_size: int, batch_size: int, seed: int) -> dict[str, float]:
    """Mean ``E[A|y]`` (``A`` when ``greedy``) of windows drafted at ``temperature`` under ``policy`` after held-out
    ``contexts``, as the training reward defines it, and their cost-model speedup (a ratio of sums)."""
    generator = torch.Generator(next(drafter.parameters()).device).manual_seed(seed)
    accepted, lengths = [], []
    for start in range(0, len(contexts), batch_size):
        verified = verify_windows(target, drafter, contexts[start : start + batch_size], policy, greedy=greedy,
                                  temperature=temperature, verify_temperature=verify_temperature, pad_id=pad_id,
                                  vocab_size=vocab_size, generator=generator)
        accepted.append(verified.accepted.float().cpu())
        lengths.append(verified.drafted.window_mask.sum(-1).cpu())
    accepted, lengths = torch.cat(accepted), torch.cat(lengths)
    return {"expected_accepted": float(accepted.mean()),
            "simulated_speedup": float(overall_speedup(accepted, lengths, cost_model))}
