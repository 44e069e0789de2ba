"""Choosing the serving runtime (ppow_trl.serving.runtime) without compiling anything: arguments checked first, and every
reason not to compile gives the eager models with one warning line, never a crash."""

from __future__ import annotations

import pytest
import torch
from conftest import make_target_and_drafters

from ppow_trl.serving import runtime as runtime_module
from ppow_trl.serving.runtime import compile_unavailable_reason, serving_runtime


@pytest.fixture(scope="module")
def models():
    target, _, close = make_target_and_drafters(seed=0)
    return target, close


def test_a_failed_compile_serves_eagerly_with_one_line(models, monkeypatch, caplog):
    target, close = models

    def broken(self, progress=True):
        raise RuntimeError("inductor failed\nlong traceback")

    monkeypatch.setattr(runtime_module, "compile_unavailable_reason", lambda *models: None)
    monkeypatch.setattr(runtime_module.CompiledCausalLM, "warm_up", broken)
    with caplog.at_level("WARNING"):
        served = serving_runtime(target, close, runtime="compiled", max_window=2, progress=False)
    assert served.name == "eager" and served.requested == "compiled"
    assert served.target is target and served.drafter is close
    assert served.fallback == "RuntimeError: inductor failed"
    assert "serving eagerly" in caplog.text and "long traceback" not in caplog.text
    assert "compiled unavailable: RuntimeError" in served.describe()


def test_reasons_not_to_compile(models, monkeypatch):
    target, close = models
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CXX", raising=False)
    assert "no C++ compiler" in compile_unavailable_reason(target, close)
    served = serving_runtime(target, close, runtime="compiled", max_window=2, progress=False)
    assert served.name == "eager" and "no C++ compiler" in served.fallback


def test_bad_arguments_fail_before_anything_compiles(models):
    target, close = models
    assert serving_runtime(target, close, runtime="eager", max_window=2).target is target
    with pytest.raises(ValueError, match="runtime must be one of"):
        serving_runtime(target, close, runtime="fast", max_window=2)
    with pytest.raises(ValueError, match="precision must be one of"):
        serving_runtime(target, close, runtime="compiled", max_window=2, precision="int4")
    with pytest.raises(ValueError, match="max_window >= 0"):
        serving_runtime(target, close, runtime="compiled", max_window=-1)
    with pytest.raises(ValueError, match="max_cache_len"):
        serving_runtime(target, close, runtime="compiled", max_window=4, max_cache_len=4)


