"""Hardware-aware cost model of a speculative round and the cost-aware speedup ``S(y)``.

Times are stored as ratios to one plain target decoding step (``t_t = 1``): absolute times are not
portable between machines, ratios mostly are, and ``S(y)`` only depends on ratios.
"""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..drafting import family_of
from ..features import context_features
from ..utils import crop_cache, interleaved_medians, load_json, save_json

COST_MODEL_FILE = "ppow_cost_model.json"


@dataclass
class CostModel:
    """Relative costs of a speculative round.

    Args:
        drafter_cost (`float`): ``t_d / t_t``, drafter time per drafted token over one target step.
        verify_cost (`list[float]`): ``t_v(L) / t_t`` for ``L = 0, 1, ..., K``: the target forward over
            ``L + 1`` tokens with a KV cache. ``verify_cost[0]`` is 1 by definition (``t_v(0) = t_t``).
            Lengths past the list are extrapolated linearly from its last two entries.
        description (`str`): where the figures come from (machine, dtype, models); informational.
        drafter_per_round (`bool`): ``drafter_cost`` is one drafter forward per *round* (a block drafter,
            ``ppow_trl.drafters.dflash``, drafts its whole window in one forward), not per drafted token.
        runtime (`str`): the runtime the forwards were timed on (``ppow_trl.serving.runtime``: ``"eager"`` or
            ``"compiled"``); a rule chosen on one runtime's costs is served on that runtime.
        plain_overhead (`float`): ``o_0``, the serving loop's host work per plain decoding step (argmax, cache
            bookkeeping, the runtime's wrapper) beyond the forward, over ``t_t``; 0: not measured.
        round_overhead (`float`): ``o_r``, the loop's host work per drafting round (verification, both caches'
            rollback) beyond the forwards, over ``t_t``; 0: not measured.
        drafted_token_overhead (`float`): ``o_d``, the loop's host work per drafted token (its argmax and
            confidence) beyond the drafter's forward, over ``t_t``; 0: not measured.
            The three are measured by running the loop (``ppow_trl.serving.runtime.measure_loop_overhead``): on the compiled
            runtime a round's host work is a few percent of a step, the size of the margins a rule is chosen on.
    """

    drafter_cost: float
    verify_cost: list[float]
    description: str = ""
    raw_seconds: dict = field(default_factory=dict)
    drafter_per_round: bool = False
    runtime: str = "eager"
    plain_overhead: float = 0.0
    round_overhead: float = 0.0
    drafted_token_overhead: float = 0.0

    def __post_init__(self):
        if self.drafter_cost < 0 or not self.verify_cost or any(c <= 0 for c in self.verify_cost):
            raise ValueError(
                f"Invalid cost model: drafter_cost={self.drafter_cost}, verify_cost={self.verify_cost}. Costs are "
                "ratios to one target step: drafter_cost >= 0 and a non-empty list of positive verify costs."
            )
        if min(self.plain_overhead, self.round_overhead, self.drafted_token_overhead) < 0:
            raise ValueError(f"Loop overheads are >= 0 (ratios to one target step), got plain_overhead="
                             f"{self.plain_overhead}, round_overhead={self.round_overhead}, drafted_token_overhead="
                             f"{self.drafted_token_overhead}.")

    @classmethod
    def from_seconds(cls, target_step: float, drafter_step: float, verify: list[float], description: str = "") -> "CostModel":
        """Build from measured seconds (``t_t``, ``t_d``, ``[t_v(0), t_v(1), ...]``), stored as ratios."""
        return cls(
            drafter_cost=drafter_step / target_step,
            verify_cost=[1.0] + [t / target_step for t in verify[1:]],
            description=description,
            raw_seconds={"target_step": target_step, "drafter_step": drafter_step, "verify": list(verify)},
        )

    def verify_time(self, window_length: torch.Tensor) -> torch.Tensor:
        """``t_v(L) / t_t`` for a tensor of window lengths (linear extrapolation past the table)."""
        table = torch.tensor(self.verify_cost, dtype=torch.float32, device=window_length.device)
        last = len(self.verify_cost) - 1
        slope = (table[-1] - table[-2]) if last >= 1 else table.new_tensor(0.0)
        inside = table[window_length.long().clamp(0, last)]
        return torch.where(window_length > last, table[-1] + slope * (window_length.float() - last), inside)

    def drafter_forwards(self, window_length: torch.Tensor, charged: torch.Tensor | None = None) -> torch.Tensor:
        """Drafter forwards of a round drafting ``L`` tokens: ``L`` (``charged``: those of its tokens the drafter's
        model ran for, when some came free: a hybrid's lookups), or ``1[L > 0]`` for a block drafter."""
        if self.drafter_per_round:
            return (window_length > 0).float()
        return window_length.float() if charged is None else charged.float()

    def round_time(self, window_length: torch.Tensor, charged: torch.Tensor | None = None,
                   drafting: torch.Tensor | None = None) -> torch.Tensor:
        """Time of one round relative to a plain decoding step of the serving loop:
        ``(L t_d + t_v(L) + o(L)) / (1 + o_0)`` with ``o(0) = o_0`` (``plain_overhead``) and ``o(L > 0) = o_r + L o_d``
        (``round_overhead``, ``drafted_token_overhead``); a block drafter's round costs ``t_d`` once. ``L = 0`` is
        exactly 1, and with no overhead measured this is ``L t_d + t_v(L)``. ``charged``: the drafter forwards of each
        round when fewer than ``L`` (``drafter_forwards``). ``drafting``: rounds that went through drafting whatever
        ``L`` (an empty window's round, ``L = 0``: the loop's per-round work ``o_r`` instead of ``o_0``); default
        ``L > 0``."""
        forwards = self.drafter_forwards(window_length, charged) * self.drafter_cost + self.verify_time(window_length)
        work = self.round_overhead + window_length.float() * self.drafted_token_overhead
        drafting = window_length > 0 if drafting is None else drafting.bool() | (window_length > 0)
        overhead = torch.where(drafting, work, torch.full_like(work, self.plain_overhead))
        return (forwards + overhead) / (1.0 + self.plain_overhead)

    def save_pretrained(self, folder: str | Path) -> Path:
        """Save as ``folder/ppow_cost_model.json`` (next to the drafter it was measured with)."""
        return save_json(asdict(self), folder, COST_MODEL_FILE)

    @classmethod
    def from_pretrained(cls, folder_or_repo: str | Path, **hub_kwargs) -> "CostModel":
        """Load ``ppow_cost_model.json`` from a local folder, or from a Hub repo id (``hf_hub_download``;
        ``hub_kwargs`` such as ``revision=``, ``token=``, ``cache_dir=`` are passed on)."""
        return cls(**load_json(folder_or_repo, COST_MODEL_FILE, "calibrate one with ppow_trl.calibrate_cost_model.",
                               **hub_kwargs))


