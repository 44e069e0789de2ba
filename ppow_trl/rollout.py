"""Drafting windows with the drafter and scoring them with the target, batched over contexts.

This is the data path ``contexts -> drafter windows -> target distributions`` that the demo, the
evaluation and the trainer's rollouts share. Contexts have different lengths: they are left-padded
and given explicit position ids, so each row sees the positions it would see alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from .padding import pad_sequences
from .verification import lengths_to_mask, probabilities_from_logits, sample_categorical
from .windowing import AdaptiveWindowPolicy


def left_pad(sequences: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Contexts padded on the left (``ppow_trl.padding``). Returns ``(ids, attention_mask)``, both ``(B, T)``.

    Every context needs at least one token (the window continues it).
    """
    if not sequences:
        raise ValueError("No contexts given.")
    for row, seq in enumerate(sequences):
        if len(seq) == 0:
            raise ValueError(f"Context {row} is empty: a window needs at least one token of context.")
    return pad_sequences(sequences, pad_id, side="left")


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding: ``cumsum(mask) - 1``, clamped at 0 on the padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


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


def length_buckets(lengths: list[int], max_padding: float = 0.2) -> list[list[int]]:
    """Group context indices (longest first) so each group's left padding stays under ``max_padding`` of its
    tokens: ``(n * longest - sum) / (n * longest) <= max_padding``. One group when padding is already low."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    buckets: list[list[int]] = []
    for index in order:
        if buckets:
            bucket = buckets[-1] + [index]
            longest = lengths[bucket[0]]
            if 1 - sum(lengths[i] for i in bucket) / (len(bucket) * longest) <= max_padding:
                buckets[-1] = bucket
                continue
        buckets.append([index])
    return buckets


def _forward_contexts(model, contexts, pad_id, device):
    ids, mask = left_pad(contexts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    # logits_to_keep=1: the prefill would otherwise build (B, T, V) logits for every context position
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions_from_mask(mask), use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1], out.cache, mask


def _merge_left_padded(caches, masks, order: torch.Tensor):
    """One left-padded batch cache from bucket caches (plain full-attention layers only), rows in ``order``."""
    width = max(mask.shape[1] for mask in masks)
    merged = caches[0]
    for layer_index, layer in enumerate(merged.layers):
        for name in ("keys", "values"):
            parts = [torch.nn.functional.pad(getattr(c.layers[layer_index], name), (0, 0, width - m.shape[1], 0))
                     for c, m in zip(caches, masks)]
            setattr(layer, name, torch.cat(parts)[order.to(parts[0].device)])
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in masks])[order.to(masks[0].device)]
    return merged, mask


def _prefill(model, contexts, pad_id, num_samples_per_context):
    """Forward the left-padded contexts; the KV cache is then shared by ``G`` samples of each.

    Contexts of very different lengths are run in length buckets (``length_buckets``) so that little compute
    goes to padding, and their caches are merged into one left-padded batch cache (models whose cache layers
    are all plain full-attention ``DynamicLayer``; others run as one padded batch). Returns the last-position
    logits, the cache, the attention mask and the last position ids, all repeated ``G`` times along the batch
    (rows ``g*G .. g*G + G-1`` belong to context ``g``).
    """
    device = next(model.parameters()).device
    buckets = length_buckets([len(c) for c in contexts])
    results = []
    for bucket in buckets if len(buckets) > 1 else ():
        results.append(_forward_contexts(model, [contexts[i] for i in bucket], pad_id, device))
        if not all(type(layer) is DynamicLayer for layer in results[-1][1].layers):
            results = []  # sliding-window or other bounded cache layers: no merging
            break
    if results:
        flat = torch.tensor([i for bucket in buckets for i in bucket])
        inverse = torch.empty_like(flat)
        inverse[flat] = torch.arange(len(flat))
        cache, mask = _merge_left_padded([r[1] for r in results], [r[2] for r in results], inverse)
        logits = torch.cat([r[0] for r in results])[inverse.to(device)]
    else:  # padding already low, or cache layers that cannot be merged: one padded batch in the given order
        logits, cache, mask = _forward_contexts(model, contexts, pad_id, device)
    positions = positions_from_mask(mask)
    if num_samples_per_context > 1:
        cache.batch_repeat_interleave(num_samples_per_context)
        logits, mask, positions = (t.repeat_interleave(num_samples_per_context, dim=0) for t in (logits, mask, positions))
    return logits, cache, mask, positions[:, -1:]


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
) -> DraftedWindows:
    """Draft up to ``policy.max_window`` tokens after each context (drafter KV cache, one token per step).

    ``temperature = 0`` drafts greedily (the window rule still uses the policy's confidences
    ``max softmax(z / T_c)``, never the one-hot ``q``). With ``num_samples_per_context = G`` each context is prefilled
    once and ``G`` windows are sampled from the shared cache (GRPO's group); rows are ordered context
    by context. Rows keep drafting as a batch until every row's policy has stopped (or ``K`` is
    reached); the mask keeps the prefix the policy chose, which is what a row drafting alone would
    have proposed.
    """
    logits, cache, mask, last_position = _prefill(drafter, contexts, pad_id, num_samples_per_context)
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
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        last_position = last_position + 1
        out = drafter(input_ids=token.unsqueeze(-1), attention_mask=mask, position_ids=last_position, cache=cache,
                      use_cache=True)
        logits = out.logits[:, -1]
    window_ids = torch.stack(tokens, dim=1)
    confidences = torch.stack(confidences, dim=1)
    window_mask = lengths_to_mask(policy.window_lengths(confidences), window_ids.shape[1])
    return DraftedWindows(window_ids=window_ids, drafter_probs=torch.stack(probs, dim=1), window_mask=window_mask,
                          confidences=confidences)


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
    first_logits, cache, mask, last_position = _prefill(target, contexts, pad_id, num_samples_per_context)
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
