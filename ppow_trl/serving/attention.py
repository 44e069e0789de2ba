"""Attention whose every query row is computed the same way whatever the number of rows: lossless by construction.

Why: speculative decoding is lossless when the target's logits for a position do not depend on how many positions
one forward scores (one in a decode step, L + 1 in a verify pass). Inductor lowers a CPU ``bmm`` with one query row
(a decode step) into a product and a sum, and a ``bmm`` with several rows into a GEMM kernel: two summation orders.
In fp32 the two differ by about 1e-7 relative and greedy tokens rarely change; in bf16 (the int8 target's
activations) the scores round to 8 bits, and the compiled int8 SmolLM2's verify logits differed from its decode
logits on almost every row (up to 0.5), so speculation picked other tokens than plain int8 decoding at near ties.

``rowwise_attention_forward`` writes attention as the product and sum for every row count, in fp32:

    s_ij = scale * sum_d q_id k_jd + mask_ij,    p_ij = softmax_j(s_ij),    o_id = sum_j p_ij v_jd

(keys and values repeated over the query heads of their group), computed in fp32 from the stored keys and values
and rounded to the activations' dtype once, at the end. Under inductor each sum becomes one reduction loop over ``d``
(scores) or ``j`` (output) per row, the same loop for 1 and for L + 1 rows; nothing is materialized at the size of
the product. It is registered with transformers' ``AttentionInterface`` as ``"ppow_rowwise"`` (with the eager
implementation's additive mask), and the compiled runtime traces its graphs with it under
``CompileSettings(row_independent=True)`` (``rowwise_attention``).

Its cost: the sums are not GEMM kernels, so a verify pass of several rows gets dearer. SmolLM2 fp32 on an AMD EPYC
(1 thread, benchmarks/row_independence.py): the decode step about the same, a 5-row verify 1.97 steps against 1.41
with PyTorch's attention.
"""

from __future__ import annotations

import contextlib

import torch

ROWWISE_ATTENTION = "ppow_rowwise"


def rowwise_attention_forward(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                              **kwargs):
    """transformers' attention signature (``AttentionInterface``); the formula is in the module docstring. Returns
    ``(output (batch, rows, heads, dim), None)``: no attention weights are kept."""
    if dropout and module.training:
        raise ValueError("The row-wise attention is for serving (eval mode, no dropout).")
    from transformers.integrations.sdpa_attention import repeat_kv  # each key/value head serves `groups` query heads

    groups = getattr(module, "num_key_value_groups", 1)
    q = query.float()
    k = repeat_kv(key, groups).float()
    v = repeat_kv(value, groups).float()
    compiled = torch.compiler.is_compiling()
    # scores[b, h, i, j] = sum_d q[b, h, i, d] k[b, h, j, d]. Compiled, it is written as a product and a sum, not a
    # matmul, so that one row and several rows run the same reduction (module docstring). Eagerly (a prompt's
    # prefill: hundreds of rows) the product would be materialized, so it is a matmul there: no compiled graph's
    # row is compared with a prefill row.
    scores = ((q.unsqueeze(3) * k.unsqueeze(2)).sum(-1) if compiled else q @ k.transpose(-1, -2)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask[..., : k.shape[-2]].float()
    probs = torch.softmax(scores, dim=-1)
    # out[b, h, i, d] = sum_j probs[b, h, i, j] v[b, h, j, d]
    out = (probs.unsqueeze(-1) * v.unsqueeze(2)).sum(-2) if compiled else probs @ v
    return out.to(query.dtype).transpose(1, 2).contiguous(), None


def register_rowwise_attention() -> str:
    """Register ``ROWWISE_ATTENTION`` with transformers (attention and mask interfaces); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention_forward)
    AttentionMaskInterface.register(ROWWISE_ATTENTION, eager_mask)
    return ROWWISE_ATTENTION


@contextlib.contextmanager
def rowwise_attention(model):
    """``model`` runs ``ROWWISE_ATTENTION`` inside the block, its own attention after it (the compiled runtime's
    graphs are traced and run inside it; the eager model, e.g. a prompt's prefill, keeps its implementation)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "_attn_implementation"):  # not a transformers model: its own attention
        yield
        return
    previous = config._attn_implementation
    config._attn_implementation = register_rowwise_attention()
    try:
        yield
    finally:
        config._attn_implementation = previous
