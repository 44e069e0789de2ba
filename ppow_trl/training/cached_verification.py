"""Greedy verification from the cached target text: PPOW's greedy rewards without a target forward.

Every training context is a prefix ``c = prompt + r_<s`` of a target response ``r``. When ``r`` is the target's own
greedy text, greedy verification of a window ``y`` drafted after ``c`` reads nothing the cache does not hold:

    a_i = [y_i == argmax p(. | c, y_<i)] = [y_i == r_{s+i}]     while y_<i == r_{s..s+i-1} (the cached path)
    A   = the leading run of a_i = 1 within the window's length L

and the target's greedy distribution at a verified position ``i`` (one-hot at its argmax) is ``onehot(r_{s+i})``.
Verification reaches positions ``i <= min(A + 1, L)``: the matched ones and the first mismatch, every one of them on
the cached path. So ``A``, ``R_speed`` and ``R_prox`` over the reached positions
(``ppow_trl.core.rollout.reached_positions``) need no target forward. The one case the cache cannot serve: a window
that matched every token left in the cached text and runs past its end (the response was cut at ``max_new_tokens``,
or the window continues past its EOS); that row is verified by the target, exactly as ``rollout.verify_windows``
would.

What the cache cannot give (use ``reward_source="target"``): T = 1 rewards (``E[A|y]`` and ``R_prox`` against
``p(. | c, y_<i)`` after a rejected-but-kept token sit off the cached path), ``R_prox`` over positions past the first
rejection, and contexts that are not the target's greedy text. The shortcut is exact when the cached token is the
target's argmax at every position; batched fp32 generation can differ from batch-1 teacher forcing at near-ties
(``benchmarks/cache_rewards.py`` measures how often).
"""

from __future__ import annotations

import torch

from ..core.rollout import VerifiedWindows, draft_windows, target_window_probs
from ..core.verification import window_prefix_acceptance
from ..core.windowing import AdaptiveWindowPolicy

PAST_TEXT = -1  # a position past the end of the cached text in ``next_tokens``


def cached_next_tokens(responses: list[torch.Tensor], starts, width: int) -> torch.Tensor:
    """``r_{s+1..s+width}`` of each ``(response, start)``: ``(C, width)`` long, ``PAST_TEXT`` past the text's end."""
    out = torch.full((len(responses), width), PAST_TEXT, dtype=torch.long)
    for row, (response, start) in enumerate(zip(responses, starts)):
        tail = torch.as_tensor(response, dtype=torch.long)[int(start): int(start) + width]
        out[row, : len(tail)] = tail
    return out


def one_hot_targets(next_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The target's greedy distributions on the cached path, ``onehot(r_{s+i})``: ``(C, width, V)`` float32, an all-zero
    row past the text (never read: a window reaching it is verified by the target)."""
    known = next_tokens != PAST_TEXT
    probs = torch.nn.functional.one_hot(next_tokens.clamp_min(0), vocab_size).float()
    return probs * known.unsqueeze(-1)


def leaves_cached_text(window_ids: torch.Tensor, window_mask: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
    """Rows whose verification reaches a position past the cached text: ``(B,)`` bool.

    Position ``i`` is reached when ``y_<i`` all matched and ``i <= L``; it is past the text when
    ``next_tokens[:, i - 1] == PAST_TEXT`` (``next_tokens`` holds ``K`` or more columns).
    """
    width = window_ids.shape[1]
    known = next_tokens[:, :width] != PAST_TEXT
    matched = (window_ids == next_tokens[:, :width]) & known
    reached = torch.cat([torch.ones_like(matched[:, :1]), matched[:, :-1].long().cumprod(-1).bool()], dim=-1)
    return (reached & window_mask & ~known).any(dim=-1)


@torch.no_grad()
def verify_windows_from_cache(
    drafter,
    contexts: list[torch.Tensor],
    next_tokens: torch.Tensor,
    policy: AdaptiveWindowPolicy,
    *,
    target=None,
    temperature: float = 1.0,
    pad_id: int = 0,
    vocab_size: int,
    generator: torch.Generator | None = None,
    num_samples_per_context: int = 1,
    features: list[torch.Tensor] | None = None,
) -> tuple[VerifiedWindows, int]:
    """``rollout.verify_windows(greedy=True)`` with the target's greedy text read from ``next_tokens`` (``(C, >= K + 1)``,
    the cached ``r_{s+1..}`` after each context, ``cached_next_tokens``).

    Windows are drafted as in ``verify_windows`` (same generator use, so the same windows). ``target_probs`` holds
    ``onehot(r_{s+i})``; rows leaving the cached text (``leaves_cached_text``) get the target's own greedy
    distributions from ``target_window_probs`` (``target`` is then required). Returns ``(verified, target_rows)``:
    ``target_rows`` is the number of windows the target verified.
    """
    group = num_samples_per_context
    if next_tokens.shape[0] != len(contexts) or next_tokens.shape[1] < policy.max_window + 1:
        raise ValueError(f"next_tokens must be (contexts, >= K + 1) = ({len(contexts)}, >= {policy.max_window + 1}), "
                         f"got {tuple(next_tokens.shape)}.")
    drafted = draft_windows(drafter, contexts, policy, pad_id=pad_id, temperature=temperature, vocab_size=vocab_size,
                            generator=generator, num_samples_per_context=group, target=target, features=features)
    device = drafted.window_ids.device
    width = drafted.window_ids.shape[1]
    rows_next = next_tokens[:, : width + 1].to(device).repeat_interleave(group, dim=0)
    target_probs = one_hot_targets(rows_next, vocab_size)
    off_path = leaves_cached_text(drafted.window_ids, drafted.window_mask, rows_next)
    rows = off_path.nonzero().squeeze(-1)
    if len(rows):
        if target is None:
            raise ValueError(f"{len(rows)} windows run past the cached text (the response ended): pass target= to "
                             "verify them.")
        row_contexts = [contexts[int(row) // group] for row in rows]
        target_probs[rows] = target_window_probs(target, row_contexts, drafted.window_ids[rows], pad_id=pad_id,
                                                 temperature=0.0, vocab_size=vocab_size).to(device)
    prefix = window_prefix_acceptance(drafted.window_ids, target_probs, drafted.drafter_probs, drafted.window_mask,
                                      greedy=True)
    return VerifiedWindows(drafted=drafted, target_probs=target_probs, prefix=prefix), len(rows)
