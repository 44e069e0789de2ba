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

- block drafters (``BlockSession``, ``ppow_trl.dflash``): one forward drafts a whole block from the target's
  features of the committed tokens before the anchor (the last committed token). ``prefill``/``extend`` run it
  and return slot 1's logits; ``step`` runs nothing and returns the next slot's (slot ``k``'s distribution does
  not depend on the drafted ``y_<k``). So the loops are the same; ``session.forwards`` counts real drafter
  forwards (one per round for blocks, one per token for the others), which is what the cost model charges.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import DFlashCache

from .batching import left_pad, positions_from_mask, prefill_contexts
from .dflash.modeling import anchored_block_hidden, check_target as check_block_target, is_block_drafter
from .dflash.configuration import hidden_state_indices
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


def drafter_family(drafter) -> str:
    """``"standalone"``, ``"chain"`` (EAGLE-3, ``ppow_trl.eagle3``) or ``"block"`` (DFlash, ``ppow_trl.dflash``)."""
    model = base_drafter(drafter)
    if isinstance(model, Eagle3DrafterForCausalLM):
        return "chain"
    return "block" if is_block_drafter(model) else "standalone"


def reads_target_features(drafter) -> bool:
    """Whether ``drafter`` conditions on the target's hidden states (the chain and block families)."""
    return drafter_family(drafter) != "standalone"


def target_layer_ids(drafter) -> list[int] | None:
    """The target ``output_hidden_states`` indices a feature-conditioned drafter reads (a DFlash config's decoder
    layer ids plus one); ``None`` for standalone drafters."""
    family = drafter_family(drafter)
    if family == "standalone":
        return None
    config = base_drafter(drafter).config
    return hidden_state_indices(config) if family == "block" else list(config.target_layer_ids)


def drafting_session(drafter, target=None):
    """The session for ``drafter``'s family. A feature-conditioned drafter checks ``target`` is the one it reads;
    a block drafter needs it (the target's embedding and head are its own)."""
    family = drafter_family(drafter)
    if family == "block":
        if target is None:
            raise ValueError("A DFlash block drafter drafts with the target's embedding and output head: pass target=.")
        check_block_target(base_drafter(drafter), target)
        return BlockSession(drafter, target)
    if family == "chain":
        if target is not None:
            base_drafter(drafter).check_target(target)
        return ChainSession(drafter)
    return StandaloneSession(drafter)


def check_window(session, max_window: int) -> None:
    """Refuse a window longer than the drafter can propose per round (a block drafter's ``block_size - 1``)."""
    if session.max_window is not None and max_window > session.max_window:
        raise ValueError(f"max_window (K) = {max_window}, but this block drafter proposes at most {session.max_window} "
                         f"tokens per round (block_size - 1): use K <= {session.max_window}, or a drafter with "
                         "a larger block_size.")


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
    # No attention mask: one unpadded sequence attends to its whole cache, as in generate's decoding steps (which
    # drop an all-ones mask). Timed in isolation, with or without a mask the SmolLM2 step costs the same.
    return target_forward(model, feature_layers, input_ids=ids, position_ids=positions, cache=cache, use_cache=True,
                          **kwargs)


def _shift_rows(rows: torch.Tensor, shift: int) -> torch.Tensor:
    """``rows[shift:]`` padded with zero rows at the end to the same length."""
    out = torch.zeros_like(rows)
    if shift < rows.shape[0]:
        out[: rows.shape[0] - shift] = rows[shift:]
    return out


class StandaloneSession:
    """A causal LM drafting on its own: its state is its KV cache over the tokens it has read."""

    target_layer_ids = None
    max_window = None  # no limit on the window

    def __init__(self, drafter):
        self.drafter = drafter
        self.cache = None
        self.mask = self.positions = None
        self.forwards = 0  # drafter forwards run (one per drafted token)

    # one sequence ---------------------------------------------------------------------------------------
    def seen(self) -> int:
        return 0 if self.cache is None else self.cache.get_seq_length()

    def extend(self, sequence: list[int], features: torch.Tensor | None = None) -> torch.Tensor | None:
        """Read the committed tokens not cached yet (at least the last one); logits of the next token ``(1, V)``."""
        start = self.seen()
        out, _ = forward_at(self.drafter, sequence[start:], self.cache, start, logits_to_keep=1)
        self.forwards += 1
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
        self.forwards += 1
        return logits

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one drafted token per row ``(B,)``; logits of the next ``(B, V)``."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=-1)
        self.positions = self.positions + 1
        out = self.drafter(input_ids=tokens.view(-1, 1), attention_mask=self.mask, position_ids=self.positions,
                           cache=self.cache, use_cache=True)
        self.forwards += 1
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

    max_window = None

    def __init__(self, drafter):
        self.drafter = drafter
        self.model = base_drafter(drafter)
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


