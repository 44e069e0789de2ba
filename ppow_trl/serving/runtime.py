"""The runtime a target and its drafter serve on: ``"compiled"`` (``ppow_trl.compiled_runtime.compiled``) or
``"eager"``.

``serving_runtime(target, drafter, runtime="compiled", max_window=K)`` is the one place that decides how the models
run when they serve, and the cost model, the calibration of the served rule, the recipe and the benchmarks all go
through it: the costs a rule is chosen on are the costs of the runtime that serves it.

- ``"compiled"``: the target (and a drafter whose family ``compiles``: a causal LM over its own KV cache) become
  ``CompiledCausalLM``s with ``K + 1`` row counts over a static cache of ``max_cache_len`` positions, warmed up with
  a progress bar (from the on-disk inductor cache when it holds them). Prompt lookup drafts on the host next to the
  compiled target. For a drafter that reads the target's hidden states (EAGLE-3, DFlash), the target's graphs also
  return those states (``CompiledCausalLM(feature_layers=...)``), so each verify pass hands the drafter its features;
  the head itself runs eagerly (its family does not compile it).
- ``"eager"``: the models as they are.

``precision`` (``"fp32"``, ``"bf16"``, ``"int8"``: ``ppow_trl.compiled_runtime.precision``) converts a copy of the
target before either runtime: fewer bytes read per token. The drafter keeps its own precision unless
``drafter_precision`` names one (a converted copy of a causal-LM drafter, the hybrid's included): the drafter only
proposes and the target decides every token, so its precision changes which tokens are accepted (tau) and what a
draft step costs (``t_d``), never the output.

When compiling is not possible (no C++ compiler, a model inductor cannot trace, a failed warm-up), one warning line
says why and the models serve eagerly: a user gets a slower answer, never a crash. ``ServingRuntime.name`` then says
``"eager"`` and ``fallback`` holds the reason, so that a saved cost model never claims a runtime it was not measured on.
"""

from __future__ import annotations

import logging
import os
import shutil
import statistics
import time
from dataclasses import dataclass

import torch

from ..compiled_runtime.compiled import CompiledCausalLM, CompileSettings
from ..compiled_runtime.precision import check_precision, serving_precision
from ..core.cost import CostModel, calibrate_cost_model
from ..drafting import family_of
from ..models import logits_width
from .generation import speculative_generate
from ..core.windowing import AdaptiveWindowPolicy

logger = logging.getLogger(__name__)

RUNTIMES = ("compiled", "eager")
DEFAULT_MAX_CACHE_LEN = 512
"""Positions of the static KV cache: prompt + new tokens + K must fit. Attention always reads the whole static cache,
so a longer cache costs a little on every step (SmolLM2: its K/V over 512 positions are 4% of the weights' bytes)."""


@dataclass
class ServingRuntime:
    """The models as they serve. ``name``: the runtime in use (``"compiled"`` or ``"eager"``); ``requested``: the one
    asked for; ``fallback``: why compiled was asked and eager serves (``None`` otherwise)."""

    target: object
    drafter: object
    name: str
    requested: str
    compile_seconds: float = 0.0
    settings: str = ""
    fallback: str | None = None
    precision: str = "fp32"
    drafter_precision: str | None = None
    proposer: object = None  # the drafter at drafter_precision, uncompiled: calibration rollouts run it

    @property
    def verifier(self):
        """The target as it verifies, uncompiled (same precision and weights): batched calibration rollouts run it."""
        return getattr(self.target, "model", self.target) if isinstance(self.target, CompiledCausalLM) else self.target

    def describe(self) -> str:
        precision = ("" if self.precision == "fp32" else f", target {self.precision}") + (
            f", drafter {self.drafter_precision}" if self.drafter_precision else "")
        if self.name == "compiled":
            return f"compiled (inductor {self.settings}, warm-up {self.compile_seconds:.0f} s{precision})"
        return "eager" + (f" (compiled unavailable: {self.fallback})" if self.fallback else "") + (
            f" ({precision[2:]})" if precision else "")

    def measure_cost_model(self, max_window: int, *, loop_overhead: bool = True, vocab_size: int | None = None,
                           **kwargs) -> CostModel:
        """``calibrate_cost_model`` on these models (``kwargs``: its options), labelled with this runtime, plus the
        serving loop's host work per step, per round and per drafted token (``measure_loop_overhead``, over the shared
        ``vocab_size``; ``loop_overhead=False`` skips it): the one way the trainer's speed reward and the served rule get their costs."""
        with torch.no_grad():
            cost_model = calibrate_cost_model(self.target, self.drafter, max_window, **kwargs)
            if loop_overhead:
                measure_loop_overhead(self.target, self.drafter, cost_model, max_window, vocab_size=vocab_size,
                                      context_ids=kwargs.get("context_ids"), seed=kwargs.get("seed", 0))
        cost_model.runtime = self.name
        cost_model.description += f"; runtime {self.describe()}"
        return cost_model


