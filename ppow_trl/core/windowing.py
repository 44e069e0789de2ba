"""Adaptive divergence-aware windowing: which windows to train on, and how long a window is.

1. Which windows: score each position of a target-generated sequence with
   ``s_t = conf_t * D_t`` (the drafter is confident and wrong) and sample window starts with
   probability proportional to ``(s_t + eps)^beta``, mixed with a uniform share.
2. How long: ``AdaptiveWindowPolicy`` keeps drafting while the running acceptance estimate
   ``prod_{j<=i} conf_j`` stays at or above ``h``, up to ``K``. Training rollouts and generation use
   this same object, saved with the drafter.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from .cost import CostModel, overall_speedup
from .custom_generate.generate import (
    PPOW_GENERATION_CONFIG_KEY as GENERATION_CONFIG_KEY,
    SpeculationGuard,
    WindowBudget,
    generate as _hook_generate,
    keep_drafting,
    window_confidence,
)
from .rewards import divergence
from .verification import lengths_to_mask
from ..utils import PEFT_ASSISTANT_MESSAGE, is_peft_model, load_json, save_json

WINDOW_POLICY_FILE = "ppow_window_policy.json"


def drafter_confidence(drafter_probs: torch.Tensor) -> torch.Tensor:
    """``conf_t = max_v q_t(v)`` of a distribution already computed (window selection's ``s_t``; the window
    *rule* uses ``AdaptiveWindowPolicy.confidence`` on logits instead, at its own temperature)."""
    return drafter_probs.float().amax(dim=-1)


def divergence_scores(
    target_probs: torch.Tensor, drafter_probs: torch.Tensor, mask: torch.Tensor | None = None, kind: str = "kl"
) -> torch.Tensor:
    """Confidence-weighted divergence ``s_t = conf_t * D_t(p_t, q_t)`` per position; 0 where masked out.

    High scores mark positions where the drafter is confident yet far from the target: the
    windows that teach the most.
    """
    scores = drafter_confidence(drafter_probs) * divergence(target_probs, drafter_probs, kind)
    return scores if mask is None else scores * mask


def window_start_probabilities(
    scores: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 1.0,
    eps: float = 1e-3,
    uniform_share: float = 0.1,
) -> torch.Tensor:
    """Sampling distribution over window starts: ``(1 - u) (s_t + eps)^beta / Z + u / N`` on valid positions.

    ``beta = 0`` gives uniform selection; ``uniform_share = u`` keeps every valid position reachable
    (scores go stale between refreshes). Flattened over all sequences: ``(B, T) -> (B, T)`` summing to 1.
    """
    if beta < 0 or eps <= 0 or not 0.0 <= uniform_share <= 1.0:
        raise ValueError(f"Need beta >= 0, eps > 0 and 0 <= uniform_share <= 1; got {beta}, {eps}, {uniform_share}.")
    mask = mask.bool()
    num_valid = mask.sum()
    if num_valid == 0:
        raise ValueError("No valid window start: every position is masked out (empty responses?).")
    # (s + eps)^beta in log space: a large beta on KL scores (up to ~87 nats) would overflow to inf.
    log_weights = beta * (scores.float().clamp_min(0.0) + eps).log()
    weighted = torch.softmax(log_weights.masked_fill(~mask, float("-inf")).flatten(), dim=0).view_as(scores)
    uniform = mask.float() / num_valid
    return (1.0 - uniform_share) * weighted + uniform_share * uniform


def sample_window_starts(
    probabilities: torch.Tensor, num_samples: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw ``num_samples`` (sequence, position) pairs from ``window_start_probabilities``. ``(N, 2)`` long."""
    flat = torch.multinomial(probabilities.flatten(), num_samples, replacement=True, generator=generator)
    return torch.stack([flat // probabilities.shape[1], flat % probabilities.shape[1]], dim=-1)


@dataclass
class AdaptiveWindowPolicy:
    """The window-length rule: draft while ``prod_{j<=i} conf_j >= threshold`` and ``i < max_window``.

    ``conf_j = max_v softmax(z_j / confidence_temperature)`` of the drafter's logits ``z_j``: a property of
    the policy, the same in training rollouts, our generation loop, the HF hook, calibration and the
    benchmark, greedy or sampled (``ppow_trl/core/custom_generate/generate.py`` holds the rule). The first token is
    drafted (unless ``empty_windows``); the token whose confidence pushes the estimate below ``h`` is still proposed
    (it may be accepted) and ends the window. ``threshold = 0`` is a fixed window of ``max_window`` tokens. (A threshold
    on the acceptance estimate is optimal for this stopping problem under mild assumptions: SpecDec++, arXiv
    2405.19715.)

    Args:
        max_window (`int`): ``K``, the most tokens drafted per round (>= 1).
        threshold (`float`): ``h`` in ``[0, 1]``.
        confidence_temperature (`float`): ``T_c > 0`` of the confidences (files saved before it existed load
            with 1.0, the value every route used for sampled windows).
        calibration (`dict`, *optional*): how ``(K, h)`` were chosen, written by
            ``ppow_trl.serving.calibration.calibrate_policy``: the regime they are for (``"greedy"`` or ``"sampling"``
            and its temperature), the number of held-out contexts, the predicted speedup. ``None``: set by hand.
        empty_windows (`bool`): a round drafts nothing when its first token's confidence is under ``h`` (the
            round is a plain step; the drafter's first forward has run, and the cost model charges it). Where a
            token costs no forward (prompt lookup, a hybrid's lookups) a round without a match is then free; set by
            the serving calibration when it predicts faster. Our loop and exact tau apply it; transformers'
            assisted loop and llama.cpp need one candidate per drafting round and draft the first token anyway.
        guard (`dict`, *optional*): the online guard of every generation, ``{"break_even_tokens": b, "loss_budget": H,
            "probe_every": N, "max_pause": M, "round_costs": [c_0, ..., c_K], "free_token_saving": s}``
            (``SpeculationGuard``): drafting pauses for ``N`` rounds once the drafting rounds, each costing its own
            window's ``c_L`` steps (less ``s`` per free token; ``b`` each for a rule saved without the table) and
            yielding ``A + 1`` tokens, have lost more than ``H`` steps against plain decoding since they last broke
            even; it resumes with ``H / 2`` spent, and the pause doubles (up to ``M``) while resumptions keep losing.
            ``None``: no guard.

    ``max_window = 0`` means no speculation: every route decodes plainly (the serving calibration chooses it when the
    measured cost model predicts under ``SERVED_MIN_SPEEDUP`` for every ``(K, h)``).
    """

    max_window: int = 8
    threshold: float = 0.0
    confidence_temperature: float = 1.0
    calibration: dict | None = None
    guard: dict | None = None
    empty_windows: bool = False

    def __post_init__(self):
        if not isinstance(self.max_window, int) or self.max_window < 0:
            raise ValueError(f"max_window (K) must be an integer >= 0 (0: no speculation), got {self.max_window!r}.")
        if not 0.0 <= float(self.threshold) <= 1.0:
            raise ValueError(
                f"threshold (h) must lie in [0, 1], got {self.threshold!r}: it is compared with a product of probabilities."
            )
        if not float(self.confidence_temperature) > 0:
            raise ValueError(f"confidence_temperature (T_c) must be > 0, got {self.confidence_temperature!r}.")
        if self.guard is not None:
            self.new_guard(fresh=True)  # validates the settings now, not at the first generation

    def new_guard(self, fresh: bool = False) -> SpeculationGuard | None:
        """The ``SpeculationGuard`` of one generation (``None`` without a guard or without speculation): a new one, or,
        with ``across_generations`` in the settings, this policy's own guard carried over from its last generation
        (``SpeculationGuard.new_generation``; one generation at a time). ``fresh``: a new one whatever the settings
        (a replay of a generation as the first one served, ``exact_greedy_tau``)."""
        if not self.guard or self.max_window == 0:
            return None
        if fresh or not self.guard.get("across_generations"):
            return SpeculationGuard.from_settings(self.guard)
        settings, guard = self.__dict__.get("_carried_guard", (None, None))
        if settings is not self.guard:  # none yet, or the settings were replaced: start over
            guard = SpeculationGuard.from_settings(self.guard)
            self.__dict__["_carried_guard"] = (self.guard, guard)  # not a field: never saved
        guard.new_generation()
        return guard

    def confidence(self, logits: torch.Tensor) -> torch.Tensor:
        """``conf = max_v softmax(z / T_c)``: the drafter's confidence from its logits ``z`` (last dim = vocab)."""
        return window_confidence(logits, self.confidence_temperature)

    def keep_drafting(self, running_acceptance: torch.Tensor, num_drafted: int) -> torch.Tensor:
        """Whether to draft another token after ``num_drafted`` tokens with estimate ``prod conf``."""
        return keep_drafting(running_acceptance, num_drafted, self.max_window, self.threshold)

    def window_lengths(self, confidences: torch.Tensor) -> torch.Tensor:
        """Lengths the rule picks given per-position confidences ``(B, >=K)`` of a drafted sequence. ``(B,)``.

        Same rule as ``keep_drafting``, applied to a whole rollout at once: ``L = 1 + #{i < K: prod_{j<=i} conf_j >= h}``
        (the running product only decreases, so the counted positions form a prefix).
        """
        if self.max_window == 0:
            return torch.zeros(confidences.shape[0], dtype=torch.long, device=confidences.device)
        running = confidences[:, : self.max_window - 1].float().cumprod(dim=-1)
        lengths = 1 + self.keep_drafting(running, 0).sum(dim=-1)
        if self.empty_windows:  # L = 0 when conf_1 < h
            lengths = torch.where(self.drafts_first(confidences[:, 0]), lengths, torch.zeros_like(lengths))
        return lengths

    def drafts_first(self, first_confidence: torch.Tensor) -> torch.Tensor:
        """Whether a round keeps its first drafted token, of confidence ``conf_1``: always, or ``conf_1 >= h`` with
        ``empty_windows``."""
        if not self.empty_windows:
            return torch.ones_like(first_confidence, dtype=torch.bool)
        return first_confidence.float() >= self.threshold

    def drafting_rounds(self, window_lengths: torch.Tensor) -> torch.Tensor:
        """Which rounds went through drafting (``CostModel.round_time``'s ``drafting``): every one of a speculative
        rule, empty windows included (their loop work is a drafting round's)."""
        return torch.full_like(window_lengths, self.max_window > 0, dtype=torch.bool)

    def drafter_forwards(self, window_lengths: torch.Tensor, charged: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter forwards of rounds of ``window_lengths`` tokens: ``M_n = sum_{k <= L'_n} charged[n, k]``
        (every token charged when ``charged`` is ``None``) over ``L'_n = max(L_n, 1)`` tokens with ``empty_windows``
        (an empty round computed its first token, then dropped it), ``L_n`` otherwise."""
        computed = window_lengths.clamp(min=1) if self.empty_windows and self.max_window > 0 else window_lengths
        if charged is None:
            return computed.float()
        return (charged.float() * lengths_to_mask(computed, charged.shape[1]).float()).sum(dim=1)

    def with_window(self, max_window: int, threshold: float, empty_windows: bool | None = None) -> "AdaptiveWindowPolicy":
        """The same confidence definition and guard with another ``(K, h)`` (and ``empty_windows``, kept when
        ``None``; ``calibration`` dropped)."""
        return AdaptiveWindowPolicy(int(max_window), float(threshold), self.confidence_temperature, guard=self.guard,
                                    empty_windows=self.empty_windows if empty_windows is None else bool(empty_windows))

    def save_pretrained(self, folder: str | Path) -> Path:
        """Save as ``folder/ppow_window_policy.json``, so generation uses the rule training used (``empty_windows``
        only when set: files of rules without it stay readable by versions before it)."""
        data = asdict(self)
        if not data["empty_windows"]:
            data.pop("empty_windows")
        return save_json(data, folder, WINDOW_POLICY_FILE)

    @classmethod
    def from_dict(cls, data: dict) -> "AdaptiveWindowPolicy":
        """From a saved dict; keys this version does not know are an error naming them."""
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(
                f"Unknown window-policy fields {sorted(unknown)}: this {WINDOW_POLICY_FILE} was written by a newer "
                "ppow_trl; upgrade ppow_trl."
            )
        return cls(**data)

    @classmethod
    def from_pretrained(cls, folder_or_repo: str | Path, **hub_kwargs) -> "AdaptiveWindowPolicy":
        """Load ``ppow_window_policy.json`` from a local folder, or from a Hub repo id (``hf_hub_download``;
        ``hub_kwargs`` such as ``revision=`` are passed on)."""
        return cls.from_dict(load_json(folder_or_repo, WINDOW_POLICY_FILE, "this drafter was not saved by ppow_trl.",
                                       **hub_kwargs))


def expected_accepted_within(prefix_acceptance: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``E[A | y_{1:L}] = sum_{k<=L} P(A >= k | y)`` per row: a window cut to ``L`` tokens is a prefix of the drafted
    one, so its expected accepted length sums the first ``L`` prefix-acceptance terms (0/1 terms when greedy).
    ``prefix_acceptance`` ``(N, K)``, ``lengths`` ``(N,)``; the one E[A]-for-a-length of the package."""
    keep = torch.arange(prefix_acceptance.shape[1], device=prefix_acceptance.device) < lengths.to(
        prefix_acceptance.device).unsqueeze(-1)
    return (prefix_acceptance * keep).sum(dim=-1)


def accepted_spread_within(prefix_acceptance: torch.Tensor, lengths: torch.Tensor) -> float:
    """Standard deviation of the accepted length ``A`` of one round over the rows and their randomness:
    ``Var A = mean_n E[A_n^2] - (mean_n E[A_n])^2`` with ``E[A^2 | y] = sum_{k<=L} (2k - 1) P(A >= k | y)``
    (``A^2 = sum_{k<=A} (2k - 1)``; 0/1 terms when greedy, where only the rows differ)."""
    prefix_acceptance = prefix_acceptance.double()  # sums of many terms: bf16/fp16 rollouts would round them
    keep = torch.arange(prefix_acceptance.shape[1], device=prefix_acceptance.device) < lengths.to(
        prefix_acceptance.device).unsqueeze(-1)
    odd = 2 * torch.arange(1, prefix_acceptance.shape[1] + 1, device=prefix_acceptance.device) - 1
    first = (prefix_acceptance * keep).sum(dim=-1).mean()
    second = (prefix_acceptance * keep * odd).sum(dim=-1).mean()
    return float((second - first**2).clamp(min=0.0).sqrt())


def policy_speedup(
    policy: AdaptiveWindowPolicy, confidences: torch.Tensor, prefix_acceptance: torch.Tensor, cost_model: CostModel,
    charged: torch.Tensor | None = None,
) -> torch.Tensor:
    """Cost-model speedup of ``policy`` on rollouts of ``K`` tokens (``K >= policy.max_window``): ``sum_n (E[A_n] + 1)
    / sum_n (M_n t_d + t_v(L_n))`` with ``E[A_n]`` from ``expected_accepted_within`` and ``M_n = L_n``, or the
    tokens the drafter's model ran for (``charged`` ``(N, K)``), over ``max(L_n, 1)`` tokens for ``empty_windows``
    (``AdaptiveWindowPolicy.drafter_forwards``)."""
    lengths = policy.window_lengths(confidences)
    return overall_speedup(expected_accepted_within(prefix_acceptance, lengths), lengths, cost_model,
                           policy.drafter_forwards(lengths, charged), policy.drafting_rounds(lengths))


SERVED_MIN_SPEEDUP = 1.05
"""A speculative rule is served only when predicted at least this much faster than plain decoding
(``chosen_rule``): a margin for near-ties. The predictions' error on served prompts
(``benchmarks/results/compiled_serving.json``, 1 thread, AMD EPYC) ran from -15% to +8%, and the rule predicted
closest to 1x (1.013x, int8 target) served 0.97x. A rule predicted within 5% of 1x stands to gain little and to lose
as much; plain decoding is lossless and never slower than itself. (The margin does not cover the larger errors: the
online guard is there for a rule that loses while it serves.)"""


def search_window_grid(
    confidences: torch.Tensor,
    prefix_acceptance: torch.Tensor,
    cost_model: CostModel,
    thresholds=tuple(i / 20 for i in range(20)),
    max_windows=None,
    confidence_temperature: float = 1.0,
    allow_no_speculation: bool = False,
    charged: torch.Tensor | None = None,
    min_speedup: float = 1.0,
    empty_windows: Sequence[bool] = (False,),
) -> tuple[AdaptiveWindowPolicy, list[dict]]:
    """The ``(K, h)`` maximising the cost-model speedup on held-out rollouts, and the grid: the search step of the one
    calibration, ``ppow_trl.serving.calibration.calibrate_policy`` (which drafts and verifies those windows and calls it).

    ``confidences`` (at ``confidence_temperature``) and ``prefix_acceptance`` are ``(N, K_max)`` from windows
    of ``K_max`` tokens drafted on held-out contexts (see ``policy_speedup``; ``charged``: its drafter forwards).
    ``allow_no_speculation``: ``K = 0`` (plain decoding, speedup 1 by definition) is a candidate too, and wins
    whenever no ``(K, h)`` is predicted above 1x (it comes first, so a tie keeps plain decoding), or, with
    ``min_speedup`` > 1, at least ``min_speedup`` (``chosen_rule``). ``empty_windows``: the rule variants searched
    (``(False, True)``: also rules whose rounds draft nothing when the first confidence is under ``h``, rows marked
    ``"empty_windows": True``; ``h = 0`` is the same rule either way and is searched once).
    """
    max_windows = max_windows or range(1, confidences.shape[1] + 1)
    grid = [{"max_window": 0, "threshold": 0.0, "speedup": 1.0}] if allow_no_speculation else []
    for empty in empty_windows:
        for max_window in max_windows:
            for threshold in thresholds:
                if empty and threshold == 0.0:  # h = 0 drafts every first token: the same rule
                    continue
                policy = AdaptiveWindowPolicy(int(max_window), float(threshold), confidence_temperature,
                                              empty_windows=bool(empty))
                value = policy_speedup(policy, confidences, prefix_acceptance, cost_model, charged).item()
                row = {"max_window": int(max_window), "threshold": float(threshold), "speedup": value}
                grid.append({**row, "empty_windows": True} if empty else row)
    best = grid[chosen_rule(grid, [row["speedup"] for row in grid], min_speedup)]
    return AdaptiveWindowPolicy(best["max_window"], best["threshold"], confidence_temperature,
                                empty_windows=best.get("empty_windows", False)), grid


def chosen_rule(rows: list[dict], speedups: list[float], min_speedup: float = 1.0) -> int:
    """The index of the rule to serve among ``rows`` (``{"max_window", "threshold"}``) with predicted ``speedups``:
    the first of the highest, except that when plain decoding is a candidate (a ``max_window == 0`` row), a
    speculative rule must be predicted at least ``min_speedup`` to replace it.

    Why a margin: the prediction is a model (held-out contexts, costs timed apart from the loop), and its error on
    served prompts is a few percent either way (``benchmarks/results/compiled_serving.json``: a rule predicted
    1.013x served 0.97x its plain decoding). A rule predicted within that error of 1x risks a loss for no
    expected gain; plain decoding is lossless and never slower than itself."""
    if not min_speedup >= 1.0:  # NaN too
        raise ValueError(f"min_speedup must be >= 1 (1: no margin), got {min_speedup}.")
    best = max(range(len(rows)), key=speedups.__getitem__)
    plain = next((i for i, row in enumerate(rows) if row["max_window"] == 0), None)
    if plain is not None and rows[best]["max_window"] > 0 and speedups[best] < min_speedup:
        return plain
    return best


# The window rule in a drafter's generation config, for HF's assisted generation (``ppow_trl.serving.assisted``).

def _check_policy(policy) -> AdaptiveWindowPolicy:
    if not isinstance(policy, AdaptiveWindowPolicy):
        raise ValueError(f"policy must be an AdaptiveWindowPolicy, got {type(policy).__name__}.")
    return policy


def policy_dict(policy: AdaptiveWindowPolicy) -> dict:
    """What the hook reads from ``generation_config.ppow_window_policy``: the policy minus ``calibration`` (it
    stays in ``ppow_window_policy.json``), ``{"max_window": K, "threshold": h, "confidence_temperature": T_c}``."""
    data = asdict(_check_policy(policy))
    data.pop("calibration", None)
    if not data.get("empty_windows"):  # transformers' loop drafts the first token anyway; said only when set
        data.pop("empty_windows", None)
    if data.get("guard") is None:  # an unguarded policy writes the same generation config as before the guard
        data.pop("guard", None)
    return data


def configure_generation_config(generation_config, policy: AdaptiveWindowPolicy, vocab_size: int | None = None):
    """Set a drafter's ``generation_config`` for HF's assisted generation with our rule; returns it.

    ``num_assistant_tokens = K`` (HF drafts at most this many; with a guard, a ``WindowBudget`` that reads 0 while the
    guard pauses, see ``ppow_trl.core.custom_generate.generate``), ``num_assistant_tokens_schedule = "constant"``
    (HF never changes K), ``assistant_confidence_threshold = 0`` (HF's per-token rule and its re-tuning are
    off), and ``ppow_window_policy = policy_dict(policy)`` (``K``, ``h``, ``T_c``; read by the hook), plus
    ``vocab_size`` when given (the tokenizer's length: confidences over those scores only, as in training).
    """
    policy = _check_policy(policy)
    guard = policy.new_guard(fresh=True)  # its own: HF starts each generation on it (WindowBudget)
    # K = 0: HF's loop asks for no candidate, every round is a plain target step. A guarded drafter gets a live
    # budget (K, or 0 while the guard pauses; it is written as K).
    generation_config.num_assistant_tokens = policy.max_window if guard is None else WindowBudget(policy.max_window,
                                                                                                  guard)
    generation_config.num_assistant_tokens_schedule = "constant"
    generation_config.assistant_confidence_threshold = 0.0
    data = policy_dict(policy)
    if vocab_size is None:  # keep what the config already says (e.g. re-saving a loaded drafter)
        vocab_size = (getattr(generation_config, GENERATION_CONFIG_KEY, None) or {}).get("vocab_size")
    if vocab_size is not None:
        data["vocab_size"] = int(vocab_size)
    setattr(generation_config, GENERATION_CONFIG_KEY, data)
    # A config derived from the model config is rebuilt from it on load (transformers), which would drop our policy
    # key from a Hub repo's generation_config.json: mark it as the drafter's own.
    generation_config._from_model_config = False
    return generation_config


def attach_window_policy(drafter, policy, vocab_size: int | None = None):
    """In memory, without saving: make ``drafter`` apply ``policy`` as an HF assistant; returns ``drafter``.

    Sets its generation config (``configure_generation_config``) and replaces its ``generate`` with
    ``functools.partial(ppow_trl.core.custom_generate.generate.generate, model=drafter)``: the same code a folder's
    ``custom_generate/generate.py`` holds, installed as ``from_pretrained(trust_remote_code=True)`` would.
    """
    if is_peft_model(drafter):
        raise ValueError(PEFT_ASSISTANT_MESSAGE)
    configure_generation_config(drafter.generation_config, policy, vocab_size)
    drafter.generate = functools.partial(_hook_generate, model=drafter)
    return drafter
