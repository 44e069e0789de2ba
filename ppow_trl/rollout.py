"""Drafting windows with the drafter and scoring them with the target, batched over contexts.

This is the data path ``contexts -> drafter windows -> target distributions`` that the demo, the
evaluation and the trainer's rollouts share. Contexts have different lengths: they are left-padded
and given explicit position ids, so each row sees the positions it would see alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .verification import lengths_to_mask, probabilities_from_logits
from .windowing import AdaptiveWindowPolicy, drafter_confidence


def left_pad(sequences: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack 1-D token tensors, padding on the left. Returns ``(ids, attention_mask)``, both ``(B, T)``."""
    if not sequences:
        raise ValueError("No contexts given.")
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"Context {row} is empty: a window needs at least one token of context.")
        ids[row, width - len(seq) :] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, width - len(seq) :] = 1
    return ids, mask


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding: ``cumsum(mask) - 1``, clamped at 0 on the padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


@dataclass
class DraftedWindows:
    """Windows drafted after a batch of contexts.

    ``window_ids`` (B, K); ``drafter_probs`` (B, K, V) the distributions the tokens were drawn from;
    ``window_mask`` (B, K) the ``L <= K`` tokens the window policy keeps.
    """

    window_ids: torch.Tensor
    drafter_probs: torch.Tensor
    window_mask: torch.Tensor

    @property
    def confidences(self) -> torch.Tensor:
        return drafter_confidence(self.drafter_probs)


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
) -> DraftedWindows:
    """Draft up to ``policy.max_window`` tokens after each context (drafter KV cache, one token per step).

    ``temperature = 0`` drafts greedily. Rows keep drafting as a batch until every row's policy has
    stopped (or ``K`` is reached); the mask keeps the prefix the policy chose, which is what a
    row drafting alone would have proposed.
    """
    device = next(drafter.parameters()).device
    ids, mask = left_pad(contexts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    positions = positions_from_mask(mask)
    tokens, probs, running = [], [], torch.ones(len(contexts), device=device)
    active = torch.ones(len(contexts), dtype=torch.bool, device=device)
    cache = None
    step_ids = ids
    for step in range(policy.max_window):
        # logits_to_keep=1: the prefill would otherwise build (B, T, V) logits for every context position
        out = drafter(input_ids=step_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                      logits_to_keep=1)
        cache = out.cache
        logits = out.logits[:, -1, :vocab_size] if vocab_size else out.logits[:, -1]
        q = probabilities_from_logits(logits, temperature)
        token = torch.multinomial(q, 1, generator=generator).squeeze(-1) if temperature > 0 else q.argmax(-1)
        tokens.append(token)
        probs.append(q)
        running = running * drafter_confidence(q)
        active = active & policy.keep_drafting(running, step + 1)
        if not active.any():
            break
        step_ids = token.unsqueeze(-1)
        mask = torch.cat([mask, mask.new_ones(len(contexts), 1)], dim=-1)
        positions = positions[:, -1:] + 1
    window_ids = torch.stack(tokens, dim=1)
    drafter_probs = torch.stack(probs, dim=1)
    window_mask = lengths_to_mask(policy.window_lengths(drafter_confidence(drafter_probs)), window_ids.shape[1])
    return DraftedWindows(window_ids=window_ids, drafter_probs=drafter_probs, window_mask=window_mask)


@torch.no_grad()
def target_window_probs(
    target,
    contexts: list[torch.Tensor],
    window_ids: torch.Tensor,
    *,
    pad_id: int = 0,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """``p_i = p(. | c, y_<i)`` for ``i = 1..K+1`` from one target forward over ``c + y``. ``(B, K + 1, V)``.

    Padded window slots are scored too (cheap, and masked out later by the verification functions).
    """
    device = next(target.parameters()).device
    ids, mask = left_pad(contexts, pad_id)
    full = torch.cat([ids.to(device), window_ids.to(device)], dim=1)
    full_mask = torch.cat([mask.to(device), torch.ones_like(window_ids, device=device)], dim=1)
    max_window = window_ids.shape[1]
    out = target(input_ids=full, attention_mask=full_mask, position_ids=positions_from_mask(full_mask),
                 logits_to_keep=max_window + 1)
    logits = out.logits[..., :vocab_size] if vocab_size else out.logits
    return probabilities_from_logits(logits, temperature)
