"""Speculative decoding with a PPOW drafter and its adaptive window rule (batch size 1).

Each round the drafter proposes up to ``K`` tokens one by one while ``policy.keep_drafting`` holds for
the running product of its confidences; one target forward scores the window (plus the bonus
position); the core verification functions decide what is kept; both models keep their KV caches
across rounds and are cropped after a rejection.

Counting conventions (stated wherever tau is printed, see docs/ppow.md "Evaluation protocol"):

- The target is prefilled with the prompt minus its last token (no logits are needed there). Every
  round then runs exactly one target forward over ``[last committed token] + window``, which gives
  ``p_1..p_{L+1}``. So every generated token comes from a verification round.
- ``target_forwards`` counts every target forward call, the prefill included (0 prefill calls for a
  one-token prompt). ``verification_forwards`` (= rounds) excludes the prefill.
- ``tau = tokens generated / verification forwards``: the mean number of tokens a round yields,
  bonus/correction token included (EAGLE's convention: the prefill is not a decoding step). A
  round yields ``A + 1`` tokens, fewer only in the last round when it is cut at the first EOS.
- Windows are capped at ``max_new_tokens - generated - 1`` tokens (as HF's assisted generation does):
  a round can never overshoot ``max_new_tokens``, so drafting tokens that would be thrown away is
  avoided; with one token left the round verifies an empty window (a plain target step).

Greedy mode (``do_sample=False``): the drafter proposes ``argmax`` of its logits and ``greedy_verify_one``
keeps the leading tokens equal to the target's ``argmax`` (``greedy_verify`` with a one-hot ``p``, without
building it). Sampling mode:
``q = softmax(drafter_logits / temperature)`` is sampled and ``p`` uses the same temperature;
``speculative_sampling_verify`` decides, so the output is distributed as the target's own samples at
that temperature. In both modes the window rule uses the policy's confidences
``conf = max softmax(drafter_logits / policy.confidence_temperature)`` (``AdaptiveWindowPolicy.confidence``),
the same definition as training rollouts, the HF hook and calibration.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from time import perf_counter

import torch

from ..drafting import check_window, drafting_session
from ..features import forward_at
from ..models import logits_width
from ..utils import crop_cache
from ..core.verification import (
    acceptance_histogram,
    greedy_verify_one,
    probabilities_from_logits,
    sample_categorical,
    speculative_sampling_verify,
)
from ..metrics.speculative_decoding.summary import TAU_CONVENTION  # the one text, also the metric module's
from ..core.windowing import AdaptiveWindowPolicy



@dataclass
class SpeculativeOutput:
    """Result of ``speculative_generate``.

    ``sequences`` (1, prompt + new); ``new_tokens`` the generated ids; ``target_forwards`` every target
    forward call, the prefill included; ``prefill_forwards`` how many of those were the prefill (0 or 1);
    per round: ``drafted_per_round`` = ``window_lengths`` (``L``, tokens drafted = tokens verified),
    ``accepted_per_round`` (``A`` as returned by the verifier, before any EOS cut) and
    ``tokens_per_round`` (tokens appended: ``A + 1``, fewer only when cut after an EOS).
    """

    sequences: torch.Tensor
    new_tokens: list[int]
    target_forwards: int
    prefill_forwards: int
    drafter_forwards: int
    drafted_per_round: list[int]
    accepted_per_round: list[int]
    tokens_per_round: list[int]
    max_window: int
    finished_by_eos: bool = False
    guard_decisions: list[bool] | None = None  # per round, whether the guard let it draft (None: no guard)
    round_seconds: list[float] = field(default_factory=list)  # per round, its wall time (drafting, verify, host work)
    free_per_round: list[int] = field(default_factory=list)  # per round, drafted tokens no drafter forward ran for
    free_drafted: int = 0  # drafted tokens whose drafter forward did not run (a hybrid's lookups): not charged t_d

    @property
    def window_lengths(self) -> list[int]:
        """Window length ``L`` of each round (every drafted token is verified, so = ``drafted_per_round``)."""
        return self.drafted_per_round

    @property
    def num_rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def verification_forwards(self) -> int:
        """Target forwards excluding the prefill: one per round."""
        return self.target_forwards - self.prefill_forwards

    @property
    def tau(self) -> float:
        """Tokens generated per verification forward (prefill excluded, bonus token included)."""
        return len(self.new_tokens) / self.verification_forwards

    @property
    def tau_with_prefill(self) -> float:
        """Tokens generated per target forward, the prefill counted as one forward."""
        return len(self.new_tokens) / self.target_forwards

    def acceptance_histogram(self) -> list[int]:
        """``hist[a]`` = number of rounds whose verifier accepted ``a`` drafted tokens, ``a = 0..K``."""
        return acceptance_histogram(self.accepted_per_round, self.max_window)


@dataclass
class ExactGreedyTau:
    """What ``exact_greedy_tau`` derives without running the loop (the same fields as the live loop's).

    ``drafted_per_round`` is not included: after the first mismatch in a window, how many more tokens
    the drafter proposes depends on confidences conditioned on its own wrong token, which the
    teacher-forced pass does not see (and which change neither ``A`` nor the output).
    """

    tau: float
    num_rounds: int
    new_tokens: list[int]
    accepted_per_round: list[int]
    tokens_per_round: list[int]
    target_forwards: int
    prefill_forwards: int
    max_window: int
    convention: str = field(default=TAU_CONVENTION)

    def acceptance_histogram(self) -> list[int]:
        return acceptance_histogram(self.accepted_per_round, self.max_window)


def _eos_set(target, eos_token_id) -> set[int]:
    """``None`` -> the target's ``generation_config.eos_token_id`` (as ``generate`` does); ``[]`` disables EOS."""
    if eos_token_id is None:
        config = getattr(target, "generation_config", None)
        eos_token_id = getattr(config, "eos_token_id", None)
        if eos_token_id is None:
            return set()
    if isinstance(eos_token_id, torch.Tensor):
        eos_token_id = eos_token_id.tolist()
    if isinstance(eos_token_id, int):
        return {eos_token_id}
    if isinstance(eos_token_id, Iterable):
        return {int(t) for t in eos_token_id}
    raise ValueError(f"eos_token_id must be an int, a list of ints or None; got {eos_token_id!r}.")


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _shared_vocab(target, drafter, vocab_size) -> int:
    target_width, drafter_width = logits_width(target), logits_width(drafter)
    if vocab_size is None:
        if target_width != drafter_width:
            raise ValueError(
                f"The target returns {target_width} logits and the drafter {drafter_width}: pass "
                "vocab_size=ppow_trl.check_compatibility(target, drafter, tokenizer) to compare the shared "
                "vocabulary only."
            )
        return target_width
    vocab_size = int(vocab_size)
    if not 0 < vocab_size <= min(target_width, drafter_width):
        raise ValueError(
            f"vocab_size={vocab_size} must lie in [1, {min(target_width, drafter_width)}] (the target has "
            f"{target_width} logits, the drafter {drafter_width}); see ppow_trl.check_compatibility."
        )
    return vocab_size


def _check_inputs(input_ids, max_new_tokens, policy) -> list[int]:
    input_ids = torch.as_tensor(input_ids)
    if input_ids.ndim == 1:
        input_ids = input_ids.unsqueeze(0)
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (1, T); got shape {tuple(input_ids.shape)}.")
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"speculative_generate supports batch size 1 only (the evaluation protocol's setting); got a batch of "
            f"{input_ids.shape[0]}. Call it once per prompt."
        )
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: give at least one token.")
    if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}.")
    if not isinstance(policy, AdaptiveWindowPolicy):
        raise ValueError(f"policy must be an AdaptiveWindowPolicy, got {type(policy).__name__}.")
    return input_ids[0].tolist()


