"""DFlash block drafters' configuration: transformers' own ``MuseGlimmerAssistantConfig``, shaped for a target.

The drafter class is transformers' ``MuseGlimmerAssistantModel`` (no remote code): the model that
``target.generate(assistant_model=drafter, speculation_type="dflash")`` drives through
``DFlashTokenCandidateGenerator``. Its config carries what that generator reads:

- ``target_layer_ids``: *decoder layer* indices ``i`` whose outputs it reads, i.e. the target's
  ``output_hidden_states[i + 1]`` (transformers' DFlash convention; ``ppow_trl.drafters.eagle3`` stores the hidden-state
  indices themselves). ``default_target_layer_ids(L) = [1, L // 2 - 1, L - 4]``: the same tensors as the EAGLE-3
  family's default ``[2, L // 2, L - 3]``, so both families share one cached feature column (SmolLM2: layers
  1, 14, 26 = hidden states 2, 15, 27).
- ``block_size``: positions per drafter forward, ``[anchor, mask x (block_size - 1)]``: at most
  ``block_size - 1`` drafted tokens per round.
- ``mask_token_id``: the id whose (target) embedding fills the block's masked slots. It must never be a token the
  target reads in normal text; ``choose_mask_token_id``.

The ids of the target it was built for go in ``ppow_target`` (type, depth, hidden size, vocabulary, name) so a
mismatch is refused with a message (``check_target``); stock transformers ignores that field.
"""

from __future__ import annotations

from transformers import MuseGlimmerAssistantConfig, PreTrainedModel

DEFAULT_BLOCK_SIZE = 8


def default_target_layer_ids(num_target_layers: int) -> list[int]:
    """``[1, L // 2 - 1, L - 4]`` (decoder layers; hidden states ``[2, L // 2, L - 3]``, EAGLE-3's default)."""
    ids = [1, num_target_layers // 2 - 1, num_target_layers - 4]
    return sorted({min(max(i, 0), num_target_layers - 1) for i in ids})  # shallow targets: fewer, distinct layers


def hidden_state_indices(config) -> list[int]:
    """The target ``output_hidden_states`` indices a DFlash config reads: ``target_layer_ids + 1``."""
    return [int(i) + 1 for i in config.target_layer_ids]


def choose_mask_token_id(tokenizer) -> int:
    """The tokenizer's mask token, else its highest-id special token that chat text never contains.

    Candidates are the added special tokens other than BOS/EOS/PAD/UNK and those the chat template writes. SmolLM2
    (all 49,152 rows in use) gives 16, ``<empty_output>``: a StarCoder notebook marker absent from chat data.
    """
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return int(tokenizer.mask_token_id)
    reserved = {getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "pad", "unk")}
    template = str(getattr(tokenizer, "chat_template", "") or "")
    candidates = [
        index for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(token, "special", False) and index not in reserved and str(token) not in template
    ]
    if not candidates:
        raise ValueError("The tokenizer has no mask token and no unused special token: pass mask_token_id= (an id the "
                         "target never reads in normal text, e.g. a reserved or added token).")
    return int(max(candidates))


def dflash_config_for(
    target: PreTrainedModel,
    *,
    mask_token_id: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
    num_hidden_layers: int = 1,
    target_layer_ids: list[int] | None = None,
    target_name_or_path: str | None = None,
) -> MuseGlimmerAssistantConfig:
    """A ``MuseGlimmerAssistantConfig`` with the target's width, heads, MLP, norm epsilon and RoPE, full attention.

    The drafter's hidden size must be the target's: the block is embedded by the target's input embedding and its
    outputs go through the target's output head.
    """
    text = target.config.get_text_config()
    layers = text.num_hidden_layers
    ids = default_target_layer_ids(layers) if target_layer_ids is None else [int(i) for i in target_layer_ids]
    if any(not 0 <= i < layers for i in ids):
        raise ValueError(f"target_layer_ids {ids} must be decoder layer indices of the target (0..{layers - 1}).")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (the anchor and at least one drafted slot), got {block_size}.")
    vocab = target.get_input_embeddings().weight.shape[0]
    if not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id {mask_token_id} is not a row of the target's embedding ({vocab} rows).")
    rope = dict(getattr(text, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0})
    return MuseGlimmerAssistantConfig(
        hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=text.num_attention_heads,
        num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
        head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
        rope_parameters=rope,
        max_position_embeddings=text.max_position_embeddings,
        layer_types=["full_attention"] * num_hidden_layers,
        hidden_act=getattr(text, "hidden_act", "silu"),
        bos_token_id=getattr(text, "bos_token_id", None),
        eos_token_id=getattr(text, "eos_token_id", None),
        pad_token_id=getattr(text, "pad_token_id", None),
        # the target head's rows: the width of the block's logits (vLLM reads it too)
        vocab_size=target.get_output_embeddings().weight.shape[0],
        block_size=int(block_size),
        mask_token_id=int(mask_token_id),
        target_layer_ids=ids,
        ppow_target={
            "model_type": text.model_type,
            "num_hidden_layers": layers,
            "hidden_size": text.hidden_size,
            "vocab_size": vocab,
            "name_or_path": target_name_or_path or getattr(target.config, "_name_or_path", None) or None,
        },
    )
