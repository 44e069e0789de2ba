"""The target's forwards and hidden-state features, for every drafter family and loop (family-neutral).

A feature-conditioned drafter (EAGLE-3 heads, DFlash blocks) reads the target's hidden states at a few
``output_hidden_states`` indices, concatenated. The loops get them from the forward that verified the tokens
(``target_forward`` / ``forward_at``), so no second target pass runs in generation; training and scoring get
them teacher-forced (``target_features``, ``context_features``). Standalone drafters pass ``layer_ids=None``
and get plain forwards.
"""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache

from .batching import left_pad, positions_from_mask


def select_features(hidden_states: tuple[torch.Tensor, ...], layer_ids: list[int]) -> torch.Tensor:
    """``cat(hidden_states[i] for i in layer_ids)`` along the last axis: ``(B, T, len(layer_ids) * H)``.

    ``hidden_states`` is a model output's ``hidden_states`` tuple (``output_hidden_states=True``): index 0 is the
    embedding output, index ``i`` the output of decoder layer ``i - 1``.
    """
    if max(layer_ids) >= len(hidden_states):
        raise ValueError(f"target_layer_ids {layer_ids} exceed the target's {len(hidden_states)} hidden states.")
    return torch.cat([hidden_states[i] for i in layer_ids], dim=-1)


_NOT_A_RUNTIME = object()


def target_forward(target, layer_ids: list[int] | None, **forward_kwargs):
    """``target(**forward_kwargs)`` and, when ``layer_ids`` is given, the features of its input positions.

    Returns ``(output, features or None)``. One forward gives both the verification logits and the features the
    drafter reads next (no second target pass). ``output_hidden_states`` keeps every layer's states of this call
    until it returns; only the selected ones are kept. A compiled runtime built to return these layers
    (``CompiledCausalLM(feature_layers=...)``) returns them from its graphs (``return_features``), which
    ``output_hidden_states`` would send to the eager model.
    """
    if layer_ids is None:
        return target(**forward_kwargs), None
    served = getattr(target, "feature_layers", _NOT_A_RUNTIME)
    if served == list(layer_ids):
        output = target(**forward_kwargs, return_features=True)
        return output, output.features
    if served is not _NOT_A_RUNTIME:
        # a compiled runtime built for other layers (or none): correct, but every verify pass runs eagerly
        warnings.warn(f"This compiled runtime returns the hidden states {served}, not {list(layer_ids)}: every forward "
                      "that reads features runs the eager model. Build it with serving_runtime(target, drafter), or "
                      "CompiledCausalLM(..., feature_layers=ppow_trl.drafting.target_layer_ids(drafter)).",
                      stacklevel=2)
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
    device = next(target.parameters()).device
    ids, mask = left_pad(contexts, pad_id)
    ids, mask = ids.to(device), mask.to(device)
    features = target_features(target, ids, mask, layer_ids, position_ids=positions_from_mask(mask))
    return [row[-len(context):] for row, context in zip(features, contexts)]


def forward_at(model, tokens: list[int], cache, start: int, feature_layers: list[int] | None = None, **kwargs):
    """Forward ``tokens`` (one sequence) at positions ``start..`` after a cache holding exactly ``start`` positions.

    Returns ``(output, features)``: the model output (``cache`` set) and, with ``feature_layers``, the hidden
    states a feature-conditioned drafter reads (``target_forward``), else ``None``. The loops' single entry to a
    forward over one sequence: the target's verification and the standalone drafter's steps.
    """
    cached = 0 if cache is None else cache.get_seq_length()
    if cached != start:  # an internal invariant: caches must hold exactly the committed prefix
        raise RuntimeError(f"KV cache holds {cached} positions, expected {start}.")
    device = next(model.parameters()).device
    # a compiled runtime (ppow_trl.compiled_runtime.compiled): its static cache
    if cache is None and hasattr(model, "new_cache"):
        cache = model.new_cache()
    elif cache is None:
        # Sliding-window (and other bounded) cache layers only allow rolling back after a rejection when
        # they record past states, as transformers' own assisted decoding arranges.
        cache = DynamicCache(config=model.config.get_text_config())
        cache.activate_past_recording()
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
    # No attention mask: one unpadded sequence attends to its whole cache, as in generate's decoding steps (which
    # drop an all-ones mask). Timed in isolation, with or without a mask the SmolLM2 step costs the same.
    return target_forward(model, feature_layers, input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                          **kwargs)


class RolloutFeatures:
    """The target's features of the contexts a rollout drafted from, kept for the loss that replays those windows
    (a drafter reading the target's hidden states): ``keep(contexts)`` computes and remembers them, calling the object
    with contexts returns theirs (computing the ones not kept, e.g. a reference model's or an evaluation's)."""

    def __init__(self, target, layer_ids: list[int] | None, pad_id: int | None = 0):
        self.target, self.layer_ids, self.pad_id = target, layer_ids, pad_id or 0
        self.kept: dict[tuple, torch.Tensor] = {}

    def keep(self, contexts: list[torch.Tensor]) -> list[torch.Tensor]:
        features = context_features(self.target, contexts, self.layer_ids, self.pad_id)
        self.kept = {tuple(c.tolist()): f for c, f in zip(contexts, features)}
        return features

    def __call__(self, contexts: list[torch.Tensor]) -> list[torch.Tensor]:
        missing = [c for c in contexts if tuple(c.tolist()) not in self.kept]
        if missing:
            computed = context_features(self.target, missing, self.layer_ids, self.pad_id)
            self.kept = {**self.kept, **{tuple(c.tolist()): f for c, f in zip(missing, computed)}}
        return [self.kept[tuple(c.tolist())] for c in contexts]
