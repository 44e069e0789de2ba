"""What the trainers log, in one place: the keys, who logs them, and what each one measures.

``PPOWTrainer`` logs its own ``ppow/*`` keys next to the ones TRL's ``GRPOTrainer`` logs for any reward functions
(``reward``, ``rewards/speed/mean``, ...); its evaluation logs ``eval_tau`` and the calibrated rule. ``KDTrainer`` logs
``kd/*`` next to transformers' ``loss``. ``train_on_policy`` returns its per-step entries instead of logging them.
The trainers take their evaluation keys from here (``PPOW_EVAL``, ``TAU``), ``docs/logged-metrics.md`` is rendered from
these tables (``tools/render_reference.py``), and ``tests/test_reference_docs.py`` checks that every ``ppow/*`` and
``kd/*`` key in the trainers' code is listed here and that the keys attributed to TRL are ones TRL logs.
"""

from __future__ import annotations

from dataclasses import dataclass

TAU = "tau"
"""Exact greedy tau of held-out prompts, logged as ``eval_tau`` by both trainers' evaluations."""

EVAL_PREFIX = "eval_"
"""What an evaluation puts before each key (``metric_key_prefix``; ``eval_<name>_`` for a dict of eval datasets)."""

KD_STEP_SUFFIX = "_step{k}"
"""Appended to a ``kd/*`` key for slot ``k >= 1`` of a drafter trained on several slots at once."""


@dataclass(frozen=True)
class LoggedMetric:
    """One logged key: ``key`` as written to the logs (evaluation keys without their ``eval_`` prefix), ``logger``
    the class or function whose code writes it, and what it measures."""

    key: str
    logger: str
    description: str


PPOW_TRAIN = (
    LoggedMetric("ppow/expected_accepted", "PPOWTrainer",
                 "Mean accepted length of the batch's windows: E[A|y] under speculative sampling "
                 "(`acceptance=\"expected\"`), or the realised greedy A (`acceptance=\"greedy\"`)."),
    LoggedMetric("ppow/simulated_tau", "PPOWTrainer",
                 "`ppow/expected_accepted` + 1: the tau these windows would give (bonus token included)."),
    LoggedMetric("ppow/window_length", "PPOWTrainer",
                 "Mean drafted window length L under the rollout's window rule (at most `max_window`)."),
    LoggedMetric("ppow/full_window_ratio", "PPOWTrainer",
                 "Share of windows that reached `max_window` tokens (the threshold h did not stop them)."),
    LoggedMetric("ppow/R_speed", "PPOWTrainer",
                 "Mean speed reward R_speed (`speed_reward`: the cost-model speedup S(y), or E[A|y] + 1)."),
    LoggedMetric("ppow/R_prox", "PPOWTrainer",
                 "Mean proximity reward R_prox (`proximity_divergence` over `proximity_positions`), before lambda."),
    LoggedMetric("ppow/selected_divergence", "PPOWTrainer",
                 "Mean `selection_divergence` D(p, q) at the first position of the drafted windows: how hard the "
                 "contexts the divergence-aware selection drew are."),
    LoggedMetric("ppow/cost_ratio", "PPOWTrainer",
                 "t_d / t_t of the cost model the speed reward uses (constant over a run)."),
    LoggedMetric("ppow/target_verified_share", "PPOWTrainer",
                 "Share of the windows the target ran a forward for: 1 with `reward_source=\"target\"`; with "
                 "`\"cache\"`, only windows that run past their response's end."),
)
"""``PPOWTrainer``'s own training keys, averaged over the logging interval and across processes."""

