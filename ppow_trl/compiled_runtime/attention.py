"""Attention whose every query row is computed the same way whatever the number of rows: lossless by construction.

Why: speculative decoding is lossless when the target's logits for a position do not depend on how many positions
one forward scores (one in a decode step, L + 1 in a verify pass). Inductor lowers a CPU ``bmm`` with one query row
(a decode step) into a product and a sum, and a ``bmm`` with several rows into a GEMM kernel: two summation orders.
In fp32 the two differ by about 1e-7 relative and greedy tokens rarely change; at low precision the differences
reach the logits' rounding step and near ties flip.

``fixed_rows_attention_forward`` gives every compiled call the same attention shapes: the query rows are padded to
``rows`` (the runtime's largest row count, K_max + 1) with copies of the last row, so a decode step and every verify
pass run one and the same GEMM and softmax, and a row's result cannot depend on the rows beside it (a GEMM's
summation order follows its shapes, not its contents). In fp32, with the heads of a key/value group stacked so that
no key or value is copied:

    s_ij = scale * sum_d q_id k_jd + mask_ij,    p_ij = softmax_j(s_ij),    o_id = sum_j p_ij v_jd,

for ``i`` over the padded rows of every query head of a group (one GEMM of ``groups * rows`` rows per key/value
head), then the real rows are kept and rounded to the activations' dtype once. The padded rows are not free: a
decode step now scores K_max + 1 rows against every cache position (SmolLM2, 30 layers, 512 positions, AMD EPYC,
1 thread: the decode step 1.09x [1.08, 1.10] int8 and 1.11x [1.01, 1.22] fp32 PyTorch's attention's, a 2-5 row
verify 0.90-1.01x; benchmarks/row_independence.py).
Why not drop the padding now that the runtime uses only the C++ GEMM template (``CompileSettings.backends``)? Unpadded,
that template's rows were bitwise too (a 6-layer Llama of SmolLM2's shape, fp32, L = 2..5), but its decode step took
1.23x the padded one's (14.7 vs 12.1 ms, AMD EPYC, 1 thread, torch.compile): the padded shape is also the faster one.
Longer calls (a prompt's prefill, run eagerly) are not padded: no compiled row is compared with a prefill row.

It is registered with transformers' ``AttentionInterface`` once per row count (``register_fixed_rows_attention``,
with the eager implementation's additive mask), and the compiled runtime traces its graphs with it under
``CompileSettings(row_independent=True)`` (``fixed_rows_attention``).
"""

from __future__ import annotations

import contextlib
import functools

import torch

FIXED_ROWS_ATTENTION = "ppow_fixed_rows_{rows}"


def fixed_rows_attention_forward(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                                 *, rows: int, **kwargs):
    """transformers' attention signature (``AttentionInterface``) with the rows padded to ``rows`` while compiling;
    the formula is in the module docstring. Returns ``(output (batch, query rows, heads, dim), None)``."""
    if dropout and module.training:
        raise ValueError("The fixed-rows attention is for serving (eval mode, no dropout).")
    batch, heads, real_rows, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    q = query.float()
    mask = None if attention_mask is None else attention_mask[..., : key.shape[-2]].float()
    padded = rows if torch.compiler.is_compiling() and real_rows < rows else real_rows
    if padded > real_rows:
        # copies of the last row: real, finite rows (zeros would be as good; copies keep the mask's shape simple)
        q = torch.cat([q, q[:, :, -1:].expand(-1, -1, padded - real_rows, -1)], dim=2)
        if mask is not None:
            mask = torch.cat([mask, mask[:, :, -1:].expand(-1, -1, padded - real_rows, -1)], dim=2)
    # query head h reads key/value head h // groups (transformers' repeat_kv): stack a group's heads as rows
    scores = (q.reshape(batch, kv_heads, groups * padded, dim) @ key.float().transpose(-1, -2)) * scaling
    scores = scores.view(batch, kv_heads, groups, padded, -1)
    if mask is not None:
        scores = scores + mask[:, :, None]
    probs = torch.softmax(scores, dim=-1).view(batch, kv_heads, groups * padded, -1)
    out = (probs @ value.float()).view(batch, heads, padded, dim)[:, :, :real_rows]
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register_fixed_rows_attention(rows: int) -> str:
    """Register the attention padded to ``rows`` with transformers (attention and mask interfaces); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    name = FIXED_ROWS_ATTENTION.format(rows=rows)
    AttentionInterface.register(name, functools.partial(fixed_rows_attention_forward, rows=rows))
    AttentionMaskInterface.register(name, eager_mask)
    return name


@contextlib.contextmanager
def fixed_rows_attention(model, rows: int):
    """``model`` runs the attention padded to ``rows`` inside the block, its own attention after it (the compiled
    runtime's graphs are traced and run inside it; the eager model, e.g. a prompt's prefill, keeps its own)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "_attn_implementation"):  # not a transformers model: its own attention
        yield
        return
    previous = config._attn_implementation
    config._attn_implementation = register_fixed_rows_attention(rows)
    try:
        yield
    finally:
        config._attn_implementation = previous
