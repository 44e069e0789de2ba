"""One drafter interface for every loop: generation, rollouts, exact greedy tau and the benchmark.

A drafting session holds one drafter's state over committed sequences and answers the same few calls whatever
the family:

- ``prefill(contexts, ...)``: the drafter's next-token logits after a batch of contexts (left-padded, shared by
  ``G`` samples each), for rollouts;
- ``extend(sequence)``: catch up on the committed tokens it has not seen (one sequence), for generation;
- ``step(tokens)``: append one drafted token per row, giving the logits of the next one;
- ``rollback(valid_length)``: forget what lies beyond the verified prefix after a round;
- ``teacher_forced_windows(...)``: the proposals and confidences of a window started after every prefix of a
  known text (exact greedy tau, without running the loop).

Families:

- standalone (``StandaloneSession``): any causal LM over the target's vocabulary (a truncated target, a small LM,
  ``PPOWDrafterForCausalLM``). Its state is its KV cache.
- feature-conditioned chains (``ChainSession``, ``ppow_trl.eagle3``): the drafter reads the target's hidden states
  at ``target_layer_ids``. The loops hand it the features of every committed token from the target forward that
  verified it (``target_layer_ids`` tells them which to capture: ``ppow_trl.eagle3.target_forward``), so no
  second target pass runs in generation. Pair ``j`` is ``(h_j, s_{j+1})``; after drafting it feeds back its own
  output in place of the target's features; after verification only the real pairs are kept and the accepted
  tokens' features are appended.

A block-parallel family (DFlash) drafts a whole block from one forward: it fits the same calls with ``step`` never
needed (``prefill``/``extend`` return the block's logits), which is why the loops ask the session for logits and
never call the drafter themselves.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from .batching import left_pad, positions_from_mask, prefill_contexts
from .eagle3 import Eagle3DrafterForCausalLM, target_forward
from .utils import crop_cache


def base_drafter(model):
    """The model under PEFT / DDP wrappers (what decides the family)."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
            model = model.module
        else:
            return model


def reads_target_features(drafter) -> bool:
    """Whether ``drafter`` conditions on the target's hidden states (the EAGLE-3 family)."""
    return isinstance(base_drafter(drafter), Eagle3DrafterForCausalLM)


def target_layer_ids(drafter) -> list[int] | None:
    """The target hidden-state indices a feature-conditioned drafter reads; ``None`` for standalone drafters."""
    return list(base_drafter(drafter).config.target_layer_ids) if reads_target_features(drafter) else None


def drafting_session(drafter, target=None):
    """The session for ``drafter``'s family. A feature-conditioned drafter checks ``target`` is the one it reads."""
    if reads_target_features(drafter):
        if target is not None:
            base_drafter(drafter).check_target(target)
        return ChainSession(drafter)
    return StandaloneSession(drafter)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def forward_at(model, tokens: list[int], cache, start: int, feature_layers: list[int] | None = None, **kwargs):
    """Forward ``tokens`` (one sequence) at positions ``start..`` after a cache holding exactly ``start`` positions.

    Returns ``(output, features)``: the model output (``cache`` set) and, with ``feature_layers``, the hidden
    states a feature-conditioned drafter reads (``ppow_trl.eagle3.target_forward``), else ``None``. The loops'
    single entry to a forward over one sequence: the target's verification and the standalone drafter's steps.
    """
    cached = 0 if cache is None else cache.get_seq_length()
    if cached != start:  # an internal invariant: caches must hold exactly the committed prefix
        raise RuntimeError(f"KV cache holds {cached} positions, expected {start}.")
    device = _device(model)
    if cache is None:
        # Sliding-window (and other bounded) cache layers only allow rolling back after a rejection when
        # they record past states, as transformers' own assisted decoding arranges.
        cache = DynamicCache(config=model.config.get_text_config())
        cache.activate_past_recording()
    ids = torch.tensor([tokens], dtype=torch.long, device=device)
    positions = torch.arange(start, start + len(tokens), device=device).unsqueeze(0)
    mask = torch.ones((1, start + len(tokens)), dtype=torch.long, device=device)
    return target_forward(model, feature_layers, input_ids=ids, attention_mask=mask, position_ids=positions,
                          cache=cache, use_cache=True, **kwargs)


