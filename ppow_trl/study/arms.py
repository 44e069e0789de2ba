"""The study's arms: what each trains, from which start, for which budget (design/PPOW.md "Baselines").

Every arm starts from the same drafter (the target's first layers with a reduced head over the same ids),
sees the same target-generated data and gets the same wall-clock training budget ``budget_seconds``:

- ``kd``: token-level distillation, forward KL on the target's top-k, for the whole budget. Its state at
  ``warm_seconds`` is saved and evaluated as ``kd_warm``: the warm start every PPOW arm continues from.
- ``kd_tv``: distillation on the direct acceptance objective (minimise TV = maximise sum_v min(p, q)).
- ``ppow``: ``kd_warm`` then PPOW for the rest of the budget (``budget_seconds - warm_seconds``).
- ablations of ``ppow`` from the same warm start: no cost term (reward E[A|y] + 1), no R_prox,
  uniform selection, fixed K (trained and served without the adaptive window), per-token credit; and
  ``ppow_greedy``, PPOW rewarded by greedy verification (the regime of the primary measure).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Arm:
    """One arm: ``kind`` "kd" (loss ``kd_loss``) or "ppow" (PPOWConfig fields ``ppow`` over the study's)."""

    name: str
    kind: str
    description: str
    kd_loss: str = "forward_kl"
    ppow: dict = field(default_factory=dict)

    @property
    def starts_from_warm(self) -> bool:
        return self.kind == "ppow"


ARMS = {arm.name: arm for arm in [
    Arm("kd", "kd", "KD, forward KL, whole budget"),
    Arm("kd_tv", "kd", "KD, direct acceptance (TV), whole budget", kd_loss="tv"),
    Arm("ppow", "ppow", "KD warm start, then PPOW (full)"),
    Arm("ppow_no_cost", "ppow", "PPOW without the cost term: reward E[A|y] + 1", ppow={"speed_reward": "tokens"}),
    Arm("ppow_no_prox", "ppow", "PPOW without R_prox", ppow={"proximity_weight": 0.0}),
    Arm("ppow_uniform", "ppow", "PPOW with uniform context selection", ppow={"selection_beta": 0.0}),
    Arm("ppow_fixed_k", "ppow", "PPOW with fixed windows of K (trained and served)",
        ppow={"window_threshold": 0.0, "calibrate_window": False}),
    Arm("ppow_per_token", "ppow", "PPOW with per-token credit", ppow={"per_token_credit": "replace"}),
    # Not an ablation of the paper's method but the regime the primary measure serves: rewards from greedy
    # verification (A, and R_prox against the target's one-hot argmax) of windows still sampled at T = 1.
    Arm("ppow_greedy", "ppow", "PPOW with greedy-verification rewards (the served regime)",
        ppow={"acceptance": "greedy"}),
    # The full method again under another seed (LoRA init, window sampling, selection): the seed-to-seed spread
    # that an ablation's effect has to exceed.
    Arm("ppow_seed1", "ppow", "KD warm start, then PPOW (full), seed 1", ppow={"seed": 1}),
]}
# Evaluated, not trained: the KD arm's state at the warm-start point.
WARM = "kd_warm"
# The order arms run in: the two KD arms first (the warm start comes from `kd`), then PPOW and its ablations.
ORDER = ["kd", "kd_tv", "ppow", "ppow_greedy", "ppow_no_cost", "ppow_no_prox", "ppow_uniform", "ppow_fixed_k",
         "ppow_per_token", "ppow_seed1"]
