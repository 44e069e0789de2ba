"""The EAGLE-3 drafting session: a head reading the target's hidden states, drafting as a chain.

The loops hand it the features of every committed token from the target forward that verified it
(``ppow_trl.features.forward_at`` with ``target_layer_ids``), so no second target pass runs in generation. Pair
``j`` is ``(h_j, s_{j+1})``; after drafting it feeds back its own output in place of the target's features; after
verification only the real pairs are kept and the accepted tokens' features are appended.
"""

from __future__ import annotations

import torch

from ...batching import left_pad, positions_from_mask
from ...utils import unwrap_model


def context_pairs(contexts: list[torch.Tensor], features: list[torch.Tensor], pad_id: int, device):
    """Each context's pairs ``(h_j, c_{j+1})``, left-padded: ``(ids, mask, feats, positions)``, ``ids`` ``(B, P)`` the
    tokens ``c_1..``, ``feats`` ``(B, P, F)`` the target's features of ``c_0..`` (the last one is not read). The batch
    both drafting (``ChainSession.prefill``) and the loss (``Eagle3Family.window_hidden``) start from."""
    ids, mask = left_pad([torch.as_tensor(c)[1:] for c in contexts], pad_id)
    width = ids.shape[1]
    feats = torch.stack([torch.nn.functional.pad(f[: len(c) - 1].to(device), (0, 0, width - len(c) + 1, 0))
                         for f, c in zip(features, contexts)])
    ids, mask = ids.to(device), mask.to(device)
    return ids, mask, feats, positions_from_mask(mask)


