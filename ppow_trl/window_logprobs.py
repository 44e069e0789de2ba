"""Log-probabilities of drafted windows for the loss, with each context computed once per group.

GRPO's loss needs ``log q_theta(y_i | c, y_<i)`` for every token of every window. TRL's generic path runs
the drafter over ``context + window`` for each of the G windows of a context, so the context (hundreds
of tokens) is recomputed G times for windows of at most K tokens. Here the distinct contexts of a
micro-batch run once (with gradients), their KV cache is repeated for the windows that share them, and
one more forward runs the windows on top of it. The log-probs and their gradients are those of the
generic path (the repeated cache is part of the autograd graph, so the context's parameters receive the
sum over the G windows exactly as before); only the repeated work is gone.

The head is applied to the shared vocabulary only: ``q`` is normalised over the rows the rollout
sampled from (``logits[..., :V]`` for a drafter whose head has padding rows beyond the tokenizer, the
draft rows for a reduced-vocabulary drafter), so the training log-probs equal the sampled ones. The
projection uses TRL's chunked log-prob kernel, which never materialises the ``(rows, K, V)`` logits.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from trl.kernels import ChunkedLogProbFunction
from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

from .rollout import positions_from_mask

# Config attributes that change the logits in ways this path does not reproduce (TRL's path handles them).
_UNSUPPORTED_LOGIT_SCALES = ("output_multiplier", "lm_head_multiplier", "logits_scaling")


def head_rows_and_labels(model, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head rows the rollout samples from, and a lookup table target id -> position among them.

    Returns ``rows`` (R,) head-row indices and ``lookup`` (W,) with ``lookup[id]`` the position of token
    ``id`` in ``rows`` or -100 when the drafter cannot propose it. Plain drafter: ``rows = 0..V-1`` (padding
    rows of a head wider than the tokenizer are excluded). Reduced-vocabulary drafter
    (``draft_vocab_ids``): the draft rows whose id is below ``V``.
    """
    head = model.get_output_embeddings()
    device = head.weight.device
    draft_ids = getattr(model, "draft_vocab_ids", None)
    if draft_ids is None:
        if vocab_size > head.weight.shape[0]:
            raise ValueError(f"vocab_size {vocab_size} exceeds the drafter head's {head.weight.shape[0]} rows.")
        rows = torch.arange(vocab_size, device=device)
        token_ids = rows
    else:
        rows = (draft_ids < vocab_size).nonzero().squeeze(-1).to(device)
        token_ids = draft_ids[rows].to(device)
    lookup = torch.full((max(vocab_size, int(token_ids.max()) + 1),), -100, dtype=torch.long, device=device)
    lookup[token_ids] = torch.arange(len(rows), device=device)
    return rows, lookup


def window_labels(model, window_ids: torch.Tensor, window_mask: torch.Tensor, vocab_size: int):
    """``(rows, labels, valid)``: the head rows the rollout sampled from, each window token's position among them
    and the real (unpadded) window slots. A real token the drafter cannot propose is an error (it was not sampled)."""
    rows, lookup = head_rows_and_labels(model, vocab_size)
    labels = lookup[window_ids.clamp(0, len(lookup) - 1).to(lookup.device)].to(window_ids.device)
    valid = window_mask.bool()
    if (labels[valid] < 0).any():
        raise ValueError("A window token lies outside the drafter's vocabulary: it cannot have been sampled from it.")
    return rows, labels, valid


def logit_transform(model) -> tuple[float | None, float]:
    """``(final_logit_softcapping, logit_scale)`` of the model's text config (None / 1.0 when absent)."""
    config = model.config.get_text_config()
    for name in _UNSUPPORTED_LOGIT_SCALES:
        if getattr(config, name, None) not in (None, 1.0):
            raise NotImplementedError(
                f"The drafter's config sets {name}; the shared-context loss path does not apply it. Set "
                "PPOWConfig(shared_context_logprobs=False) to use TRL's generic path."
            )
    scale = getattr(config, "logit_scale", None)
    return getattr(config, "final_logit_softcapping", None), 1.0 if scale is None else scale


