"""Training contexts for PPOW: every prefix of a target-generated response, and which ones to train on.

A *candidate* is a pair (sequence, start): the context ``prompt_ids + response_ids[:start]`` after
which the drafter proposes a window. Candidates are numbered sequence-major: sequence ``s`` owns
``offsets[s] .. offsets[s] + lengths[s] - 1``. ``ContextPool`` turns a dataset of target responses into
the candidate dataset GRPOTrainer iterates over; ``score_sequences`` scores every candidate of a batch
of sequences; ``ContextSelector`` draws the contexts of each generation round with probability
``~ (s_t + eps)^beta`` (mixed with a uniform share), hierarchically (a sequence, then a start in it), so
no draw ever needs a distribution over every candidate of the pool.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset

from ..batching import left_pad, positions_from_mask
from ..drafting import family_of, target_layer_ids
from ..features import target_forward
from ..core.verification import probabilities_from_logits
from ..core.windowing import divergence_scores

SELECTOR_STATE_FILE = "ppow_context_selector.pt"
LEGACY_SELECTOR_STATE_FILE = "ppow_context_selector.json"  # written before the tensor file; still loads
# torch.multinomial refuses more categories than this.
MAX_MULTINOMIAL_CATEGORIES = 1 << 24
# An integer ``num_candidates`` given to ContextSelector (no sequence structure) is grouped in blocks this long.
_BLOCK = 4096


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(lengths, 0) - lengths


class ContextPool:
    """Token ids of target-generated sequences and the numbering of their window starts (candidates).

    Args:
        dataset: rows with ``prompt_ids`` and ``response_ids`` (``ppow_trl.data.build_target_responses``).
        max_context_length: contexts longer than this (the models' limit minus room for a window)
            are an error raised here, before any training.

    Attributes:
        lengths: ``(S,)`` candidates (= response tokens) per sequence; ``ContextSelector(pool.lengths, ...)``.
        offsets: ``(S,)`` index of each sequence's first candidate.
    """

    def __init__(self, dataset: Dataset, max_context_length: int | None = None):
        missing = {"prompt_ids", "response_ids"} - set(dataset.column_names)
        if missing:
            raise ValueError(
                f"The training dataset lacks {sorted(missing)}: PPOWTrainer trains on target-generated responses. "
                "Build them with ppow_trl.data.build_target_responses(target, tokenizer, prompts)."
            )
        self.prompts = [torch.tensor(ids, dtype=torch.long) for ids in dataset["prompt_ids"]]
        self.responses = [torch.tensor(ids, dtype=torch.long) for ids in dataset["response_ids"]]
        lengths = torch.tensor([len(r) for r in self.responses], dtype=torch.long)
        if len(self.responses) == 0 or lengths.sum() == 0:
            raise ValueError("The training dataset holds no response tokens: there is no context to draft after.")
        if any(len(p) == 0 for p in self.prompts):
            raise ValueError("A row of the training dataset has empty prompt_ids; every context needs a prompt.")
        if max_context_length is not None:
            longest = max(len(p) + len(r) for p, r in zip(self.prompts, self.responses))
            if longest > max_context_length:
                raise ValueError(
                    f"A training sequence has {longest} tokens but contexts may have at most {max_context_length} "
                    "(the models' max_position_embeddings minus max_window + 1). Regenerate with a smaller "
                    "max_new_tokens / max_prompt_length, or filter long rows."
                )
        self.lengths = lengths
        self.offsets = _offsets(lengths)
        self._ends = torch.cumsum(lengths, 0)

    def __len__(self) -> int:
        return int(self._ends[-1])

    def locate(self, candidates) -> tuple[torch.Tensor, torch.Tensor]:
        """``(sequence, start)`` of each candidate index (a binary search: no per-candidate table is kept)."""
        candidates = torch.as_tensor(candidates, dtype=torch.long)
        if candidates.numel() and (candidates.min() < 0 or candidates.max() >= len(self)):
            raise IndexError(f"Candidate indices must lie in [0, {len(self)}).")
        sequence = torch.searchsorted(self._ends, candidates, right=True)
        return sequence, candidates - self.offsets[sequence]

    def context(self, index: int) -> list[int]:
        sequence, start = (int(t) for t in self.locate(int(index)))
        return torch.cat([self.prompts[sequence], self.responses[sequence][:start]]).tolist()

    def candidates_of(self, sequences) -> torch.Tensor:
        """The candidate indices of ``sequences``, in that order (each sequence's starts ascending)."""
        parts = [self.offsets[s] + torch.arange(int(self.lengths[s])) for s in sequences]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def candidate_dataset(self) -> Dataset:
        """The dataset GRPOTrainer iterates: a ``candidate`` index, and ``prompt`` = the context's token ids.

        ``prompt`` is built lazily (``with_transform``): storing every prefix would take quadratic space.
        """

        def add_prompt(batch):
            batch["prompt"] = [self.context(i) for i in batch["candidate"]]
            return batch

        return Dataset.from_dict({"candidate": np.arange(len(self), dtype=np.int64)}).with_transform(add_prompt)

    def sequence_ids(self, sequence: int) -> torch.Tensor:
        return torch.cat([self.prompts[sequence], self.responses[sequence]])


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _response_probs(target, drafter, ids, mask, positions, keep: int, vocab_size: int, target_temperature: float,
                    drafter_temperature: float, layer_ids=None, greedy_from_text: bool = False):
    """``(p, q)`` at the last ``keep - 1`` scoring positions of a left-padded batch, ``(B, keep - 1, V)`` each: the
    target's next-token distributions and the drafter's first window token after each prefix (its family's
    ``response_distributions``). The target's forward also gives the features a feature-conditioned drafter reads
    (``layer_ids``), so no second target pass runs. ``greedy_from_text``: the sequences are the target's greedy text,
    so its greedy ``p`` at each position is the one-hot of the next token of ``ids`` and the target runs only for
    features (``ppow_trl.training.cached_verification``)."""
    features = None
    if greedy_from_text:
        p = torch.nn.functional.one_hot(ids[:, -(keep - 1):], vocab_size).float()
    if layer_ids is not None or not greedy_from_text:
        device = _model_device(target)
        out, features = target_forward(target, layer_ids, input_ids=ids.to(device), attention_mask=mask.to(device),
                                       position_ids=positions.to(device), logits_to_keep=keep, use_cache=False)
        if not greedy_from_text:
            # logits_to_keep keeps the last `keep` positions; the very last one predicts past the sequence's end.
            p = probabilities_from_logits(out.logits[:, -keep:-1, :vocab_size], target_temperature)
    device = _model_device(drafter)
    logits, _ = family_of(drafter).response_distributions(drafter, ids.to(device), mask.to(device),
                                                          positions.to(device), keep, target=target,
                                                          features=features)
    return p, probabilities_from_logits(logits[..., :vocab_size], drafter_temperature)


@torch.no_grad()
def score_sequences(target, drafter, sequences, prompt_lengths, *, vocab_size: int, target_temperature: float = 1.0,
                    drafter_temperature: float = 1.0, kind: str = "kl", pad_id: int = 0, batch_size: int = 8,
                    max_batch_logits: int = 1 << 26, greedy_from_text: bool = False) -> list[torch.Tensor]:
    """``s_t = conf_t * D(p_t, q_t)`` at every response position of each sequence (teacher forced).

    Returns one ``(T_i,)`` float32 tensor per sequence, on the drafter's device, ``T_i = len(ids_i) -
    prompt_length_i``. Position ``t`` scores the context ``ids_i[:prompt_length_i + t]``, i.e. the first token
    of a window drafted at candidate start ``t``. ``p`` at the verification temperature (0 = greedy,
    one-hot), ``q`` at the drafter's sampling temperature.

    Sequences are sorted by length and scored in left-padded batches (explicit position ids, so each row
    sees the positions it would see alone) of at most ``batch_size`` sequences and ``max_batch_logits``
    elements of ``(B, T, V)`` logits per model (a longer sequence goes alone); only the response
    positions' logits are built (``logits_to_keep``) and the divergence is computed on the drafter's device.
    ``greedy_from_text`` (``target_temperature = 0`` on the target's own greedy text): ``p_t`` is the one-hot of the
    sequence's next token, read from the text instead of a target forward (``_response_probs``).
    """
    if greedy_from_text and target_temperature != 0:
        raise ValueError("greedy_from_text reads the target's greedy (one-hot) p from the text: target_temperature must be 0.")
    sequences = [torch.as_tensor(s, dtype=torch.long) for s in sequences]
    prompt_lengths = [int(p) for p in prompt_lengths]
    if len(sequences) != len(prompt_lengths):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lengths)} prompt lengths.")
    for ids, prompt_length in zip(sequences, prompt_lengths):
        if not 1 <= prompt_length <= len(ids):
            raise ValueError(f"A prompt length {prompt_length} outside [1, {len(ids)}]: every context needs a prompt.")
    device = _model_device(drafter)
    layer_ids = target_layer_ids(drafter)  # a feature-conditioned drafter reads the target's hidden states
    if layer_ids is not None and min(prompt_lengths) < 2:
        raise ValueError("A feature-conditioned drafter needs prompts of at least 2 tokens (one pair).")
    responses = [len(ids) - p for ids, p in zip(sequences, prompt_lengths)]
    results = [torch.zeros(n, device=device) for n in responses]  # final for empty responses

    def score(batch):
        keep = max(responses[i] for i in batch) + 1
        ids, mask = left_pad([sequences[i] for i in batch], pad_id)
        positions = positions_from_mask(mask)
        p, q = _response_probs(target, drafter, ids, mask, positions, keep, vocab_size, target_temperature,
                               drafter_temperature, layer_ids, greedy_from_text)
        p = p.to(device)
        rows = divergence_scores(p, q, kind=kind)  # (B, keep - 1): sequence i's response is its last T_i columns
        for row, i in enumerate(batch):
            results[i] = rows[row, rows.shape[1] - responses[i]:]

    batch: list[int] = []
    for i in sorted((i for i in range(len(sequences)) if responses[i] > 0), key=lambda i: len(sequences[i])):
        grown = batch + [i]
        # sorted by total length, not response length: a batch's logits width is its longest response + 1
        logits = len(grown) * (max(responses[j] for j in grown) + 1) * vocab_size
        if batch and (len(grown) > batch_size or logits > max_batch_logits):
            score(batch)
            grown = [i]
        batch = grown
    if batch:
        score(batch)
    return results


