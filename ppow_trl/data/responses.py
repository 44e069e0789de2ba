"""Target-regenerated responses: the data a drafter learns from (`build_target_responses`).

EAGLE, SpecForge and speculators regenerate the responses with the target itself: a drafter must learn what
*the target* writes, not what some other model wrote (see docs/ppow.md "Setting"). This module holds that
builder and the pieces it and the other data builders share: `encode_prompt` (chat template -> ids),
`pad_sequences` (from `ppow_trl.padding`), `stop_token_ids` / `truncate_at_stop`, and the target's eval mode while it labels data.
The results go through the resumable cache of `ppow_trl.data.cache`.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, Features, Value

from ..padding import pad_sequences  # re-exported as ppow_trl.data.pad_sequences
from .cache import (
    DEFAULT_CHUNK_SIZE,
    build_sharded_dataset,
    dataset_fingerprint,
    model_fingerprint,
    tokenizer_fingerprint,
)

logger = logging.getLogger(__name__)

TOKEN_IDS_FEATURE = [Value("int32")]  # int32 halves the disk use of int64; vocabularies are far smaller


def encode_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended (where the assistant answer starts).

    The template already holds any special tokens the model expects, so the tokenizer must not add more.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def stop_token_ids(target, tokenizer) -> list[int]:
    """Every token that ends a response: the tokenizer's eos and the target's generation eos token(s).

    Chat models often end a turn with a token (e.g. `<|im_end|>`) other than the pretraining eos.
    """
    candidates = [tokenizer.eos_token_id]
    generation_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    candidates += generation_eos if isinstance(generation_eos, list) else [generation_eos]
    return list(dict.fromkeys(token for token in candidates if token is not None))


def truncate_at_stop(token_ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """`token_ids` up to and including the first stop token (drops what generate padded after it)."""
    for position, token in enumerate(token_ids):
        if token in stop_ids:
            return list(token_ids[: position + 1])
    return list(token_ids)


def topk_labels(logits: torch.Tensor, top_k: int) -> tuple[list, list]:
    """``(ids, logprobs)`` lists of the ``top_k`` most likely tokens of each row of ``logits`` (float32
    log-softmax over the full vocabulary, temperature 1): the KD teacher signal (``compute_target_topk``'s)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logprobs.topk(min(top_k, logprobs.shape[-1]), dim=-1)
    return ids.tolist(), values.tolist()


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """Dropout off while the target labels data, then restore the caller's mode."""
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        model.train(was_training)


_INPUT_INDEX = "__input_index__"


def _prompt_length(row: dict[str, Any]) -> int:
    """A prompt's length for batching: the characters of its messages (no tokenizer pass needed)."""
    return sum(len(message["content"]) for message in row["messages"])


def _decoder_at(target, precision: str):
    """The model that decodes at ``precision``: ``target`` itself, or for ``"bf16"`` a bfloat16 copy of a float32
    ``target`` (quantized and half-precision targets are used as they are)."""
    if precision != "bf16" or next(target.parameters()).dtype != torch.float32:
        return target
    return copy.deepcopy(target).to(torch.bfloat16)


def _generation_kwargs(
    max_new_tokens: int, do_sample: bool, temperature: float, stop_ids: list[int], pad_id: int
) -> dict[str, Any]:
    """`generate` options that sample from the target's own distribution.

    We override the model's generation_config defaults (top-k 50, a checkpoint's top-p or repetition
    penalty): the verifier accepts against the raw distribution at `temperature`, so the data must
    come from that distribution too.
    """
    kwargs = {
        "max_new_tokens": max_new_tokens,
        "do_sample": do_sample,
        "eos_token_id": stop_ids,
        "pad_token_id": pad_id,
        "repetition_penalty": 1.0,
    }
    if do_sample:
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    return kwargs


def build_target_responses(
    target,
    tokenizer,
    prompts: Dataset,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    do_sample: bool = False,
    temperature: float = 1.0,
    seed: int = 0,
    max_prompt_length: int | None = 512,
    cache_dir: str | Path | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    label_top_k: int | None = None,
    sort_by_length: bool = True,
    precision: str = "fp32",
) -> Dataset:
    """Regenerate the responses to `prompts` with the target, the data a drafter should learn from.

    Each prompt's chat template (with generation prompt) is tokenized; batches are left-padded (so every
    prompt ends where generation starts) and decoded with `target.generate`: greedy, or sampled from the
    target's full distribution at `temperature` (no top-k/top-p). A response stops at and includes the
    first stop token (`stop_token_ids`), or after `max_new_tokens`; it holds no padding.

    Prompts longer than `max_prompt_length` tokens are **dropped** (with a warning), not truncated: a cut
    chat loses either its instruction or its generation prompt. The held-out/train separation is the
    loaders' (e.g. `load_sharegpt("train")` vs `"test"`): this function only labels what it is given.

    Batches (``sort_by_length``): the prompts are sorted by length over the whole dataset before they are cut into
    chunks and batches (the rows come back in input order), so a batch pads little and large batches pay (a decode
    step mostly reads the weights). Sorting within chunks only is not enough once a chunk is one batch: a batch of
    64 ShareGPT prompts drawn at random pads to its longest, up to ``max_prompt_length``.

    Determinism: each chunk of `chunk_size` prompts is generated under its own seed derived from `seed`,
    so a resumed run equals an uninterrupted one. Sampled outputs depend on `seed`, `batch_size` and
    `chunk_size` (the random stream is shared within a batch); all three are part of the cache key.

    Labels in the same pass (``label_top_k``): the target's top-k log-probabilities at every response position are
    read from the logits `generate` computed anyway (``output_logits``, before any logits processor), so the KD
    teacher signal costs no second forward over prompts and responses (`compute_target_topk`'s). They equal a
    teacher-forced forward's up to float rounding (a KV-cached decode step against one forward over the sequence).

    Precision (``precision="bf16"``): a float32 target decodes with a bfloat16 copy of its weights (a quantized or
    already half-precision target decodes as it is). A decode step mostly reads the weights, so half the bytes pay:
    on a 2-core AMD EPYC (avx512_bf16), one process of one thread, batch 64 of the shortest ShareGPT prompts decoded
    171 tokens/s against 124 in float32 (a one-off measurement; `benchmarks/data_throughput.py` has the
    `regenerate_batched_bf16` row, not yet rerun). The text is then the bf16 model's greedy text: the
    same model, but its near-ties break otherwise (on 64 prompts x 128 tokens, 16 answers were identical and the
    others first differed after 37 tokens on average), and the labels are its log-probabilities. That is training
    data, not served output: serving and the served rule's calibration stay on the target's own precision.

    Args:
        target: the target causal LM (any `generate`-capable model; left in the mode it came in).
        tokenizer: its tokenizer (not modified).
        prompts: a prompt dataset (`messages` column; all columns are carried to the output).
        cache_dir: root of the resumable cache (see `build_sharded_dataset`); None keeps everything in memory.
        label_top_k: also add `topk_ids` / `topk_logprobs` (the columns `compute_target_topk` adds) from the
            generation's own logits; None (default) adds no labels.
        sort_by_length: batch prompts of similar length together (default); False keeps the input order.
        precision: ``"fp32"`` (default: the target as given) or ``"bf16"`` (a bfloat16 copy of a float32 target).

    Returns:
        The prompt rows plus `prompt_ids` and `response_ids` (lists of int32 token ids), and the top-k columns with
        ``label_top_k``.
    """
    if "messages" not in prompts.column_names:
        raise ValueError(f"prompts needs a 'messages' column (see load_prompts), got {prompts.column_names}.")
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"precision must be 'fp32' or 'bf16', got {precision!r}.")
    stop_ids = stop_token_ids(target, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    generation_kwargs = _generation_kwargs(max_new_tokens, do_sample, temperature, stop_ids, pad_id)
    fingerprint = model_fingerprint(target)  # the target's: a bf16 copy is keyed by `precision` below
    decoder = _decoder_at(target, precision)

    def process_batch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for row in rows:
            row["prompt_ids"] = encode_prompt(tokenizer, row["messages"])
        rows = [row for row in rows if max_prompt_length is None or len(row["prompt_ids"]) <= max_prompt_length]
        if not rows:
            return []
        input_ids, attention_mask = pad_sequences([row["prompt_ids"] for row in rows], pad_id, "left", target.device)
        labelled = {"output_logits": True, "return_dict_in_generate": True} if label_top_k else {}
        with _eval_mode(decoder):
            output = decoder.generate(input_ids=input_ids, attention_mask=attention_mask, **generation_kwargs,
                                      **labelled)
        sequences = output.sequences if label_top_k else output
        for index, (row, new_tokens) in enumerate(zip(rows, sequences[:, input_ids.shape[1] :].tolist())):
            row["response_ids"] = truncate_at_stop(new_tokens, stop_ids)
            if label_top_k:  # step t's logits predict response token t
                steps = torch.stack([logits[index] for logits in output.logits[: len(row["response_ids"])]])
                row["topk_ids"], row["topk_logprobs"] = topk_labels(steps, label_top_k)
        return rows

    settings = {
        "model": fingerprint,
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "inputs": dataset_fingerprint(prompts),
        "generation": generation_kwargs,
        # Seed and temperature do not change greedy outputs: leave them out so greedy caches are shared.
        "seed": seed if do_sample else None,
        "max_prompt_length": max_prompt_length,
        "batch_size": batch_size,
        "chunk_size": chunk_size,
    }
    features = {**prompts.features, "prompt_ids": TOKEN_IDS_FEATURE, "response_ids": TOKEN_IDS_FEATURE}
    work = prompts
    if sort_by_length:  # every chunk and batch holds prompts of similar length; _INPUT_INDEX restores the order
        settings["order"] = "sorted by length"
        lengths = [_prompt_length({"messages": messages}) for messages in prompts["messages"]]
        order = sorted(range(len(prompts)), key=lambda index: (lengths[index], index))
        work = prompts.select(order).add_column(_INPUT_INDEX, order)
        features[_INPUT_INDEX] = Value("int64")
    if label_top_k:
        settings["label_top_k"] = label_top_k  # only when set: the caches of unlabelled responses keep their keys
        features.update(topk_ids=[[Value("int32")]], topk_logprobs=[[Value("float32")]])
    if decoder is not target:
        settings["precision"] = precision  # likewise: float32 caches keep their keys
    features = Features(features)
    responses = build_sharded_dataset(
        work,
        process_batch,
        features=features,
        kind="responses",
        settings=settings,
        cache_dir=cache_dir,
        batch_size=batch_size,
        chunk_size=chunk_size,
        seed=seed if do_sample else None,
        desc="Generating target responses",
        # prompts of similar length share a batch: little of each decode step is left padding, so large batches pay
        sort_key=_prompt_length if sort_by_length else None,
        unit="token",
        count=lambda out: sum(len(row["response_ids"]) for row in out),
    )
    if sort_by_length:
        responses = responses.sort(_INPUT_INDEX).remove_columns(_INPUT_INDEX).flatten_indices()
    if len(responses) < len(prompts):
        logger.warning(
            "Dropped %d of %d prompts longer than max_prompt_length=%s tokens.",
            len(prompts) - len(responses),
            len(prompts),
            max_prompt_length,
        )
    return responses

