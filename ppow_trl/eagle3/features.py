"""The target's features that an EAGLE-3 drafter reads: hidden states of a few layers, concatenated."""

from __future__ import annotations

import torch


def select_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """``cat(hidden_states[i] for i in layer_ids)`` along the last axis: ``(B, T, len(layer_ids) * H)``.

    ``hidden_states`` is a model output's ``hidden_states`` tuple (``output_hidden_states=True``): index 0 is the
    embedding output, index ``i`` the output of decoder layer ``i - 1``.
    """
    if max(layer_ids) >= len(hidden_states):
        raise ValueError(f"target_layer_ids {layer_ids} exceed the target's {len(hidden_states)} hidden states.")
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


def target_forward(target, layer_ids: list[int] | None, **forward_kwargs):
    """``target(**forward_kwargs)`` and, when ``layer_ids`` is given, the features of its input positions.

    Returns ``(output, features or None)``. One forward gives both the verification logits and the features the
    drafter reads next (no second target pass). ``output_hidden_states`` keeps every layer's states of this call
    until it returns; only the selected ones are kept.
    """
    if layer_ids is None:
        return target(**forward_kwargs), None
    output = target(**forward_kwargs, output_hidden_states=True)
    features = select_features(output.hidden_states, layer_ids)
    output.hidden_states = None
    return output, features


@torch.no_grad()
def target_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    layer_ids: list[int] | None = None, **forward_kwargs) -> torch.Tensor:
    """Teacher-forced features of every position of ``input_ids`` ``(B, T)``: ``(B, T, len(layer_ids) * H)``.

    ``forward_kwargs`` go to the target (e.g. ``position_ids`` for left-padded rows); ``logits_to_keep=1`` is
    added so no ``(B, T, V)`` logits are built.
    """
    forward_kwargs.setdefault("logits_to_keep", 1)
    _, features = target_forward(target, layer_ids, input_ids=input_ids, attention_mask=attention_mask,
                                 **forward_kwargs)
    return features


@torch.no_grad()
def context_features(target, contexts: list[torch.Tensor], layer_ids: list[int], pad_id: int = 0) -> list[torch.Tensor]:
    """Features of every token of each context, ``[(len(c), F)]``, from one left-padded teacher-forced forward."""
    from ..batching import left_pad, positions_from_mask

    device = next(target.parameters()).device
    ids, mask = left_pad(contexts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    features = target_features(target, ids, mask, layer_ids, position_ids=positions_from_mask(mask))
    return [row[-len(context):] for row, context in zip(features, contexts)]
