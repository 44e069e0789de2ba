"""Token-level distillation (KD) of a drafter on cached target top-k distributions.

The KD baseline of the study and PPOW's warm start (docs/ppow.md "Baselines"; trainer-notes §7): the drafter
learns the target's next-token distribution along target-generated responses, by forward KL against the
target's top-k log-probabilities stored by `ppow_trl.data.compute_target_topk`. No teacher is held in memory,
and reduced-vocabulary drafters (`PPOWDrafterForCausalLM`, also inside a `PeftModel`) are supported; TRL's
`DistillationTrainer`/`GKDTrainer` need a live teacher with the same head and break on those.

Loss, per response position (teacher top-k ids ``S`` with log-probabilities ``l``, temperature 1, as stored;
drafter ``q = softmax(draft_logits / temperature)`` over its own output columns):

- Teacher ids the drafter cannot output (outside its draft vocabulary, or past its logits' width) have
  ``q = 0``; let ``S_in`` be the top-k ids it can output.
- ``tail_bucket=True`` (default): ``p_j = exp(l_j)`` on ``S_in`` plus one "rest" class holding
  ``p_rest = 1 - sum_{S_in} exp(l_j)`` (the teacher's mass beyond its top-k *and* on ids the drafter cannot
  output); the drafter's rest class is ``q_rest = sum_{v not in S_in} q_v`` (computed exactly, as a
  logsumexp over the other columns, not as ``1 - sum``). The loss is ``KL(p || q)`` over these
  ``|S_in| + 1`` classes. Both sides are proper distributions, so it is >= 0 and 0 iff they agree.
- ``tail_bucket=False``: the teacher is renormalised over ``S_in`` (mass on ids the drafter cannot output is
  dropped): ``p_j = exp(l_j) / sum_{S_in} exp(l)``; the drafter is *not* renormalised:
  ``KL = sum_{S_in} p_j (log p_j - log q_j)``, which is the KL between ``p`` (zero outside ``S_in``) and the
  drafter's full softmax, so mass the drafter puts outside the teacher's top-k is penalised too. Positions
  where no top-k id is in the draft vocabulary contribute 0.

Numerics: everything in float32 and log space; a teacher rest mass below `TAIL_EPSILON` (the rounding noise
of summing float32 probabilities; e.g. when ``k`` equals the vocabulary size) counts as 0, and ``log q_rest``
is clamped at the log of the smallest normal float32, as in `ppow_trl.core.rewards.kl_divergence` (a drafter whose
output columns are all in ``S_in`` has no rest mass, and the teacher's mass there cannot be learnt). Draft
logits (`full_vocab_logits=False`) are used, so no ``-inf`` logit reaches the softmax.

Reduction: the loss is the sum of the per-token KL over response tokens divided by the number of response
tokens in the (gradient-accumulated) batch, as transformers does for cross-entropy: the collator adds
standard ``labels`` (``-100`` outside response tokens) only so that the `Trainer` can count them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel, Trainer, TrainingArguments

from ..drafter import ReducedVocabHeadMixin
from ..drafting import family_of, load_drafter
from ..utils import unwrap_model
from .logged_metrics import TAU

# Columns the trainer reads (from `ppow_trl.data.build_target_responses` + `compute_target_topk`).
KD_COLUMNS = ("prompt_ids", "response_ids", "topk_ids", "topk_logprobs")
# Teacher rest mass below this is float32 rounding noise of `1 - sum(exp(topk_logprobs))` and counts as 0.
TAIL_EPSILON = 1e-6
_LOG_FLOOR = math.log(torch.finfo(torch.float32).tiny)
_MISSING_COLUMNS_HINT = (
    "build them with `ppow_trl.data.build_target_responses` and then `ppow_trl.data.compute_target_topk`"
)


@dataclass
class KDConfig(TrainingArguments):
    r"""
    Configuration class for the [`KDTrainer`]: token-level distillation of a drafter on cached target top-k
    distributions (`ppow_trl.data.compute_target_topk`).

    Only the parameters specific to KD are listed here; see [`~transformers.TrainingArguments`] for the others.

    Parameters:
        temperature (`float`, *optional*, defaults to `1.0`):
            Temperature of the drafter's softmax in the loss, `q = softmax(draft_logits / temperature)`. The
            teacher's cached log-probabilities are at temperature 1.
        loss (`str`, *optional*, defaults to `"forward_kl"`):
            Per-position loss: `"forward_kl"` (imitation, `topk_forward_kl`) or `"tv"` (total variation
            `1 - sum_v min(p, q)`, `topk_total_variation`: maximises the expected acceptance rate directly).
        tail_bucket (`bool`, *optional*, defaults to `True`):
            Whether to add the teacher's mass outside its top-k (and on ids outside the drafter's vocabulary) as
            one extra "rest" class, compared with the drafter's mass outside those ids. If `False`, the teacher's
            top-k distribution is renormalised over the ids the drafter can output.
        bf16_autocast (`bool`, *optional*, defaults to `False`):
            Run the drafter's forward (and so its backward) under ``torch.autocast(bfloat16)``; the weights, the
            optimizer and the loss stay float32. About 1.6x the trained tokens per second on CPUs with avx512_bf16 or
            AMX (``benchmarks/results/trainer_throughput.json``). Unlike ``bf16=True`` it needs no mixed-precision
            ``Accelerator``, so it works on a CPU and inside a launch whose accelerate state is already set up.
        ttt_steps (`int`, *optional*, defaults to `3`):
            Feature-conditioned (EAGLE-3) drafters only: EAGLE-3's training-time test. The drafter is unrolled
            ``n`` drafting steps on its own hidden states (``Eagle3DrafterForCausalLM.unroll``); step ``k`` at the
            position predicting response token ``t`` is the KD loss of window slot ``k + 1`` against the teacher
            at ``t``. Ignored for standalone drafters (their slot ``k`` is their step 0 at a later position).
        ttt_decay (`float`, *optional*, defaults to `0.8`):
            Loss weight ``ttt_decay ** k`` of step ``k`` (SpecForge's value); the loss is
            ``sum_k w_k * mean KL_k / sum_k w_k``.
        block_anchors (`int`, *optional*, defaults to `32`):
            DFlash block drafters only (``ppow_trl.drafters.dflash``): the anchored-block objective. Per sequence, up to this
            many anchors ``a`` are drawn without replacement among the positions predicting a response token; the
            block anchored at ``a`` reads the target's features of positions ``< a`` and itself bidirectionally, and
            its slot ``k`` (``1 .. block_size - 1``) is scored against the teacher at position ``a + k - 1`` (the
            distribution of token ``a + k``), where that position predicts a response token.
        block_decay_gamma (`float`, *optional*, defaults to `4.0`):
            Slot ``k``'s weight ``w_k = exp(-(k - 1) / gamma)`` (DFlash's position decay); the loss is
            ``sum_k w_k * mean KL_k / sum_k w_k`` like TTT's.
        eval_tau_window (`int`, *optional*, defaults to `0`):
            K of `eval_tau`: exact greedy tau at fixed windows of K tokens (h = 0) over the eval rows' prompts, with
            their `response_ids` as the target's greedy text (needs `target=`). Usable as `metric_for_best_model`, e.g.
            with transformers' `EarlyStoppingCallback`. 0: no `eval_tau` (the eval rows then need the KD columns).
        eval_max_new_tokens (`int`, *optional*, defaults to `128`):
            Tokens per eval prompt for `eval_tau` (the eval responses' generation length).
        max_length (`int` or `None`, *optional*, defaults to `1024`):
            Maximum length of `prompt_ids + response_ids`. Longer examples lose the start of their prompt (at
            least one prompt token is kept; a response alone longer than that loses its end). `None`: no
            truncation.

    > [!NOTE]
    > These parameters have default values different from [`~transformers.TrainingArguments`]:
    > - `logging_steps`: defaults to `10` instead of `500`.
    > - `remove_unused_columns`: defaults to `False` instead of `True` (the collator reads the dataset's
    >   `prompt_ids`, `response_ids`, `topk_ids` and `topk_logprobs` columns, which are no model inputs).
    """

    logging_steps: float = field(
        default=10,
        metadata={
            "help": "Log every X updates steps. Should be an integer or a float in range `[0,1)`. If smaller than 1, "
            "will be interpreted as ratio of total training steps."
        },
    )
    remove_unused_columns: bool = field(
        default=False,
        metadata={"help": "Keep the dataset columns: the KD collator reads the token ids and the teacher top-k."},
    )
    temperature: float = field(
        default=1.0,
        metadata={
            "help": "Temperature of the drafter's softmax in the loss (the teacher's top-k is at temperature 1)."
        },
    )
    loss: str = field(
        default="forward_kl",
        metadata={
            "help": "'forward_kl' (imitate the target: KL(p || q)) or 'tv' (maximise the expected acceptance rate "
            "sum_v min(p, q), the direct acceptance objective)."
        },
    )
    tail_bucket: bool = field(
        default=True,
        metadata={
            "help": "Add the teacher's mass outside its top-k as one extra 'rest' class, compared with the "
            "drafter's mass outside those ids; else renormalise the teacher over its top-k."
        },
    )
    bf16_autocast: bool = field(
        default=False,
        metadata={"help": "Drafter forward/backward under torch.autocast(bfloat16); weights, optimizer and loss fp32."},
    )
    ttt_steps: int = field(
        default=3,
        metadata={
            "help": "Feature-conditioned (EAGLE-3) drafters only: drafting steps unrolled on the drafter's own "
            "hidden states (training-time test); step k learns window slot k + 1."
        },
    )
    ttt_decay: float = field(
        default=0.8,
        metadata={"help": "Weight of TTT step k is ttt_decay ** k (SpecForge's 0.8)."},
    )
    block_anchors: int = field(
        default=32,
        metadata={
            "help": "DFlash block drafters only: anchors (blocks) sampled per sequence among the positions predicting "
            "a response token."
        },
    )
    block_decay_gamma: float = field(
        default=4.0,
        metadata={"help": "DFlash block drafters only: slot k's loss weight is exp(-(k - 1) / gamma) (speculators' 4 "
                  "for blocks of 8; SpecForge uses 7 for blocks of 16)."},
    )
    eval_tau_window: int = field(
        default=0,
        metadata={
            "help": "K of `eval_tau`: exact greedy tau (fixed windows of K, h = 0) over the eval rows' prompts, with "
            "their `response_ids` as the target's greedy text (needs `target=`). Usable as `metric_for_best_model` "
            "with transformers' EarlyStoppingCallback. 0: no eval_tau (eval rows then need the KD columns)."
        },
    )
    eval_max_new_tokens: int = field(
        default=128,
        metadata={"help": "Tokens per eval prompt for `eval_tau` (the eval responses' generation length)."},
    )
    max_length: int | None = field(
        default=1024,
        metadata={
            "help": "Maximum length of prompt + response; longer examples are truncated from the left of the "
            "prompt. None: no truncation."
        },
    )

    def __post_init__(self):
        if self.loss not in ("forward_kl", "tv"):
            raise ValueError(f"loss must be 'forward_kl' or 'tv', got {self.loss!r}.")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}.")
        if self.block_anchors < 1:
            raise ValueError(f"block_anchors must be >= 1, got {self.block_anchors}.")
        if not self.block_decay_gamma > 0:
            raise ValueError(f"block_decay_gamma must be > 0, got {self.block_decay_gamma}.")
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps must be >= 1, got {self.ttt_steps}.")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay must lie in (0, 1], got {self.ttt_decay}.")
        if self.eval_tau_window < 0 or self.eval_max_new_tokens < 1:
            raise ValueError(f"eval_tau_window must be >= 0 and eval_max_new_tokens >= 1, got {self.eval_tau_window} "
                             f"and {self.eval_max_new_tokens}.")
        if self.max_length is not None and self.max_length < 2:
            raise ValueError(f"max_length must be at least 2 (a prompt and a response token), got {self.max_length}.")
        super().__post_init__()


# ---------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------


def with_lengths(dataset, args):
    """``dataset`` with the length column ``train_sampling_strategy="group_by_length"`` batches by (``len(prompt_ids)
    + len(response_ids)``), when that strategy is chosen and the column is missing: sequences of similar length share
    a batch, so little of a step's forward and backward is padding (transformers' sampler would otherwise read
    ``input_ids``, which these rows do not have)."""
    if getattr(args, "train_sampling_strategy", None) != "group_by_length":
        return dataset
    name = args.length_column_name
    if name in (getattr(dataset, "column_names", None) or []) or not hasattr(dataset, "add_column"):
        return dataset
    lengths = [len(p) + len(r) for p, r in zip(dataset["prompt_ids"], dataset["response_ids"])]
    return dataset.add_column(name, lengths)


def check_kd_columns(column_names: Sequence[str] | None, what: str = "dataset") -> None:
    """Raise a ValueError naming the builders if `column_names` lacks a KD column (None: unknown, not checked)."""
    if column_names is None:
        return
    missing = [name for name in KD_COLUMNS if name not in column_names]
    if missing:
        raise ValueError(
            f"KDTrainer's {what} lacks the columns {missing} (it has {sorted(column_names)}); {_MISSING_COLUMNS_HINT}."
        )


def _truncate(prompt: list[int], response: list[int], max_length: int | None) -> tuple[list[int], int]:
    """Cut `prompt + response` to `max_length`: the prompt's start first, then the response's end.

    Returns the kept prompt and the number of response tokens kept.
    """
    if max_length is None or len(prompt) + len(response) <= max_length:
        return prompt, len(response)
    kept_response = min(len(response), max_length - 1)  # the last prompt token predicts response[0]
    return prompt[len(prompt) - (max_length - kept_response) :], kept_response


@dataclass
class DataCollatorForKD:
    """Right-pad `prompt_ids + response_ids` and align the teacher's top-k with the positions predicting them.

    For an example with (kept) prompt length `P` and `R` response tokens, position `P - 1 + t` of the sequence
    predicts `response_ids[t]`; row `t` of `topk_ids`/`topk_logprobs` is the teacher's distribution there.

    Returns a batch of tensors:
        - `input_ids`, `attention_mask` `(B, L)`: right-padded with `pad_token_id`.
        - `labels` `(B, L)`: the response tokens at their own positions, `-100` elsewhere (the usual causal-LM
          convention; only used by the `Trainer` to count response tokens).
        - `completion_mask` `(B, L)` bool: the positions that predict a response token.
        - `teacher_topk_ids` (long) and `teacher_topk_logprobs` (float32) `(B, L, k)`: the teacher's top-k at
          those positions (zeros elsewhere).
        - `target_features` `(B, L, F)` float32, when the examples have that column
          (`ppow_trl.data.compute_target_features`): the target's features of each kept position (zeros on padding).
    """

    pad_token_id: int = 0
    max_length: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("DataCollatorForKD got an empty batch.")
        check_kd_columns(list(examples[0].keys()), "batch")
        rows, feature_rows, top_k = [], [], None
        for example in examples:
            prompt, response = list(example["prompt_ids"]), list(example["response_ids"])
            topk_ids, topk_logprobs = example["topk_ids"], example["topk_logprobs"]
            if len(prompt) == 0:
                raise ValueError("Every example needs a prompt token (it predicts the first response token).")
            if not (len(topk_ids) == len(topk_logprobs) == len(response)):
                raise ValueError(
                    f"topk_ids/topk_logprobs hold {len(topk_ids)}/{len(topk_logprobs)} rows for {len(response)} "
                    "response tokens; recompute them with `ppow_trl.data.compute_target_topk` on this dataset."
                )
            full_prompt = len(prompt)
            prompt, kept = _truncate(prompt, response, self.max_length)
            features = example.get("target_features")
            if features is not None:  # the kept positions: the prompt's suffix and the response's prefix
                features = torch.as_tensor(features, dtype=torch.float32)
                if features.shape[0] != full_prompt + len(response):
                    raise ValueError(f"target_features has {features.shape[0]} rows for {full_prompt + len(response)} "
                                     "tokens; recompute them with ppow_trl.data.compute_target_features.")
                features = features[full_prompt - len(prompt) : full_prompt + kept]
            width = len(topk_ids[0]) if kept else 0  # an empty response has no top-k rows
            ids = torch.as_tensor(topk_ids[:kept], dtype=torch.long).reshape(kept, width)
            logprobs = torch.as_tensor(topk_logprobs[:kept], dtype=torch.float32).reshape(kept, width)
            if kept:
                if ids.shape != logprobs.shape:
                    raise ValueError(
                        f"topk_ids {tuple(ids.shape)} and topk_logprobs {tuple(logprobs.shape)} differ in shape."
                    )
                if top_k is not None and ids.shape[1] != top_k:
                    raise ValueError(f"All examples of a batch need the same top-k, got {top_k} and {ids.shape[1]}.")
                top_k = ids.shape[1]
            rows.append((prompt, response[:kept], ids, logprobs))
            feature_rows.append(features)

        top_k = top_k or 1
        length = max(len(prompt) + len(response) for prompt, response, _, _ in rows)
        batch_size = len(rows)
        input_ids = torch.full((batch_size, length), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch_size, length), dtype=torch.long)
        labels = torch.full((batch_size, length), -100, dtype=torch.long)
        completion_mask = torch.zeros((batch_size, length), dtype=torch.bool)
        teacher_ids = torch.zeros((batch_size, length, top_k), dtype=torch.long)
        teacher_logprobs = torch.zeros((batch_size, length, top_k), dtype=torch.float32)
        for row, (prompt, response, ids, logprobs) in enumerate(rows):
            size, start = len(prompt) + len(response), len(prompt) - 1
            input_ids[row, :size] = torch.tensor(prompt + response, dtype=torch.long)
            attention_mask[row, :size] = 1
            labels[row, len(prompt) : size] = input_ids[row, len(prompt) : size]
            completion_mask[row, start : start + len(response)] = True
            teacher_ids[row, start : start + len(response)] = ids
            teacher_logprobs[row, start : start + len(response)] = logprobs
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
            "completion_mask": completion_mask,
            "teacher_topk_ids": teacher_ids,
            "teacher_topk_logprobs": teacher_logprobs,
        }
        if any(features is not None for features in feature_rows):
            if any(features is None for features in feature_rows):
                raise ValueError("Some examples of the batch have target_features and others not.")
            padded = torch.zeros((batch_size, length, feature_rows[0].shape[-1]), dtype=torch.float32)
            for row, features in enumerate(feature_rows):
                padded[row, : features.shape[0]] = features
            batch["target_features"] = padded
        return batch


# ---------------------------------------------------------------------------------------------------------
# Loss
# ---------------------------------------------------------------------------------------------------------


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x <= 0`` (values above 0 are clamped), stable on both ends; ``-inf`` at 0."""
    x = x.clamp_max(0.0)
    return torch.where(x > -math.log(2.0), torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def vocab_maps(model, num_columns: int, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`(column_ids, id_to_column)` of a drafter's output columns.

    `column_ids[c]` is the target token id of output column `c` (`draft_vocab_ids` for a
    `PPOWDrafterForCausalLM` or an EAGLE-3 drafter, possibly inside a `PeftModel`; `arange(num_columns)` for an ordinary causal LM);
    `id_to_column[i]` is the column of token id `i`, or -1 when the drafter cannot output it.
    """
    base = unwrap_model(model)
    if isinstance(base, ReducedVocabHeadMixin):
        column_ids = base.draft_vocab_ids.to(device=device, dtype=torch.long)
        if column_ids.numel() != num_columns:
            raise ValueError(f"The drafter has {column_ids.numel()} draft ids but its head {num_columns} columns.")
        size = max(int(base.config.full_vocab_size), int(column_ids.max()) + 1)
    else:
        column_ids = torch.arange(num_columns, device=device)
        size = num_columns
    id_to_column = torch.full((size,), -1, dtype=torch.long, device=device)
    id_to_column[column_ids] = torch.arange(num_columns, device=device)
    return column_ids, id_to_column


def topk_forward_kl(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    id_to_column: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tail_bucket: bool = True,
) -> torch.Tensor:
    """Per-position forward KL between the teacher's top-k and the drafter (module docstring). `(...,)`.

    Args:
        student_logits: `(..., C)` drafter scores over its C output columns (draft logits; finite).
        teacher_ids: `(..., k)` target token ids of the teacher's top-k.
        teacher_logprobs: `(..., k)` their log-probabilities (temperature 1, full target vocabulary).
        id_to_column: maps a token id to its output column, -1 if the drafter cannot output it (`vocab_maps`);
            None: column = id. Ids past its end count as outside the vocabulary.
        temperature: drafter softmax temperature.
        tail_bucket: add the rest class (True) or renormalise the teacher over the kept ids (False).
    """
    log_q, log_p_raw, inside, columns = _teacher_support(student_logits, teacher_ids, teacher_logprobs,
                                                         id_to_column, temperature)
    log_q_support = torch.where(inside, log_q.gather(-1, columns), torch.zeros_like(log_p_raw))

    if tail_bucket:
        log_p = torch.where(inside, log_p_raw, torch.zeros_like(log_p_raw))
        p = torch.where(inside, log_p_raw.exp(), torch.zeros_like(log_p_raw))
        support_kl = (p * (log_p - log_q_support)).sum(dim=-1)
        # Teacher rest: 1 - sum_{S_in} p, from the (constant) teacher values.
        log_p_mass = torch.logsumexp(log_p_raw.masked_fill(~inside, float("-inf")), dim=-1)
        log_p_tail = _log1mexp(log_p_mass)
        p_tail = log_p_tail.exp()
        has_tail = p_tail > TAIL_EPSILON
        # Drafter rest: exact logsumexp over the columns outside S_in (never 1 - sum, which cancels badly).
        in_support = torch.zeros_like(log_q).scatter_add_(-1, columns, inside.to(log_q.dtype)) > 0
        log_q_tail = torch.logsumexp(log_q.masked_fill(in_support, float("-inf")), dim=-1).clamp_min(_LOG_FLOOR)
        safe_log_p_tail = torch.where(has_tail, log_p_tail, torch.zeros_like(log_p_tail))
        tail_kl = torch.where(has_tail, p_tail * (safe_log_p_tail - log_q_tail), torch.zeros_like(p_tail))
        kl = support_kl + tail_kl
    else:
        log_norm = torch.logsumexp(log_p_raw.masked_fill(~inside, float("-inf")), dim=-1, keepdim=True)
        valid = inside.any(dim=-1, keepdim=True)
        log_p = torch.where(inside, log_p_raw - torch.where(valid, log_norm, torch.zeros_like(log_norm)), 0.0)
        p = torch.where(inside, log_p.exp(), torch.zeros_like(log_p))
        kl = (p * (log_p - log_q_support)).sum(dim=-1)
    return kl.clamp_min(0.0)


def _teacher_support(student_logits, teacher_ids, teacher_logprobs, id_to_column, temperature):
    """``(log_q, log_p, inside, columns)``: the drafter's log-softmax, the teacher's log-probs, the mask of
    ``S_in`` (top-k ids the drafter can output, with nonzero teacher probability) and their columns."""
    log_q = torch.log_softmax(student_logits.float() / temperature, dim=-1)
    ids = teacher_ids.long()
    if id_to_column is None:
        id_to_column = torch.arange(log_q.shape[-1], device=ids.device)
    in_table = (ids >= 0) & (ids < id_to_column.numel())
    columns = id_to_column[ids.clamp(0, id_to_column.numel() - 1)]
    log_p = teacher_logprobs.detach().float()
    inside = in_table & (columns >= 0) & torch.isfinite(log_p)
    return log_q, log_p, inside, columns.clamp_min(0)


def topk_total_variation(
    student_logits: torch.Tensor,
    teacher_ids: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    id_to_column: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
    tail_bucket: bool = True,
) -> torch.Tensor:
    """Per-position total variation ``TV = 1 - sum_v min(p_v, q_v)`` from the teacher's top-k. `(...,)`.

    Minimising it maximises the expected acceptance rate of one drafted token, ``sum_v min(p, q)`` (the
    direct acceptance objective of the LK losses, arXiv 2602.23881), instead of imitating ``p`` everywhere.
    The overlap is summed over ``S_in`` (module docstring); ``tail_bucket=True`` adds
    ``min(p_rest, q_rest)`` of the two rest classes, i.e. the TV of the coarse-grained distributions, a
    lower bound of the true TV that is tight when the teacher's top-k holds its mass. ``tail_bucket=False``
    counts the overlap on ``S_in`` only: ``1 - sum_{S_in} min(p, q)``, an upper bound of the true TV.
    Gradients flow through ``q``; ``min`` passes them where ``q < p`` (raise ``q`` where it is short).
    """
    log_q, log_p, inside, columns = _teacher_support(student_logits, teacher_ids, teacher_logprobs,
                                                     id_to_column, temperature)
    p = torch.where(inside, log_p.exp(), torch.zeros_like(log_p))
    q = torch.where(inside, log_q.gather(-1, columns).exp(), torch.zeros_like(log_p))
    overlap = torch.minimum(p, q).sum(dim=-1)
    if tail_bucket:
        p_rest = (1.0 - p.sum(dim=-1)).clamp_min(0.0)
        in_support = torch.zeros_like(log_q).scatter_add_(-1, columns, inside.to(log_q.dtype)) > 0
        q_rest = torch.logsumexp(log_q.masked_fill(in_support, float("-inf")), dim=-1).exp()
        overlap = overlap + torch.minimum(p_rest, q_rest)
    return (1.0 - overlap).clamp(0.0, 1.0)


KD_LOSSES = {"forward_kl": topk_forward_kl, "tv": topk_total_variation}


# ---------------------------------------------------------------------------------------------------------
# Trainer
# ---------------------------------------------------------------------------------------------------------


class KDTrainer(Trainer):
    """Token-level distillation of a drafter on cached target top-k distributions (the KD baseline).

    Args:
        model: the drafter: a causal LM over the target's tokenizer, a `PPOWDrafterForCausalLM` (reduced
            vocabulary), a `PeftModel` around either, or a path/Hub id loaded by its family (`load_drafter`). Its
            forward must accept `logits_to_keep` (every transformers causal LM does): only the positions that
            predict response tokens go through the output head.
        args: a `KDConfig` (defaults: `KDConfig()`).
        data_collator: defaults to `DataCollatorForKD` with the tokenizer's pad id and `args.max_length`.
        train_dataset, eval_dataset: rows with `prompt_ids`, `response_ids`, `topk_ids` and `topk_logprobs`, as
            built by `ppow_trl.data.build_target_responses` then `ppow_trl.data.compute_target_topk`.
        processing_class: the tokenizer (for the pad id, and saved with the model).
        peft_config: a PEFT config (e.g. `LoraConfig`): the drafter is wrapped with `get_peft_model` and only the
            adapter is trained and saved.
        target: the frozen target, required for drafters that read its hidden states
            (`ppow_trl.drafters.eagle3.Eagle3DrafterForCausalLM`): its features are computed on the fly for each batch
            (one no-grad teacher-forced forward) and the drafter is trained with EAGLE-3's training-time test
            (`KDConfig.ttt_steps`). Standalone drafters ignore it.

    Logged metrics (averaged over the logging interval, on response positions): `kd/kl` or `kd/tv` (per-token
    loss value: the KL of the module docstring, or the TV with `loss="tv"`) and `kd/top1_agreement` (share of positions where the drafter's
    argmax is the teacher's top-1 id).
    """

    def __init__(
        self,
        model: PreTrainedModel | torch.nn.Module | str,
        args: KDConfig | None = None,
        data_collator: Callable | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        callbacks=None,
        optimizers=(None, None),
        peft_config=None,
        target: PreTrainedModel | None = None,
        **kwargs,
    ):
        if args is None:
            args = KDConfig()
        elif not isinstance(args, KDConfig):
            raise TypeError(f"KDTrainer needs a KDConfig, got {type(args).__name__}.")
        if isinstance(model, str):  # a folder or Hub id of any family, any layout it imports
            model = load_drafter(model, target=target)
        if peft_config is not None:
            from peft import PeftModel, get_peft_model

            if isinstance(model, PeftModel):
                raise ValueError("The model is already a PeftModel; pass a PeftModel or a peft_config, not both.")
            model = get_peft_model(model, peft_config)
            if args.gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
                model.enable_input_require_grads()  # reentrant checkpointing needs inputs that require grad

        self.family = family_of(model)
        if not self.family.trainable:
            raise ValueError(f"A {self.family.name} drafter has no parameters to distil into.")
        if self.family.target_layer_ids(model) is not None:
            has_features = "target_features" in (getattr(train_dataset, "column_names", None) or [])
            if target is None and not has_features:
                raise ValueError(f"This drafter reads the target's hidden states ({self.family.description}): pass "
                                 "target= (the frozen target it was built for) so the trainer can compute its "
                                 "features, or a dataset with them (ppow_trl.data.compute_target_features).")
            if target is None and self.family.runs_on_target:
                raise ValueError(f"A {self.family.description} drafts through the target's embedding and output "
                                 "head: pass target= (the frozen target it was built for).")
            if target is not None:
                self.family.check_target(model, target)
                target.eval().requires_grad_(False)
        self.target = target

        if train_dataset is not None:
            check_kd_columns(getattr(train_dataset, "column_names", None), "train_dataset")
            train_dataset = with_lengths(train_dataset, args)
        eval_sets = eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]
        if args.eval_tau_window and target is None:
            raise ValueError("eval_tau_window > 0 measures exact greedy tau against the target: pass target= (the "
                             "frozen target), or set eval_tau_window=0.")
        for dataset in eval_sets:
            if dataset is not None and args.eval_tau_window:
                # eval_tau only reads prompts and the target's greedy responses; the KD columns add eval_loss
                missing = {"prompt_ids", "response_ids"} - set(getattr(dataset, "column_names", None) or [])
                if missing:
                    raise ValueError(f"eval_dataset lacks {sorted(missing)}: eval_tau needs held-out prompts and the "
                                     "target's greedy responses (ppow_trl.data.build_target_responses).")
            elif dataset is not None:
                check_kd_columns(getattr(dataset, "column_names", None), "eval_dataset")

        if data_collator is None:
            pad_id = getattr(processing_class, "pad_token_id", None)
            if pad_id is None:
                pad_id = getattr(processing_class, "eos_token_id", None)
            pad_id = pad_id if pad_id is not None else 0
            data_collator = DataCollatorForKD(pad_token_id=pad_id, max_length=args.max_length)

        super().__init__(
            model=model,
            args=args,
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
            **kwargs,
        )
        if "labels" not in self.label_names:  # a block drafter's forward has no labels argument: the collator's count
            self.label_names = ["labels"]
        self._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
        self._vocab_maps_cache: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.trained_positions = 0  # response positions the loss has seen in training (the study's budget)

    def get_eval_dataloader(self, eval_dataset=None):
        # an evaluated dataset needs the length column too: transformers batches it by length under group_by_length
        if eval_dataset is None or not isinstance(eval_dataset, str):
            eval_dataset = with_lengths(eval_dataset if eval_dataset is not None else self.eval_dataset, self.args)
        return super().get_eval_dataloader(eval_dataset)

    def _set_signature_columns_if_needed(self):
        # The collator, not the model, reads the dataset: keep its columns even with remove_unused_columns=True.
        if self._signature_columns is None:
            self._signature_columns = [*KD_COLUMNS, "target_features"]

    def _vocab_maps(self, num_columns: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(device), num_columns)
        if key not in self._vocab_maps_cache:
            self._vocab_maps_cache[key] = vocab_maps(self.model, num_columns, device)
        return self._vocab_maps_cache[key]

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["completion_mask"].bool()
        # the family's student rows: one per slot (its maths lives with the family, ppow_trl.drafting)
        device_type = mask.device.type
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=self.args.bf16_autocast):
            rows, outputs = self.family.kd_rows(model, inputs, mask, self.args, target=self.target)
        weights = self.family.kd_slot_weights(self.args, len(rows))
        chain = weights is not None  # per-slot means, weighted
        weights = weights or [1.0]
        column_ids, id_to_column = self._vocab_maps(rows[0][0].shape[-1], rows[0][0].device)
        loss, stats = 0.0, []
        for weight, (student, target_mask) in zip(weights, rows):
            teacher_ids = inputs["teacher_topk_ids"][target_mask]
            teacher_logprobs = inputs["teacher_topk_logprobs"][target_mask]
            kl = KD_LOSSES[self.args.loss](
                student,
                teacher_ids,
                teacher_logprobs,
                id_to_column,
                temperature=self.args.temperature,
                tail_bucket=self.args.tail_bucket,
            )
            num_tokens = kl.numel()
            if chain:  # per-step means, weighted (module doc of KDConfig.ttt_decay)
                step_loss = kl.sum() / max(num_tokens, 1) * weight / sum(weights)
            elif num_items_in_batch is not None and self.model_accepts_loss_kwargs:
                # Token-weighted over the whole accumulated batch, like transformers' cross-entropy; the Trainer
                # then does not divide by the accumulation steps.
                step_loss = kl.sum() / num_items_in_batch
                if self.args.average_tokens_across_devices:
                    step_loss = step_loss * (self.accelerator.num_processes // self.get_tp_size())
            else:
                step_loss = kl.sum() / max(num_tokens, 1)
            if num_tokens == 0:
                step_loss = step_loss + 0.0 * student.sum()  # keep the graph connected
            loss = loss + step_loss
            with torch.no_grad():
                agree = (column_ids[student.argmax(dim=-1)] == teacher_ids[:, 0]).float().sum() if num_tokens else 0.0
                stats.append([float(kl.detach().sum()), float(agree), float(num_tokens)])
        with torch.no_grad():
            stats = torch.tensor(stats, device=rows[0][0].device)
            stats = self.accelerator.gather(stats).reshape(-1, len(rows), 3).sum(dim=0)
            mode = "train" if model.training else "eval"
            name = "kd/kl" if self.args.loss == "forward_kl" else "kd/tv"
            for step, (total, agree, count) in enumerate(stats.tolist()):
                if count > 0:
                    suffix = f"_step{step}" if step else ""
                    self._metrics[mode][name + suffix].append(total / count)
                    self._metrics[mode]["kd/top1_agreement" + suffix].append(agree / count)
            if model.training:
                self.trained_positions += int(stats[0, 2])  # response positions trained on, all processes
        return (loss, outputs) if return_outputs else loss

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None,
                        metric_key_prefix: str = "eval"):
        """transformers' loop (``eval_loss`` where the rows carry the teacher's top-k), plus ``eval_tau`` with
        ``eval_tau_window`` (``held_out_tau``); metrics added here reach ``metric_for_best_model`` and the callbacks."""
        from transformers.trainer_utils import EvalLoopOutput

        dataset = dataloader.dataset
        if set(KD_COLUMNS) <= set(getattr(dataset, "column_names", None) or []):
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        else:
            output = EvalLoopOutput(predictions=None, label_ids=None, metrics={}, num_samples=len(dataset))
        if self.args.eval_tau_window:
            output.metrics[f"{metric_key_prefix}_{TAU}"] = self.held_out_tau(dataset)
        return output

    @torch.no_grad()
    def held_out_tau(self, dataset) -> float:
        """Exact greedy tau at fixed windows of ``eval_tau_window`` over ``dataset``'s prompts, with its
        ``response_ids`` as the target's greedy text (ratio of sums; prompts sharded over the processes)."""
        from .held_out import held_out_tau_counts
        from ..core.windowing import AdaptiveWindowPolicy

        acc = self.accelerator
        rows = dataset.select(range(acc.process_index, len(dataset), acc.num_processes))
        continuations = {tuple(p): list(r) for p, r in zip(rows["prompt_ids"], rows["response_ids"])}
        drafter = unwrap_model(self.model)
        was_training = drafter.training
        drafter.eval()
        try:
            counts = held_out_tau_counts(self.target, drafter, rows["prompt_ids"],
                                         [AdaptiveWindowPolicy(self.args.eval_tau_window, 0.0)],
                                         max_new_tokens=self.args.eval_max_new_tokens,
                                         vocab_size=len(self.processing_class) if self.processing_class is not None
                                         else self.target.config.vocab_size, continuations=continuations)
        finally:
            drafter.train(was_training)
        counts = counts.float().to(acc.device)
        if acc.num_processes > 1:
            counts = acc.reduce(counts, reduction="sum")
        return float(counts[0] / counts[1].clamp_min(1))

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = {key: sum(values) / len(values) for key, values in self._metrics[mode].items() if values}
        if mode == "eval":
            metrics = {f"eval_{key}": value for key, value in metrics.items()}
        logs.update(metrics)
        super().log(logs, start_time)
        self._metrics[mode].clear()