def score_sequence(target, drafter, ids: torch.Tensor, prompt_length: int, *, vocab_size: int,
                   target_temperature: float = 1.0, drafter_temperature: float = 1.0, kind: str = "kl",
                   pad_id: int = 0) -> torch.Tensor:
    """``score_sequences`` of one sequence, on the CPU. ``(T,)``."""
    return score_sequences(target, drafter, [ids], [prompt_length], vocab_size=vocab_size,
                           target_temperature=target_temperature, drafter_temperature=drafter_temperature,
                           kind=kind, pad_id=pad_id)[0].cpu()


def _categorical(probabilities: torch.Tensor, count: int, generator: torch.Generator) -> torch.Tensor:
    """``count`` draws with replacement; inverse-CDF sampling where torch.multinomial's category limit is exceeded."""
    if len(probabilities) <= MAX_MULTINOMIAL_CATEGORIES:
        return torch.multinomial(probabilities, count, replacement=True, generator=generator)
    cdf = probabilities.double().cumsum(0)
    u = torch.rand(count, generator=generator, dtype=torch.float64) * cdf[-1]
    return torch.searchsorted(cdf, u, right=True).clamp_max(len(probabilities) - 1)


class ContextSelector:
    """Chooses the contexts of each generation round: ``P(i) = (1-u) (s_i+eps)^beta / Z + u / N``.

    Args:
        lengths: candidates per sequence, ``(S,)`` (``ContextPool.lengths``); candidate ``i`` of sequence
            ``s`` is ``offsets[s] + t``. An ``int`` ``N`` means ``N`` candidates with no sequence structure.
        beta, eps, uniform_share: as in ``ppow_trl.core.windowing.window_start_probabilities``.
        seed: with the round index, seeds each round's draw.

    Unscored candidates get the mean scored value, so a partial refresh neither starves nor favours them.
    A draw picks a sequence ``s`` with probability ``P(s) = sum_{i in s} P(i)``, then a start in it with
    probability ``P(i) / P(s)``: exactly ``P(i)``, with no multinomial over more than
    ``max(S, longest sequence)`` categories (the flat one fails above 2^24 candidates) and no per-candidate
    probability vector built (the per-sequence sums are cached until the scores change).

    Round ``r`` draws its candidates (with replacement) from a generator seeded by ``(seed, r)`` with
    the scores in force when that round is generated, so every process draws the same global batch
    and a resumed run (scores restored from the checkpoint, ``r`` derived from the global step) draws
    exactly what the uninterrupted run drew. Choosing at generation time, not in the dataloader's
    sampler, keeps prefetching from drawing a round with stale scores.
    """

    def __init__(self, lengths, *, beta: float, eps: float, uniform_share: float, seed: int = 0):
        if beta < 0 or eps <= 0 or not 0.0 <= uniform_share <= 1.0:
            raise ValueError(f"Need beta >= 0, eps > 0 and 0 <= uniform_share <= 1; got {beta}, {eps}, {uniform_share}.")
        if isinstance(lengths, int):
            lengths = [_BLOCK] * (lengths // _BLOCK) + ([lengths % _BLOCK] if lengths % _BLOCK else [])
        lengths = torch.as_tensor(lengths, dtype=torch.long).flatten()
        if len(lengths) == 0 or (lengths < 0).any() or lengths.sum() == 0:
            raise ValueError("ContextSelector needs non-negative per-sequence lengths with at least one candidate.")
        self.lengths = lengths
        self.offsets = _offsets(lengths)
        self.num_sequences = len(lengths)
        self.num_candidates = int(lengths.sum())
        self.beta, self.eps, self.uniform_share = beta, eps, uniform_share
        self.seed = seed
        self.scores = torch.zeros(self.num_candidates)
        self.scored = torch.zeros(self.num_candidates, dtype=torch.bool)
        self.last_refresh_step = None
        self.refresh_count = 0
        self._cache = None

    # -------------------------------------------------------------- the distribution

    def _log_weights(self, fill, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """``beta log(s_i + eps)`` (float64) of candidates ``start:stop``, unscored ones at ``fill`` (if not None)."""
        scores = self.scores[start:stop].to(torch.float64, copy=True)
        if fill is not None:
            scores = torch.where(self.scored[start:stop], scores, fill)
        # (s + eps)^beta in log space: a large beta on KL scores (up to ~87 nats) would overflow to inf.
        return scores.clamp_(min=0.0).add_(self.eps).log_().mul_(self.beta)  # in place: N can be ~10^8

    def _prepared(self) -> dict:
        """The fill value, the largest log weight and the per-sequence sums ``W_s`` of ``exp(log w - top)``;
        computed once per change of the scores."""
        if self._cache is None:
            count = int(self.scored.sum())
            fill = None
            if 0 < count < self.num_candidates:  # unscored candidates get the mean scored value
                fill = torch.where(self.scored, self.scores.double(), 0.0).sum() / count
            log_weights = self._log_weights(fill)
            top = log_weights.max()
            sums = torch.segment_reduce(log_weights.sub_(top).exp_(), "sum", lengths=self.lengths)
            self._cache = {"fill": fill, "top": top, "sums": sums, "total": sums.sum()}
        return self._cache

    def sequence_probabilities(self) -> torch.Tensor:
        """``P(s) = (1-u) W_s / W + u n_s / N``: the probability of drawing a candidate of sequence ``s``. ``(S,)`` float64."""
        cache, u = self._prepared(), self.uniform_share
        return (1.0 - u) * cache["sums"] / cache["total"] + u * self.lengths.double() / self.num_candidates

    def position_probabilities(self, sequence: int) -> torch.Tensor:
        """``P(i | s) = P(i) / P(s)`` over the starts of ``sequence``. ``(lengths[s],)`` float64, summing to 1."""
        start = int(self.offsets[sequence])
        flat = self._flat_probabilities(start, start + int(self.lengths[sequence]))
        return flat / flat.sum()

    def _flat_probabilities(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        cache, u = self._prepared(), self.uniform_share
        weights = self._log_weights(cache["fill"], start, stop).sub_(cache["top"]).exp_()
        return (1.0 - u) * weights / cache["total"] + u / self.num_candidates

    def probabilities(self) -> torch.Tensor:
        """Selection probabilities over all candidates, ``(N,)`` float32: ``window_start_probabilities`` of the
        (filled) scores. For inspection: drawing never builds this vector."""
        return self._flat_probabilities().float()

    def set_scores(self, candidates: torch.Tensor, scores: torch.Tensor) -> None:
        self.scores[candidates] = scores.float().cpu()
        self.scored[candidates] = True
        self._cache = None

    def draw(self, round_index: int, count: int) -> torch.Tensor:
        """The ``count`` candidates of generation round ``round_index``: ``(count,)`` long."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + round_index)
        sequences = _categorical(self.sequence_probabilities(), count, generator)
        starts = torch.zeros(count, dtype=torch.long)
        for sequence in torch.unique(sequences).tolist():  # ascending: a fixed order of generator use
            rows = (sequences == sequence).nonzero().squeeze(-1)
            starts[rows] = _categorical(self.position_probabilities(sequence), len(rows), generator)
        return self.offsets[sequences] + starts

    # -------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict:
        """Tensors (float32 scores, bool ``scored``, int per-sequence ``lengths``) and a few scalars."""
        lengths_dtype = torch.int32 if int(self.lengths.max()) < 2**31 else torch.long
        return {"scores": self.scores.clone(), "scored": self.scored.clone(), "lengths": self.lengths.to(lengths_dtype),
                "seed": self.seed, "last_refresh_step": self.last_refresh_step, "refresh_count": self.refresh_count}

    def load_state_dict(self, state: dict) -> None:
        """From ``state_dict()``, or the JSON lists an older version saved."""
        scores = torch.as_tensor(state["scores"], dtype=torch.float32).flatten()
        if len(scores) != self.num_candidates:
            raise ValueError(
                f"The checkpoint's context selector has {len(scores)} candidates, this dataset "
                f"{self.num_candidates}: resume with the same training data."
            )
        lengths = state.get("lengths")
        if lengths is not None and not torch.equal(torch.as_tensor(lengths, dtype=torch.long).flatten(), self.lengths):
            raise ValueError(
                f"The checkpoint's context selector has {len(lengths)} sequences with other lengths than this "
                f"dataset's {self.num_sequences}: resume with the same training data."
            )
        self.scores = scores.clone()
        self.scored = torch.as_tensor(state["scored"], dtype=torch.bool).flatten().clone()
        self.last_refresh_step = state["last_refresh_step"]
        self.refresh_count = int(state["refresh_count"])
        self._cache = None

    def save_state(self, path: str | Path) -> Path:
        """``torch.save`` of ``state_dict()`` (e.g. ``checkpoint/ppow_context_selector.pt``)."""
        torch.save(self.state_dict(), path)
        return Path(path)

    def load_state(self, path: str | Path) -> None:
        """Restore from a file ``save_state`` wrote, or from an older ``.json`` state file."""
        path = Path(path)
        if path.suffix == ".json":
            with open(path) as f:
                self.load_state_dict(json.load(f))
        else:
            self.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))


def refresh_scores(selector: ContextSelector, pool: ContextPool, target, drafter, accelerator, *, count: int,
                   vocab_size: int, target_temperature: float, drafter_temperature: float, kind: str,
                   pad_id: int, greedy_from_text: bool = False) -> None:
    """Rescore a rotating subset of ``count`` sequences with the current drafter, ``s_t = conf_t * D(p_t, q_t)``.

    Each process scores its share (``score_sequences``) with its own (DDP: full) drafter copy; the scores are then
    gathered, so every process ends with the same selector state and draws the same global batch.
    """
    num_sequences = len(pool.responses)
    count = min(count, num_sequences)
    first = (selector.refresh_count * count) % num_sequences
    sequences = [(first + i) % num_sequences for i in range(count)]
    world, device = accelerator.num_processes, accelerator.device
    shares = [sequences[rank::world] for rank in range(world)]
    mine = shares[accelerator.process_index]
    rows = score_sequences(target, drafter, [pool.sequence_ids(s) for s in mine], [len(pool.prompts[s]) for s in mine],
                           vocab_size=vocab_size, target_temperature=target_temperature,
                           drafter_temperature=drafter_temperature, kind=kind, pad_id=pad_id,
                           greedy_from_text=greedy_from_text)
    local = torch.cat([row.float().to(device) for row in rows]) if rows else torch.zeros(0, device=device)
    if world > 1:
        # Every process knows every share's size from the pool: pad to the largest, all-gather, unpad.
        sizes = [int(sum(int(pool.lengths[s]) for s in share)) for share in shares]
        width = max(max(sizes), 1)
        padded = torch.zeros(width, device=device)
        padded[: len(local)] = local
        everything = accelerator.gather(padded).view(world, width)
        scores = torch.cat([everything[rank, :size] for rank, size in enumerate(sizes)])
    else:
        scores = local
    selector.set_scores(pool.candidates_of([s for share in shares for s in share]), scores.cpu())
    selector.refresh_count += 1
