"""The speculation core: what PPOW trains on and what serving runs, written once for both. Verification (greedy
accepted length, speculative sampling: ``verification``), the window rule (``windowing``: window selection and
``AdaptiveWindowPolicy``; the rule itself is written once in ``custom_generate/generate.py``, the file copied into
drafter folders), the cost model and speedup (``cost``), the rewards (``rewards``), per-position credit (``credit``)
and the batched draft -> verify -> rewards path that the trainer's rollouts, calibration and held-out metrics share
(``rollout``). It imports none of the subpackages: drafter families are found through ``ppow_trl.drafting``'s
registry.
"""

from .cost import CostModel, calibrate_cost_model, overall_speedup, speedup
from .credit import per_position_advantages, per_position_credit
from .rewards import divergence, proximity_reward, window_reward
from .rollout import DraftedWindows, VerifiedWindows, draft_windows, target_window_probs, verify_windows, window_rewards
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
    "AdaptiveWindowPolicy",
    "CostModel",
    "DraftedWindows",
    "VerificationResult",
    "VerifiedWindows",
    "acceptance_probabilities",
    "attach_window_policy",
    "calibrate_cost_model",
    "configure_generation_config",
    "divergence",
    "divergence_scores",
    "draft_windows",
    "expected_accepted_length",
    "greedy_accepted_length",
    "greedy_verify",
    "overall_speedup",
    "per_position_advantages",
    "per_position_credit",
    "proximity_reward",
    "residual_distribution",
    "speculative_sampling_verify",
    "speedup",
    "target_window_probs",
    "verify_windows",
    "window_reward",
    "window_rewards",
    "window_start_probabilities",
]
