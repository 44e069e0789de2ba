"""Adaptive divergence-aware windowing: which windows to train on, and how long a window is.

1. Which windows: score each position of a target-generated sequence with
   ``s_t = conf_t * D_t`` (the drafter is confident and wrong) and sample window starts with
   probability proportional to ``(s_t + eps)^beta``, mixed with a uniform share.
2. How long: ``AdaptiveWindowPolicy`` keeps drafting while the running acceptance estimate
   ``prod_{j<=i} conf_j`` stays at or above ``h``, up to ``K``. Training rollouts and generation use
   this same object, saved with the drafter.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .cost import CostModel, overall_speedup
from .custom_generate.generate import SpeculationGuard, keep_drafting, window_confidence
from .rewards import divergence
from .utils import load_json, save_json

WINDOW_POLICY_FILE = "ppow_window_policy.json"


def drafter_confidence(drafter_probs: torch.Tensor) -> torch.Tensor:
    """``conf_t = max_v q_t(v)`` of a distribution already computed (window selection's ``s_t``; the window
    *rule* uses ``AdaptiveWindowPolicy.confidence`` on logits instead, at its own temperature)."""
    return drafter_probs.float().amax(dim=-1)


def divergence_scores(
    target_probs: torch.Tensor, drafter_probs: torch.Tensor, mask: torch.Tensor | None = None, kind: str = "kl"
) -> torch.Tensor:
    """Confidence-weighted divergence ``s_t = conf_t * D_t(p_t, q_t)`` per position; 0 where masked out.

    High scores mark positions where the drafter is confident yet far from the target: the
    windows that teach the most.
    """
    scores = drafter_confidence(drafter_probs) * divergence(target_probs, drafter_probs, kind)
    return scores if mask is None else scores * mask


def window_start_probabilities(
    scores: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 1.0,
    eps: float = 1e-3,
    uniform_share: float = 0.1,
) -> torch.Tensor:
    """Sampling distribution over window starts: ``(1 - u) (s_t + eps)^beta / Z + u / N`` on valid positions.

    ``beta = 0`` gives uniform selection; ``uniform_share = u`` keeps every valid position reachable
    (scores go stale between refreshes). Flattened over all sequences: ``(B, T) -> (B, T)`` summing to 1.
    """
    if beta < 0 or eps <= 0 or not 0.0 <= uniform_share <= 1.0:
        raise ValueError(f"Need beta >= 0, eps > 0 and 0 <= uniform_share <= 1; got {beta}, {eps}, {uniform_share}.")
    mask = mask.bool()
    num_valid = mask.sum()
    if num_valid == 0:
        raise ValueError("No valid window start: every position is masked out (empty responses?).")
    # (s + eps)^beta in log space: a large beta on KL scores (up to ~87 nats) would overflow to inf.
    log_weights = beta * (scores.float().clamp_min(0.0) + eps).log()
    weighted = torch.softmax(log_weights.masked_fill(~mask, float("-inf")).flatten(), dim=0).view_as(scores)
    uniform = mask.float() / num_valid
    return (1.0 - uniform_share) * weighted + uniform_share * uniform


def sample_window_starts(
    probabilities: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw ``num_samples`` (sequence, position) pairs from ``window_start_probabilities``. ``(N, 2)`` long."""
    flat = torch.multinomial(probabilities.flatten(), num_samples, replacement=True, generator=generator)
    return torch.stack([flat // probabilities.shape[1], flat % probabilities.shape[1]], dim=-1)


@dataclass
class AdaptiveWindowPolicy:
    """The window-length rule: draft while ``prod_{j<=i} conf_j >= threshold`` and ``i < max_window``.

    ``conf_j = max_v softmax(z_j / confidence_temperature)`` of the drafter's logits ``z_j``: a property of
    the policy, the same in training rollouts, our generation loop, the HF hook, calibration and the
    benchmark, greedy or sampled (``ppow_trl/custom_generate/generate.py`` holds the rule). The first token is
    always drafted; the token whose confidence pushes the estimate below ``h`` is still proposed (it may be
    accepted) and ends the window. ``threshold = 0`` is a fixed window of ``max_window`` tokens. (A threshold
    on the acceptance estimate is optimal for this stopping problem under mild assumptions: SpecDec++, arXiv
    2405.19715.)

    Args:
        max_window (`int`): ``K``, the most tokens drafted per round (>= 1).
        threshold (`float`): ``h`` in ``[0, 1]``.
        confidence_temperature (`float`): ``T_c > 0`` of the confidences (files saved before it existed load
            with 1.0, the value every route used for sampled windows).
        calibration (`dict`, *optional*): how ``(K, h)`` were chosen, written by
            ``ppow_trl.calibration.calibrate_policy``: the regime they are for (``"greedy"`` or ``"sampling"``
            and its temperature), the number of held-out contexts, the predicted speedup. ``None``: set by hand.
        guard (`dict`, *optional*): the online guard of every generation, ``{"break_even_tokens": b, "window": W,
            "probe_every": N}`` (``SpeculationGuard``): drafting pauses for ``N`` rounds when the last ``W``
            drafting rounds yielded fewer than ``b`` tokens each on average. ``None``: no guard.

    ``max_window = 0`` means no speculation: every route decodes plainly (the calibration chooses it when the
    measured cost model predicts less than 1x for every ``(K, h)``).
    """

    max_window: int = 8
    threshold: float = 0.0
    confidence_temperature: float = 1.0
    calibration: dict | None = None
    guard: dict | None = None

    def __post_init__(self):
        if not isinstance(self.max_window, int) or self.max_window < 0:
            raise ValueError(f"max_window (K) must be an integer >= 0 (0: no speculation), got {self.max_window!r}.")
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(
                f"threshold (h) must lie in [0, 1], got {self.threshold!r}: it is compared with a product of probabilities."
            )
        if not float(self.confidence_temperature) > 0:
            raise ValueError(f"confidence_temperature (T_c) must be > 0, got {self.confidence_temperature!r}.")
        if self.guard is not None:
            self.new_guard()  # validates the settings now, not at the first generation

    def new_guard(self) -> SpeculationGuard | None:
        """A fresh ``SpeculationGuard`` for one generation (``None`` without a guard or without speculation)."""
        return SpeculationGuard(**self.guard) if self.guard and self.max_window > 0 else None

    def confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """``conf = max_v softmax(z / T_c)``: the drafter's confidence from its logits ``z`` (last dim = vocab)."""
        return window_confidence(logits, self.confidence_temperature)

    def keep_drafting(self, running_acceptance: torch.Tensor, num_drafted: int) -> torch.Tensor:
        """Whether to draft another token after ``num_drafted`` tokens with estimate ``prod conf``."""
        return keep_drafting(running_acceptance, num_drafted, self.max_window, self.threshold)

    def window_lengths(self, confidences: torch.Tensor) -> torch.Tensor:
        """Lengths the rule picks given per-position confidences ``(B, >=K)`` of a drafted sequence. ``(B,)``.

        Same rule as ``keep_drafting``, applied to a whole rollout at once: ``L = 1 + #{i < K: prod_{j<=i} conf_j >= h}``
        (the running product only decreases, so the counted positions form a prefix).
        """
        if self.max_window == 0:
            return torch.zeros(confidences.shape[0], dtype=torch.long, device=confidences.device)
        running = confidences[:, : self.max_window - 1].float().cumprod(dim=-1)
        return 1 + self.keep_drafting(running, 0).sum(dim=-1)

    def with_window(self, max_window: int, threshold: float) -> "AdaptiveWindowPolicy":
        """The same confidence definition and guard with another ``(K, h)`` (``calibration`` dropped)."""
        return AdaptiveWindowPolicy(int(max_window), float(threshold), self.confidence_temperature, guard=self.guard)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Save as ``folder/ppow_window_policy.json``, so generation uses the rule training used."""
        return save_json(asdict(self), folder, WINDOW_POLICY_FILE)

    @classmethod
    def from_dict(cls, data: dict) -> "AdaptiveWindowPolicy":
        """From a saved dict; keys this version does not know are an error naming them."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"Unknown window-policy fields {sorted(unknown)}: this {WINDOW_POLICY_FILE} was written by a newer "
                "ppow_trl; upgrade ppow_trl."
            )
        return cls(**data)

    @classmethod
    def from_pretrained(cls, folder_or_repo: str | Path, **hub_kwargs) -> "AdaptiveWindowPolicy":
        """Load ``ppow_window_policy.json`` from a local folder, or from a Hub repo id (``hf_hub_download``;
        ``hub_kwargs`` such as ``revision=`` are passed on)."""
        return cls.from_dict(load_json(folder_or_repo, WINDOW_POLICY_FILE, "this drafter was not saved by ppow_trl.",
                                       **hub_kwargs))


def policy_speedup(
    policy: AdaptiveWindowPolicy, confidences: torch.Tensor, prefix_acceptance: torch.Tensor, cost_model: CostModel
) -> torch.Tensor:
    """Cost-model speedup of ``policy`` on rollouts of ``K`` tokens (``K >= policy.max_window``).

    ``prefix_acceptance[:, k-1] = P(A >= k | y)`` from a full rollout; a shorter window is a prefix of
    it, so ``E[A | y_{1:L}] = sum_{k<=L} P(A >= k)`` exactly (for greedy drafting too, with 0/1 terms).
    """
    lengths = policy.window_lengths(confidences)
    keep = torch.arange(prefix_acceptance.shape[1], device=lengths.device) < lengths.unsqueeze(-1)
    return overall_speedup((prefix_acceptance * keep).sum(dim=-1), lengths, cost_model)


def calibrate_window_policy(
    confidences: torch.Tensor,
    prefix_acceptance: torch.Tensor,
    cost_model: CostModel,
    thresholds=tuple(i / 20 for i in range(20)),
    max_windows=None,
    confidence_temperature: float = 1.0,
    allow_no_speculation: bool = False,
) -> tuple[AdaptiveWindowPolicy, list[dict]]:
    """Choose ``(K, h)`` maximising the cost-model speedup on held-out rollouts; returns it and the grid.

    ``confidences`` (at ``confidence_temperature``) and ``prefix_acceptance`` are ``(N, K_max)`` from windows
    of ``K_max`` tokens drafted on held-out contexts (see ``policy_speedup``). This is the grid search on
    tensors; ``ppow_trl.calibration.calibrate_policy`` drafts and verifies those windows and calls it.
    ``allow_no_speculation``: ``K = 0`` (plain decoding, speedup 1 by definition) is a candidate too, and wins
    whenever no ``(K, h)`` is predicted above 1x (it comes first, so a tie keeps plain decoding).
    """
    max_windows = max_windows or range(1, confidences.shape[1] + 1)
    grid = [{"max_window": 0, "threshold": 0.0, "speedup": 1.0}] if allow_no_speculation else []
    for max_window in max_windows:
        for threshold in thresholds:
            policy = AdaptiveWindowPolicy(int(max_window), float(threshold), confidence_temperature)
            value = policy_speedup(policy, confidences, prefix_acceptance, cost_model).item()
            grid.append({"max_window": int(max_window), "threshold": float(threshold), "speedup": value})
    best = max(grid, key=lambda row: row["speedup"])
    return AdaptiveWindowPolicy(best["max_window"], best["threshold"], confidence_temperature), grid
