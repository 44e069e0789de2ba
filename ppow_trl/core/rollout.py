"""Draft -> verify -> rewards, batched over contexts: the one data path of rollouts, calibration and evaluation.

``contexts -> drafter windows (draft_windows) -> target distributions (target_window_probs) -> P(A >= k | y)
(verify_windows) -> R_speed, R_prox, per-position credit (window_rewards)``. The trainer's rollouts, the window
calibration (``ppow_trl.serving.calibration``), the trainer's held-out metrics, the study and the demo all run it. Contexts
have different lengths: they are left-padded and given explicit position ids, so each row sees the positions it
would see alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
# left_pad, length_buckets and positions_from_mask are re-exported: they lived here before ppow_trl.batching.
from ..batching import left_pad, length_buckets, positions_from_mask, prefill_contexts  # noqa: F401
from ..drafting import drafting_session
from ..features import context_features
from .cost import CostModel, speedup
from .credit import per_position_credit
from .rewards import proximity_terms
from .verification import lengths_to_mask, probabilities_from_logits, sample_categorical, window_prefix_acceptance
from .windowing import AdaptiveWindowPolicy


@dataclass
class DraftedWindows:
    """Windows drafted after a batch of contexts.

    ``window_ids`` (B, K); ``drafter_probs`` (B, K, V) the distributions the tokens were drawn from (one-hot
    when drafting greedily); ``window_mask`` (B, K) the ``L <= K`` tokens the window policy keeps;
    ``confidences`` (B, K) the policy's ``conf = max softmax(z / T_c)`` of each drafted position (what the
    rule decided on; not ``max q``, which is 1 for greedy drafting).
    """

    window_ids: torch.Tensor
    drafter_probs: torch.Tensor
    window_mask: torch.Tensor
    confidences: torch.Tensor
    charged: torch.Tensor | None = None
    """(B, K) 1 where the drafter's model ran for the token, 0 where it came free (a hybrid's lookup); ``None``: every
    token was charged (``DraftingSession.charged_steps``, optional)."""


@torch.no_grad()
def draft_windows(
    drafter,
    contexts: list[torch.Tensor],
    policy: AdaptiveWindowPolicy,
    *,
    pad_id: int = 0,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    num_samples_per_context: int = 1,
    target=None,
    features: list[torch.Tensor] | None = None,
) -> DraftedWindows:
    """Draft up to ``policy.max_window`` tokens after each context (drafter KV cache, one token per step).

    ``temperature = 0`` drafts greedily (the window rule still uses the policy's confidences
    ``max softmax(z / T_c)``, never the one-hot ``q``). With ``num_samples_per_context = G`` each context is prefilled
    once and ``G`` windows are sampled from the shared cache (GRPO's group); rows are ordered context
    by context. Rows keep drafting as a batch until every row's policy has stopped (or ``K`` is
    reached); the mask keeps the prefix the policy chose, which is what a row drafting alone would
    have proposed. A drafter that reads the target's hidden states (``ppow_trl.drafting``) needs ``target``: its
    features of the contexts come from one teacher-forced target forward (``context_features``), unless given as
    ``features`` (``[(len(c), F)]``, e.g. kept by the trainer for its loss).
    """
    session = drafting_session(drafter, target)
    if session.target_layer_ids is None:
        features = None
    elif features is None:
        if target is None:
            raise ValueError("This drafter reads the target's hidden states: pass target= to draft_windows.")
        features = context_features(target, contexts, session.target_layer_ids, pad_id)
    logits = session.prefill(contexts, pad_id, num_samples_per_context, features)
    tokens, probs, confidences = [], [], []
    running = torch.ones(logits.shape[0], device=logits.device)
    for step in range(policy.max_window):
        logits = logits[..., :vocab_size] if vocab_size else logits
        q = probabilities_from_logits(logits, temperature)
        token = sample_categorical(q, generator) if temperature > 0 else q.argmax(-1)
        tokens.append(token)
        probs.append(q)
        confidences.append(policy.confidence(logits))
        running = running * confidences[-1]
        if not policy.keep_drafting(running, step + 1).any():
            break
        logits = session.step(token)
    window_ids = torch.stack(tokens, dim=1)
    confidences = torch.stack(confidences, dim=1)
    window_mask = lengths_to_mask(policy.window_lengths(confidences), window_ids.shape[1])
    charged = getattr(session, "charged_steps", None)
    if charged is not None:
        charged = torch.stack(charged[: window_ids.shape[1]], dim=1).float().to(confidences.device)
    return DraftedWindows(window_ids=window_ids, drafter_probs=torch.stack(probs, dim=1), window_mask=window_mask,
                          confidences=confidences, charged=charged)


@torch.no_grad()
def target_window_probs(
    target,
    contexts: list[torch.Tensor],
    window_ids: torch.Tensor,
    *,
    pad_id: int = 0,
    temperature: float = 1.0,
    vocab_size: int | None = None,
    num_samples_per_context: int = 1,
) -> torch.Tensor:
    """``p_i = p(. | c, y_<i)`` for ``i = 1..K+1``: the target's verification of each window. ``(B, K + 1, V)``.

    The context is prefilled once (its last position gives ``p_1``) and its KV cache is shared by the
    ``G = num_samples_per_context`` windows drafted after it; one more forward over the windows gives
    ``p_2..p_{K+1}``. Padded window slots are scored too (cheap; masked out by the verification functions).
    """
    first_logits, cache, mask, last_position = prefill_contexts(target, contexts, pad_id, num_samples_per_context)
    window_ids = window_ids.to(first_logits.device)
    if window_ids.shape[0] != first_logits.shape[0]:
        raise ValueError(
            f"{window_ids.shape[0]} windows for {len(contexts)} contexts x {num_samples_per_context} samples each."
        )
    max_window = window_ids.shape[1]
    full_mask = torch.cat([mask, mask.new_ones(mask.shape[0], max_window)], dim=-1)
    positions = last_position + 1 + torch.arange(max_window, device=window_ids.device)
    out = target(input_ids=window_ids, attention_mask=full_mask, position_ids=positions, cache=cache, use_cache=True)
    logits = torch.cat([first_logits.unsqueeze(1), out.logits], dim=1)
    return probabilities_from_logits(logits[..., :vocab_size] if vocab_size else logits, temperature)


@dataclass
class VerifiedWindows:
    """Drafted windows and their verification: ``drafted`` (``DraftedWindows``), ``target_probs`` ``(B, K + 1, V)``
    (``p_i`` on the drafter's device) and ``prefix`` ``(B, K)``, ``P(A >= k | y)`` (0/1 when greedy)."""

    drafted: DraftedWindows
    target_probs: torch.Tensor
    prefix: torch.Tensor

    @property
    def accepted(self) -> torch.Tensor:
        """``E[A | y]`` (``A`` when greedy) of each window, ``(B,)``."""
        return self.prefix.sum(dim=-1)


@torch.no_grad()
def verify_windows(
    target,
    drafter,
    contexts: list[torch.Tensor],
    policy: AdaptiveWindowPolicy,
    *,
    greedy: bool,
    temperature: float = 1.0,
    verify_temperature: float | None = None,
    pad_id: int = 0,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
    num_samples_per_context: int = 1,
    features: list[torch.Tensor] | None = None,
) -> VerifiedWindows:
    """Draft windows after ``contexts`` under ``policy`` and verify them with ``target``.

    ``greedy``: greedy verification (``a_i = [y_i == argmax p_i]``); the drafter samples at ``temperature`` (0 drafts
    greedily) and the target's ``p`` is taken at ``verify_temperature`` (default: 0 when greedy, else
    ``temperature``). Speculative sampling otherwise: ``P(A >= k | y) = prod_{i<=k} min(1, p_i(y_i) / q_i(y_i))``.
    """
    if verify_temperature is None:
        verify_temperature = 0.0 if greedy else temperature
    drafted = draft_windows(drafter, contexts, policy, pad_id=pad_id, temperature=temperature, vocab_size=vocab_size,
                            generator=generator, num_samples_per_context=num_samples_per_context, target=target,
                            features=features)
    p = target_window_probs(target, contexts, drafted.window_ids, pad_id=pad_id, temperature=verify_temperature,
                            vocab_size=vocab_size, num_samples_per_context=num_samples_per_context)
    p = p.to(drafted.drafter_probs.device)
    prefix = window_prefix_acceptance(drafted.window_ids, p, drafted.drafter_probs, drafted.window_mask, greedy=greedy)
    return VerifiedWindows(drafted=drafted, target_probs=p, prefix=prefix)


PROXIMITY_POSITIONS = ("window", "reached")


def reached_positions(prefix: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """``P(position k is verified) = P(A >= k - 1 | y)`` for ``k <= L`` (1 at ``k = 1``), 0 past ``L``: ``(B, K)``.

    Greedy: 1 on the matched positions and the first mismatch, 0 after it (positions a served round never reads).
    """
    reached = torch.cat([torch.ones_like(prefix[:, :1]), prefix[:, :-1]], dim=-1)
    return reached * window_mask


def window_rewards(verified: VerifiedWindows, cost_model: CostModel | None, *, proximity_divergence: str = "tv",
                   proximity_weight: float = 1.0, proximity_positions: str = "window") -> dict[str, torch.Tensor]:
    """The reward terms of docs/ppow.md for verified windows.

    Returns ``accepted`` (E[A|y], or A when greedy), ``prefix`` (P(A >= k)), ``lengths`` (L), ``speed``
    (``R_speed = S(y)`` with ``cost_model``, else ``E[A|y] + 1``), ``proximity`` (``R_prox = (1/L) sum_i w_i r_i``) and
    ``credit`` (the per-position credit ``C_k`` of ``ppow_trl.core.credit``, 0 past L). ``proximity_positions``:
    ``"window"`` (``w_i = 1`` on every drafted position, docs/ppow.md) or ``"reached"`` (``w_i = P(A >= i - 1 | y)``,
    the positions verification reaches: what cached greedy rewards can compute,
    ``ppow_trl.training.cached_verification``).
    """
    if proximity_positions not in PROXIMITY_POSITIONS:
        raise ValueError(f"proximity_positions must be one of {PROXIMITY_POSITIONS}, got {proximity_positions!r}.")
    drafted, prefix = verified.drafted, verified.prefix
    accepted, lengths = verified.accepted, drafted.window_mask.sum(-1)
    r_speed = speedup(accepted, lengths, cost_model) if cost_model is not None else accepted + 1.0
    terms = proximity_terms(verified.target_probs, drafted.drafter_probs, kind=proximity_divergence)
    if proximity_positions == "reached":
        weight = reached_positions(prefix, drafted.window_mask)
        terms = torch.where(weight > 0, terms * weight, 0.0)  # not 0 * -inf: -KL of a one-hot q off the reached path
    r_prox = (terms * drafted.window_mask).sum(-1) / lengths.clamp_min(1)
    credit = per_position_credit(prefix, terms, drafted.window_mask, cost_model, proximity_weight)
    return {"accepted": accepted, "prefix": prefix, "lengths": lengths, "speed": r_speed, "proximity": r_prox,
            "credit": credit}
