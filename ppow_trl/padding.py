"""Padding token sequences into batches: the one implementation, left or right.

Left padding is for sequences that continue (generation, drafting and verification: every row ends where the
next token goes; rows get explicit position ids, ``cumsum(mask) - 1``); right padding is for teacher-forced
passes where every real token keeps its natural position without position ids (the target's top-k labels).
We pad by hand instead of through a tokenizer so that no caller's tokenizer is ever mutated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def pad_sequences(
    sequences: Sequence[Sequence[int]], pad_id: int, side: str = "right", device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack token sequences (lists or 1-D tensors) into ``(input_ids, attention_mask)``, both ``(B, T)`` int64."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right', got {side!r}.")
    length = max((len(sequence) for sequence in sequences), default=0)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        span = slice(length - len(sequence), length) if side == "left" else slice(0, len(sequence))
        input_ids[row, span] = torch.as_tensor(sequence, dtype=torch.long)
        attention_mask[row, span] = 1
    return input_ids.to(device), attention_mask.to(device)