def speedup(expected_accepted: torch.Tensor, window_length: torch.Tensor, cost_model: CostModel) -> torch.Tensor:
    """Cost-aware speedup of one round: ``S(y) = (E[A|y] + 1) * t_t / (L * t_d + t_v(L))`` (a block drafter's
    round costs ``t_d + t_v(L)``; with the loop's host work measured, ``(E[A|y] + 1) (1 + o_0) / (L t_d + t_v(L) +
    o_r + L o_d)``: ``CostModel.round_time``).

    The numerator counts the tokens the round yields (accepted + correction/bonus); the denominator
    is its time in target steps, so ``S = 1`` means as fast as plain decoding. Greedy training may
    pass the realised ``A`` as ``expected_accepted``. Empty windows (``L = 0``) give ``S = 1``.
    """
    return (expected_accepted.float() + 1.0) / cost_model.round_time(window_length)


def overall_speedup(expected_accepted: torch.Tensor, window_length: torch.Tensor, cost_model: CostModel,
                    charged: torch.Tensor | None = None, drafting: torch.Tensor | None = None) -> torch.Tensor:
    """Speedup of many rounds together: tokens per unit time, ``sum(E[A]+1) / sum(L t_d + t_v(L))`` (``charged``:
    each round's drafter forwards when fewer than ``L``, ``CostModel.round_time``).

    This (a ratio of sums) is what a decoding run measures; the mean of per-round ``S`` is not.
    """
    return (expected_accepted.float() + 1.0).sum() / cost_model.round_time(window_length, charged, drafting).sum()


