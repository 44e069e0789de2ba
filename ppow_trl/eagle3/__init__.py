"""EAGLE-3-style drafters: heads that read the target's hidden states (a drafter family, see ``ppow_trl.drafting``)."""

from .configuration_eagle3 import Eagle3DrafterConfig, default_target_layer_ids
from .assisted import TargetFeatureTap, attach_to_target, chain_generate
from .convert import detect_format, export_eagle3, import_eagle3
from .features import context_features, select_features, target_features, target_forward
from .modeling_eagle3 import ChainCache, Eagle3DrafterForCausalLM, Eagle3DrafterOutput


def __getattr__(name):
    # ppow_trl.eagle3.data imports ppow_trl.data, which the core modules must not import at load time
    if name in ("compute_target_features", "feature_bytes"):
        from . import data

        return getattr(data, name)
    raise AttributeError(name)

__all__ = [
    "ChainCache",
    "TargetFeatureTap",
    "attach_to_target",
    "chain_generate",
    "compute_target_features",
    "feature_bytes",
    "context_features",
    "detect_format",
    "export_eagle3",
    "import_eagle3",
    "Eagle3DrafterConfig",
    "Eagle3DrafterForCausalLM",
    "Eagle3DrafterOutput",
    "default_target_layer_ids",
    "select_features",
    "target_features",
    "target_forward",
]
