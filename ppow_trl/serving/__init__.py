"""Serving a drafter: everything between a trained drafter and tokens generated faster, as transformers keeps
``generation/``. The speculative loop and exact greedy tau (``generation``), the runtime a target and its drafter
serve on, compiled or eager, and the loop overheads measured on it (``runtime``, over ``ppow_trl.compiled_runtime``),
the rule's calibration (``calibration``) and the served rule (``rule``), and transformers'
``generate(assistant_model=...)`` hook (``assisted``, ``assistant_loop``). What serving shares with training (the
verification, the window rule, the cost model, the rewards and the rollout path) is ``ppow_trl.core``. Drafter
families are found through ``ppow_trl.drafting``'s registry: nothing here imports one.
"""

import importlib
import warnings

from .assisted import load_assistant, load_cost_model, save_assistant, write_assistant_files
from .calibration import calibrate_policy, held_out_contexts
from .generation import ExactGreedyTau, SpeculativeOutput, exact_greedy_tau, greedy_continuation, speculative_generate
from .rule import DEFAULT_GUARD, calibrate_for_serving, describe_serving_rule
from .runtime import ServingRuntime, measure_loop_overhead, serving_runtime

__all__ = [
    "DEFAULT_GUARD",
    "ExactGreedyTau",
    "ServingRuntime",
    "SpeculativeOutput",
    "calibrate_for_serving",
    "calibrate_policy",
    "describe_serving_rule",
    "exact_greedy_tau",
    "greedy_continuation",
    "held_out_contexts",
    "load_assistant",
    "load_cost_model",
    "measure_loop_overhead",
    "save_assistant",
    "serving_runtime",
    "speculative_generate",
    "write_assistant_files",
]

_MOVED_TO = ("ppow_trl.core", "ppow_trl.compiled_runtime")
"""Where the names this package exported before its core and compiled runtime moved out now live."""


def __getattr__(name: str):
    """``ppow_trl.serving.<name>`` for what moved to ``ppow_trl.core`` or ``ppow_trl.compiled_runtime``, with a
    ``FutureWarning`` naming the new path: a module that left this package (``cost``, imported by its old name
    through ``ppow_trl._moved``) or a name this package exported before (``CostModel``)."""
    from .._moved import MOVED

    if f"{__name__}.{name}" in MOVED:
        return importlib.import_module(f"{__name__}.{name}")
    for package_name in _MOVED_TO:
        package = importlib.import_module(package_name)
        if name in package.__all__:
            warnings.warn(f"ppow_trl.serving.{name} moved to {package_name}.{name}: import it from there (the old "
                          "path will be removed).", FutureWarning, stacklevel=2)
            value = globals()[name] = getattr(package, name)  # warns once: the next look-up finds it here
            return value
    raise AttributeError(f"module 'ppow_trl.serving' has no attribute {name!r}")
