"""Serving a drafter: everything between a trained drafter and tokens generated faster, as transformers keeps
``generation/``. The speculative loop and exact greedy tau (``generation``), verification (``verification``), the
window rule (``windowing``, written once in ``custom_generate/generate.py``, the file copied into drafter folders),
the cost model (``cost``), the batched draft -> verify -> rewards path that calibration, evaluation and the trainer's
rollouts share (``rollout``, ``credit``, ``rewards``), the rule's calibration (``calibration``) and the served rule
(``rule``), transformers' ``generate(assistant_model=...)`` hook (``assisted``, ``assistant_loop``), and the runtime
the models serve on (``runtime``, ``compiled``, and the target's serving precision, ``precision``). Drafter families are found through ``ppow_trl.drafting``'s registry:
nothing here imports one.
"""

from .assisted import load_assistant, load_cost_model, save_assistant, write_assistant_files
from .calibration import calibrate_policy, held_out_contexts
from .compiled import CompiledCausalLM, CompileSettings
from .cost import CostModel, calibrate_cost_model, overall_speedup, speedup
from .credit import per_position_advantages, per_position_credit
from .precision import PRECISIONS, Int8WeightOnlyLinear, serving_precision
from .generation import ExactGreedyTau, SpeculativeOutput, exact_greedy_tau, greedy_continuation, speculative_generate
from .rewards import divergence, proximity_reward, window_reward
from .rollout import DraftedWindows, VerifiedWindows, draft_windows, target_window_probs, verify_windows, window_rewards
from .rule import DEFAULT_GUARD, calibrate_for_serving, describe_serving_rule
from .runtime import ServingRuntime, measure_loop_overhead, serving_runtime
from .verification import (
    VerificationResult,
    acceptance_probabilities,
    expected_accepted_length,
    greedy_accepted_length,
    greedy_verify,
    residual_distribution,
    speculative_sampling_verify,
)
from .windowing import (
    AdaptiveWindowPolicy,
    attach_window_policy,
    configure_generation_config,
    divergence_scores,
    window_start_probabilities,
)

__all__ = [
    "PRECISIONS",
    "Int8WeightOnlyLinear",
    "serving_precision",
    "AdaptiveWindowPolicy",
    "CompileSettings",
    "CompiledCausalLM",
    "CostModel",
    "DEFAULT_GUARD",
    "DraftedWindows",
    "ExactGreedyTau",
    "ServingRuntime",
    "SpeculativeOutput",
    "VerificationResult",
    "VerifiedWindows",
    "acceptance_probabilities",
    "attach_window_policy",
    "calibrate_cost_model",
    "calibrate_for_serving",
    "calibrate_policy",
    "configure_generation_config",
    "describe_serving_rule",
    "divergence",
    "divergence_scores",
    "draft_windows",
    "exact_greedy_tau",
    "expected_accepted_length",
    "greedy_accepted_length",
    "greedy_continuation",
    "greedy_verify",
    "held_out_contexts",
    "load_assistant",
    "load_cost_model",
    "measure_loop_overhead",
    "overall_speedup",
    "per_position_advantages",
    "per_position_credit",
    "proximity_reward",
    "residual_distribution",
    "save_assistant",
    "serving_runtime",
    "speculative_generate",
    "speculative_sampling_verify",
    "speedup",
    "target_window_probs",
    "verify_windows",
    "window_reward",
    "window_rewards",
    "window_start_probabilities",
    "write_assistant_files",
]
