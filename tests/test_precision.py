"""The target's serving precision (``ppow_trl.compiled_runtime.precision``): int8 weight-only layers against the formula
they state, conversion of a copy, and speculative == plain decoding on the same converted target on the eager runtime,
with a warning (on a real model the eager kernels round a verify pass a little differently from a decode step, so a
token may differ at a near tie; the compiled int8 graphs, bitwise row-independent, are checked in
``test_compiled.py``)."""

from __future__ import annotations

import pytest
import torch

from conftest import make_target_and_drafters, make_tiny_llama
from ppow_trl.serving.generation import speculative_generate
from ppow_trl.compiled_runtime.precision import Int8WeightOnlyLinear, int8_supported, precision_of, serving_precision
from ppow_trl.serving.runtime import serving_runtime
from ppow_trl.core.windowing import AdaptiveWindowPolicy


def test_int8_layer_is_the_product_with_its_dequantized_weight():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True)
    layer = Int8WeightOnlyLinear(linear)
    scale = layer.scale.float()
    torch.testing.assert_close(scale, linear.weight.abs().amax(dim=1) / 127, rtol=2**-8, atol=0)
    dequantized = layer.dequantized_weight()
    # W ~ s Q with |W - s Q| <= s / 2 entry-wise (half a quantization step; a clamped entry at most as much)
    assert ((linear.weight - dequantized).abs() <= scale[:, None] * (0.5 + 1e-3)).all()
    for dtype in (torch.float32, torch.bfloat16):  # the output in the input's dtype; the GEMM's input rounded to bf16
        for rows in (1, 2, 5):
            x = torch.randn(1, rows, 64).to(dtype)
            expected = x.to(torch.bfloat16).float() @ dequantized.T + linear.bias
            out = layer(x)
            assert out.shape == (1, rows, 48) and out.dtype == dtype
            torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2)
    # each row alone gives the same values as in a batch of rows (the kernel is row-independent)
    x = torch.randn(4, 64)
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(4)]), layer(x))


def test_serving_precision_converts_a_copy_and_keeps_the_fp32_model():
    model = make_tiny_llama(num_layers=2, seed=0)
    before = {name: p.clone() for name, p in model.named_parameters()}
    assert serving_precision(model, "fp32") is model
    bf16 = serving_precision(model, "bf16")
    assert bf16 is not model and all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    int8 = serving_precision(model, "int8")
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    quantized = [m for m in int8.modules() if isinstance(m, Int8WeightOnlyLinear)]
    assert len(quantized) == sum(int8_supported(m) for m in linears) > 0
    assert int8.lm_head.__class__ is Int8WeightOnlyLinear  # the tied head has its own int8 copy
    # int8 weights only: the embedding, norms and stream stay fp32 (ppow_trl.compiled_runtime.precision)
    assert int8.get_input_embeddings().weight.dtype == torch.float32
    assert [precision_of(m) for m in (model, bf16, int8)] == ["fp32", "bf16", "int8"]
    # one copy per model and precision (the trainer's cost model and the served runtime share its compiled graphs)
    assert serving_precision(model, "int8") is int8 and serving_precision(int8, "int8") is int8
    for name, p in model.named_parameters():  # the fp32 model is untouched
        assert p.dtype == torch.float32 and torch.equal(p, before[name])
    with pytest.raises(ValueError, match="precision must be one of"):
        serving_precision(model, "int4")
    # a model changed in place after its conversion (a drafter trained further) gets a fresh copy, not the stale one
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    fresh = serving_precision(model, "int8")
    assert fresh is not int8 and torch.allclose(fresh.lm_head.dequantized_weight(), 2 * int8.lm_head.dequantized_weight())
    assert serving_precision(model, "int8") is fresh  # unchanged since: shared again
    # "fp32" means the model as loaded; upcast (a drafter asked for at fp32) makes a float32 copy of a bf16 model
    assert serving_precision(bf16, "fp32") is bf16
    upcast = serving_precision(bf16, "fp32", upcast=True)
    assert precision_of(upcast) == "fp32" and precision_of(bf16) == "bf16"
    with pytest.raises(ValueError, match="already int8"):
        serving_precision(int8, "fp32", upcast=True)


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_speculative_decoding_on_a_converted_target_equals_plain_decoding_on_it(precision, caplog):
    target, _, drafter = make_target_and_drafters(seed=0, noise=0.01)
    target.generation_config.eos_token_id = None
    with caplog.at_level("WARNING"):
        runtime = serving_runtime(target, drafter, runtime="eager", max_window=3, precision=precision)
    assert f"{precision} target is not lossless" in caplog.text
    assert runtime.precision == precision and precision_of(runtime.verifier) == precision
    assert precision in runtime.describe()
    g = torch.Generator().manual_seed(1)
    accepted = 0
    for _ in range(6):
        ids = torch.randint(8, 64, (1, 5), generator=g)
        plain = speculative_generate(runtime.target, drafter, ids, policy=AdaptiveWindowPolicy(max_window=0),
                                     max_new_tokens=24)
        fast = speculative_generate(runtime.target, drafter, ids, policy=AdaptiveWindowPolicy(max_window=3),
                                    max_new_tokens=24)
        assert fast.new_tokens == plain.new_tokens
        accepted += len(fast.new_tokens) - (fast.target_forwards - fast.prefill_forwards)
    assert accepted > 0  # the windows were accepted, not only corrected: the comparison exercised verification