class BlockSession:
    """A DFlash block drafter: its ``DFlashCache`` over the target features of committed tokens (the context),
    the features not read yet, and the slot logits of the latest block.

    Each round (``extend``) reads the new context features and drafts one block anchored at the last committed
    token, exactly as transformers' ``DFlashTokenCandidateGenerator`` does: the cache is cut back to the context
    (the previous block's positions dropped), the new features and the block go through one forward, and slot
    ``k``'s output goes through the target's head.
    """

    def __init__(self, drafter, target):
        self.drafter = drafter
        self.model = base_drafter(drafter)
        self.embed = target.get_input_embeddings()
        self.head = target.get_output_embeddings()
        self.block_size = int(self.model.config.block_size)
        self.max_window = self.block_size - 1  # drafted slots per block
        self.target_layer_ids = hidden_state_indices(self.model.config)
        self.cache = None
        self.context = 0  # committed positions whose features are in the cache
        self.features: list[torch.Tensor] = []
        self.slot_logits = None  # (rows, block_size - 1, V)
        self.slot = 0
        self.forwards = 0

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden.to(self.head.weight.dtype))

    def _full_block(self):
        """The native route's window hook (``ppow_trl.dflash.assisted``) paused: this loop applies its own rule."""
        window = getattr(self.model, "_ppow_block_window", None)
        return window.paused() if window is not None else contextlib.nullcontext()

    def _start_block(self, slot_logits: torch.Tensor) -> torch.Tensor:
        self.slot_logits, self.slot = slot_logits, 0
        self.forwards += 1
        return slot_logits[:, 0]

    # one sequence ---------------------------------------------------------------------------------------
    def add_features(self, features: torch.Tensor | None) -> None:
        """Target features ``(n, F)`` of the next ``n`` committed positions (from the forward that verified them)."""
        if features is not None:
            self.features.append(features.reshape(-1, features.shape[-1]))

    def extend(self, sequence: list[int], features: torch.Tensor | None = None) -> torch.Tensor:
        """Read the features of committed tokens before the last one; draft a block anchored at the last one.
        Returns slot 1's logits ``(1, V)``."""
        if features is not None:
            self.add_features(features)
        wanted = len(sequence) - 1 - self.context
        new = torch.cat(self.features) if self.features else None
        have = 0 if new is None else new.shape[0]
        if have < wanted:
            raise RuntimeError(f"{have} target features for {wanted} new context positions.")
        device = self.model.encoder.fc.weight.device
        if self.cache is None:
            self.cache = DFlashCache(config=self.model.config)
            self.cache.activate_past_recording()
        crop_cache(self.cache, self.context)  # drop the previous block
        if new is None:
            new = torch.zeros((0, self.model.encoder.fc.in_features), device=device)
        context = new[:wanted].unsqueeze(0).to(device=device, dtype=self.model.encoder.fc.weight.dtype)
        self.features = [new[wanted:]] if have > wanted else []
        anchor = len(sequence) - 1
        ids = torch.full((1, self.block_size), int(self.model.config.mask_token_id), dtype=torch.long, device=device)
        ids[0, 0] = sequence[-1]
        positions = torch.cat([torch.arange(self.context, anchor, device=device),
                               torch.arange(anchor, anchor + self.block_size, device=device)]).unsqueeze(0)
        self.cache.set_previous_accepted_tokens(wanted)
        with self._full_block():
            out = self.drafter(noise_embeds=self.embed(ids), context_hidden_states=context, position_ids=positions,
                               cache=self.cache)
        self.context = anchor
        return self._start_block(self._logits(out.last_hidden_state[:, 1:]))

    def rollback(self, valid_length: int) -> None:
        """Nothing to undo: the cache holds target features only, and the next ``extend`` drops the block."""

    # batches --------------------------------------------------------------------------------------------
    def prefill(self, contexts: list[torch.Tensor], pad_id: int = 0, num_samples: int = 1,
                features: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Slot 1's logits after each context (a block anchored at its last token, reading the features of the
        others), ``(len(contexts) * G, V)``, rows context by context; later slots come from ``step``."""
        if features is None:
            raise ValueError("A DFlash drafter needs the target's features of the contexts "
                             "(ppow_trl.eagle3.context_features); pass target= to the rollout.")
        slot_logits = self._logits(block_after_contexts(self.drafter, self.embed, contexts, features)[:, 1:])
        return self._start_block(slot_logits.repeat_interleave(num_samples, dim=0))

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """The next slot's logits (no forward: slot ``k`` does not read the drafted ``y_<k``)."""
        self.slot += 1
        if self.slot >= self.slot_logits.shape[1]:
            raise ValueError(f"A block of {self.block_size} drafts at most {self.block_size - 1} tokens: use "
                             f"max_window <= {self.block_size - 1} with this drafter.")
        return self.slot_logits[:, self.slot]

    # teacher-forced windows ------------------------------------------------------------------------------
    def teacher_forced_logits(self, prompt: list[int], text: list[int], max_window: int,
                              features: torch.Tensor | None = None):
        """As ``StandaloneSession.teacher_forced_logits``: slot ``k`` of a window after ``prompt + text[:s]`` is
        slot ``k + 1`` of the block anchored at position ``len(prompt) + s - 1``, computed for every ``s`` in one
        forward (``anchored_block_hidden``). The block never reads its own drafts, so this is exactly what the
        loop drafts, matched or not (``features``: the target's, ``(len(prompt) + len(text), F)``)."""
        if features is None:
            raise ValueError("teacher_forced_logits of a DFlash drafter needs the target's features.")
        if max_window > self.block_size - 1:
            raise ValueError(f"max_window {max_window} exceeds this drafter's block of {self.block_size - 1} slots.")
        sequence = prompt + text
        device = self.model.encoder.fc.weight.device
        anchors = torch.arange(len(prompt) - 1, len(sequence) - 1, device=device).unsqueeze(0)
        ids = torch.tensor([sequence], dtype=torch.long, device=device)[:, anchors[0]]
        context = features[None, : len(sequence) - 1].to(device)
        hidden = anchored_block_hidden(self.drafter, self.embed, context, ids, anchors)[0]  # (M, S, H)
        for slot in range(max_window):
            yield slot, self._logits(hidden[:, slot + 1])


