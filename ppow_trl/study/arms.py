"""The study's arms: what each trains, from which start, for which budget (docs/ppow.md "Baselines").

Every arm starts from the same drafter (the target's first layers with a reduced head over the same ids),
sees the same target-generated data and gets the same wall-clock training budget ``budget_seconds``:

- ``kd``: token-level distillation, forward KL on the target's top-k, for the whole budget. Its state at
  ``warm_seconds`` is saved and evaluated as ``kd_warm``: the warm start every PPOW arm continues from.
- ``kd_tv``: distillation on the direct acceptance objective (minimise TV = maximise sum_v min(p, q)).
- ``ppow``: ``kd_warm`` then PPOW for the rest of the budget (``budget_seconds - warm_seconds``).
- ablations of ``ppow`` from the same warm start: no cost term (reward E[A|y] + 1), no R_prox,
  uniform selection, fixed K (trained and served without the adaptive window), per-token credit; and
  ``ppow_greedy``, PPOW rewarded by greedy verification (the regime of the primary measure).
- the same protocol for another drafter family (``Arm.drafter``): ``eagle3_kd`` (an EAGLE-3 head reading the
  target's hidden states, KD with training-time test on cached target features) and ``eagle3_ppow`` (its state at
  ``warm_seconds`` then PPOW), each family with its own warm start (``warm_start_of``); ``dflash_kd`` (a DFlash
  block drafter, transformers' ``MuseGlimmerAssistantModel``, KD on anchored blocks from the same cached features)
  and ``dflash_ppow``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..drafting import family_names, get_family

BASELINE_DRAFTER = "truncated"  # the drafter of the main table's arms (KD, PPOW and its ablations)


@dataclass(frozen=True)
class Arm:
    """One arm: ``kind`` "kd" (loss ``kd_loss``), "ppow" (PPOWConfig fields ``ppow`` over the study's) or "eval" (a
    drafter without parameters, evaluated as built), for the drafter ``drafter``: "truncated" (the standalone family:
    the target's first layers) or a registered family's name (``ppow_trl.drafting``), built with ``build``
    (``DrafterFamily.build`` options over the study's ``num_layers = drafter_layers``)."""

    name: str
    kind: str
    description: str
    kd_loss: str = "forward_kl"
    ppow: dict = field(default_factory=dict)
    drafter: str = BASELINE_DRAFTER
    kd: dict = field(default_factory=dict)  # KDConfig fields over the study's (e.g. learning_rate, ttt_steps)
    build: dict = field(default_factory=dict)  # DrafterFamily.build options over the study's

    @property
    def family(self) -> str:
        """The registered family of this arm's drafter (the study calls the standalone one "truncated")."""
        return DRAFTER_FAMILY.get(self.drafter, self.drafter)

    @property
    def starts_from_warm(self) -> bool:
        return self.kind == "ppow"

    @property
    def kd_arm(self) -> str | None:
        """The family's KD arm: it saves the warm start of the family's PPOW arms (``None``: the family has none)."""
        return KD_ARM.get(self.drafter)

    @property
    def saves_warm_start(self) -> bool:
        return self.kd_arm is not None and self.name == self.kd_arm


# The study's name of a family's drafter where it is not the family's own (the standalone family: the target's first
# layers).
DRAFTER_FAMILY = {BASELINE_DRAFTER: "standalone"}
# The DFlash arms' drafter: blocks of 8 (7 drafted slots >= the study's K = 6), 2 layers like the truncated drafter;
# the EAGLE-3 head: one fused layer, as EAGLE-3's.
DFLASH_BUILD = {"block_size": 8, "num_layers": 2}
EAGLE3_BUILD = {"num_layers": 1}

# The KD arm of each drafter family; its state at `warm_seconds` is `warm_start_of(family)`.
KD_ARM = {BASELINE_DRAFTER: "kd", "eagle3": "eagle3_kd", "dflash": "dflash_kd"}


def warm_start_of(drafter: str) -> str:
    """Name of a family's warm start (evaluated as an arm): ``kd_warm``, ``eagle3_kd_warm``."""
    return f"{KD_ARM[drafter]}_warm"


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
    Arm("eagle3_kd", "kd", "EAGLE-3 head, KD with 3-step training-time test, whole budget", drafter="eagle3", build=EAGLE3_BUILD),
    Arm("eagle3_ppow", "ppow", "EAGLE-3 head: KD warm start, then PPOW (full)", drafter="eagle3", build=EAGLE3_BUILD),
    # What limits the fresh head at this budget: its learning rate (a new layer, not a pretrained one) and TTT depth.
    Arm("eagle3_kd_lr2e-3", "kd", "EAGLE-3 head, KD with TTT, learning rate 2e-3", drafter="eagle3", build=EAGLE3_BUILD,
        kd={"learning_rate": 2e-3}),
    Arm("eagle3_kd_ttt1", "kd", "EAGLE-3 head, KD without training-time test (1 step)", drafter="eagle3", build=EAGLE3_BUILD,
        kd={"ttt_steps": 1}),
    Arm("dflash_kd", "kd", "DFlash block drafter (2 layers, blocks of 8), KD on anchored blocks, whole budget",
        drafter="dflash", build=DFLASH_BUILD),
    Arm("dflash_ppow", "ppow", "DFlash block drafter: KD warm start, then PPOW (full)", drafter="dflash", build=DFLASH_BUILD),
    # What limits the fresh block drafter at this budget: learning per step (its rate) or steps (a full-vocabulary
    # head on every slot makes each step ~2.6x a truncated-drafter step here).
    Arm("dflash_kd_lr2e-3", "kd", "DFlash block drafter, KD on anchored blocks, learning rate 2e-3", drafter="dflash", build=DFLASH_BUILD,
        kd={"learning_rate": 2e-3}),
]}
# Every registered family without parameters (prompt lookup): evaluated as built, a baseline row of the tables.
ARMS.update({name: Arm(name, "eval", f"{get_family(name).description}, no training", drafter=name)
             for name in family_names() if not get_family(name).trainable})
# Evaluated, not trained: each family's KD arm's state at the warm-start point.
WARM = warm_start_of(BASELINE_DRAFTER)
WARM_STARTS = [warm_start_of(family) for family in KD_ARM]
# The order arms run in: the two KD arms first (the warm start comes from `kd`), then PPOW and its ablations.
ORDER = ["kd", "kd_tv", "ppow", "ppow_greedy", "ppow_no_cost", "ppow_no_prox", "ppow_uniform", "ppow_fixed_k",
         "ppow_per_token", "ppow_seed1", "eagle3_kd", "eagle3_ppow", "eagle3_kd_lr2e-3", "eagle3_kd_ttt1", "dflash_kd",
         "dflash_ppow", "dflash_kd_lr2e-3", *(name for name, arm in ARMS.items() if arm.kind == "eval")]
