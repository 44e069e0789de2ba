"""EAGLE-3 drafters in Hugging Face's own assisted generation: ``target.generate(**inputs, assistant_model=drafter)``.

transformers 5.24's assisted loop hands an assistant token ids only (``AssistedCandidateGenerator`` calls
``assistant.generate(input_ids=committed, ...)`` each round; only its DFlash/MTP generators see the target's
outputs, and the loop takes no candidate generator from the caller). A feature-conditioned drafter therefore gets
the target's hidden states itself:

- ``attach_to_target(drafter, target, policy)`` registers forward hooks on the target (``TargetFeatureTap``): on its
  input embedding (hidden state 0), on decoder layer ``i - 1`` (hidden state ``i``) and on the final norm (the
  last one), for the drafter's ``target_layer_ids``. Every target forward appends its positions' features
  (``start`` = the length of the cache it was given; positions from ``start`` on replace older, rejected ones).
  HF's verification forward over ``[last token] + candidates`` is thus also what hands the drafter the accepted
  tokens' features: no second target forward per round.
- The drafter's ``generate`` is replaced by ``chain_generate`` (bound with ``functools.partial``, the same hook
  mechanism as standalone drafters, ``ppow_trl.serving.assisted``): when HF calls it as an assistant it reads the committed
  ids, trims the features to the verified prefix (positions ``< len(ids) - 1``), catches the drafter's
  ``ChainSession`` up and drafts with PPOW's adaptive window (``PPOWWindowCriteria``, the same rule as every other
  route), sampling from the target's logits processors' output exactly as HF's own assistant decoding does. HF then
  verifies as usual, so the output is lossless.

Limits: batch size 1 (HF's assisted decoding refuses larger batches anyway); decoder-only targets whose decoder
keeps its layers in ``get_decoder().layers`` and its final norm in ``get_decoder().norm`` (Llama, Qwen2, Mistral,
SmolLM2 and most HF decoders); the first round of each ``generate`` call runs one extra target forward over the
prompt (HF calls the assistant before the target has run); the hooks see every forward of the target while
attached (``tap.remove()`` detaches them). No remote code is involved: ``load_assistant(folder, target=target)``
does all of this for a saved drafter.
"""

from __future__ import annotations

import contextlib
import functools

import torch
from ...serving.assistant_loop import check_assistant_call, draft_window
from ...features import target_features
from ...core.windowing import configure_generation_config
from .session import ChainSession


class TargetFeatureTap:
    """Forward hooks on ``target`` that keep the hidden states at ``layer_ids`` (``output_hidden_states`` indices) of
    every position it has processed: ``features`` ``(positions, len(layer_ids) * hidden)``, batch 1."""

    def __init__(self, target, layer_ids: list[int]):
        self.target, self.layer_ids = target, list(layer_ids)
        decoder = target.get_decoder()
        layers = getattr(decoder, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ValueError(f"{type(target).__name__} keeps no decoder layers in get_decoder().layers: the EAGLE-3 "
                             "hooks cannot find the hidden states to read.")
        modules = {}
        for index in self.layer_ids:
            if index == 0:
                modules[index] = target.get_input_embeddings()
            elif index < len(layers):
                modules[index] = layers[index - 1]
            elif index == len(layers) and getattr(decoder, "norm", None) is not None:
                modules[index] = decoder.norm  # HF's last hidden state is the normed one
            else:
                raise ValueError(f"target_layer_ids {self.layer_ids} exceed the target's {len(layers)} layers.")
        self.features: torch.Tensor | None = None
        self._captured: dict[int, torch.Tensor] = {}
        self._start = 0
        self._paused = False
        self._handles = [target.register_forward_pre_hook(self._before, with_kwargs=True),
                         target.register_forward_hook(self._after)]
        self._handles += [module.register_forward_hook(functools.partial(self._capture, index))
                          for index, module in modules.items()]

    def __len__(self) -> int:
        return 0 if self.features is None else self.features.shape[0]

    def _before(self, module, args, kwargs):
        if self._paused:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self._start = 0 if cache is None else cache.get_seq_length()
        self._captured = {}

    def _capture(self, index, module, args, output):
        if not self._paused:
            self._captured[index] = (output[0] if isinstance(output, tuple) else output).detach()

    def _after(self, module, args, output):
        if self._paused or len(self._captured) != len(self.layer_ids):
            return
        new = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
        if new.shape[0] != 1:
            raise ValueError(f"EAGLE-3 assisted generation runs batch size 1; the target ran a batch of {new.shape[0]}.")
        kept = None if self.features is None or self._start == 0 else self.features[: self._start]
        self.features = new[0] if kept is None else torch.cat([kept, new[0]])
        self._captured = {}

    @contextlib.contextmanager
    def paused(self):
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def attach_to_target(drafter, target, policy=None, vocab_size: int | None = None) -> TargetFeatureTap:
    """Make ``target.generate(..., assistant_model=drafter)`` work for an EAGLE-3 ``drafter`` (module docstring).

    Checks ``target`` is the one the drafter reads, registers the ``TargetFeatureTap`` and installs
    ``chain_generate``; ``policy`` (an ``AdaptiveWindowPolicy``) sets the window rule in the drafter's generation
    config (``ppow_trl.core.windowing.configure_generation_config``), else the one it carries is used. Returns the tap.
    """
    drafter.check_target(target)
    if policy is not None:
        configure_generation_config(drafter.generation_config, policy, vocab_size)
    previous = getattr(drafter, "_ppow_feature_tap", None)
    if previous is not None:
        previous.remove()
    tap = TargetFeatureTap(target, drafter.config.target_layer_ids)
    drafter._ppow_feature_tap = tap
    drafter._ppow_session = None
    drafter.generate = functools.partial(chain_generate, model=drafter)
    return tap


@torch.no_grad()
def chain_generate(*args, model, input_ids=None, generation_config=None, logits_processor=None, max_new_tokens=None,
                   **kwargs):
    """The EAGLE-3 drafter's ``generate`` as HF's assistant: one window after the committed ``input_ids``
    (``ppow_trl.serving.assistant_loop.draft_window``), after catching its ``ChainSession`` up on the target's features."""
    input_ids = input_ids if input_ids is not None else args[0]
    check_assistant_call(generation_config, input_ids, "EAGLE-3")
    tap = model._ppow_feature_tap
    sequence = input_ids[0].tolist()
    committed = len(sequence)
    session = model._ppow_session
    # A new generate call (or the same committed ids again, e.g. a repeated prompt): start from the features.
    read = [] if session is None else session.sequence
    fresh = session is None or len(read) >= committed or read != sequence[: len(read)]
    if fresh:
        session = model._ppow_session = ChainSession(model)
    if fresh or len(tap) < committed - 1:  # HF asks for candidates before the target has run: its features, once
        with tap.paused():
            tap.features = target_features(tap.target, input_ids[:, :-1].to(tap.target.device),
                                           layer_ids=tap.layer_ids)[0]
    session.features = []
    session.add_features(tap.features[session.pairs : committed - 1].to(model.device))
    logits = session.extend(sequence)
    return draft_window(model, session, logits, input_ids, generation_config, logits_processor, max_new_tokens,
                        need_one="An EAGLE-3 drafter needs a prompt of at least 2 tokens (one pair to draft from).")
