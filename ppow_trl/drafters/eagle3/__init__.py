"""EAGLE-3-style drafters: heads that read the target's hidden states (a drafter family, see ``ppow_trl.drafting``)."""

from .configuration_eagle3 import Eagle3DrafterConfig, default_target_layer_ids, resolve_target_layer_ids
from .assisted import TargetFeatureTap, attach_to_target, chain_generate
from .convert import detect_format, export_eagle3, import_eagle3
# The target features are family-neutral (ppow_trl.features); re-exported here where users found them first.
from ...features import context_features, select_features, target_features, target_forward
from .modeling_eagle3 import ChainCache, Eagle3DrafterForCausalLM, Eagle3DrafterOutput
from .session import ChainSession

__all__ = [
    "ChainCache",
    "ChainSession",
    "TargetFeatureTap",
    "attach_to_target",
    "chain_generate",
    "context_features",
    "detect_format",
    "export_eagle3",
    "import_eagle3",
    "Eagle3DrafterConfig",
    "Eagle3DrafterForCausalLM",
    "Eagle3DrafterOutput",
    "default_target_layer_ids",
    "resolve_target_layer_ids",
    "select_features",
    "target_features",
    "target_forward",
]
