"""The target's serving precision: fewer bytes read per token, the other lever of CPU decoding.

At batch 1 a decode step reads every weight once, so on a CPU it is close to memory-bound (SmolLM2-135M: 0.54 GB of
fp32 weights per token; 19 GB/s at one thread on an AMD EPYC). Precisions offered (``PRECISIONS``):

- ``"fp32"``: the model as loaded (the default; the one whose greedy output is the reference everywhere else).
- ``"bf16"``: weights and activations in bfloat16 (2 bytes a weight).
- ``"int8"``: int8 weight-only. Each ``nn.Linear`` weight ``W`` (``N x K``) is stored as ``Q = round(W / s)`` in int8
  with one scale per output row, ``s_n = max_k |W_nk| / 127`` (in bfloat16), so ``W ~ s * Q`` with ``|W - s Q| <= s / 2``.
  The layer rounds its input to bfloat16 and computes ``y = (bf16(x) Q^T) * s`` (``aten._weight_int8pack_mm``, which
  inductor compiles into its C++ weight-only GEMM template), returned in the input's dtype. Everything else (the
  residual stream, norms, attention, the KV cache, the embedding) stays fp32: the weights are what a decode step
  reads, and a bf16 residual stream rounded wherever inductor's fusion happened to store it, which differs between a
  decode step's graph and a verify pass's (``ppow_trl.compiled_runtime.compiled``). A tied lm head gets its own int8
  copy.

``serving_precision(model, precision)`` returns a converted copy (the fp32 model is left as it is: calibration and
the benchmarks compare against it). Lossless is a property of one precision and one set of kernels: speculation on
an int8 target reproduces plain decoding of that int8 target, bitwise on the compiled runtime's row-independent
graphs (``CompileSettings.row_independent``, the default), not the fp32 model's tokens. At bf16 the whole stream is
bf16 and its logits round to 8 bits; the eager runtime's kernels differ per row count, so there ``serving_runtime``
warns that speculation may pick another token than plain decoding at a near tie."""

from __future__ import annotations

import copy
import itertools
import logging
import weakref

import torch

PRECISIONS = ("fp32", "bf16", "int8")

logger = logging.getLogger(__name__)

_CONVERTED: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()
"""model -> {precision: (weights' version, converted copy)}: one copy per model, precision and state of its weights in
a process, so that the trainer's cost model and the recipe's serving runtime share one compiled target (a second copy
would compile again), while a drafter trained further gets a fresh copy (``_weights_version``)."""


def _weights_version(model) -> int | None:
    """A number that grows whenever any of ``model``'s parameters or buffers is changed in place (an optimizer step,
    ``load_state_dict``): the sum of their version counters. ``None`` where a tensor keeps none (inference tensors):
    such a model is never reused from the cache."""
    try:
        return sum(tensor._version for tensor in itertools.chain(model.parameters(), model.buffers()))
    except RuntimeError:
        return None


def check_precision(precision: str) -> str:
    """``precision`` if it is one of ``PRECISIONS``; a clear error otherwise (before any model is converted)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}.")
    return precision


class Int8WeightOnlyLinear(torch.nn.Module):
    """``nn.Linear`` with int8 weights and one scale per output row (module docstring: ``y = (bf16(x) Q^T) * s + b``,
    in ``x``'s dtype)."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        weight = linear.weight.detach().float()
        # The scale is rounded to the GEMM input's dtype first (the kernel takes it in that dtype), and Q is computed
        # against the rounded scale, so that |W - s Q| <= s / 2 holds for the scale the kernel multiplies by.
        scale = (weight.abs().amax(dim=1).clamp(min=1e-12) / 127.0).to(dtype)
        self.register_buffer("weight_int8", torch.round(weight / scale.float()[:, None]).clamp(-127, 127)
                             .to(torch.int8))
        self.register_buffer("scale", scale)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def dequantized_weight(self) -> torch.Tensor:
        """``s * Q`` in fp32: the weight this layer multiplies by (for tests and error bounds)."""
        return self.weight_int8.float() * self.scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the GEMM's input in the scales' dtype (bf16: the vectorized weight-only kernel), its output in x's dtype
        rows = x.reshape(-1, self.in_features).to(self.scale.dtype).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scale).to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=int8 per-row scales"


def int8_supported(linear: torch.nn.Linear) -> bool:
    """Whether ``aten._weight_int8pack_mm`` takes this layer's shape: ``in_features % 32 == 0`` and ``out_features %
    16 == 0`` (torch 2.13's CPU kernel crashed the process on ``in_features`` 7, 8, 12 and 20 and on ``out_features``
    5; LLM layers are multiples of 64). Other layers stay bf16."""
    return linear.in_features % 32 == 0 and linear.out_features % 16 == 0


def serving_precision(model, precision: str = "fp32", *, upcast: bool = False):
    """``model`` at ``precision`` (module docstring): the model itself when it is already at ``precision``, else a
    converted copy in eval mode, its generation config kept (made once per model, precision and state of its weights
    in a process: the target is frozen while it serves). ``"fp32"`` is the default and means the model as loaded: a
    bf16 model stays bf16 (no fp32 copy of a target in memory) unless ``upcast``, which makes a float32 copy (a drafter
    asked for at fp32). An int8 model cannot be upcast (its weights were rounded): an error."""
    check_precision(precision)
    current = precision_of(model)
    if current == precision or (precision == "fp32" and not upcast):
        return model
    if current == "int8":
        raise ValueError(f"This model's weights are already int8 (Int8WeightOnlyLinear); it cannot serve at {precision}. "
                         "Convert the fp32 model instead.")
    version = _weights_version(model)
    cached_version, converted = _CONVERTED.get(model, {}).get(precision, (None, None))
    if converted is not None and version is not None and cached_version == version:
        return converted
    converted = copy.deepcopy(model).eval()
    if precision == "fp32":  # a bf16 model (its bf16 attention choice kept: it is a choice for speed, not precision)
        converted.float()
    if precision == "bf16":
        converted.to(torch.bfloat16)
        if hasattr(converted, "set_attn_implementation"):
            # PyTorch's CPU flash attention in bf16 took 0.53 ms a layer for one query row against 0.19 ms for two
            # (SmolLM2, 512-position static cache, AMD EPYC, torch 2.13): the one-row decode step was 1.5x the two-row
            # verify. transformers' eager attention (matmul, softmax) is fused by inductor instead.
            converted.set_attn_implementation("eager")
    if precision == "int8":
        for module in list(converted.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear) and int8_supported(child):
                    setattr(module, name, Int8WeightOnlyLinear(child))
        # An lm head tied to the embedding is now its own int8 module: saving must not re-tie it.
        converted.config.get_text_config().tie_word_embeddings = False
    _CONVERTED.setdefault(model, {})[precision] = (version, converted)
    return converted


def precision_of(model) -> str:
    """The serving precision of a model converted by ``serving_precision`` (``"fp32"`` when it was not)."""
    if any(isinstance(module, Int8WeightOnlyLinear) for module in model.modules()):
        return "int8"
    parameter = next(model.parameters(), None)
    return "bf16" if parameter is not None and parameter.dtype == torch.bfloat16 else "fp32"
