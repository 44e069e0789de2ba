"""Training contexts for PPOW: every prefix of a target-generated response, and which ones to train on.

A *candidate* is a pair (sequence, start): the context ``prompt_ids + response_ids[:start]`` after
which the drafter proposes a window. ``ContextPool`` turns a dataset of target responses into the
candidate dataset GRPOTrainer iterates over; ``ContextSelector`` draws the contexts of each
generation round with probability ``~ (s_t + eps)^beta`` (mixed with a uniform share).
"""

from __future__ import annotations

import torch
from datasets import Dataset

from .windowing import divergence_scores, window_start_probabilities


class ContextPool:
    """Token ids of target-generated sequences and the flat list of their window starts.

    Args:
        dataset: rows with ``prompt_ids`` and ``response_ids`` (``ppow_trl.data.build_target_responses``).
        max_context_length: contexts longer than this (the models' limit minus room for a window)
            are an error raised here, before any training.
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
        # candidate i <-> (sequence[i], start[i]), sequence-major
        self.sequence = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        self.offsets = torch.cumsum(lengths, 0) - lengths
        self.start = torch.arange(int(lengths.sum())) - self.offsets[self.sequence]

    def __len__(self) -> int:
        return len(self.sequence)

    def context(self, index: int) -> list[int]:
        sequence, start = int(self.sequence[index]), int(self.start[index])
        return torch.cat([self.prompts[sequence], self.responses[sequence][:start]]).tolist()

    def candidate_dataset(self) -> Dataset:
        """The dataset GRPOTrainer iterates: a ``candidate`` index, and ``prompt`` = the context's token ids.

        ``prompt`` is built lazily (``with_transform``): storing every prefix would take quadratic space.
        """

        def add_prompt(batch):
            batch["prompt"] = [self.context(i) for i in batch["candidate"]]
            return batch

        return Dataset.from_dict({"candidate": list(range(len(self)))}).with_transform(add_prompt)

    def sequence_ids(self, sequence: int) -> torch.Tensor:
        return torch.cat([self.prompts[sequence], self.responses[sequence]])


@torch.no_grad()
def score_sequence(target, drafter, ids: torch.Tensor, prompt_length: int, *, vocab_size: int,
                   target_temperature: float = 1.0, drafter_temperature: float = 1.0, kind: str = "kl") -> torch.Tensor:
    """``s_t = conf_t * D(p_t, q_t)`` at every response position of one sequence (teacher forced). ``(T,)``.

    ``p`` at the verification temperature (0 = greedy, one-hot), ``q`` at the drafter's sampling temperature.

    Position ``t`` scores the context ``ids[:prompt_length + t]``, i.e. the first token of a window
    drafted at candidate start ``t``.
    """
    from .verification import probabilities_from_logits

    def probs(model, temperature):
        device = next(model.parameters()).device
        logits = model(input_ids=ids[None].to(device)).logits[0, prompt_length - 1 : -1, :vocab_size]
        return probabilities_from_logits(logits.float().cpu(), temperature)

    return divergence_scores(probs(target, target_temperature), probs(drafter, drafter_temperature), kind=kind)


class ContextSelector:
    """Chooses the contexts of each generation round: ``P(i) = (1-u) (s_i+eps)^beta / Z + u / N``.

    Round ``r`` draws its candidates (with replacement) from a generator seeded by ``(seed, r)`` with
    the scores in force when that round is generated, so every process draws the same global batch
    and a resumed run (scores restored from the checkpoint, ``r`` derived from the global step) draws
    exactly what the uninterrupted run drew. Choosing at generation time, not in the dataloader's
    sampler, keeps prefetching from drawing a round with stale scores.
    """

    def __init__(self, num_candidates: int, *, beta: float, eps: float, uniform_share: float, seed: int = 0):
        self.num_candidates = num_candidates
        self.beta, self.eps, self.uniform_share = beta, eps, uniform_share
        self.seed = seed
        self.scores = torch.zeros(num_candidates)
        self.scored = torch.zeros(num_candidates, dtype=torch.bool)
        self.last_refresh_step = None
        self.refresh_count = 0

    def probabilities(self) -> torch.Tensor:
        """Selection probabilities over candidates. Unscored candidates get the mean scored value, so a
        partial refresh neither starves nor favours them."""
        scores = self.scores.clone()
        if self.scored.any() and not self.scored.all():
            scores[~self.scored] = scores[self.scored].mean()
        mask = torch.ones(1, self.num_candidates, dtype=torch.bool)
        return window_start_probabilities(scores[None], mask, self.beta, self.eps, self.uniform_share)[0]

    def set_scores(self, candidates: torch.Tensor, scores: torch.Tensor) -> None:
        self.scores[candidates] = scores.float()
        self.scored[candidates] = True

    def draw(self, round_index: int, count: int) -> torch.Tensor:
        """The ``count`` candidates of generation round ``round_index``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + round_index)
        return torch.multinomial(self.probabilities(), count, replacement=True, generator=generator)

    def state_dict(self) -> dict:
        return {"scores": self.scores.tolist(), "scored": self.scored.tolist(), "seed": self.seed,
                "last_refresh_step": self.last_refresh_step, "refresh_count": self.refresh_count}

    def load_state_dict(self, state: dict) -> None:
        if len(state["scores"]) != self.num_candidates:
            raise ValueError(
                f"The checkpoint's context selector has {len(state['scores'])} candidates, this dataset "
                f"{self.num_candidates}: resume with the same training data."
            )
        self.scores = torch.tensor(state["scores"])
        self.scored = torch.tensor(state["scored"], dtype=torch.bool)
        self.last_refresh_step = state["last_refresh_step"]
        self.refresh_count = state["refresh_count"]