def group_contexts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct contexts of a batch: ``(first_row, inverse)`` with ``prompt_ids[first_row[inverse]] == prompt_ids``.

    Rows are equal when their (left-padded) ids and masks are; ``first_row`` keeps the first row of each,
    in order of first appearance.
    """
    keys = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=-1)
    _, inverse = torch.unique(keys, dim=0, return_inverse=True)
    # the first row of each distinct key, ordered by first appearance (deterministic, independent of sorting)
    first = torch.full((int(inverse.max()) + 1,), keys.shape[0], dtype=torch.long, device=keys.device)
    first.scatter_reduce_(0, inverse, torch.arange(keys.shape[0], device=keys.device), reduce="amin")
    order = torch.argsort(first)
    relabel = torch.empty_like(order)
    relabel[order] = torch.arange(len(order), device=order.device)
    return first[order], relabel[inverse]


def shared_context_window_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_window_tokens: int,
    *,
    vocab_size: int,
    temperature: float,
    compute_entropy: bool = False,
    cast_lm_head_to_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z / T)[y_i]`` (and the entropy) at the last ``num_window_tokens`` positions. ``(B, C)``.

    ``input_ids``/``attention_mask`` are TRL's ``[left-padded context | right-padded window]`` rows, ``C =
    num_window_tokens``. ``model`` is the causal LM itself (its forward is where this runs, so DDP and PEFT
    wrappers stay in the call chain). Padding positions of the window get 0. ``cast_lm_head_to_fp32``: the head
    runs in float32 outside autocast, as TRL's fused head does with that option.
    """
    width = input_ids.shape[1] - num_window_tokens
    prompt_ids, prompt_mask = input_ids[:, :width], attention_mask[:, :width]
    window_ids, window_mask = input_ids[:, width:], attention_mask[:, width:]
    first_row, inverse = group_contexts(prompt_ids, prompt_mask)

    backbone = model.base_model
    # Contexts once, with gradients; positions ignore the left padding, as in the rollout that sampled them.
    context_mask = prompt_mask[first_row]
    cache = DynamicCache(config=model.config.get_text_config())
    context_out = backbone(input_ids=prompt_ids[first_row], attention_mask=context_mask,
                           position_ids=positions_from_mask(context_mask), cache=cache, use_cache=True)
    if cache.get_seq_length() != width:
        raise RuntimeError(
            "The drafter's forward did not fill the KV cache (activation checkpointing drops it in training): the "
            "windows would be scored without their context. Disable activation checkpointing on the drafter."
        )
    hidden = [context_out.last_hidden_state[:, -1:][inverse]]  # predicts y_1
    if num_window_tokens > 1:
        cache.batch_select_indices(inverse)  # differentiable indexing: each row reads its context's keys/values
        rows_mask = prompt_mask
        steps = window_ids[:, :-1]
        full_mask = torch.cat([rows_mask, window_mask[:, :-1]], dim=-1)
        positions = rows_mask.sum(-1, keepdim=True) + torch.arange(num_window_tokens - 1, device=steps.device)
        window_out = backbone(input_ids=steps, attention_mask=full_mask, position_ids=positions, cache=cache,
                              use_cache=True)
        hidden.append(window_out.last_hidden_state)  # predicts y_2..y_C
    hidden = torch.cat(hidden, dim=1)

    rows, labels, valid = window_labels(model, window_ids, window_mask, vocab_size)
    head = model.get_output_embeddings()
    weight = head.weight if len(rows) == head.weight.shape[0] else head.weight[rows]
    bias = None if head.bias is None else (head.bias if len(rows) == head.bias.shape[0] else head.bias[rows])
    softcap, scale = logit_transform(model)
    hidden = hidden.to(weight.device)
    autocast = contextlib.nullcontext()
    if cast_lm_head_to_fp32:
        hidden, autocast = hidden.float(), torch.autocast(hidden.device.type, enabled=False)
    outputs = ("log_probs", "entropy") if compute_entropy else ("log_probs",)
    with autocast:
        log_probs, entropy, *_ = ChunkedLogProbFunction.apply(
            hidden[valid], weight, bias, labels[valid], temperature, _CHUNKED_LOGPROB_CHUNK_SIZE, softcap, scale,
            outputs,
        )
    # masked_scatter keeps an all-padding batch connected to the graph (a differentiable zero)
    log_probs = log_probs.new_zeros(valid.shape).masked_scatter(valid, log_probs)
    if entropy is not None:
        entropy = entropy.new_zeros(valid.shape).masked_scatter(valid, entropy)
    return log_probs, entropy


