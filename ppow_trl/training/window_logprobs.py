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
import functools

import torch
from ._trl_compat import chunked_logprobs
from ..drafter import ReducedVocabHeadMixin

# Config attributes that change the logits in ways this path does not reproduce (TRL's path handles them).
_UNSUPPORTED_LOGIT_SCALES = ("output_multiplier", "lm_head_multiplier", "logits_scaling")


def head_rows_and_labels(head: torch.nn.Module, draft_vocab_ids: torch.Tensor | None,
                         vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The head rows the rollout samples from, and a lookup table target id -> position among them.

    Returns ``rows`` (R,) head-row indices and ``lookup`` (W,) with ``lookup[id]`` the position of token
    ``id`` in ``rows`` or -100 when the drafter cannot propose it. Full head (``draft_vocab_ids`` None):
    ``rows = 0..V-1`` (padding rows of a head wider than the tokenizer are excluded). Reduced-vocabulary head
    (``draft_vocab_ids``): the draft rows whose id is below ``V``.
    """
    device = head.weight.device
    if draft_vocab_ids is None:
        if vocab_size > head.weight.shape[0]:
            raise ValueError(f"vocab_size {vocab_size} exceeds the drafter head's {head.weight.shape[0]} rows.")
        rows = torch.arange(vocab_size, device=device)
        token_ids = rows
    else:
        rows = (draft_vocab_ids < vocab_size).nonzero().squeeze(-1).to(device)
        token_ids = draft_vocab_ids[rows].to(device)
    lookup = torch.full((max(vocab_size, int(token_ids.max()) + 1),), -100, dtype=torch.long, device=device)
    lookup[token_ids] = torch.arange(len(rows), device=device)
    return rows, lookup


def window_labels(head: torch.nn.Module, draft_vocab_ids: torch.Tensor | None, window_ids: torch.Tensor,
                  window_mask: torch.Tensor, vocab_size: int):
    """``(rows, labels, valid)``: the head rows the rollout sampled from, each window token's position among them
    and the real (unpadded) window slots. A real token the drafter cannot propose is an error (it was not sampled)."""
    rows, lookup = head_rows_and_labels(head, draft_vocab_ids, vocab_size)
    ids = window_ids.to(lookup.device)
    inside = (ids >= 0) & (ids < len(lookup))  # an id past the table is outside the vocabulary, not the last row
    labels = torch.where(inside, lookup[ids.clamp(0, len(lookup) - 1)], -100).to(window_ids.device)
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


def window_logprobs(
    drafter,
    family,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    num_window_tokens: int,
    *,
    vocab_size: int,
    temperature: float,
    target=None,
    context_features=None,
    compute_entropy: bool = False,
    cast_lm_head_to_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log softmax(z / T)[y_i]`` (and the entropy) at the last ``num_window_tokens`` positions. ``(B, C)``.

    ``input_ids``/``attention_mask`` are TRL's ``[left-padded context | right-padded window]`` rows, ``C =
    num_window_tokens``. ``drafter`` is the model itself (this runs inside its forward, so DDP and PEFT wrappers stay
    in the call chain); ``family`` (``ppow_trl.drafting``) gives the states ``window_hidden`` of each window position
    with every distinct context computed once, and the head that projects them (``output_head``);
    ``context_features(contexts)`` the target's features a feature-conditioned drafter drafted from. Padding positions
    of the window get 0. ``cast_lm_head_to_fp32``: the head runs in float32 outside autocast, as TRL's fused head
    does with that option. The projection is TRL's chunked kernel: no ``(B, C, V)`` logits are built.
    """
    width = input_ids.shape[1] - num_window_tokens
    prompt_ids, prompt_mask = input_ids[:, :width], attention_mask[:, :width]
    window_ids, window_mask = input_ids[:, width:], attention_mask[:, width:]
    first_row, inverse = group_contexts(prompt_ids, prompt_mask)
    contexts = [prompt_ids[row][prompt_mask[row].bool()] for row in first_row.tolist()]
    features = context_features(contexts) if family.target_layer_ids(drafter) is not None else None
    hidden = family.window_hidden(drafter, contexts, inverse, window_ids, target=target, features=features)

    head = family.output_head(drafter, target)
    rows, labels, valid = window_labels(head, getattr(drafter, "draft_vocab_ids", None), window_ids.to(head.weight.device),
                                        window_mask.to(head.weight.device), vocab_size)
    weight = head.weight if len(rows) == head.weight.shape[0] else head.weight[rows]
    bias = None if head.bias is None else (head.bias if len(rows) == head.bias.shape[0] else head.bias[rows])
    softcap, scale = logit_transform(drafter)
    hidden = hidden.to(weight.device)
    autocast = contextlib.nullcontext()
    if cast_lm_head_to_fp32:
        hidden, autocast = hidden.float(), torch.autocast(hidden.device.type, enabled=False)
    outputs = ("log_probs", "entropy") if compute_entropy else ("log_probs",)
    with autocast:
        log_probs, entropy, *_ = chunked_logprobs(
            hidden[valid], weight, bias, labels[valid], temperature, softcap, scale, outputs,
        )
    # masked_scatter keeps an all-padding batch connected to the graph (a differentiable zero)
    log_probs = log_probs.new_zeros(valid.shape).masked_scatter(valid, log_probs)
    if entropy is not None:
        entropy = entropy.new_zeros(valid.shape).masked_scatter(valid, entropy)
    return log_probs, entropy


def install_loss_route(drafter, family, target, *, vocab_size: int, shared_context: bool, context_features) -> None:
    """Two routes into the drafter's own ``forward`` (the innermost model's, where TRL put its fused head), so they
    run inside DDP's and PEFT's ``forward`` like every training forward:

    - ``ppow_window_logprobs={...}``: ``window_logprobs`` (the loss path), from the family's ``window_hidden``;
      ``context_features(contexts)`` gives a feature-conditioned drafter the target's features it drafted from;
    - TRL's fused head (``fused_lm_head=True``, used when ``shared_context=False``): for a reduced-vocabulary
      drafter, target-id labels are mapped to draft rows first, else the log-probs are silently wrong
      (docs/design/trainer-notes.md, section 0). Only a standalone causal LM over the target's vocabulary has it.

    Bad set-ups are refused here, before training: a LoRA on the head, TRL's path for a drafter that needs features
    or whose head has rows the rollout never samples.
    """
    head = family.output_head(drafter, target)
    if hasattr(head, "lora_A"):
        # Both loss paths project with head.weight, the frozen base weight: a LoRA delta on the head would shape the
        # sampled q but never the loss.
        raise ValueError(
            "LoRA on the drafter's output head is not supported: the loss uses the head's weight, not the adapter's "
            "delta. Leave lm_head out of target_modules (or train it fully with modules_to_save=['lm_head'])."
        )
    reduced = isinstance(drafter, ReducedVocabHeadMixin)
    if not shared_context:
        if family.target_layer_ids(drafter) is not None:
            raise ValueError(f"A {family.description} has no TRL generic loss path (its forward needs the target's "
                             "features): keep shared_context_logprobs=True.")
        head_rows = head.weight.shape[0]
        if not reduced and head_rows != vocab_size:
            raise ValueError(
                f"The drafter's head has {head_rows} rows but the shared vocabulary is {vocab_size}: TRL's generic "
                "loss path normalises over every row while the rollout samples over the first "
                f"{vocab_size}, so the log-probs would not be those sampled. Keep shared_context_logprobs=True."
            )
    inner_forward = drafter.forward

    @functools.wraps(inner_forward)
    def forward(*args, ppow_window_logprobs=None, **kwargs):
        if ppow_window_logprobs is not None:
            return window_logprobs(drafter, family, kwargs["input_ids"], kwargs["attention_mask"], target=target,
                                   context_features=context_features, **ppow_window_logprobs)
        if reduced and kwargs.get("fused_lm_head") and kwargs.get("labels") is not None:
            kwargs["labels"] = drafter.draft_index(kwargs["labels"])
        return inner_forward(*args, **kwargs)

    drafter.forward = forward
    drafter._ppow_window_logprobs = True
