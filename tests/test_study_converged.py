"""The converged study end to end on tiny budgets (ppow_trl.study.converged): KD to convergence with early stopping,
arms from the converged drafter, and the summary with intervals and paired ratios."""

from __future__ import annotations

import json

import pytest

from ppow_trl.study.converged import (
    ConvergedConfig,
    arm_finished,
    converge,
    converged_finished,
    run_arm,
)
from ppow_trl.study.converged_report import write_report


@pytest.mark.slow
def test_smoke_converge_then_arms_then_summary(tmp_path):
    config = ConvergedConfig.smoke()
    results, work = tmp_path / "results", tmp_path / "work"
    converged = converge("truncated", config, results, work)
    assert converged_finished("truncated", config, results)
    assert converged["budget"]["optimizer_steps"] <= dict(config.max_kd_steps)["truncated"]
    assert converged["curve"] and all("held_out_tau_fixed_k" in row for row in converged["curve"])
    assert (work / "truncated_converged" / "ppow_window_policy.json").is_file()
    for arm in ("kd_more", "ppow_cache", "on_policy"):
        result = run_arm("truncated", arm, 0, config, results, work)
        assert arm_finished("truncated", arm, 0, config, results)
        assert result["budget"]["train_step_seconds"] >= config.extra_seconds
        assert result["budget"]["optimizer_steps"] >= 1
        assert set(result["evaluation"]["sampling"]) == {"mtbench", "sharegpt_test"}
    ppow = json.loads((results / "arms" / "truncated_ppow_cache_s0.json").read_text())
    shares = [row["ppow/target_verified_share"] for row in ppow["train_log"] if "ppow/target_verified_share" in row]
    assert shares and max(shares) < 1.0  # the cache served the rewards
    summary = write_report(results, tmp_path / "BENCHMARKS.md")
    rows = summary["families"]["truncated"]
    assert set(rows) == {"converged", "kd_more", "ppow_cache", "on_policy"}
    greedy = rows["ppow_cache"]["evaluation"]["mtbench"]["greedy, fixed K"]
    assert {"expected_accepted", "ci", "per_seed", "ratio_to_kd_more", "predicted_speedup"} <= set(greedy)
    assert "converged-study:start" in (tmp_path / "BENCHMARKS.md").read_text()
    assert json.loads((results / "summary.json").read_text()) == json.loads(json.dumps(summary))
