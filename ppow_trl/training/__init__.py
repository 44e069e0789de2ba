"""Training a drafter: PPOW (``PPOWTrainer``, ``PPOWConfig``: window-level rewards with the target as verifier, on
TRL's GRPO trainer), the token-level distillation baseline and warm start (``KDTrainer``, ``KDConfig``), on-policy
distillation (``on_policy``), and what they train on: the contexts windows start from (``contexts``), the window
log-probs of the loss (``window_logprobs``), rewards from the training text itself (``cached_verification``), the
held-out metrics (``held_out``) and the model card a trained drafter is saved with (``model_card``). TRL's private
touch points are checked in one place (``_trl_compat``). Windows are drafted, verified and rewarded by
the rollout path of ``ppow_trl.core`` (``ppow_trl.core.rollout``), the same one calibration runs.
"""

from .cached_verification import verify_windows_from_cache
from .contexts import ContextPool, ContextSelector
from .held_out import held_out_tau_counts, held_out_window_metrics
from .kd_trainer import DataCollatorForKD, KDConfig, KDTrainer
from .model_card import render_model_card, write_model_card
from .on_policy import on_policy_loss, train_on_policy
from .ppow_config import PPOWConfig
from .ppow_trainer import PPOWTrainer

__all__ = [
    "ContextPool",
    "ContextSelector",
    "DataCollatorForKD",
    "KDConfig",
    "KDTrainer",
    "PPOWConfig",
    "PPOWTrainer",
    "held_out_tau_counts",
    "held_out_window_metrics",
    "on_policy_loss",
    "render_model_card",
    "train_on_policy",
    "verify_windows_from_cache",
    "write_model_card",
]
