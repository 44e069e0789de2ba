"""Teacher-forced data: the target's top-k along a dataset's own answers, one forward per sequence
(`build_teacher_forced`).

EAGLE-1's route. Regenerating answers (`build_target_responses`) costs one target forward per new token and then a
second pass to label them (`compute_target_topk`); here the answer is fixed text (ShareGPT's, or yours), so one
teacher-forced forward over ``prompt + answer`` gives every label at once: at response position ``t`` the target's
top-k of ``p(. | prompt, answer_<t)``. The drafter still learns *the target's* distribution at every position (its
labels are the target's); what differs from regenerated data is the text it is conditioned on, which another model
wrote. What each costs is measured by ``benchmarks/data_throughput.py``, what each buys by the main job's runs.

The rows have the columns of ``build_target_responses`` + ``compute_target_topk`` (``prompt_ids``, ``response_ids``,
``topk_ids``, ``topk_logprobs``), so ``KDTrainer`` and ``PPOWTrainer`` take them as they are. With
``feature_layer_ids`` the same forward also keeps the hidden states a feature-conditioned drafter (EAGLE-3) trains on,
the ``target_features`` column of ``compute_target_features``: no second pass over the sequences. Results go through the
resumable sharded cache (``ppow_trl.data.cache``), split over the processes of a launch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from datasets import Array2D, Dataset, Features, Value

from .cache import (DEFAULT_CHUNK_SIZE, build_sharded_dataset, check_disk, dataset_fingerprint, model_fingerprint,
                    tokenizer_fingerprint)
from ..features import target_forward
from .features import FEATURES_COLUMN
from .responses import TOKEN_IDS_FEATURE, _eval_mode, encode_prompt, pad_sequences, stop_token_ids, topk_labels

# The dtypes the target's forward may run its matmuls in while it labels (``autocast``); the log-softmax and top-k
# are always float32.
LABEL_PRECISIONS = ("fp32", "bf16")


def answer_token_ids(tokenizer, answer: str, end_id: int, max_tokens: int) -> list[int]:
    """The token ids of ``answer`` as the assistant's turn, ``end_id`` (the turn's end) appended, cut to
    ``max_tokens`` (a cut answer has no end token: it was not over)."""
    ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [end_id]
    return ids[:max_tokens]


def _autocast(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def _teacher_forced_batch(target, rows: list[dict[str, Any]], top_k: int, precision: str,
                          feature_layer_ids: list[int] | None = None) -> list[dict[str, Any]]:
    """One forward of the target over each row's ``prompt_ids + response_ids`` (right-padded): the top-k at
    the positions ``len(prompt) - 1 + t`` that predict ``response[t]`` (the only ones sent through the output
    head, ``logits_to_keep``) and, with ``feature_layer_ids``, the float16 hidden states of every real position."""
    starts = [len(row["prompt_ids"]) - 1 for row in rows]
    stops = [start + len(row["response_ids"]) for start, row in zip(starts, rows)]
    first, last = min(starts), max(stops)
    device = next(target.parameters()).device
    sequences = [row["prompt_ids"] + row["response_ids"] for row in rows]
    input_ids, _ = pad_sequences(sequences, 0, "right", device)
    # No attention mask: with right padding a causal mask alone already keeps every real token from the pads (they
    # all come after it), and without a mask SDPA takes its fused causal kernel (a quarter of the forward's time
    # went to the masked path on a 2-core CPU). The pads' own outputs are never read.
    with _eval_mode(target), _autocast(precision, device), torch.no_grad():
        output, features = target_forward(target, feature_layer_ids, input_ids=input_ids,
                                          logits_to_keep=torch.arange(first, last, device=device))
    logits = output.logits
    if features is not None:  # causal: a real position's states do not depend on the pads after it
        features = features.to(torch.float16).cpu().numpy()
    for index, (row, start, stop) in enumerate(zip(rows, starts, stops)):
        row["topk_ids"], row["topk_logprobs"] = topk_labels(logits[index, start - first : stop - first], top_k)
        if features is not None:
            row[FEATURES_COLUMN] = features[index, : len(sequences[index])]
    return rows


def build_teacher_forced(
    target,
    tokenizer,
    conversations: Dataset,
    *,
    max_response_tokens: int = 256,
    max_prompt_length: int | None = 512,
    top_k: int = 32,
    batch_size: int = 8,
    precision: str = "fp32",
    cache_dir: str | Path | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    feature_layer_ids: list[int] | None = None,
) -> Dataset:
    """Label the answers of ``conversations`` with the target's top-k, teacher-forced, in one forward each.

    Each row's ``messages`` (ending with the user's turn) becomes ``prompt_ids`` (chat template with generation
    prompt, `encode_prompt`) and its ``answer`` the ``response_ids`` (`answer_token_ids`: the answer's tokens and the
    turn's end token, at most ``max_response_tokens``). Rows with an empty answer, or a prompt longer than
    ``max_prompt_length`` tokens, are dropped. Inside a batch, rows of similar length are grouped (each chunk is
    sorted by length before it is cut into batches), so little of a forward is padding; rows come back in input order.

    Args:
        target: the target causal LM (accepts ``logits_to_keep``; left in the mode it came in).
        tokenizer: its tokenizer.
        conversations: rows with ``messages`` and ``answer`` (e.g. `load_sharegpt_conversations`); all columns are
            carried to the output.
        precision: ``"fp32"`` or ``"bf16"`` (the target's matmuls under bf16 autocast: about twice as fast on CPUs
            with avx512_bf16 or AMX; the labels' log-softmax stays float32). Part of the cache key.
        cache_dir: root of the resumable cache (see `build_sharded_dataset`); None keeps everything in memory.
        feature_layer_ids: indices of the target's ``output_hidden_states`` an EAGLE-3 head reads
            (``Eagle3DrafterConfig.target_layer_ids``): their states at every position of ``prompt + answer``,
            concatenated, float16, from the same forward (under ``precision``; the head serves on float32 states).

    Returns:
        The rows plus ``prompt_ids``, ``response_ids`` (int32 ids), ``topk_ids`` and ``topk_logprobs`` (one row of
        ``top_k`` per response token), the columns ``KDTrainer`` reads; with ``feature_layer_ids``, also
        ``target_features`` ``(len(prompt) + len(answer), len(feature_layer_ids) * hidden_size)``, read as numpy.
    """
    missing = {"messages", "answer"} - set(conversations.column_names)
    if missing:
        raise ValueError(f"build_teacher_forced needs the columns {sorted(missing)} (see "
                         "ppow_trl.data.load_sharegpt_conversations); got {conversations.column_names}.")
    if precision not in LABEL_PRECISIONS:
        raise ValueError(f"precision must be one of {LABEL_PRECISIONS}, got {precision!r}.")
    if max_response_tokens < 1 or top_k < 1:
        raise ValueError(f"max_response_tokens and top_k must be >= 1, got {max_response_tokens} and {top_k}.")
    end_id = stop_token_ids(target, tokenizer)[0]
    # Before any forward: room for the labels (int32 id + float32 log-prob per top-k entry and response token; a
    # token is about 4 characters of English, and no answer keeps more than max_response_tokens).
    tokens = sum(min(len(answer) // 4 + 1, max_response_tokens) for answer in conversations["answer"])
    needed = tokens * top_k * 8 * 2  # x2: Arrow's list offsets and slack
    width = len(feature_layer_ids) * target.config.get_text_config().hidden_size if feature_layer_ids else 0
    if width:  # the features of the prompts too (the head attends over them), float16
        prompt_tokens = sum(min(len(m[-1]["content"]) // 4 + 16, max_prompt_length or 10**9)
                            for m in conversations["messages"])
        needed += (tokens + prompt_tokens) * width * 2

    def process_batch(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        kept = []
        for row in rows:
            if not row["answer"].strip():
                continue
            row["prompt_ids"] = encode_prompt(tokenizer, row["messages"])
            if max_prompt_length is not None and len(row["prompt_ids"]) > max_prompt_length:
                continue
            row["response_ids"] = answer_token_ids(tokenizer, row["answer"], end_id, max_response_tokens)
            kept.append(row)
        return _teacher_forced_batch(target, kept, top_k, precision, feature_layer_ids) if kept else []

    settings = {
        "model": model_fingerprint(target),
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "inputs": dataset_fingerprint(conversations),
        "max_response_tokens": max_response_tokens,
        "max_prompt_length": max_prompt_length,
        "top_k": top_k,
        "precision": precision,
        "batch_size": batch_size,
        "chunk_size": chunk_size,
    }
    columns = {**conversations.features, "prompt_ids": TOKEN_IDS_FEATURE, "response_ids": TOKEN_IDS_FEATURE,
               "topk_ids": [[Value("int32")]], "topk_logprobs": [[Value("float32")]]}
    if feature_layer_ids:  # keyed only when asked: caches of labels alone keep their names
        settings["feature_layer_ids"] = [int(i) for i in feature_layer_ids]
        columns[FEATURES_COLUMN] = Array2D(shape=(None, width), dtype="float16")
    check_disk(cache_dir, needed, "Teacher-forced labels" + (" and target features" if width else ""),
               kind="teacher-forced", settings=settings)  # before any forward; finished shards count as written
    dataset = build_sharded_dataset(
        conversations,
        process_batch,
        features=Features(columns),
        kind="teacher-forced",
        settings=settings,
        cache_dir=cache_dir,
        batch_size=batch_size,
        chunk_size=chunk_size,
        desc="Labelling answers (teacher-forced)",
        sort_key=lambda row: len(row["messages"][-1]["content"]) + len(row["answer"]),
        unit="token",
        count=lambda out: sum(len(row["response_ids"]) for row in out),
    )
    if feature_layer_ids:
        return dataset.with_format("numpy", columns=[FEATURES_COLUMN], output_all_columns=True)
    return dataset
