"""The DFlash drafting session: one forward drafts a whole block from the target's features.

One forward drafts a block from the target's features of the committed tokens before the anchor (the last
committed token). ``prefill``/``extend`` run it and return slot 1's logits; ``step`` runs nothing and returns the
next slot's (slot ``k``'s distribution does not depend on the drafted ``y_<k``). So the loops are the same as for
every family; ``forwards`` counts real drafter forwards (one per round), which is what the cost model charges.
"""

from __future__ import annotations

import contextlib

import torch
from transformers.cache_utils import DFlashCache

from ...utils import crop_cache, unwrap_model
from .configuration import hidden_state_indices
from .modeling import anchored_block_hidden


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
        self.model = unwrap_model(drafter)
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
        """The native route's window hook (``ppow_trl.drafters.dflash.assisted``) paused: this loop applies its own rule."""
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
                             "(ppow_trl.features.context_features); pass target= to the rollout.")
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

    # the cost model's unit -------------------------------------------------------------------------------
    def timed_step(self, context: list[int], features: torch.Tensor | None):
        """A callable running one block round as generation does (``extend``): the features of one newly verified
        position read into the cached context, then the block; the state is put back each time."""
        self.extend(context[:-1], features=features[:-2])
        start, last = self.context, features[-2:-1]

        def step():
            crop_cache(self.cache, start)
            self.context, self.features = start, [last]
            self.extend(context)

        return step


def block_after_contexts(drafter, embed, contexts: list[torch.Tensor], features: list[torch.Tensor]) -> torch.Tensor:
    """Output states ``(B, S, H)`` of one block per context, anchored at its last token and reading the target's
    ``features[i]`` of its other tokens (left-padded; ``anchored_block_hidden``). Rollouts and PPOW's loss."""
    device = unwrap_model(drafter).encoder.fc.weight.device
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

