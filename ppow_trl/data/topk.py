"""Teacher-forced top-k of the target along its own responses (`compute_target_topk`).

The target's top-k next-token log-probabilities at every response position are the teacher signal of
token-level distillation (the KD baseline and warm start, `ppow_trl.training.kd_trainer`), stored once so the
target need not be kept in memory while the drafter trains. Rows come from `build_target_responses`;
results go through the same resumable cache (`ppow_trl.data.cache`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, Features, Value

from .cache import DEFAULT_CHUNK_SIZE, build_sharded_dataset, dataset_fingerprint, model_fingerprint
from .responses import _eval_mode, pad_sequences, topk_labels


def target_top1_ids(dataset: Dataset) -> torch.Tensor:
    """The target's most likely token at every labelled position of ``dataset`` (``topk_ids``' first column), read
    with Arrow's list kernels (no Python list per token: 2M positions of top-32 would be 64M Python ints).

    On teacher-forced rows these are the tokens the target itself would write there, a better sample of what a
    drafter must propose (its draft vocabulary) than the fixed answers' own tokens."""
    import pyarrow.compute as pc

    column = dataset.with_format("arrow")[:]["topk_ids"] if len(dataset) else None
    if column is None:
        return torch.zeros(0, dtype=torch.long)
    per_token = pc.list_flatten(column)  # one top-k list per labelled position
    return torch.from_numpy(pc.list_element(per_token, 0).to_numpy(zero_copy_only=False).astype("int64"))


def _topk_batch(target, rows: list[dict[str, Any]], top_k: int) -> list[dict[str, Any]]:
    """Teacher-forced top-k log-probabilities of the target along each row's response.

    Position `len(prompt) - 1 + t` of `prompt + response` predicts `response[t]`. Right padding keeps
    every real token at its natural position; the (ignored) pad id 0 is hidden by the attention mask.
    Only the positions that predict some response token go through the output head (`logits_to_keep`),
    which matters for large vocabularies.
    """
    starts = [len(row["prompt_ids"]) - 1 for row in rows]
    stops = [start + len(row["response_ids"]) for start, row in zip(starts, rows)]
    first, last = min(starts), max(stops)
    if last > first:
        sequences = [row["prompt_ids"] + row["response_ids"] for row in rows]
        input_ids, attention_mask = pad_sequences(sequences, 0, "right", target.device)
        with _eval_mode(target):
            logits = target(
                input_ids=input_ids,
                attention_mask=attention_mask,
                logits_to_keep=torch.arange(first, last, device=target.device),
            ).logits
    for index, (row, start, stop) in enumerate(zip(rows, starts, stops)):
        if stop == start:  # an empty response has nothing to predict
            row["topk_ids"], row["topk_logprobs"] = [], []
            continue
        row["topk_ids"], row["topk_logprobs"] = topk_labels(logits[index, start - first : stop - first], top_k)
    return rows


def compute_target_topk(
    target,
    dataset: Dataset,
    *,
    top_k: int = 32,
    batch_size: int = 8,
    cache_dir: str | Path | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Dataset:
    """Add the target's top-k next-token log-probabilities along each response (teacher forcing).

    One forward of the target over `prompt_ids + response_ids` gives, for each response position t,
    the `top_k` most likely tokens of `p(. | prompt, response_<t)` and their log-probabilities (log-softmax
    over the full vocabulary at temperature 1, computed in float32). Row t predicts `response_ids[t]`, so
    both new columns have one row per response token. This is the cheap distillation signal: the drafter
    can be trained on it later without the target in memory.

    Storage: int32 ids and float32 log-probs, `8 * top_k` bytes per response token (64 KiB for 256
    tokens at top_k=32); float32 keeps `exp(logprob)` sums exact enough for KL and acceptance estimates.
    Results are cached and resumable exactly as in `build_target_responses` (same helper).

    Args:
        target: the target causal LM (must accept `logits_to_keep`, as transformers' causal LMs do).
        dataset: rows with `prompt_ids` and `response_ids` (e.g. from `build_target_responses`).

    Returns:
        `dataset` plus `topk_ids` (list of lists of int32) and `topk_logprobs` (list of lists of float32).
    """
    missing = {"prompt_ids", "response_ids"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"compute_target_topk needs the columns {sorted(missing)}; run build_target_responses first.")
    settings = {
        "model": model_fingerprint(target),
        "inputs": dataset_fingerprint(dataset),
        "top_k": top_k,
        "batch_size": batch_size,
        "chunk_size": chunk_size,
    }
    features = Features(
        {**dataset.features, "topk_ids": [[Value("int32")]], "topk_logprobs": [[Value("float32")]]}
    )
    return build_sharded_dataset(
        dataset,
        lambda rows: _topk_batch(target, rows, top_k),
        features=features,
        kind="topk",
        settings=settings,
        cache_dir=cache_dir,
        batch_size=batch_size,
        chunk_size=chunk_size,
        desc="Computing target top-k",
    )