def _truncate_at_eos(tokens: list[int], eos: set[int]) -> tuple[list[int], bool]:
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1], True
    return tokens, False


def model_steps(session) -> int:
    """Drafter forwards the session ran so far: a hybrid's inner drafter's (``model_forwards``: its lookups run
    none), every other session's ``forwards``."""
    return int(getattr(session, "model_forwards", getattr(session, "forwards", 0)))


def round_cap(policy: AdaptiveWindowPolicy, guard, room: int, previous: tuple[int, ...] | None) -> int:
    """The most tokens this round drafts: ``K`` (0 while the guard pauses), at most ``room``. A drafting round first
    hands the guard the previous drafting round's ``(A, L, F, D)``: accepted, drafted, drafted free, and drafter
    steps spent on a dropped first token (``empty_windows``) (``SpeculationGuard``'s protocol, the one HF's loop
    imposes); call once per round."""
    drafting = guard is None or guard.decide()
    cap = min(policy.max_window if drafting else 0, room)
    if guard is not None and cap > 0 and previous is not None:
        guard.record(*previous)
    return cap


@torch.no_grad()
def speculative_generate(
    target,
    drafter,
    input_ids,
    *,
    policy: AdaptiveWindowPolicy,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    eos_token_id=None,
    vocab_size: int | None = None,
    generator: torch.Generator | None = None,
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` tokens after ``input_ids`` (1, T) with speculative decoding.

    Greedy (``do_sample=False``) output equals ``target.generate(do_sample=False)`` token for token;
    sampled output is distributed as the target's samples at ``temperature``. ``eos_token_id``: an int
    or a list; ``None`` uses ``target.generation_config.eos_token_id`` like ``generate`` (pass ``[]``
    for none). ``vocab_size``: the shared vocabulary (``ppow_trl.check_compatibility``); both models'
    logits are sliced to it. See the module docstring for the counting conventions (tau).
    """
    prompt = _check_inputs(input_ids, max_new_tokens, policy)
    if temperature <= 0:
        raise ValueError(
            f"temperature must be > 0, got {temperature} (use do_sample=False for greedy decoding; greedy decoding "
            "ignores temperature)."
        )
    vocab = _shared_vocab(target, drafter, vocab_size)
    eos = _eos_set(target, eos_token_id)

    sequence = list(prompt)
    new_tokens: list[int] = []
    session = drafting_session(drafter, target)
    check_window(session, policy.max_window)
    layer_ids = session.target_layer_ids  # None for standalone drafters: the target returns no features
    target_cache = None
    target_forwards = prefill_forwards = 0
    drafted, accepted_counts, emitted, seconds, free = [], [], [], [], []
    finished_by_eos = False

    if len(prompt) > 1:  # the target's cache holds every committed token but the last one
        out, features = forward_at(target, prompt[:-1], None, 0, layer_ids, logits_to_keep=1)
        target_cache = out.cache
        session.add_features(features)
        prefill_forwards = target_forwards = 1
    guard = policy.new_guard()
    previous = None  # (A, L, F) of the last drafting round, handed to the guard when the next one starts

    while not finished_by_eos and len(new_tokens) < max_new_tokens:
        started = perf_counter()
        committed = len(sequence)
        cap = round_cap(policy, guard, max_new_tokens - len(new_tokens) - 1, previous)
        free_before, steps_before = getattr(session, "looked_up", 0), model_steps(session)
        window: list[int] = []
        drafter_probs: list[torch.Tensor] = []
        # every committed token the drafter has not read yet (None: nothing to draft from yet)
        logits = session.extend(sequence) if cap > 0 else None
        if logits is not None:
            running = torch.ones((), device=logits.device)
            for step in range(cap):
                step_logits = logits[-1, :vocab]
                if do_sample:
                    q = probabilities_from_logits(step_logits, temperature)
                    token = int(sample_categorical(q, generator))
                    drafter_probs.append(q)
                else:  # greedy verification never reads q
                    token = int(step_logits.argmax())
                window.append(token)
                running = running * policy.confidence(step_logits)
                if step == 0 and not bool(policy.drafts_first(running)):  # empty_windows: a plain step
                    window.clear()
                    drafter_probs.clear()
                    break
                if step + 1 == cap or not bool(policy.keep_drafting(running, step + 1)):
                    break
                logits = session.step(torch.tensor([token], device=logits.device))

        length = len(window)
        verify_start = committed - 1
        out, features = forward_at(target, sequence[verify_start:] + window, target_cache, verify_start, layer_ids)
        logits, target_cache = out.logits[0], out.cache
        target_forwards += 1
        if do_sample:
            target_device = logits.device
            p = probabilities_from_logits(logits[-(length + 1) :, :vocab], temperature).unsqueeze(0)
            window_ids = torch.tensor([window], dtype=torch.long, device=target_device).view(1, length)
            window_mask = torch.ones((1, length), dtype=torch.bool, device=target_device)
            q_stack = (
                torch.stack(drafter_probs).to(target_device).unsqueeze(0)
                if length
                else p.new_zeros((1, 0, p.shape[-1]))
            )
            result = speculative_sampling_verify(window_ids, p, q_stack, window_mask, generator=generator)
            accepted, next_token = int(result.accepted_length[0]), int(result.next_token[0])
        else:
            accepted, next_token = greedy_verify_one(window, logits[-(length + 1) :, :vocab])
        round_tokens = window[:accepted] + [next_token]
        round_tokens = round_tokens[: max_new_tokens - len(new_tokens)]  # never cuts: windows are capped
        round_tokens, finished_by_eos = _truncate_at_eos(round_tokens, eos)

        # Both models keep only the committed prefix: the target cached [..., last] + window, the drafter the
        # committed tokens + window[:-1]; valid is what lies before the next token. The verified positions'
        # features (the last committed token and the accepted ones) go to a feature-conditioned drafter.
        crop_cache(target_cache, committed + accepted)
        session.rollback(committed + accepted)
        if features is not None:
            session.add_features(features[0, : accepted + 1])
        sequence.extend(round_tokens)
        new_tokens.extend(round_tokens)
        drafted.append(length)
        accepted_counts.append(accepted)
        emitted.append(len(round_tokens))
        free.append(min(getattr(session, "looked_up", 0) - free_before, length))  # a dropped lookup is not drafted
        if cap > 0:  # a drafting round, empty ones included: the drafter step of a dropped first token is charged
            previous = (accepted, length, free[-1], max(0, model_steps(session) - steps_before - (length - free[-1])))
        seconds.append(perf_counter() - started)

    device = input_ids.device if isinstance(input_ids, torch.Tensor) else torch.device("cpu")
    return SpeculativeOutput(
        sequences=torch.tensor([sequence], dtype=torch.long, device=device),
        new_tokens=new_tokens,
        target_forwards=target_forwards,
        prefill_forwards=prefill_forwards,
        drafter_forwards=session.forwards,  # one per round for block drafters
        free_drafted=sum(free),  # lookups drafted (one dropped by an empty window is not)
        drafted_per_round=drafted,
        accepted_per_round=accepted_counts,
        tokens_per_round=emitted,
        max_window=policy.max_window,
        finished_by_eos=finished_by_eos,
        guard_decisions=None if guard is None else list(guard.decisions),
        round_seconds=seconds,
        free_per_round=free,
    )


@torch.no_grad()
def greedy_continuation(target, prompt: list[int], num_tokens: int, vocab: int) -> list[int]:
    """The target's greedy text, ``num_tokens`` tokens, not stopping at EOS (KV-cached, one token a step)."""
    out, _ = forward_at(target, prompt, None, 0, logits_to_keep=1)
    tokens = []
    for step in range(num_tokens):
        token = int(out.logits[0, -1, :vocab].argmax())
        tokens.append(token)
        if step + 1 < num_tokens:
            out, _ = forward_at(target, [token], out.cache, len(prompt) + step)
    return tokens


@torch.no_grad()
def exact_greedy_tau(
    target,
    drafter,
    input_ids,
    *,
    policy: AdaptiveWindowPolicy,
    max_new_tokens: int,
    eos_token_id=None,
    vocab_size: int | None = None,
    continuation: list[int] | None = None,
) -> ExactGreedyTau:
    """tau of greedy ``speculative_generate`` without running its loop.

    One target greedy pass gives the text ``x_1..x_M`` (``M = max_new_tokens``, not stopped at EOS);
    one drafter teacher-forced pass over ``prompt + x`` gives, at each position ``t``, the drafter's
    proposal ``g_t`` and confidence ``c_t`` (conditioned on ``prompt + x_<t``). A round starting after
    ``s`` committed tokens drafts ``y_i``; while ``y_1..y_{i-1}`` matched, the drafter's state is
    ``prompt + x_<s+i``, so ``y_i = g_{s+i}`` and its confidence is ``c_{s+i}``. Let ``J`` = leading
    matches ``g_{s+i} == x_{s+i}`` and ``L`` the window length. Then ``A = min(J, L)``, and
    ``L > J`` vs ``L <= J`` (and ``L`` itself when ``L <= J``) depends only on the keep-drafting
    decisions after ``i <= J`` tokens, i.e. on ``c_{s+1..s+J}``: all teacher-forced. Confidences after
    the first mismatch are the drafter's real ones conditioned on its wrong token, but they only
    decide how many more (rejected) tokens are drafted, never ``A``. Hence
    ``A = min(J, policy.window_lengths(c_{s+1..}), cap)`` with the same cap as the loop, the round
    yields ``x_{s+1..s+A+1}``, and the run ends once the first EOS or ``M`` tokens are covered.
    Confidences are the policy's (``policy.confidence``), as in the loop. A feature-conditioned chain drafter
    (EAGLE-3) feeds its own hidden state back from slot 2 on, so its slot ``i`` is not the teacher-forced row
    ``s + i``: there it is the training-time-test unroll's step ``i - 1`` at start ``s``, which is again what the
    loop drafts while ``y_<i`` matched (``ppow_trl.drafting``); the target's features come from one teacher-forced
    target pass over ``prompt + x`` (so ``continuation`` then saves only the greedy generation). ``continuation``: the target's
    greedy continuation of the prompt when already known (``max_new_tokens`` tokens, or fewer ending at an
    EOS; e.g. cached by the trainer's evaluation or regenerated data), which saves the target pass; it is
    trusted as given.
    """
    prompt = _check_inputs(input_ids, max_new_tokens, policy)
    vocab = _shared_vocab(target, drafter, vocab_size)
    eos = _eos_set(target, eos_token_id)

    if continuation is None:
        text = greedy_continuation(target, prompt, max_new_tokens, vocab)
    else:
        text = [int(t) for t in continuation[:max_new_tokens]]
        # A text that stops at an EOS is complete: the loop stops there, nothing after it is read.
        if len(text) < max_new_tokens and not _truncate_at_eos(text, eos)[1]:
            raise ValueError(f"continuation has {len(text)} tokens and no EOS, max_new_tokens is {max_new_tokens}: "
                             "give the target's greedy text up to max_new_tokens tokens or its first EOS.")
    generated, _ = _truncate_at_eos(text, eos)
    total = len(generated)
    text = text[: max(total, 1)] if len(text) < max_new_tokens else text

    # Window slot k of a round starting after text[:s], teacher-forced (row s): the drafter's proposal and
    # confidence while its first k proposals matched; slots past the text are never read (the cap).
    session = drafting_session(drafter, target)
    check_window(session, policy.max_window)
    features = None
    if session.target_layer_ids is not None:  # one teacher-forced target pass gives the features
        features = forward_at(target, prompt + text, None, 0, session.target_layer_ids, logits_to_keep=1)[1][0]
    truth = torch.tensor(text, dtype=torch.long)
    proposals = torch.zeros(len(text), policy.max_window, dtype=torch.long)
    confidences = torch.zeros(len(text), policy.max_window)
    for slot, logits in (session.teacher_forced_logits(prompt, text, policy.max_window, features)
                         if policy.max_window else ()):  # K = 0: no speculation, nothing to draft
        logits = logits[:, :vocab]
        proposals[:, slot] = logits.argmax(-1).cpu()
        confidences[:, slot] = policy.confidence(logits).float().cpu()
    # slot k of row s matches when it proposes text[s + k]
    shifted = torch.full_like(proposals, -1)
    for k in range(min(policy.max_window, len(text))):
        shifted[: len(text) - k, k] = truth[k:]
    matches = proposals == shifted

    done = 0
    accepted_counts, emitted = [], []
    # The loop's guard, replayed: it reads each drafting round's (A, L, F); L is the teacher-forced window's length,
    # the served one unless the window went on past the token after its first rejection (SpeculationGuard)
    guard, previous = policy.new_guard(fresh=True), None  # as the first generation served
    while done < total:
        cap = round_cap(policy, guard, max_new_tokens - done - 1, previous)
        if cap > 0:
            leading = int(matches[done, :cap].long().cumprod(0).sum())
            length = min(int(policy.window_lengths(confidences[done].unsqueeze(0))[0]), cap)
            accepted = min(leading, length)
            previous = (accepted, length, 0, int(length == 0))  # an empty round ran the drafter for its first token
        else:
            accepted = 0
        tokens = min(accepted + 1, total - done)
        accepted_counts.append(accepted)
        emitted.append(tokens)
        done += tokens

    prefill = 1 if len(prompt) > 1 else 0
    rounds = len(accepted_counts)
    return ExactGreedyTau(
        tau=total / rounds,
        num_rounds=rounds,
        new_tokens=generated,
        accepted_per_round=accepted_counts,
        tokens_per_round=emitted,
        target_forwards=rounds + prefill,
        prefill_forwards=prefill,
        max_window=policy.max_window,
    )