def test_loop_overhead_is_the_host_work_the_forwards_do_not_explain(models, monkeypatch):
    """measure_loop_overhead times the loop's rounds: host delays added to every drafting round and to every drafted
    token (not to plain steps) show up in round_overhead and drafted_token_overhead at about their size over t_t, and
    not in plain_overhead; the cost model's round times are then the loop's median rounds over its median plain
    step. The delays (20 ms) dwarf the tiny models' forwards (about a millisecond), so the margins hold on a loaded
    machine."""
    import time

    from ppow_trl.serving import generation
    from ppow_trl.core.cost import calibrate_cost_model
    from ppow_trl.serving.runtime import measure_loop_overhead

    target, close = models
    with torch.no_grad():
        cost = calibrate_cost_model(target, close, max_window=2, context_length=16, repeats=5, warmup=1)
    measure_loop_overhead(target, close, cost, 3, new_tokens=10, repeats=3)
    quiet = cost.plain_overhead, cost.round_overhead, cost.drafted_token_overhead
    assert min(quiet) >= 0 and "loop_overhead" in cost.raw_seconds
    delay = 0.02
    verify = generation.greedy_verify_one

    def slow_per_round_and_token(window, logits):  # 20 ms a drafting round + 20 ms a drafted token
        time.sleep(delay * (1 + len(window)) if window else 0.0)
        return verify(window, logits)

    monkeypatch.setattr(generation, "greedy_verify_one", slow_per_round_and_token)
    measure_loop_overhead(target, close, cost, 3, new_tokens=10, repeats=3)
    t_t = cost.raw_seconds["target_step"]
    assert 0.6 < (cost.round_overhead - quiet[1]) / (delay / t_t) < 1.6
    assert 0.6 < (cost.drafted_token_overhead - quiet[2]) / (delay / t_t) < 1.6
    assert cost.plain_overhead < quiet[0] + 0.3 * delay / t_t
    medians = cost.raw_seconds["loop_overhead"]["median_round_over_t_t"]
    for length in (1, 3):
        # over the loop's plain step, also where the forward timed alone was the slower (medians["0"] < 1)
        assert float(cost.round_time(torch.tensor([length]))[0]) == pytest.approx(
            medians[str(length)] / medians["0"], rel=1e-4)
    # a target step timed alone slower than the loop's plain round (T_0 < t_t): o_0 = 0, and the rounds are still the
    # loop's over its own plain round, their excess kept
    cost.raw_seconds["target_step"] = 3 * t_t
    measure_loop_overhead(target, close, cost, 3, new_tokens=10, repeats=3)
    medians = cost.raw_seconds["loop_overhead"]["median_round_over_t_t"]
    assert medians["0"] < 1 and cost.plain_overhead == 0 and cost.round_overhead > 0
    for length in (1, 3):
        assert float(cost.round_time(torch.tensor([length]))[0]) == pytest.approx(
            medians[str(length)] / medians["0"], rel=1e-4)
    with pytest.raises(ValueError, match="new_tokens >= 2 max_window"):
        measure_loop_overhead(target, close, cost, 2, new_tokens=5)


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_a_drafter_served_at_another_precision_proposes_from_a_converted_copy_and_changes_no_token(models, precision,
                                                                                                   monkeypatch):
    """``drafter_precision``: the served drafter (alone, and inside the hybrid) is a converted copy, the models given
    stay as they are, and greedy speculative decoding still gives the fp32 target's plain tokens: the target decides
    every token, so the drafter's precision moves only tau."""
    from ppow_trl.drafters.hybrid import hybrid_drafter
    from ppow_trl.serving.generation import speculative_generate
    from ppow_trl.compiled_runtime.precision import precision_of
    from ppow_trl.core.windowing import AdaptiveWindowPolicy

    target, close = models
    served = serving_runtime(target, close, runtime="eager", max_window=3, drafter_precision=precision)
    assert served.target is target and served.drafter is not close
    assert precision_of(served.drafter) == precision and precision_of(close) == precision_of(target) == "fp32"
    assert served.drafter_precision == precision and f"drafter {precision}" in served.describe()
    hybrid = hybrid_drafter(close, target)
    served_hybrid = serving_runtime(target, hybrid, runtime="eager", max_window=3, drafter_precision=precision)
    assert precision_of(served_hybrid.drafter.drafter) == precision and hybrid.drafter is close
    taus = []
    for seed in range(3):
        ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(seed))
        plain = speculative_generate(target, close, ids, policy=AdaptiveWindowPolicy(max_window=0), max_new_tokens=24)
        fast = speculative_generate(served.target, served.drafter, ids, policy=AdaptiveWindowPolicy(max_window=3),
                                    max_new_tokens=24)
        assert torch.equal(fast.sequences, plain.sequences)
        taus.append(fast.tau)
    assert max(taus) > 1.0  # the converted drafter was accepted: the comparison ran speculative rounds
    # the served rule's acceptance comes from the drafter as it proposes when served, not the fp32 one given
    from ppow_trl.serving import rule

    rolled_out = []
    real_policy = rule.calibrate_policy
    monkeypatch.setattr(rule, "calibrate_policy",
                        lambda verifier, drafter, *a, **k: rolled_out.append(drafter) or real_policy(verifier, drafter, *a, **k))
    contexts = [torch.randint(0, 64, (10,), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    rule.calibrate_for_serving(target, close, contexts, max_window=2, cost_repeats=2, runtime=served)
    assert rolled_out == [served.drafter]
    with pytest.raises(ValueError, match="precision must be one of"):
        serving_runtime(target, close, runtime="eager", max_window=2, drafter_precision="fp8")
    # fp32 asked for a bf16 drafter: served as a float32 copy; prompt lookup converts nothing, so names no precision
    bf16_served = serving_runtime(target, close, runtime="eager", max_window=3, drafter_precision="bf16")
    upcast = serving_runtime(target, bf16_served.drafter, runtime="eager", max_window=3, drafter_precision="fp32")
    assert precision_of(upcast.drafter) == "fp32" and upcast.drafter_precision == "fp32"
    from ppow_trl.drafters.prompt_lookup import PromptLookupConfig, PromptLookupDrafter

    lookup = serving_runtime(target, PromptLookupDrafter(PromptLookupConfig()), runtime="eager", max_window=3, drafter_precision="bf16")
    assert lookup.drafter_precision is None and "drafter" not in lookup.describe()
