"""Cached target features for training feature-conditioned drafters (`compute_target_features`).

Training an EAGLE-3 drafter needs the target's hidden states at ``target_layer_ids`` for every token of every
training sequence. Recomputing them for each batch costs one target forward per batch (on this CPU, SmolLM2-135M
fp32, one thread: 15 s for a batch of 8 x 420 tokens, as long as the drafter's own training step), so they are
computed once, like the KD teacher's top-k, and stored in float16 through the same resumable sharded cache as the
responses and the top-k (``ppow_trl.data.cache``). ``KDTrainer`` reads them from the batch when the dataset has the
column, and computes them on the fly otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from datasets import Array2D, Dataset, Features, concatenate_datasets

from .cache import DEFAULT_CHUNK_SIZE, build_sharded_dataset, check_disk, dataset_fingerprint, model_fingerprint
from .responses import pad_sequences
from ..features import target_features

FEATURES_COLUMN = "target_features"


def feature_bytes(dataset: Dataset, layer_ids: list[int], hidden_size: int) -> int:
    """Bytes the float16 features of ``prompt_ids + response_ids`` of every row take."""
    tokens = sum(len(p) + len(r) for p, r in zip(dataset["prompt_ids"], dataset["response_ids"]))
    return tokens * len(layer_ids) * hidden_size * 2


def _features_batch(target, rows: list[dict[str, Any]], layer_ids: list[int]) -> list[dict[str, Any]]:
    sequences = [row["prompt_ids"] + row["response_ids"] for row in rows]
    device = next(target.parameters()).device
    input_ids, attention_mask = pad_sequences(sequences, 0, "right", device)
    features = target_features(target, input_ids, attention_mask, layer_ids).to(torch.float16).cpu().numpy()
    return [{FEATURES_COLUMN: features[index, : len(sequence)]} for index, sequence in enumerate(sequences)]


def compute_target_features(
    target,
    dataset: Dataset,
    layer_ids: list[int],
    *,
    batch_size: int = 8,
    cache_dir: str | Path | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Dataset:
    """``dataset`` plus ``target_features``: the target's teacher-forced hidden states at ``layer_ids`` (indices of
    ``output_hidden_states``, concatenated) at every position of ``prompt_ids + response_ids``, float16,
    ``(len(prompt) + len(response), len(layer_ids) * hidden_size)`` per row. Cached and resumable like
    ``compute_target_topk``; the returned dataset gives that column as numpy arrays (fast to collate).
    The size is printed before the run (``feature_bytes``)."""
    missing = {"prompt_ids", "response_ids"} - set(dataset.column_names)
    if missing:
        raise ValueError(f"compute_target_features needs the columns {sorted(missing)}; run build_target_responses "
                         "first.")
    hidden = target.config.get_text_config().hidden_size
    width = len(layer_ids) * hidden
    size = feature_bytes(dataset, layer_ids, hidden)
    print(f"Target features: {size / 2**20:.0f} MiB (float16, {width} per token)"
          + (f" under {cache_dir}" if cache_dir else " in memory"), flush=True)
    settings = {"model": model_fingerprint(target), "inputs": dataset_fingerprint(dataset), "layer_ids": list(layer_ids),
                "batch_size": batch_size, "chunk_size": chunk_size}
    # before any forward: a clear error, not a full disk mid-run (the shards a killed run finished count as written)
    check_disk(cache_dir, size, "Target features", kind="features", settings=settings)
    columns = build_sharded_dataset(
        dataset,
        lambda rows: _features_batch(target, rows, layer_ids),
        features=Features({FEATURES_COLUMN: Array2D(shape=(None, width), dtype="float16")}),
        kind="features",
        settings=settings,
        cache_dir=cache_dir,
        batch_size=batch_size,
        chunk_size=chunk_size,
        desc="Computing target features",
    )
    if len(columns) != len(dataset):
        raise RuntimeError(f"{len(columns)} feature rows for {len(dataset)} examples.")
    merged = concatenate_datasets([dataset, columns], axis=1)
    return merged.with_format("numpy", columns=[FEATURES_COLUMN], output_all_columns=True)
