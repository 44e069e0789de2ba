"""Fixed-rows attention (ppow_trl.compiled_runtime.attention): transformers' attention formula, every call the same
shapes.

The compiled runtime traces it so that a row's logits do not depend on how many rows one forward scores
(tests/test_compiled.py checks that bitwise on compiled graphs); here: the formula against a float64 brute force
(grouped-query heads, a causal mask over a longer static cache), padded and unpadded, a real row's output not
changed by the rows beside it, and a model switched to it inside ``fixed_rows_attention`` and back after it.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_llama

from ppow_trl.compiled_runtime.attention import (FIXED_ROWS_ATTENTION, fixed_rows_attention,
                                        fixed_rows_attention_forward)


class _Module(torch.nn.Module):
    num_key_value_groups = 3


def _inputs(rows: int, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 6, rows, 16, generator=g).to(dtype)
    key = torch.randn(1, 2, 40, 16, generator=g).to(dtype)
    value = torch.randn(1, 2, 40, 16, generator=g).to(dtype)
    past = 30  # rows sit at positions past..past+rows-1 of a 40-position cache; later positions are masked
    allowed = torch.arange(40)[None, :] <= (past + torch.arange(rows))[:, None]
    mask = torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)[None, None]
    return query, key, value, mask


def _brute_force(query, key, value, mask, scaling):
    """o_id = sum_j softmax_j(scale * q_i . k_j + mask_ij) v_jd, one query head at a time, in float64."""
    q, k, v, m = (t.double() for t in (query, key, value, mask))
    out = torch.empty(q.shape[0], q.shape[2], q.shape[1], q.shape[3], dtype=torch.float64)
    for h in range(q.shape[1]):
        kv = h // 3  # grouped-query attention: 3 query heads per key/value head
        for i in range(q.shape[2]):
            scores = torch.stack([scaling * (q[0, h, i] @ k[0, kv, j]) + m[0, 0, i, j] for j in range(k.shape[2])])
            out[0, i, h] = torch.softmax(scores, 0) @ v[0, kv]
    return out


def _compiling(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("traced", [False, True])
def test_fixed_rows_attention_is_the_attention_formula(rows, traced, monkeypatch):
    """Eager (no padding) and traced (rows padded to 5): the formula for every real row, and only those returned."""
    if traced:
        _compiling(monkeypatch)
    query, key, value, mask = _inputs(rows)
    out, weights = fixed_rows_attention_forward(_Module(), query, key, value, mask, scaling=0.25, rows=5)
    assert weights is None and out.shape == (1, rows, 6, 16)
    torch.testing.assert_close(out.double(), _brute_force(query, key, value, mask, 0.25), atol=1e-5, rtol=1e-5)


def test_a_rows_output_does_not_depend_on_the_rows_beside_it(monkeypatch):
    """Traced: the same query row, alone or with other rows after it, gives the same bits (one shape, one kernel)."""
    _compiling(monkeypatch)
    query, key, value, mask = _inputs(4, seed=1)
    together, _ = fixed_rows_attention_forward(_Module(), query, key, value, mask, scaling=0.25, rows=5)
    for row in range(4):
        # row `row` alone: the same cache, its own mask row (positions up to 30 + row)
        alone, _ = fixed_rows_attention_forward(_Module(), query[:, :, row:row + 1], key, value,
                                                mask[:, :, row:row + 1], scaling=0.25, rows=5)
        assert torch.equal(alone[:, 0], together[:, row])


def test_bf16_inputs_are_computed_in_fp32_and_rounded_once(monkeypatch):
    _compiling(monkeypatch)
    query, key, value, mask = _inputs(3, torch.bfloat16)
    out, _ = fixed_rows_attention_forward(_Module(), query, key, value, mask, scaling=0.25, rows=5)
    reference = _brute_force(query.float(), key.float(), value.float(), mask.float(), 0.25)
    assert out.dtype == torch.bfloat16
    assert (out.double() - reference).abs().max() <= 2**-8 * reference.abs().max()  # fp32 math, one bf16 rounding


def test_a_model_runs_fixed_rows_attention_only_inside_the_block():
    model = make_tiny_llama(num_layers=2, seed=0).eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    before = model.config._attn_implementation
    with torch.no_grad():
        reference = model(ids).logits
        with fixed_rows_attention(model, rows=5):
            assert model.config._attn_implementation == FIXED_ROWS_ATTENTION.format(rows=5)
            fixed = model(ids).logits
    assert model.config._attn_implementation == before
    torch.testing.assert_close(fixed, reference, atol=1e-5, rtol=1e-5)


def test_fixed_rows_attention_refuses_dropout_in_training():
    module = _Module().train()
    with pytest.raises(ValueError, match="serving"):
        fixed_rows_attention_forward(module, *_inputs(1), scaling=0.25, dropout=0.1, rows=5)
