"""DFlash drafters in transformers' native route: ``target.generate(assistant_model=drafter, speculation_type="dflash")``.

Route (transformers 5.24, ``generation/candidate_generator.py``): ``DFlashTokenCandidateGenerator`` asks the target
for ``output_hidden_states`` at ``target_layer_ids + 1`` on every verification forward, hands the drafter the
accepted tokens' features (``context_hidden_states``) and the embedded block ``[last token, mask x (S - 1)]``,
runs it once per round on a ``DFlashCache`` and applies the target's output head to ``last_hidden_state[:, 1:]``:
every slot becomes a candidate, so stock transformers always proposes ``block_size - 1`` tokens.

The adaptive window (``BlockWindow``, installed by ``load_assistant(folder, target=target)`` or
``attach_block_window``) is a forward hook on the drafter: it computes the confidences of the first ``K - 1`` slots
through the same head, picks ``L = policy.window_lengths(conf)`` (the running-product rule of
``AdaptiveWindowPolicy``, on the first ``vocab_size`` logits at ``T_c``, as our loop does) and returns only
``last_hidden_state[:, : 1 + L]``, so the generator proposes ``L`` tokens. Lossless: the slots' distributions do not
depend on the drafted tokens, the rule reads none of them, and transformers verifies whatever it is given (greedy:
the target's own text; sampling: its distribution). The block itself is computed in full, so the ``DFlashCache``
bookkeeping (it drops ``block_size`` positions each round) is unchanged.

Which calls get which window:

- ``load_assistant(folder, target=target)`` (ppow_trl installed), then ``target.generate(..., assistant_model=drafter,
  speculation_type="dflash")``: the adaptive window saved with the drafter (``ppow_window_policy.json``).
- ``AutoModel.from_pretrained(folder)`` without ppow_trl (stock transformers, no remote code), same call: the fixed
  block of ``block_size - 1`` tokens.
- ``ppow_trl.speculative_generate`` and the benchmark: the policy they are given (``ppow_trl.drafters.dflash.session.BlockSession``
  pauses the hook, it applies the rule itself).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from ...core.windowing import AdaptiveWindowPolicy
from .modeling import check_target

MODEL_TYPE = "muse_glimmer_assistant"


class BlockWindow:
    """The forward hook applying ``policy`` to a DFlash drafter's block (module docstring)."""

    def __init__(self, drafter, target, policy: AdaptiveWindowPolicy, vocab_size: int | None = None):
        if policy.max_window > int(drafter.config.block_size) - 1:
            raise ValueError(f"The policy's K = {policy.max_window} exceeds the block's {drafter.config.block_size - 1} "
                             "drafted slots (block_size - 1).")
        self.policy, self.vocab_size = policy, vocab_size
        self.head = target.get_output_embeddings()
        self.enabled = True
        self.window_lengths: list[int] = []  # per round, for inspection
        self.anchors: list[int] = []  # the position of each round's anchor (its last committed token)
        self.block_size = int(drafter.config.block_size)
        self.handle = drafter.register_forward_hook(self._truncate, with_kwargs=True)
        drafter._ppow_block_window = self

    @torch.no_grad()
    def _truncate(self, module, args, kwargs, output):
        from transformers.cache_utils import DFlashCache

        hidden = output.last_hidden_state
        # only the generator's rounds: one cached block (not anchored training/evaluation forwards)
        if not self.enabled or not isinstance(kwargs.get("cache"), DFlashCache) or hidden.shape[1] != self.block_size:
            return output
        rule_slots = max(self.policy.max_window - 1, 0)  # the rule reads conf_1 .. conf_{K-1}
        logits = self.head(hidden[:, 1 : 1 + rule_slots].to(self.head.weight.dtype))
        logits = logits[..., : self.vocab_size] if self.vocab_size else logits
        if rule_slots:
            length = int(self.policy.window_lengths(self.policy.confidence(logits))[0])
        else:
            length = self.policy.max_window
        self.window_lengths.append(length)
        positions = kwargs.get("position_ids")
        self.anchors.append(-1 if positions is None else int(positions[0, -self.block_size]))
        output.last_hidden_state = hidden[:, : 1 + length]
        return output

    @contextlib.contextmanager
    def paused(self):
        """Full blocks inside the block (our own loops apply the rule themselves)."""
        enabled, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = enabled

    def remove(self) -> None:
        self.handle.remove()


def attach_block_window(drafter, target, policy: AdaptiveWindowPolicy, vocab_size: int | None = None) -> BlockWindow:
    """Install ``policy`` on ``drafter`` for the native route (replacing a previous one); returns the hook."""
    check_target(drafter, target)
    previous = getattr(drafter, "_ppow_block_window", None)
    if previous is not None:
        previous.remove()
    return BlockWindow(drafter, target, policy, vocab_size)


def is_block_folder(folder) -> bool:
    """Whether a local folder holds a DFlash drafter in transformers' layout (``model_type`` muse_glimmer_assistant)."""
    config = Path(folder) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == MODEL_TYPE


def load_block_drafter(folder, **from_pretrained_kwargs):
    """The drafter of a folder in transformers' layout (``AutoModel.from_pretrained``; no remote code)."""
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(folder), **from_pretrained_kwargs)
