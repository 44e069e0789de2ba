"""Per-position credit for PPOW windows (``PPOWConfig.per_token_credit``).

A window's reward is ``R = S(y) + lambda R_prox``. Token ``k`` of a window of ``L`` tokens can only change
what the window yields from position ``k`` on, so its credit is the part of ``R`` that positions ``k..L``
add:

    C_k = (S_L - S_{k-1}) + lambda (1/L) sum_{j=k..L} r_j

where ``S_k = (E_k + 1) t_t / (k t_d + t_v(k))`` is the speedup of the window cut to its first ``k`` tokens,
``E_k = sum_{j<=k} P(A >= j | y)`` (exact: a shorter window is a prefix), ``S_0 = 1`` (a plain target step),
and ``r_j`` the per-position proximity terms. With ``speed_reward="tokens"`` the speed part is
``(E_L + 1) - (E_{k-1} + 1) = sum_{j>=k} P(A >= j)``, the expected accepted tokens from ``k`` on. ``C_1 = R - 1``:
the first token carries the whole window reward. Advantages are group-relative *per position*, over the
windows of the group that reach position ``k``: a window that stopped earlier has no token ``k`` and must
not count as a zero.
"""

from __future__ import annotations

import torch

from .cost import CostModel, speedup


def prefix_speedups(prefix_acceptance: torch.Tensor, cost_model: CostModel | None) -> torch.Tensor:
    """``S_k`` for ``k = 0..K`` of each window cut to its first ``k`` tokens. ``(B, K + 1)``.

    ``prefix_acceptance[:, j-1] = P(A >= j | y)`` (0 past the window's end). ``cost_model=None``: the token
    count ``E_k + 1`` instead of the speedup (``speed_reward="tokens"``).
    """
    expected = torch.cat([prefix_acceptance.new_zeros(prefix_acceptance.shape[0], 1),
                          prefix_acceptance.float().cumsum(-1)], dim=-1)
    if cost_model is None:
        return expected + 1.0
    lengths = torch.arange(expected.shape[1], device=expected.device).expand_as(expected)
    return speedup(expected, lengths, cost_model)


def per_position_credit(
    prefix_acceptance: torch.Tensor,
    proximity: torch.Tensor,
    window_mask: torch.Tensor,
    cost_model: CostModel | None,
    proximity_weight: float,
) -> torch.Tensor:
    """``C_k = (S_L - S_{k-1}) + lambda (1/L) sum_{j>=k} r_j`` at each position ``k <= L``; 0 past ``L``. ``(B, K)``."""
    mask = window_mask.float()
    lengths = window_mask.long().sum(-1)
    speeds = prefix_speedups(prefix_acceptance * mask, cost_model)
    final = speeds.gather(1, lengths.unsqueeze(-1))  # S_L
    speed_to_go = final - speeds[:, :-1]  # S_L - S_{k-1}, k = 1..K
    proximity_to_go = (proximity.float() * mask).flip(-1).cumsum(-1).flip(-1) / lengths.clamp_min(1).unsqueeze(-1)
    return (speed_to_go + proximity_weight * proximity_to_go) * mask


def per_position_advantages(credit: torch.Tensor, mask: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """Group-relative advantages at each position over the windows of the group that reach it. ``(B, K)``.

    ``A_{b,k} = (C_{b,k} - mean_k) / (std_k + 1e-4)``, mean and (unbiased) std over the rows ``b'`` of ``b``'s
    group with ``L_{b'} >= k``; 0 where only one row reaches ``k`` and on padding. Rows are ordered group by
    group (``group_size`` consecutive windows share a context). ``scale=False``: no division by the std
    (TRL's ``scale_rewards="none"``).
    """
    mask = mask.float()
    grouped_credit = (credit.float() * mask).view(-1, group_size, credit.shape[-1])
    grouped_mask = mask.view_as(grouped_credit)
    count = grouped_mask.sum(dim=1, keepdim=True)
    mean = grouped_credit.sum(dim=1, keepdim=True) / count.clamp_min(1)
    centred = (grouped_credit - mean) * grouped_mask
    if scale:
        variance = (centred**2).sum(dim=1, keepdim=True) / (count - 1).clamp_min(1)
        centred = centred / (variance.sqrt() + 1e-4)
    centred = centred * (count > 1)
    return centred.view_as(credit)
