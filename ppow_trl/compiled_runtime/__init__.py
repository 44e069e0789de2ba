"""The runtime the models serve on: a causal LM's forward compiled with inductor once per row count over a static KV
cache (``compiled``: ``CompiledCausalLM``), its settings and on-disk cache key (``inductor_settings``), AOTInductor
packages built once and loaded by a warm start (``packaged``) and where they live on disk (``package_store``), the
fixed-rows attention that keeps a verify pass's rows bitwise the decode steps' (``attention``) and the check of that
after the warm-up (``row_check``), and the target's serving precision (``precision``: fp32, bf16, int8 weight-only).
It knows nothing of drafting or windows: ``ppow_trl.serving.runtime`` decides how a target and its drafter run on it.
"""

from .compiled import CompiledCausalLM, CompileSettings
from .precision import PRECISIONS, Int8WeightOnlyLinear, serving_precision

__all__ = [
    "PRECISIONS",
    "CompileSettings",
    "CompiledCausalLM",
    "Int8WeightOnlyLinear",
    "serving_precision",
]