def block_after_contexts(drafter, embed, contexts: list[torch.Tensor], features: list[torch.Tensor]) -> torch.Tensor:
    """Output states ``(B, S, H)`` of one block per context, anchored at its last token and reading the target's
    ``features[i]`` of its other tokens (left-padded; ``anchored_block_hidden``). Rollouts and PPOW's loss."""
    device = base_drafter(drafter).encoder.fc.weight.device
    width = max(len(c) for c in contexts) - 1
    feats = torch.zeros((len(contexts), width, features[0].shape[-1]), device=device)
    valid = torch.zeros((len(contexts), width), dtype=torch.bool, device=device)
    positions = torch.zeros((len(contexts), width), dtype=torch.long, device=device)
    for row, (context, feature) in enumerate(zip(contexts, features)):
        n = len(context) - 1
        if n:
            feats[row, width - n :] = feature[:n].to(device)
            valid[row, width - n :] = True
            positions[row, width - n :] = torch.arange(n, device=device)
    anchor_ids = torch.stack([torch.as_tensor(c)[-1] for c in contexts]).view(-1, 1).to(device)
    anchor_positions = torch.tensor([[len(c) - 1] for c in contexts], device=device)
    hidden = anchored_block_hidden(drafter, embed, feats, anchor_ids, anchor_positions, context_valid=valid,
                                   context_positions=positions)
    return hidden[:, 0]