def measure_loop_overhead(target, drafter, cost_model: CostModel, max_window: int, *, context_ids=None,
                          vocab_size: int | None = None, new_tokens: int = 36, repeats: int = 3,
                          seed: int = 0) -> CostModel:
    """Fill ``cost_model``'s loop overheads (``o_0``, ``o_r``, ``o_d``: ``CostModel``) by running the serving loop, so
    that its round times are the loop's own.

    ``speculative_generate`` runs plain (``K = 0``) and with fixed windows of ``1`` and ``max_window`` tokens
    (``h = 0``), ``new_tokens`` each, in the order 0, 1, K, K, 1, 0, ``repeats`` times; it times every round
    (``round_seconds``).
    With ``T_0`` the median plain round, ``T_L`` the median round that drafted ``L`` tokens (the first round of a run
    left out: the drafter reads the whole context there) and ``t_t``, ``t_d``, ``t_v(L)`` the forwards timed alone:

        ``o_0 = max(0, T_0 / t_t - 1)``,  ``o_r + L o_d = (1 + o_0) T_L / T_0 - (L t_d + t_v(L))`` for ``L = 1, max_window``,

    so that ``CostModel.round_time(L) = T_L / T_0``: a round as the loop runs it, over a plain step as the loop runs
    it (also where the forward timed alone was the slower, ``T_0 < t_t``). What the forwards timed alone miss goes here: the host work (argmax, confidences, verification, both caches'
    rollback) and, on a CPU, a target whose weights the drafter's forward pushed out of the cache (on an Intel Xeon
    with an int8 target, rounds of one drafted token cost 1.24 steps where the forwards timed alone gave 1.14).
    A hybrid's looked-up tokens run no drafter forward: each round is counted with the drafter steps its lookups
    saved added back (``free_per_round``), as ``round_time(L)`` charges every drafted token and a served round takes
    the saving off again. Medians: a round slowed by a neighbour on the machine does not set the rule. Negative estimates (the forwards
    timed alone were slower than the loop's) count as 0, which overstates a round's cost, never understates it.
    ``context_ids``: the context to generate after (a random one of 64 tokens when ``None``), cut to leave room in a
    static cache; ``vocab_size``: the shared vocabulary (default: the narrower model's logits). Returns
    ``cost_model``, changed in place.
    """
    if max_window < 1 or new_tokens < 2 * max_window + 2 or repeats < 1:
        raise ValueError(f"measure_loop_overhead needs max_window >= 1, new_tokens >= 2 max_window + 2 (a round of a "
                         f"full window after the first) and repeats >= 1, got {max_window}, {new_tokens}, {repeats}.")
    t_t = cost_model.raw_seconds.get("target_step")
    if not t_t:
        raise ValueError("measure_loop_overhead needs a measured cost model (raw_seconds['target_step']).")
    device = next(target.parameters()).device
    if context_ids is None:
        vocab = min(target.get_input_embeddings().num_embeddings, family_of(drafter).input_vocab_size(drafter, target))
        context_ids = torch.randint(0, vocab, (1, 64), generator=torch.Generator().manual_seed(seed))
    room = getattr(target, "max_cache_len", None)
    if room is not None:
        keep = room - new_tokens - max_window - 2
        if keep < 1:
            raise ValueError(f"A static cache of {room} positions leaves no room for a context and {new_tokens} new "
                             f"tokens: pass a smaller new_tokens=, or build the runtime with a larger max_cache_len.")
        context_ids = context_ids[:, -keep:]
    context_ids = context_ids.to(device)
    vocab_size = vocab_size or min(logits_width(target), logits_width(drafter))
    windows = sorted({0, 1, max_window})
    rounds = {window: [] for window in windows}  # seconds of the rounds that drafted exactly `window` tokens

    drafter_step = cost_model.drafter_cost * t_t  # seconds

    def run(window):
        out = speculative_generate(target, drafter, context_ids, policy=AdaptiveWindowPolicy(window, 0.0),
                                   max_new_tokens=new_tokens, eos_token_id=[], vocab_size=vocab_size)
        rows = list(zip(out.drafted_per_round, out.round_seconds, out.free_per_round))[1:]
        # a hybrid's looked-up tokens ran no drafter forward: add the step they saved, so that every round is one whose
        # L tokens were all drafted, as bare.round_time(L) charges (a served round takes the saving off again)
        rounds[window] += [seconds + free * drafter_step for length, seconds, free in rows if length == window]

    with torch.no_grad():
        run(max_window)  # untimed: first calls (allocations, the drafter's cache)
        rounds[max_window].clear()
        for _ in range(repeats):
            for window in windows + windows[::-1]:  # ABBA: a machine that slows or speeds up weighs on every arm alike
                run(window)
    if any(not times for times in rounds.values()):
        raise RuntimeError(f"measure_loop_overhead: no round drafted exactly {[w for w, t in rounds.items() if not t]} "
                           "tokens.")
    median = {window: statistics.median(times) / t_t for window, times in rounds.items()}
    cost_model.plain_overhead = max(0.0, median[0] - 1.0)
    # What the loop's round of L tokens costs beyond its forwards, in target steps, so that round_time(L) =
    # (forwards_L + excess_L) / (1 + o_0) = T_L / T_0. Where the forward timed alone was the slower (T_0 < t_t,
    # o_0 = 0), the loop's rounds are scaled by its own plain step, not by t_t, or a round's excess would be missed.
    bare = CostModel(cost_model.drafter_cost, cost_model.verify_cost, drafter_per_round=cost_model.drafter_per_round)
    scale = (1.0 + cost_model.plain_overhead) / median[0]
    excess = {L: scale * median[L] - float(bare.round_time(torch.tensor([L]))[0]) for L in windows if L > 0}
    if max_window == 1:
        o_r, o_d = excess[1], 0.0
    else:
        o_d = (excess[max_window] - excess[1]) / (max_window - 1)
        o_r = excess[1] - o_d
        if o_d < 0:  # all of it per round, at the larger of the two
            o_r, o_d = max(excess.values()), 0.0
    cost_model.round_overhead, cost_model.drafted_token_overhead = max(0.0, o_r), max(0.0, o_d)
    cost_model.raw_seconds["loop_overhead"] = {
        "plain_step": cost_model.plain_overhead * t_t, "drafting_round": cost_model.round_overhead * t_t,
        "drafted_token": cost_model.drafted_token_overhead * t_t, "windows": windows, "new_tokens": new_tokens,
        "repeats": repeats, "median_round_over_t_t": {str(window): round(value, 6) for window, value in median.items()}}
    return cost_model