GRPO_TRAIN = (
    LoggedMetric("reward", "GRPOTrainer",
                 "Mean window reward R = R_speed + lambda R_prox (`reward_weights` = [1, `proximity_weight`])."),
    LoggedMetric("reward_std", "GRPOTrainer", "Standard deviation of R over the batch's windows."),
    LoggedMetric("rewards/speed/mean", "GRPOTrainer", "Mean R_speed (the reward function `speed`)."),
    LoggedMetric("rewards/speed/std", "GRPOTrainer", "Standard deviation of R_speed over the batch."),
    LoggedMetric("rewards/proximity/mean", "GRPOTrainer",
                 "Mean R_prox (the reward function `proximity`), before its weight lambda."),
    LoggedMetric("rewards/proximity/std", "GRPOTrainer", "Standard deviation of R_prox over the batch."),
    LoggedMetric("frac_reward_zero_std", "GRPOTrainer",
                 "Share of groups whose windows all got the same reward: they give no gradient."),
    LoggedMetric("completions/mean_length", "GRPOTrainer",
                 "Mean window length in tokens (`completions/min_length` and `completions/max_length` alongside)."),
    LoggedMetric("completions/clipped_ratio", "GRPOTrainer",
                 "Share of windows that end without EOS: about 1, since windows stop at the rule, not at EOS."),
    LoggedMetric("entropy", "GRPOTrainer", "Mean entropy of the drafter's distribution over the window tokens."),
    LoggedMetric("kl", "GRPOTrainer", "KL to the initial drafter (only with `beta > 0`, which needs a `peft_config`)."),
    LoggedMetric("clip_ratio/region_mean", "GRPOTrainer",
                 "Share of window tokens whose importance ratio was clipped, with the clipped `loss_type`s "
                 "(`clip_ratio/low_*` and `clip_ratio/high_*` alongside)."),
    LoggedMetric("num_tokens", "GRPOTrainer", "Tokens (contexts and windows) processed so far."),
)
"""Keys TRL's ``GRPOTrainer`` logs for ``PPOWTrainer``, read as PPOW's windows and rewards (the reward functions are
``ppow_trl.training.ppow_trainer.speed`` and ``proximity``); TRL documents the others it may add."""

PPOW_EVAL = (
    LoggedMetric(TAU, "PPOWTrainer.evaluate",
                 "Exact greedy tau at the calibrated rule: tokens / target verification forwards, bonus token "
                 "included, over `eval_num_prompts` held-out prompts of `eval_max_new_tokens` tokens."),
    LoggedMetric("tau_fixed_window", "PPOWTrainer.evaluate",
                 "The same at fixed windows of `max_window` tokens (h = 0)."),
    LoggedMetric("expected_accepted", "PPOWTrainer.evaluate",
                 "Mean E[A|y] (A with `acceptance=\"greedy\"`) of windows drafted at `temperature` under the rule "
                 "after held-out contexts, as the training reward defines it."),
    LoggedMetric("simulated_speedup", "PPOWTrainer.evaluate",
                 "The cost-model speedup of those windows (ratio of sums)."),
    LoggedMetric("predicted_speedup", "PPOWTrainer.evaluate",
                 "The window calibration's predicted speedup of the rule it chose (NaN without `calibrate_window`)."),
    LoggedMetric("window_max", "PPOWTrainer.evaluate", "K of the calibrated rule."),
    LoggedMetric("window_threshold", "PPOWTrainer.evaluate", "h of the calibrated rule."),
)
"""``PPOWTrainer.evaluate``'s keys, in the order it computes them; each is logged as ``eval_<key>``."""

KD_TRAIN = (
    LoggedMetric("kd/kl", "KDTrainer",
                 "Mean per-token forward KL(p || q) over response tokens (`loss=\"forward_kl\"`), against the "
                 "target's top-k (with the rest class when `tail_bucket`)."),
    LoggedMetric("kd/tv", "KDTrainer", "Mean per-token total variation instead (`loss=\"tv\"`)."),
    LoggedMetric("kd/top1_agreement", "KDTrainer",
                 "Share of response positions where the drafter's argmax is the target's top-1 token."),
    LoggedMetric("loss", "Trainer", "transformers' training loss: the weighted KD loss of the optimizer steps."),
)
"""``KDTrainer``'s training keys. Drafters trained on several slots at once (EAGLE-3's training-time test, DFlash
blocks) add each ``kd/*`` key again with ``_step{k}`` for slot ``k >= 1``."""

KD_EVAL = (
    LoggedMetric("loss", "Trainer",
                 "transformers' evaluation loss, where the eval rows carry the teacher's top-k; `eval_kd/*` "
                 "alongside, as in training."),
    LoggedMetric(TAU, "KDTrainer.evaluation_loop",
                 "Exact greedy tau at fixed windows of `eval_tau_window` tokens (h = 0) over the eval prompts, their "
                 "`response_ids` as the target's greedy text (only with `eval_tau_window > 0`)."),
)
"""``KDTrainer``'s evaluation keys, each logged as ``eval_<key>``."""

ON_POLICY_STEP = (
    LoggedMetric("loss", "train_on_policy", "The step's loss: mean over window positions of KL(p || q) + TV(p, q)."),
    LoggedMetric("kl", "train_on_policy", "Its mean KL(p || q) term (target's top-k with the rest class)."),
    LoggedMetric("tv", "train_on_policy", "Its mean total-variation term."),
)
"""The entries of ``train_on_policy``'s returned ``log`` (one per optimizer step, with its ``step``); nothing is sent
to ``report_to``."""


def keys(metrics: tuple[LoggedMetric, ...]) -> tuple[str, ...]:
    """The keys of ``metrics``, in order."""
    return tuple(metric.key for metric in metrics)
