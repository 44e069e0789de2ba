"""ppow_trl: PPOW (arXiv 2605.14978) for TRL: speculative-decoding drafters trained on window-level rewards."""

__version__ = "0.1.0.dev0"

# First, before anything imports trl: an ImportError naming the supported range when another trl is installed
# (PPOWTrainer overrides private methods of trl 1.16's GRPOTrainer). The check runs when _compat is imported.
from . import _compat  # noqa: F401

# The module paths from before the subpackages still import, as the moved modules themselves, with a FutureWarning
# naming the new path; so does ppow_trl.<old name> as an attribute (the table: ppow_trl/_moved.py).
# Importing _moved puts its finder first on sys.meta_path.
from ._moved import moved_attribute as __getattr__  # noqa: F401

from .core.cost import CostModel, calibrate_cost_model, overall_speedup, speedup
# Importing the drafter module registers the `ppow_drafter` model type with AutoConfig and
# AutoModelForCausalLM, so `AutoModelForCausalLM.from_pretrained(saved_drafter)` works after `import ppow_trl`.
from .drafter import PPOWDrafterConfig, PPOWDrafterForCausalLM
# The drafter families' registry (the families: ppow_trl.drafters).
from .drafting import DrafterFamily, family_of, get_family, load_drafter, register_family
# Registers the `ppow_eagle3` model type too (EAGLE-3 heads reading the target's hidden states).
from .drafters.eagle3 import Eagle3DrafterConfig, Eagle3DrafterForCausalLM
from .serving.generation import exact_greedy_tau, speculative_generate
# Serving: the served rule, the generate(assistant_model=...) hook, the runtime, the hybrid with prompt lookup.
from .serving.assisted import load_assistant, save_assistant
from .serving.calibration import held_out_contexts
from .drafters.hybrid import hybrid_drafter
from .serving.runtime import serving_runtime
from .serving.rule import calibrate_for_serving, describe_serving_rule
# llama.cpp's layout for standalone Llama drafters (CPU serving in llama.cpp; ppow_trl.interop.llama_cpp_draft).
from .interop.gguf_export import export_gguf
from .training.kd_trainer import KDConfig, KDTrainer
from .models import OFFLINE_TARGET, build_draft_vocab, check_compatibility, draft_vocab_coverage, load_target, make_drafter
from .training.ppow_config import PPOWConfig
from .training.ppow_trainer import PPOWTrainer
from .core.rewards import divergence, proximity_reward, window_reward
from .core.verification import (
    acceptance_probabilities,
    expected_accepted_length,
    greedy_accepted_length,
    greedy_verify,
    residual_distribution,
    speculative_sampling_verify,
)
from .core.windowing import AdaptiveWindowPolicy, divergence_scores, window_start_probabilities

__all__ = [
    "load_assistant",
    "save_assistant",
    "held_out_contexts",
    "hybrid_drafter",
    "serving_runtime",
    "calibrate_for_serving",
    "describe_serving_rule",
    "AdaptiveWindowPolicy",
    "CostModel",
    "DrafterFamily",
    "Eagle3DrafterConfig",
    "Eagle3DrafterForCausalLM",
    "KDConfig",
    "KDTrainer",
    "OFFLINE_TARGET",
    "PPOWDrafterConfig",
    "PPOWConfig",
    "PPOWDrafterForCausalLM",
    "PPOWTrainer",
    "acceptance_probabilities",
    "build_draft_vocab",
    "calibrate_cost_model",
    "check_compatibility",
    "divergence",
    "divergence_scores",
    "draft_vocab_coverage",
    "exact_greedy_tau",
    "export_gguf",
    "family_of",
    "get_family",
    "load_drafter",
    "expected_accepted_length",
    "greedy_accepted_length",
    "greedy_verify",
    "load_target",
    "make_drafter",
    "overall_speedup",
    "proximity_reward",
    "register_family",
    "residual_distribution",
    "speculative_generate",
    "speculative_sampling_verify",
    "speedup",
    "window_reward",
    "window_start_probabilities",
]
