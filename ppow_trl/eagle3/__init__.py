"""EAGLE-3-style drafters: heads that read the target's hidden states (a drafter family, see ``ppow_trl.drafting``)."""

from .configuration_eagle3 import Eagle3DrafterConfig, default_target_layer_ids
from .features import select_features, target_features, target_forward
from .modeling_eagle3 import ChainCache, Eagle3DrafterForCausalLM, Eagle3DrafterOutput

__all__ = [
    "ChainCache",
    "Eagle3DrafterConfig",
    "Eagle3DrafterForCausalLM",
    "Eagle3DrafterOutput",
    "default_target_layer_ids",
    "select_features",
    "target_features",
    "target_forward",
]
