"""The runtime a target and its drafter serve on: ``"compiled"`` (``ppow_trl.compiled``) or ``"eager"``.

``serving_runtime(target, drafter, runtime="compiled", max_window=K)`` is the one place that decides how the models
run when they serve, and the cost model, the calibration of the served rule, the recipe and the benchmarks all go
through it: the costs a rule is chosen on are the costs of the runtime that serves it.

- ``"compiled"``: the target (and a drafter whose family ``compiles``: a causal LM over its own KV cache) become
  ``CompiledCausalLM``s with ``K + 1`` row counts over a static cache of ``max_cache_len`` positions, warmed up with
  a progress bar (from the on-disk inductor cache when it holds them). Prompt lookup drafts on the host next to the
  compiled target. Drafters that read the target's hidden states (EAGLE-3, DFlash) serve eagerly, said as a
  fallback: the compiled graphs do not return hidden states yet.
- ``"eager"``: the models as they are.

When compiling is not possible (no C++ compiler, a model inductor cannot trace, a failed warm-up), one warning line
says why and the models serve eagerly: a user gets a slower answer, never a crash. ``ServingRuntime.name`` then says
``"eager"`` and ``fallback`` holds the reason, so that a saved cost model never claims a runtime it was not measured on.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

import torch

from .compiled import CompiledCausalLM, CompileSettings
from .cost import CostModel, calibrate_cost_model
from .drafting import family_of

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

    def describe(self) -> str:
        if self.name == "compiled":
            return f"compiled (inductor {self.settings}, warm-up {self.compile_seconds:.0f} s)"
        return "eager" + (f" (compiled unavailable: {self.fallback})" if self.fallback else "")

    def measure_cost_model(self, max_window: int, **kwargs) -> CostModel:
        """``calibrate_cost_model`` on these models (``kwargs``: its options), labelled with this runtime: the one
        way the trainer's speed reward and the served rule get their costs."""
        with torch.no_grad():
            cost_model = calibrate_cost_model(self.target, self.drafter, max_window, **kwargs)
        cost_model.runtime = self.name
        cost_model.description += f"; runtime {self.describe()}"
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
    if drafter is not None and _reads_target_features(drafter):
        # Their verification asks the target for hidden states, which the compiled graphs do not return: a target
        # compiled without them would be timed fast and served slow.
        return "the drafter reads the target's hidden states (EAGLE-3, DFlash), which the compiled graphs do not return"
    compilers = [os.environ.get("CXX"), "g++", "c++", "clang++"]
    if not any(shutil.which(name) for name in compilers if name):
        return "no C++ compiler on PATH (inductor's CPU kernels need one: apt install g++, or set CXX)"
    return None


def _reads_target_features(drafter) -> bool:
    try:
        return family_of(drafter).target_layer_ids(drafter) is not None
    except (ValueError, TypeError):
        return False


def _drafter_compiles(drafter) -> bool:
    if drafter is None or not hasattr(drafter, "parameters"):
        return False
    try:
        return family_of(drafter).compiles
    except (ValueError, TypeError):
        return False


def serving_runtime(target, drafter=None, *, runtime: str = "compiled", max_window: int,
                    max_cache_len: int = DEFAULT_MAX_CACHE_LEN, settings: CompileSettings | None = None,
                    progress: bool = True) -> ServingRuntime:
    """``target`` and ``drafter`` on ``runtime`` (module docstring); compiled models are warmed up before returning,
    so that nothing compiles inside the served loop."""
    check_runtime(runtime)
    if not isinstance(max_window, int) or max_window < 0 or max_cache_len < max_window + 2:
        raise ValueError(f"serving_runtime needs an integer max_window >= 0 and max_cache_len > max_window + 1, got "
                         f"max_window={max_window!r}, max_cache_len={max_cache_len!r}.")
    if runtime == "eager":
        return ServingRuntime(target, drafter, "eager", runtime)
    reason = compile_unavailable_reason(target, drafter)
    if reason is None:
        settings = settings or CompileSettings()
        try:
            compiled_target = CompiledCausalLM(target, max_rows=max_window + 1, max_cache_len=max_cache_len,
                                               settings=settings)
            seconds = compiled_target.warm_up(progress=progress)
            compiled_drafter = drafter
            if _drafter_compiles(drafter):
                # A drafter reads the tokens of the last round (1 or 2) and drafts one at a time; after a guard pause
                # it reads more, eagerly. K + 1 row counts keep its graphs the target's.
                compiled_drafter = CompiledCausalLM(drafter, max_rows=max_window + 1, max_cache_len=max_cache_len,
                                                    settings=settings)
                seconds += compiled_drafter.warm_up(progress=progress)
            return ServingRuntime(compiled_target, compiled_drafter, "compiled", runtime, seconds, settings.label())
        except Exception as error:  # noqa: BLE001 - any failure to compile means: serve eagerly, say why
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
    logger.warning("Compiled runtime unavailable (%s); serving eagerly.", reason)
    return ServingRuntime(target, drafter, "eager", runtime, fallback=reason)