def check_runtime(runtime: str) -> str:
    """``runtime`` if it is one of ``RUNTIMES``; a clear error otherwise (before any model is loaded)."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}.")
    return runtime


def compile_unavailable_reason(target, drafter=None) -> str | None:
    """Why this process cannot serve ``target`` (and ``drafter``) on the compiled CPU runtime, or ``None``."""
    for name, model in (("target", target), ("drafter", drafter)):
        parameter = next(model.parameters(), None) if hasattr(model, "parameters") else None
        if parameter is not None and parameter.device.type != "cpu":
            return f"the compiled runtime is built for CPUs; the {name} is on {parameter.device.type}"
    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if not any(shutil.which(name) for name in compilers if name):
        return "no C++ compiler on PATH (inductor's CPU kernels need one: apt install g++, or set CXX)"
    return None


def _feature_layers(drafter) -> list[int] | None:
    """The target hidden states (``output_hidden_states`` indices) ``drafter`` reads, which the compiled target's
    graphs must then return; ``None`` for a drafter that reads none (or no drafter)."""
    if drafter is None:
        return None
    try:
        return family_of(drafter).target_layer_ids(drafter)
    except (ValueError, TypeError):
        return None


def _with_drafter_models(drafter, convert):
    """``drafter`` with ``convert`` applied to its causal-LM models, where its family compiles them
    (``DrafterFamily.with_compiled_models``: the standalone drafter, the hybrid's inner one): compiling, or a precision."""
    if drafter is None or not hasattr(drafter, "parameters"):
        return drafter
    try:
        family = family_of(drafter)
    except (ValueError, TypeError):
        return drafter
    return family.with_compiled_models(drafter, convert)


def serving_runtime(target, drafter=None, *, runtime: str = "compiled", max_window: int,
                    max_cache_len: int = DEFAULT_MAX_CACHE_LEN, settings: CompileSettings | None = None,
                    precision: str = "fp32", drafter_precision: str | None = None,
                    progress: bool = True) -> ServingRuntime:
    """``target`` and ``drafter`` on ``runtime`` (module docstring), the target at ``precision`` (a converted copy
    unless ``"fp32"``), the drafter at ``drafter_precision`` (``None``: as it is); compiled models are warmed up before
    returning, so that nothing compiles inside the served loop."""
    check_runtime(runtime)
    check_precision(precision)
    if not isinstance(max_window, int) or max_window < 0 or max_cache_len < 2 * max_window + 3:
        # 2 (K + 1) + 1: the warm-up checks the K + 1 row graphs against decode steps after a context (row_check)
        raise ValueError(f"serving_runtime needs an integer max_window >= 0 and max_cache_len >= 2 * max_window + 3, "
                         f"got max_window={max_window!r}, max_cache_len={max_cache_len!r}.")
    if drafter_precision is not None:
        check_precision(drafter_precision)
        converted = []  # the drafter's causal-LM models; none for prompt lookup, whose precision is then not named
        drafter = _with_drafter_models(drafter, lambda model: converted.append(model) or serving_precision(
            model, drafter_precision, upcast=True))
        drafter_precision = drafter_precision if converted else None
    precisions = {"precision": precision, "drafter_precision": drafter_precision,
                  "proposer": drafter if drafter_precision is not None else None}
    target = serving_precision(target, precision)
    if runtime == "eager":
        _warn_low_precision(precision, drafter)
        return ServingRuntime(target, drafter, "eager", runtime, **precisions)
    reason = compile_unavailable_reason(target, drafter)
    settings = settings or CompileSettings()
    if not settings.row_independent:  # with it the compiled rows are lossless (its eager fallback warns below)
        _warn_low_precision(precision, drafter)
    if reason is None:
        try:
            compiled_target = CompiledCausalLM(target, max_rows=max_window + 1, max_cache_len=max_cache_len,
                                               settings=settings, feature_layers=_feature_layers(drafter))
            seconds = compiled_target.warm_up(progress=progress)
            warmed = []

            def compile_drafter(model):
                # A drafter reads the tokens of the last round (1 or 2) and drafts one at a time; after a guard pause
                # it reads more, eagerly. K + 1 row counts keep its graphs the target's.
                compiled = CompiledCausalLM(model, max_rows=max_window + 1, max_cache_len=max_cache_len,
                                            settings=settings, verifies=False)
                warmed.append(compiled.warm_up(progress=progress))
                return compiled

            compiled_drafter = _with_drafter_models(drafter, compile_drafter)
            seconds += sum(warmed)
            return ServingRuntime(compiled_target, compiled_drafter, "compiled", runtime, seconds, compiled_target.label(),
                                  **precisions)
        except Exception as error:  # noqa: BLE001 - any failure to compile means: serve eagerly, say why
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
    logger.warning("Compiled runtime unavailable (%s); serving eagerly.", reason)
    if settings.row_independent:  # not warned above
        _warn_low_precision(precision, drafter)
    return ServingRuntime(target, drafter, "eager", runtime, fallback=reason, **precisions)


def _warn_low_precision(precision: str, drafter) -> None:
    """Speculation on a bf16/int8 target is not lossless unless its rows are independent of the row count
    (``ppow_trl.compiled_runtime.precision``): say so."""
    if precision != "fp32" and drafter is not None:
        logger.warning("Speculative decoding on a %s target is not lossless here: its logits round to bf16 (near "
                       "ties), and these kernels round a verify pass a little differently from a decode step, so "
                       "speculation may pick another token than plain %s decoding. For lossless speculation serve it "
                       "on the compiled runtime with CompileSettings(row_independent=True) (the default), or serve "
                       "the fp32 target.", precision, precision)
