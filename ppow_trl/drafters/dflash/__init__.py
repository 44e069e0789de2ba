"""DFlash block drafters (a drafter family, see ``ppow_trl.drafting``): transformers' ``MuseGlimmerAssistantModel``,
loadable by ``target.generate(assistant_model=drafter, speculation_type="dflash")`` without remote code."""

from .configuration import (
    DEFAULT_BLOCK_SIZE,
    choose_mask_token_id,
    default_target_layer_ids,
    dflash_config_for,
    hidden_state_indices,
)
from .convert import detect_dflash_format, export_dflash, import_dflash
from .modeling import (
    anchored_block_hidden,
    block_input_ids,
    block_mask,
    check_target,
    dflash_from_target,
    feature_layers,
    is_block_drafter,
)

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "anchored_block_hidden",
    "block_input_ids",
    "block_mask",
    "check_target",
    "choose_mask_token_id",
    "default_target_layer_ids",
    "dflash_config_for",
    "dflash_from_target",
    "detect_dflash_format",
    "export_dflash",
    "import_dflash",
    "feature_layers",
    "hidden_state_indices",
    "is_block_drafter",
]
