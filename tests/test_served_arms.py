"""Served configurations side by side (ppow_trl.bench.served): losslessness counted against the reference arm,
speedups as ratios of total times with intervals that contain them, and a clear error for an unknown baseline."""

from __future__ import annotations

import time

import pytest
import torch
from conftest import make_target_and_drafters

from ppow_trl.bench.served import Arm, compare_arms, format_arms, generate_arm, loop_arm
from ppow_trl.core.windowing import AdaptiveWindowPolicy


@pytest.fixture(scope="module")
def arms():
    target, random_drafter, close = make_target_and_drafters(seed=0)
    stop = []  # never stops early: every arm generates the same number of tokens
    return target, [
        generate_arm("hf", target, stop, 0, "hf"),
        loop_arm("plain", target, close, AdaptiveWindowPolicy(max_window=0), stop, 64, "plain"),
        loop_arm("spec[close]", target, close, AdaptiveWindowPolicy(3, 0.0), stop, 64, "plain"),
        loop_arm("spec[random]", target, random_drafter, AdaptiveWindowPolicy(3, 0.0), stop, 64, "plain"),
    ]


def test_greedy_arms_are_lossless_and_speedups_are_ratios_of_total_time(arms):
    target, served = arms
    prompts = [torch.randint(4, 64, (1, 5 + p), generator=torch.Generator().manual_seed(p)) for p in range(3)]
    result = compare_arms(served, prompts, max_new_tokens=12, baselines=["plain", "hf"], eager_reference="hf",
                          progress=False)
    summary = result["arms"]
    assert summary["plain"]["lossless_prompts"] == "reference"
    for label in ("spec[close]", "spec[random]"):
        assert summary[label]["lossless_prompts"] == "3/3"
    for label in ("plain", "spec[close]", "spec[random]"):
        assert summary[label]["agrees_with_eager_prompts"] == "3/3"  # same eager kernels: same tokens as generate
    assert summary["plain"]["tau"] == pytest.approx(1.0)
    assert summary["spec[close]"]["tau"] > summary["spec[random]"]["tau"] >= 1.0
    assert summary["plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    records = result["records"]
    total = lambda label: sum(r[label]["seconds"] for r in records)  # noqa: E731
    # the same tokens (lossless, no early stop): the throughput ratio is the ratio of total times
    assert summary["spec[close]"]["speedup_vs_hf"] == pytest.approx(total("hf") / total("spec[close]"))
    # against its own plain reference too (the table's "own plain" column), whatever the baselines
    assert summary["spec[close]"]["speedup_vs_reference"] == pytest.approx(total("plain") / total("spec[close]"))
    for entry in summary.values():
        low, high = entry["speedup_vs_hf_ci95"]
        assert low <= high
        low, high = entry["ms_per_token_ci95"]
        assert low <= entry["ms_per_token_median"] <= high
    table = format_arms(summary, ["plain", "hf"])
    assert len(table) == 2 + len(served) and "3/3" in table[-1]
    assert "own plain" in table[0] and all(row.count("|") == table[0].count("|") for row in table)


def test_each_arm_is_also_compared_with_its_own_plain_reference():
    """An int8 speculative row is judged against int8 plain decoding, not only against the fp32 baseline."""
    fp32 = Arm("plain[fp32]", lambda ids, n: (time.sleep(0.02) or [1] * 4, 4), "plain[fp32]")
    int8 = Arm("plain[int8]", lambda ids, n: (time.sleep(0.01) or [1] * 4, 4), "plain[int8]")
    spec = Arm("spec@int8", lambda ids, n: (time.sleep(0.005) or [1] * 4, 2), "plain[int8]")
    result = compare_arms([fp32, int8, spec], [torch.ones((1, 2), dtype=torch.long)] * 3, max_new_tokens=4,
                          baselines=["plain[fp32]"], progress=False, warmup=False)
    entry = result["arms"]["spec@int8"]
    total = lambda label: sum(r[label]["seconds"] for r in result["records"])  # noqa: E731
    assert entry["reference"] == "plain[int8]"
    assert entry["speedup_vs_reference"] == pytest.approx(total("plain[int8]") / total("spec@int8"))
    assert entry["speedup_vs_plain[fp32]"] == pytest.approx(total("plain[fp32]") / total("spec@int8"))
    assert entry["speedup_vs_reference"] < entry["speedup_vs_plain[fp32]"]


def test_speedup_is_a_throughput_ratio_when_arms_generate_different_lengths():
    slow_long = Arm("base", lambda ids, n: (time.sleep(0.02) or [1] * 8, 8), "base")
    fast_short = Arm("short", lambda ids, n: (time.sleep(0.01) or [1] * 2, 2), "base")
    result = compare_arms([slow_long, fast_short], [torch.ones((1, 2), dtype=torch.long)] * 2, max_new_tokens=8,
                          baselines=["base"], eager_reference="base", progress=False, warmup=False)
    # half the time for a quarter of the tokens: half the throughput, not 2x
    assert result["arms"]["short"]["speedup_vs_base"] == pytest.approx(0.5, rel=0.3)


def test_a_wrong_arm_is_counted_as_lossy(arms):
    target, served = arms
    wrong = Arm("wrong", lambda ids, n: ([0] * n, n), "plain")
    prompts = [torch.randint(4, 64, (1, 6), generator=torch.Generator().manual_seed(9))]
    result = compare_arms([served[1], wrong], prompts, max_new_tokens=8, baselines=["plain"],
                          eager_reference="plain", progress=False, warmup=False)
    assert result["arms"]["wrong"]["lossless_prompts"] == "0/1"


def test_unknown_baseline_is_refused_before_any_run(arms):
    _, served = arms
    with pytest.raises(ValueError, match="not among the arms"):
        compare_arms(served, [torch.ones((1, 3), dtype=torch.long)], max_new_tokens=4, baselines=["nope"])
    with pytest.raises(ValueError, match="at least one prompt"):
        compare_arms(served, [], max_new_tokens=4, baselines=["plain"])


def test_a_killed_comparison_resumes_from_its_checkpoint_without_rerunning_finished_prompts(tmp_path):
    calls = []

    def counting(label, tokens, die_at=None):
        def run(ids, n):
            prompt = int(ids[0, 0])
            if die_at is not None and prompt == die_at and not run.survived:
                run.survived = True  # dies once, like a run killed on this prompt
                raise KeyboardInterrupt
            calls.append((label, prompt))
            return [prompt + t for t in tokens], len(tokens)

        run.survived = False
        return Arm(label, run, "base")

    prompts = [torch.full((1, 3), p, dtype=torch.long) for p in range(4)]
    arms = [counting("base", [0, 1, 2]), counting("lossy", [0, 1, 7], die_at=2)]
    path = tmp_path / "run.jsonl"
    with pytest.raises(KeyboardInterrupt):
        compare_arms(arms, prompts, max_new_tokens=3, baselines=["base"], progress=False, warmup=False,
                     checkpoint=path)
    finished = {prompt for label, prompt in calls if label == "lossy"}
    assert finished == {0, 1}
    calls.clear()
    with path.open("a") as handle:
        handle.write('{"index": 2, "prom')  # the line a killed run was writing is dropped, not an error
    result = compare_arms(arms, prompts, max_new_tokens=3, baselines=["base"], progress=False, warmup=False,
                          checkpoint=path)
    assert {prompt for _, prompt in calls} == {2, 3}  # prompts 0 and 1 were read back, not run again
    assert result["arms"]["lossy"]["lossless_prompts"] == "0/4" and result["arms"]["lossy"]["prompts"] == 4
    again = compare_arms(arms, prompts, max_new_tokens=3, baselines=["base"], progress=False, warmup=False,
                         checkpoint=path)
    assert again["arms"] == result["arms"]  # everything read back: the same summary
    with pytest.raises(ValueError, match="another comparison"):
        compare_arms(arms[:1], prompts, max_new_tokens=3, baselines=["base"], progress=False, checkpoint=path)
    with pytest.raises(ValueError, match="another prompt list"):
        compare_arms(arms, [p + 10 for p in prompts], max_new_tokens=3, baselines=["base"], progress=False,
                     checkpoint=path)
