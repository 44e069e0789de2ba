"""Configuration of the EAGLE-3-style drafter: a Llama-shaped head that reads the target's hidden states."""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers as indices into HF's ``output_hidden_states`` tuple.

    SpecForge and vLLM take the *outputs* of decoder layers ``1, L // 2 - 1, L - 4`` (vLLM states them as the
    inputs of layers ``2, L // 2, L - 3``). HF's tuple holds the embedding output at index 0 and the output of
    layer ``i`` at index ``i + 1``, so these are indices ``2, L // 2, L - 3`` (SmolLM2, 30 layers: 2, 15, 27).
    """
    if num_target_layers < 4:
        raise ValueError(f"EAGLE-3's default layers need a target with >= 4 layers, got {num_target_layers}; "
                         "pass target_layer_ids explicitly.")
    return [2, num_target_layers // 2, num_target_layers - 3]


def resolve_target_layer_ids(num_target_layers: int, target_layer_ids=None) -> list[int]:
    """The hidden-state indices a head reads: ``target_layer_ids``, or the default (``default_target_layer_ids``)
    when ``None``; each must index the target's ``output_hidden_states`` (``0..num_target_layers``)."""
    layer_ids = (default_target_layer_ids(num_target_layers) if target_layer_ids is None
                 else [int(i) for i in target_layer_ids])
    if not layer_ids or any(not 0 <= i <= num_target_layers for i in layer_ids):
        raise ValueError(f"target_layer_ids {layer_ids} must index the target's output_hidden_states "
                         f"(0..{num_target_layers}).")
    return layer_ids


@strict
class Eagle3DrafterConfig(LlamaConfig):
    r"""
    Configuration of [`Eagle3DrafterForCausalLM`]. The Llama fields (``hidden_size``, ``num_attention_heads``,
    ``rope_parameters``...) describe the drafter's own decoder layer(s); ``vocab_size`` is the target's embedding
    rows (the drafter embeds tokens with the target's frozen embedding). The rest records the target it reads:

    Args:
        draft_vocab_size (`int`): rows of the drafter's head (``vocab_size`` = the target's full head).
        full_vocab_size (`int`, *optional*): width of the logits ``forward`` returns (the target's output rows);
            defaults to ``vocab_size``.
        target_hidden_size (`int`, *optional*): hidden size of the target (defaults to ``hidden_size``).
        target_layer_ids (`list[int]`): indices into the target's ``output_hidden_states`` tuple whose states
            are concatenated, in this order, as the drafter's input features (``default_target_layer_ids``).
        target_num_hidden_layers (`int`, *optional*): the target's decoder layers, checked on use.
        target_model_type (`str`, *optional*) and target_name_or_path (`str`, *optional*): the target the drafter
            was built for (the model type is checked on use; the name is informative).
    """

    model_type = "ppow_eagle3"

    draft_vocab_size: int = 32000
    full_vocab_size: int | None = None
    target_hidden_size: int | None = None
    target_layer_ids: list[int] | None = None
    target_num_hidden_layers: int | None = None
    target_model_type: str | None = None
    target_name_or_path: str | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.full_vocab_size is None:
            self.full_vocab_size = self.vocab_size
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_layer_ids is None:
            self.target_layer_ids = [0]
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.tie_word_embeddings = False  # the head is never tied to the (target's) input embeddings

    def validate_architecture(self):
        super().validate_architecture()
        if not 1 <= self.draft_vocab_size <= self.full_vocab_size:
            raise ValueError(f"draft_vocab_size ({self.draft_vocab_size}) must be between 1 and full_vocab_size "
                             f"({self.full_vocab_size}).")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: give the target hidden-state indices the drafter reads.")

    @property
    def feature_size(self) -> int:
        """Width of the concatenated target features: ``len(target_layer_ids) * target_hidden_size``."""
        return len(self.target_layer_ids) * self.target_hidden_size
