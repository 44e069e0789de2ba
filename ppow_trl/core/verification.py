"""Verification of drafted windows: the one implementation shared by rewards, generation and evaluation.

Shapes used throughout (batched over windows, masked for padding):

- ``window_ids``: ``(B, K)`` drafted tokens ``y_1..y_K`` (anything in padded slots).
- ``window_mask``: ``(B, K)`` bool, ``True`` for the ``L <= K`` drafted tokens of each row. Windows are
  contiguous, so the mask of a row is a prefix; ``L = 0`` (an empty window) is allowed.
- ``target_probs``: ``(B, K + 1, V)`` ``p_i = p(. | c, y_<i)`` for ``i = 1..K+1``; row ``b`` uses
  ``p_1..p_{L_b + 1}``, the last one being the bonus distribution after a fully accepted window.
- ``drafter_probs``: ``(B, K, V)`` ``q_i``, the distribution the drafter really sampled ``y_i`` from
  (same temperature and processors), or the distribution it argmax-ed for greedy drafting.

All arithmetic is done in float32, whatever the input dtype (fp16/bf16 probabilities lose too much
mass in the ratios ``p/q``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def probabilities_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``softmax(logits / T)`` in float32; ``T = 0`` gives the one-hot greedy distribution.

    Greedy decoding is speculative sampling with one-hot ``p`` and ``q``: then ``alpha_i`` is
    ``[y_i == argmax p_i]`` and the residual is the target's argmax, so one code path serves both.
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}.")
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return torch.softmax(logits / temperature, dim=-1)


def sample_categorical(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from each row of ``probs`` (last dim = vocabulary) by inverse CDF: ``min{i: F_i > u F_V}``. ``(...)``.

    Exact for the given distribution (zero-probability entries are never drawn) and several times faster than
    ``torch.multinomial`` over a 50k-150k vocabulary on a CPU; one uniform per row from ``generator``.
    """
    cdf = probs.float().cumsum(dim=-1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=cdf.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_max(probs.shape[-1] - 1)


def lengths_to_mask(window_lengths: torch.Tensor, max_window: int) -> torch.Tensor:
    """``(B,)`` window lengths ``L`` -> ``(B, K)`` bool mask ``[i < L]``."""
    positions = torch.arange(max_window, device=window_lengths.device)
    return positions.unsqueeze(0) < window_lengths.unsqueeze(-1)


def _check_window_shapes(window_ids, window_mask, target_probs, drafter_probs=None) -> None:
    batch, max_window = window_ids.shape
    if window_mask.shape != window_ids.shape:
        raise ValueError(f"window_mask {tuple(window_mask.shape)} must match window_ids {tuple(window_ids.shape)}.")
    if target_probs.shape[:2] != (batch, max_window + 1):
        raise ValueError(
            f"target_probs must be (B, K + 1, V) = ({batch}, {max_window + 1}, V): one distribution per drafted "
            f"token plus the bonus position; got {tuple(target_probs.shape)}."
        )
    if drafter_probs is not None:
        if drafter_probs.shape[:2] != (batch, max_window) or drafter_probs.shape[-1] != target_probs.shape[-1]:
            raise ValueError(
                f"drafter_probs must be (B, K, V) = ({batch}, {max_window}, {target_probs.shape[-1]}); got "
                f"{tuple(drafter_probs.shape)}. Slice both models' logits to the shared vocabulary first "
                "(ppow_trl.models.check_compatibility)."
            )


def leading_run_length(accepted: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """Length of the leading run of ``True`` in ``accepted & window_mask`` per row: ``(B, K) -> (B,)``."""
    return (accepted & window_mask).long().cumprod(dim=-1).sum(dim=-1)


def greedy_acceptance(window_ids: torch.Tensor, target_probs: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """``a_i = [y_i == argmax p_i]`` for drafted positions, ``False`` on padding. ``(B, K)`` bool.

    ``target_probs`` may also be logits: only the argmax is used.
    """
    _check_window_shapes(window_ids, window_mask, target_probs)
    target_argmax = target_probs[:, :-1].argmax(dim=-1)
    return (window_ids == target_argmax) & window_mask


def greedy_accepted_length(window_ids: torch.Tensor, target_probs: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """Greedy accepted length ``A`` = length of the leading run of ``a_i = 1``. ``(B,)`` long."""
    return leading_run_length(greedy_acceptance(window_ids, target_probs, window_mask), window_mask)


def acceptance_probabilities(
    window_ids: torch.Tensor,
    target_probs: torch.Tensor,
    drafter_probs: torch.Tensor,
    window_mask: torch.Tensor,
) -> torch.Tensor:
    """``alpha_i = min(1, p_i(y_i) / q_i(y_i))`` on drafted positions, 0 on padding. ``(B, K)`` float32.

    Edge cases: ``q_i(y_i) = 0`` (a token the drafter could not have sampled, e.g. after top-k) is
    accepted iff ``p_i(y_i) > 0``, the limit of the ratio; ``p_i(y_i) = 0`` gives 0.
    """
    _check_window_shapes(window_ids, window_mask, target_probs, drafter_probs)
    index = window_ids.unsqueeze(-1)
    p = target_probs[:, :-1].float().gather(-1, index).squeeze(-1)
    q = drafter_probs.float().gather(-1, index).squeeze(-1)
    ratio = p / q.clamp_min(torch.finfo(torch.float32).tiny)
    alpha = torch.where(q > 0, ratio.clamp(max=1.0), (p > 0).float())
    return alpha * window_mask


def prefix_acceptance_probabilities(alpha: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """``P(A >= k | y) = prod_{i<=k} alpha_i`` for ``k = 1..K`` (0 beyond ``L``). ``(B, K)``.

    These are the per-token credit terms: drafted token ``k`` yields a token iff all of ``1..k`` are
    accepted.
    """
    return (alpha.float() * window_mask).cumprod(dim=-1)


def expected_accepted_length(alpha: torch.Tensor, window_mask: torch.Tensor) -> torch.Tensor:
    """Closed form ``E[A | y] = sum_{k=1..L} prod_{i<=k} alpha_i`` under speculative sampling. ``(B,)``.

    Since ``A >= k`` iff the first ``k`` tokens are all accepted, ``E[A] = sum_k P(A >= k)``.
    """
    return prefix_acceptance_probabilities(alpha, window_mask).sum(dim=-1)


def window_prefix_acceptance(
    window_ids: torch.Tensor,
    target_probs: torch.Tensor,
    drafter_probs: torch.Tensor,
    window_mask: torch.Tensor,
    greedy: bool = False,
) -> torch.Tensor:
    """``P(A >= k | y)`` for ``k = 1..K``, under either verification. ``(B, K)`` float32.

    Greedy: the 0/1 indicators ``[A >= k]`` of the leading matches with the target's argmax. Speculative
    sampling: ``prod_{i<=k} alpha_i``. Summing over ``k`` gives ``A`` or ``E[A|y]``; a shorter window's
    value is a prefix sum (what window-policy calibration uses).
    """
    if greedy:
        return greedy_acceptance(window_ids, target_probs, window_mask).long().cumprod(dim=-1).float()
    alpha = acceptance_probabilities(window_ids, target_probs, drafter_probs, window_mask)
    return prefix_acceptance_probabilities(alpha, window_mask)


def residual_distribution(target_probs: torch.Tensor, drafter_probs: torch.Tensor) -> torch.Tensor:
    """``norm(max(p - q, 0))`` over the last dimension: what to sample after rejecting a drafted token.

    When ``p == q`` the residual has no mass, but then a rejection has probability 0; we return
    ``p`` there so that the result is always a distribution (never NaN).
    """
    residual = (target_probs.float() - drafter_probs.float()).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(torch.float32).tiny), target_probs.float())


@dataclass
class VerificationResult:
    """Outcome of verifying a batch of windows.

    ``accepted_length`` (B,): number of drafted tokens kept; ``next_token`` (B,): the target's token
    appended after them (the correction after a rejection, or the bonus token after a full window).
    A round therefore yields ``accepted_length + 1`` tokens.
    """

    accepted_length: torch.Tensor
    next_token: torch.Tensor


def greedy_verify(window_ids: torch.Tensor, target_probs: torch.Tensor, window_mask: torch.Tensor) -> VerificationResult:
    """Greedy verification: keep the leading matches, then append ``argmax p_{A+1}``."""
    accepted = greedy_accepted_length(window_ids, target_probs, window_mask)
    at_next = target_probs.gather(1, accepted.view(-1, 1, 1).expand(-1, 1, target_probs.shape[-1])).squeeze(1)
    return VerificationResult(accepted_length=accepted, next_token=at_next.argmax(dim=-1))


def greedy_verify_one(window: list[int], target_logits: torch.Tensor) -> tuple[int, int]:
    """``greedy_verify`` of one window from the target's logits ``(L + 1, V)`` at its positions, without building the
    one-hot ``p``: ``A = #leading i with y_i == argmax z_i`` and the next token ``argmax z_{A+1}``. The generation
    loop's greedy path: one argmax per row instead of a one-hot over the vocabulary and a gather (about 0.4 ms a
    round on a 49k vocabulary, over 1% of a compiled SmolLM2-135M step)."""
    choices = target_logits.argmax(dim=-1).tolist()
    accepted = 0
    while accepted < len(window) and window[accepted] == choices[accepted]:
        accepted += 1
    return accepted, choices[accepted]


def speculative_sampling_verify(
    window_ids: torch.Tensor,
    target_probs: torch.Tensor,
    drafter_probs: torch.Tensor,
    window_mask: torch.Tensor,
    generator: torch.Generator | None = None,
) -> VerificationResult:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    Accept ``y_i`` with probability ``alpha_i`` until the first rejection at position ``j``; then sample
    the next token from ``norm(max(p_j - q_j, 0))``; if all ``L`` tokens are accepted, sample the bonus
    token from ``p_{L+1}``. The emitted tokens are distributed exactly as the target's samples.
    """
    alpha = acceptance_probabilities(window_ids, target_probs, drafter_probs, window_mask)
    uniform = torch.rand(alpha.shape, generator=generator, device=alpha.device)
    accepted = leading_run_length(uniform < alpha, window_mask)
    window_lengths = window_mask.sum(dim=-1)
    vocab = target_probs.shape[-1]
    p_next = target_probs.float().gather(1, accepted.view(-1, 1, 1).expand(-1, 1, vocab)).squeeze(1)
    # q at the rejected position; rows with a full window have no such position (clamped, unused).
    q_index = accepted.clamp(max=window_ids.shape[1] - 1) if window_ids.shape[1] > 0 else accepted
    if window_ids.shape[1] > 0:
        q_next = drafter_probs.float().gather(1, q_index.view(-1, 1, 1).expand(-1, 1, vocab)).squeeze(1)
    else:
        q_next = torch.zeros_like(p_next)
    rejected = (accepted < window_lengths).unsqueeze(-1)
    next_probs = torch.where(rejected, residual_distribution(p_next, q_next), p_next)
    next_token = sample_categorical(next_probs, generator)
    return VerificationResult(accepted_length=accepted, next_token=next_token)


def acceptance_histogram(accepted_lengths: list[int], max_window: int) -> list[int]:
    """``hist[a]`` = number of rounds whose verifier accepted ``a`` drafted tokens, ``a = 0..K`` (``K = max_window``).

    ``accepted_lengths``: one ``A`` per round, each in ``[0, K]`` (a value outside raises ``ValueError``).
    """
    hist = [0] * (max_window + 1)
    for accepted in map(int, accepted_lengths):
        if not 0 <= accepted <= max_window:
            raise ValueError(f"accepted length {accepted} lies outside [0, {max_window}] (max_window).")
        hist[accepted] += 1
    return hist
