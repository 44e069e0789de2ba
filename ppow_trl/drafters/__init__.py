"""Drafter families: what drafts for the target. ``standalone`` (any causal LM over the target's vocabulary),
``eagle3`` (heads reading the target's hidden states), ``dflash`` (block drafters on transformers' native route),
``prompt_lookup`` (n-grams of the text itself) and ``hybrid`` (prompt lookup where the text repeats, a trained
drafter elsewhere). Each implements the family protocol of ``ppow_trl.drafting``, whose registry finds them by
module name, and serves through the window rule of ``ppow_trl.core.windowing``. The protocol, the target features
(``ppow_trl.features``) and the reduced-vocabulary drafter model (``ppow_trl.drafter``) sit below both, at the top of
the package: the serving loop asks the registry, and the families use the core's rule.
"""

from . import dflash, eagle3
from .dflash import dflash_from_target, export_dflash, import_dflash
from .dflash.family import DFlashFamily
from .eagle3 import Eagle3DrafterConfig, Eagle3DrafterForCausalLM, attach_to_target, export_eagle3, import_eagle3
from .eagle3.family import Eagle3Family
from .hybrid import HybridConfig, HybridDrafter, HybridFamily, hybrid_drafter
from .prompt_lookup import PromptLookupConfig, PromptLookupDrafter, PromptLookupFamily
from .standalone import StandaloneFamily

__all__ = [
    "DFlashFamily",
    "Eagle3DrafterConfig",
    "Eagle3DrafterForCausalLM",
    "Eagle3Family",
    "HybridConfig",
    "HybridDrafter",
    "HybridFamily",
    "PromptLookupConfig",
    "PromptLookupDrafter",
    "PromptLookupFamily",
    "StandaloneFamily",
    "attach_to_target",
    "dflash",
    "dflash_from_target",
    "eagle3",
    "export_dflash",
    "export_eagle3",
    "hybrid_drafter",
    "import_dflash",
    "import_eagle3",
]