class ChainSession:
    """A feature-conditioned chain drafter (EAGLE-3): its KV cache over real pairs, the target features it has
    not read yet, and the hidden state it feeds back while drafting."""

    max_window = None

    def __init__(self, drafter):
        self.drafter = drafter
        self.model = unwrap_model(drafter)
        self.forwards = 0
        self.target_layer_ids = list(self.model.config.target_layer_ids)
        self.cache = None
        self.pairs = 0  # real pairs in the cache (pair j = (h_j, s_{j+1}))
        self.features: list[torch.Tensor] = []  # target features of positions self.pairs, self.pairs + 1, ...
        self.sequence: list[int] = []  # the committed tokens read by the last extend
        self.hidden = self.mask = self.positions = None

    def _call(self, ids, **kwargs):
        out = self.drafter(input_ids=ids, cache=self.cache, use_cache=True, **kwargs)
        self.forwards += 1
        self.cache, self.hidden = out.cache, out.hidden_states[:, -1:]
        return out.logits[:, -1]

    # one sequence ---------------------------------------------------------------------------------------
    def add_features(self, features: torch.Tensor) -> None:
        """Target features ``(n, F)`` of the next ``n`` committed positions (from the forward that verified them)."""
        if features is not None:
            self.features.append(features.reshape(-1, features.shape[-1]))

    def extend(self, sequence: list[int], features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the pairs of committed tokens whose features arrived; logits of the next token ``(1, V)``, or
        ``None`` before any feature exists (a one-token prompt: the first round drafts nothing)."""
        if features is not None:
            self.add_features(features)
        new = torch.cat(self.features) if self.features else None
        wanted = len(sequence) - 1 - self.pairs  # pairs up to (h_{n-2}, s_{n-1}) predict s_n
        if wanted <= 0 or new is None or new.shape[0] < wanted:
            if wanted > 0 and new is not None:
                raise RuntimeError(f"{new.shape[0]} target features for {wanted} new pairs.")
            return None
        device = self.model.fc.weight.device
        ids = torch.tensor([sequence[self.pairs + 1 : self.pairs + 1 + wanted]], dtype=torch.long, device=device)
        positions = torch.arange(self.pairs, self.pairs + wanted, device=device).unsqueeze(0)
        logits = self._call(ids, target_hidden_states=new[:wanted].unsqueeze(0).to(device), position_ids=positions)
        self.pairs += wanted
        self.features = [new[wanted:]] if new.shape[0] > wanted else []
        self.mask = torch.ones((1, self.pairs), dtype=torch.long, device=device)
        self.positions = positions[:, -1:]
        self.sequence = list(sequence)
        return logits

    def rollback(self, valid_length: int) -> None:
        """Drop the drafted pairs: they carried the drafter's own hidden states, not the target's."""
        if self.cache is not None:
            self.cache.crop(self.pairs)

    # batches --------------------------------------------------------------------------------------------
    def prefill(self, contexts: list[torch.Tensor], pad_id: int = 0, num_samples: int = 1,
                features: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Logits after each context from its pairs ``(h_j, c_{j+1})``; ``features[i]`` ``(len(c_i), F)`` are the
        target's features of context ``i`` (the last one is not read). Rows context by context, ``G`` each."""
        if features is None:
            raise ValueError("A feature-conditioned drafter needs the target's features of the contexts "
                             "(ppow_trl.features.context_features); pass target= to the rollout.")
        for context in contexts:
            if len(context) < 2:
                raise ValueError("A feature-conditioned drafter needs contexts of at least 2 tokens (one pair).")
        ids, mask, feats, positions = context_pairs(contexts, features, pad_id, self.model.fc.weight.device)
        if num_samples > 1:
            ids, mask, feats, positions = (t.repeat_interleave(num_samples, dim=0) for t in (ids, mask, feats, positions))
        self.cache = None
        logits = self._call(ids, target_hidden_states=feats, attention_mask=mask, position_ids=positions,
                            logits_to_keep=1)
        self.mask, self.positions = mask, positions[:, -1:]
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Pair ``(own hidden, drafted token)`` per row at the next position; logits of the next token."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        self.positions = self.positions + 1
        return self._call(tokens.view(-1, 1), hidden_states=self.hidden, attention_mask=self.mask,
                          position_ids=self.positions)

    # teacher-forced windows ------------------------------------------------------------------------------
    def teacher_forced_logits(self, prompt: list[int], text: list[int], max_window: int,
                              features: torch.Tensor | None = None):
        """As ``StandaloneSession.teacher_forced_logits``; slot ``k`` of start ``s`` is the training-time-test unroll's
        step ``k`` at pair ``len(prompt) + s - 2`` (``features``: the target's, ``(len(prompt) + len(text), F)``).
        While the window's first ``k`` proposals match the text, the chain drafting them is exactly this unroll.
        Needs ``len(prompt) >= 2`` (a pair before the first window)."""
        if features is None:
            raise ValueError("teacher_forced_logits of a feature-conditioned drafter needs the target's features.")
        if len(prompt) < 2:
            raise ValueError("A feature-conditioned drafter drafts after >= 2 prompt tokens; this prompt has 1.")
        sequence = prompt + text
        device = self.model.fc.weight.device
        ids = torch.tensor([sequence[1:-1]], dtype=torch.long, device=device)
        steps = self.model.unroll(ids, features[None, : len(sequence) - 2].to(device), num_steps=max_window)
        first = len(prompt) - 2  # pair predicting text[0]
        for slot, draft_logits in enumerate(steps):
            logits = self.model.to_full_vocab(draft_logits[0])
            yield slot, logits[first : first + len(text)]

    # the cost model's unit -------------------------------------------------------------------------------
    def timed_step(self, context: list[int], features: torch.Tensor | None):
        """A callable drafting one token on the drafter's own hidden state after ``context`` (the step the loops
        run between verifications), the state put back each time."""
        device = self.model.fc.weight.device
        self.prefill([torch.tensor(context, device=device)], features=[features])
        length, mask, positions, hidden = self.cache.get_seq_length(), self.mask, self.positions, self.hidden
        token = torch.tensor(context[-1:], device=device)

        def step():
            self.step(token)
            self.cache.crop(length)  # back to the shared context: every repeat times the same step
            self.mask, self.positions, self.hidden = mask, positions, hidden

        return step