def _cached_step(model, context_ids: torch.Tensor, num_new: int):
    """A callable running one forward over ``num_new`` tokens on top of a KV cache of ``context_ids``."""
    cache = model(context_ids, use_cache=True).cache
    context_length = context_ids.shape[1]
    new_ids = context_ids[:, -num_new:] if num_new <= context_length else context_ids[:, :1].repeat(1, num_new)

    def step():
        model(new_ids, cache=cache, use_cache=True, logits_to_keep=num_new)
        crop_cache(cache, context_length)  # back to the shared context: every repeat times the same step

    return step


def _drafter_step(drafter, target, context_ids: torch.Tensor):
    """A callable running the unit the cost model charges as the loops run it: one drafted token (a standalone
    drafter's one-token forward, a chain drafter's step on its own hidden state) or one round (a block drafter),
    through the drafter's session (``DraftingSession.timed_step``); the state is put back after each call."""
    family = family_of(drafter)
    session = family.session(drafter, target)
    context = context_ids[0].tolist()
    layer_ids = family.target_layer_ids(drafter)
    features = None if layer_ids is None else context_features(target, [context_ids[0]], layer_ids)[0]
    return session.timed_step(context, features)


def calibrate_cost_model(
    target,
    drafter,
    max_window: int,
    *,
    context_ids: torch.Tensor | None = None,
    context_length: int = 128,
    repeats: int = 15,
    warmup: int = 3,
    seed: int = 0,
) -> CostModel:
    """Measure ``t_t``, ``t_d`` and ``t_v(L)`` for ``L = 0..max_window`` on the machine at hand.

    Every figure is the median of ``repeats`` timed forwards after ``warmup`` untimed ones, timed
    round-robin across workloads, each on top of a KV cache of the same context (a realistic decode
    state) with the cache cropped back after each forward. ``t_d`` is one drafter forward of one token with its own cache (the
    drafter drafts token by token); for a block drafter it is one round's forward (one new context position and the
    block, head included), and the model is marked ``drafter_per_round``. Time the models in the dtype and device
    you will decode with.
    """
    if max_window < 1:
        raise ValueError(f"max_window must be >= 1, got {max_window}.")
    device = next(target.parameters()).device
    if context_ids is None:
        generator = torch.Generator().manual_seed(seed)
        # Any token ids both models can embed (a reduced-vocabulary drafter still embeds the full vocabulary).
        vocab = min(target.get_input_embeddings().num_embeddings, family_of(drafter).input_vocab_size(drafter, target))
        context_ids = torch.randint(0, vocab, (1, context_length), generator=generator)
    context_ids = context_ids.to(device)
    with torch.inference_mode():
        steps = {length: _cached_step(target, context_ids, length + 1) for length in range(max_window + 1)}
        steps["drafter"] = _drafter_step(drafter, target, context_ids)
        seconds = interleaved_medians(steps, repeats, warmup, device)
    verify = [seconds[length] for length in range(max_window + 1)]
    drafter_step = seconds["drafter"]
    description = (
        f"{platform.machine()} {device.type} torch {torch.__version__} threads {torch.get_num_threads()}; "
        f"target {target.config._name_or_path or target.config.model_type} {next(target.parameters()).dtype}; "
        f"drafter {_model_name(drafter)}; context {context_ids.shape[1]} tokens; "
        f"median of {repeats}"
    )
    model = CostModel.from_seconds(verify[0], drafter_step, verify, description=description)
    model.drafter_per_round = family_of(drafter).cost_per_round
    return model


def _model_name(model) -> str:
    config = getattr(model, "config", None)
    return (getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")) or type(model).__name__
