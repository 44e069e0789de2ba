"""Left-padded batches of contexts of different lengths, prefilled once and shared by G samples each.

Rollouts (``ppow_trl.core.rollout``) and drafter sessions (``ppow_trl.drafting``) prefill contexts here: each row is
left-padded and gets explicit position ids, so it sees the positions it would see alone.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

from .padding import pad_sequences


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


def prefill_contexts(model, contexts, pad_id, num_samples_per_context):
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


def shift_rows(rows: torch.Tensor, shift: int) -> torch.Tensor:
    """``rows[shift:]`` padded with zero rows at the end to the same length (slot ``k`` of teacher-forced windows
    of a drafter whose state is the text itself: row ``s + k`` of one pass)."""
    out = torch.zeros_like(rows)
    if shift < rows.shape[0]:
        out[: rows.shape[0] - shift] = rows[shift:]
    return out