def _shift_rows(rows: torch.Tensor, shift: int) -> torch.Tensor:
    """``rows[shift:]`` padded with zero rows at the end to the same length."""
    out = torch.zeros_like(rows)
    if shift < rows.shape[0]:
        out[: rows.shape[0] - shift] = rows[shift:]
    return out


class StandaloneSession:
    """A causal LM drafting on its own: its state is its KV cache over the tokens it has read."""

    target_layer_ids = None

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = None
        self.mask = self.positions = None

    # one sequence ---------------------------------------------------------------------------------------
    def seen(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def extend(self, sequence: list[int], features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the committed tokens not cached yet (at least the last one); logits of the next token ``(1, V)``."""
        start = self.seen()
        out, _ = forward_at(self.drafter, sequence[start:], self.cache, start, logits_to_keep=1)
        self.cache = out.cache
        self.mask = torch.ones((1, len(sequence)), dtype=torch.long, device=out.logits.device)
        self.positions = torch.full((1, 1), len(sequence) - 1, device=out.logits.device)
        return out.logits[:, -1]

    def add_features(self, features: torch.Tensor | None) -> None:
        """Target features are not read by standalone drafters."""

    def rollback(self, valid_length: int) -> None:
        """Keep the cache of the first ``valid_length`` tokens of committed + drafted (the verified prefix)."""
        if self.cache is not None:
            crop_cache(self.cache, min(self.cache.get_seq_length(), valid_length))

    # batches --------------------------------------------------------------------------------------------
    def prefill(self, contexts: list[torch.Tensor], pad_id: int = 0, num_samples: int = 1,
                features: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Next-token logits ``(len(contexts) * G, V)`` after each context, rows context by context."""
        logits, self.cache, self.mask, self.positions = prefill_contexts(self.drafter, contexts, pad_id, num_samples)
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one drafted token per row ``(B,)``; logits of the next ``(B, V)``."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        self.positions = self.positions + 1
        out = self.drafter(input_ids=tokens.view(-1, 1), attention_mask=self.mask, position_ids=self.positions,
                           cache=self.cache, use_cache=True)
        self.cache = out.cache
        return out.logits[:, -1]

    # teacher-forced windows ------------------------------------------------------------------------------
    def teacher_forced_logits(self, prompt: list[int], text: list[int], max_window: int,
                              features: torch.Tensor | None = None):
        """Yields ``(slot, logits (M, V))``: slot ``k`` (0-based) of a window started after ``prompt + text[:s]``
        is row ``s``. A standalone drafter's state while its proposals match is ``prompt + text[:s + k]``, so slot
        ``k`` of start ``s`` is the one teacher-forced pass's row ``s + k`` (rows past the text are never read)."""
        out, _ = forward_at(self.drafter, prompt + text[:-1], None, 0, logits_to_keep=len(text))
        logits = out.logits[0, -len(text):]
        for slot in range(max_window):
            yield slot, _shift_rows(logits, slot)


class ChainSession:
    """A feature-conditioned chain drafter (EAGLE-3): its KV cache over real pairs, the target features it has
    not read yet, and the hidden state it feeds back while drafting."""

    def __init__(self, drafter):
        self.drafter = drafter
        self.model = base_drafter(drafter)
        self.target_layer_ids = list(self.model.config.target_layer_ids)
        self.cache = None
        self.pairs = 0  # real pairs in the cache (pair j = (h_j, s_{j+1}))
        self.features: list[torch.Tensor] = []  # target features of positions self.pairs, self.pairs + 1, ...
        self.sequence: list[int] = []  # the committed tokens read by the last extend
        self.hidden = self.mask = self.positions = None

    def _call(self, ids, **kwargs):
        out = self.drafter(input_ids=ids, cache=self.cache, use_cache=True, **kwargs)
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
                             "(ppow_trl.eagle3.target_features); pass target= to the rollout.")
        for context in contexts:
            if len(context) < 2:
                raise ValueError("A feature-conditioned drafter needs contexts of at least 2 tokens (one pair).")
        device = self.model.fc.weight.device
        ids, mask = left_pad([torch.as_tensor(c)[1:] for c in contexts], pad_id)
        width = ids.shape[1]
        feats = torch.stack([torch.nn.functional.pad(f[: len(c) - 1], (0, 0, width - len(c) + 1, 0))
                             for f, c in zip(features, contexts)])
        ids, mask, feats = ids.to(device), mask.to(device), feats.to(device)
        positions = positions_from_mask(mask)
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
