"""Window rewards of PPOW: divergences, the distribution-based proximity reward and the total reward.

The cost-aware speedup reward ``R_speed = S(y)`` is ``ppow_trl.core.cost.speedup``; this module adds the
dense proximity term and their sum. Everything works on probabilities (last dimension = vocabulary),
in float32, masked for padding.
"""

from __future__ import annotations

import torch

DIVERGENCES = ("tv", "kl", "js")


def total_variation(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``TV(p, q) = 1/2 sum_v |p(v) - q(v)|``; ``1 - TV = sum_v min(p(v), q(v))`` is the acceptance rate."""
    return 0.5 * (p.float() - q.float()).abs().sum(dim=-1)


def kl_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``KL(p || q) = sum_v p(v) log(p(v) / q(v))``, with ``0 log 0 = 0``.

    ``q(v) = 0`` where ``p(v) > 0`` makes KL infinite (e.g. a target token outside a reduced draft
    vocabulary); we clamp ``q`` at the smallest normal float32 so the result stays finite (~87 nats
    per unit of missing mass) and gradients stay usable.
    """
    p, q = p.float(), q.float()
    log_q = q.clamp_min(torch.finfo(torch.float32).tiny).log()
    return (torch.xlogy(p, p) - p * log_q).sum(dim=-1).clamp_min(0.0)


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``JS(p, q) = 1/2 KL(p || m) + 1/2 KL(q || m)`` with ``m = (p + q) / 2``; bounded by ``log 2``."""
    m = 0.5 * (p.float() + q.float())
    return 0.5 * kl_divergence(p, m) + 0.5 * kl_divergence(q, m)


def divergence(p: torch.Tensor, q: torch.Tensor, kind: str = "tv") -> torch.Tensor:
    """``D(p, q)`` for ``kind`` in ``("tv", "kl", "js")``."""
    if kind == "tv":
        return total_variation(p, q)
    if kind == "kl":
        return kl_divergence(p, q)
    if kind == "js":
        return js_divergence(p, q)
    raise ValueError(f"Unknown divergence {kind!r}; choose one of {DIVERGENCES}.")


def proximity_terms(target_probs: torch.Tensor, drafter_probs: torch.Tensor, kind: str = "tv") -> torch.Tensor:
    """Per-position proximity ``r_i``: ``1 - TV(p_i, q_i)`` (the expected acceptance rate at position ``i``),
    or ``-KL(p_i || q_i)`` / ``-JS(p_i, q_i)``. ``(B, K)``; ``target_probs`` may carry the bonus position
    ``K + 1``, which is ignored."""
    distance = divergence(target_probs[:, : drafter_probs.shape[1]], drafter_probs, kind)
    return 1.0 - distance if kind == "tv" else -distance


def proximity_reward(
    target_probs: torch.Tensor,
    drafter_probs: torch.Tensor,
    window_mask: torch.Tensor,
    kind: str = "tv",
) -> torch.Tensor:
    """Distribution-based proximity reward ``R_prox = (1/L) sum_{i<=L} r_i`` (``proximity_terms``). ``(B,)``.

    Empty windows get 0.
    """
    lengths = window_mask.sum(dim=-1)
    return (proximity_terms(target_probs, drafter_probs, kind) * window_mask).sum(dim=-1) / lengths.clamp_min(1)


def window_reward(speed_reward: torch.Tensor, proximity: torch.Tensor, proximity_weight: float) -> torch.Tensor:
    """Total reward ``R = R_speed + lambda * R_prox``."""
    return speed_reward + proximity_weight * proximity