def chain_window_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_window_tokens: int,
    *,
    vocab_size: int,
    temperature: float,
    context_features,
    compute_entropy: bool = False,
    cast_lm_head_to_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``shared_context_window_logprobs`` for a feature-conditioned chain drafter (``ppow_trl.eagle3``).

    The drafter replays what the rollout did (``ppow_trl.drafting.ChainSession``), with gradients: each distinct
    context's pairs ``(h_j, c_{j+1})`` once (``context_features(contexts)`` gives the target's features, the ones the
    rollout drafted from), its cache repeated for the windows that share it, then one step per window token on the
    drafter's own hidden state. ``log q(y_i)`` is the log-softmax at ``temperature`` over the draft rows the rollout
    sampled from (ids below ``vocab_size``), so it equals the sampled log-probability.
    """
    from .batching import left_pad

    width = input_ids.shape[1] - num_window_tokens
    prompt_ids, prompt_mask = input_ids[:, :width], attention_mask[:, :width]
    window_ids, window_mask = input_ids[:, width:], attention_mask[:, width:]
    first_row, inverse = group_contexts(prompt_ids, prompt_mask)
    contexts = [prompt_ids[row][prompt_mask[row].bool()] for row in first_row.tolist()]
    features = context_features(contexts)
    device = model.fc.weight.device if hasattr(model, "fc") else input_ids.device
    ids, mask = left_pad([c[1:] for c in contexts], 0)
    pairs = ids.shape[1]
    feats = torch.stack([torch.nn.functional.pad(f[: len(c) - 1].to(device), (0, 0, pairs - len(c) + 1, 0))
                         for f, c in zip(features, contexts)])
    ids, mask = ids.to(device), mask.to(device)
    positions = positions_from_mask(mask)
    out = model(input_ids=ids, target_hidden_states=feats, attention_mask=mask, position_ids=positions, use_cache=True,
                logits_to_keep=1, full_vocab_logits=False)
    cache, hidden = out.cache, out.hidden_states[:, -1:][inverse]
    cache.batch_select_indices(inverse)  # differentiable: each window reads its context's keys and values
    mask, position = mask[inverse], positions[:, -1:][inverse]
    logits = [out.draft_logits[:, -1][inverse]]
    for step in range(num_window_tokens - 1):
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        position = position + 1
        out = model(input_ids=window_ids[:, step : step + 1].to(device), hidden_states=hidden, attention_mask=mask,
                    position_ids=position, cache=cache, use_cache=True, full_vocab_logits=False)
        cache, hidden = out.cache, out.hidden_states
        logits.append(out.draft_logits[:, -1])
    logits = torch.stack(logits, dim=1)  # (B, C, draft rows)

    rows, labels, valid = window_labels(model, window_ids.to(device), window_mask.to(device), vocab_size)
    logits = logits[..., rows]
    if cast_lm_head_to_fp32:
        logits = logits.float()
    log_q = torch.log_softmax(logits / temperature, dim=-1)
    log_probs = log_q.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * valid
    entropy = None
    if compute_entropy:
        entropy = -(log_q.exp() * log_q).sum(-1) * valid
    return log_probs, entropy


def block_window_logprobs(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_window_tokens: int,
    *,
    vocab_size: int,
    temperature: float,
    context_features,
    target,
    compute_entropy: bool = False,
    cast_lm_head_to_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``shared_context_window_logprobs`` for a DFlash block drafter (``ppow_trl.dflash``).

    One block per distinct context, anchored at its last token and reading the target's features of the others
    (``context_features(contexts)``, the ones the rollout drafted from), with gradients; slot ``i`` through the
    target's frozen head gives ``q_i``, which does not depend on the drafted ``y_<i``, so every window of a context
    reads the same block. ``log q(y_i)`` is the log-softmax at ``temperature`` over the first ``vocab_size`` ids,
    the distribution the rollout sampled from.
    """
    from .drafting import block_after_contexts

    width = input_ids.shape[1] - num_window_tokens
    prompt_ids, prompt_mask = input_ids[:, :width], attention_mask[:, :width]
    window_ids, window_mask = input_ids[:, width:], attention_mask[:, width:]
    first_row, inverse = group_contexts(prompt_ids, prompt_mask)
    contexts = [prompt_ids[row][prompt_mask[row].bool()] for row in first_row.tolist()]
    hidden = block_after_contexts(model, target.get_input_embeddings(), contexts, context_features(contexts))
    head = target.get_output_embeddings()
    hidden = hidden[:, 1 : 1 + num_window_tokens].to(head.weight.device)
    if cast_lm_head_to_fp32:
        hidden = hidden.float()
    weight = head.weight[:vocab_size].to(hidden.dtype)
    bias = None if head.bias is None else head.bias[:vocab_size].to(hidden.dtype)
    logits = torch.nn.functional.linear(hidden, weight, bias)[inverse]  # (B, C, vocab_size)
    log_q = torch.log_softmax(logits / temperature, dim=-1)
    valid = window_mask.bool().to(log_q.device)
    labels = window_ids.to(log_q.device).clamp(0, vocab_size - 1)
    log_probs = log_q.gather(-1, labels.unsqueeze(-1)).squeeze(-1) * valid
    entropy = None
    if compute_entropy:
        entropy = -(log_q.exp() * log_q).sum(-1) * valid
    return log_probs, entropy
