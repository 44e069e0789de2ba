"""The study's measurement pieces (`ppow_trl.study`): budgets, per-prompt acceptance, intervals, report."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import make_bigram_llama, make_tiny_llama, make_tiny_tokenizer
from datasets import Dataset

from ppow_trl.serving.calibration import held_out_contexts
from ppow_trl.serving.generation import speculative_generate
from ppow_trl.study.budget import TrainingBudget
from ppow_trl.study.evaluate import (
    bootstrap_interval,
    greedy_records,
    paired_ratio_interval,
    ratio_of_sums,
    sampled_records,
    summarize,
)
from ppow_trl.core.windowing import AdaptiveWindowPolicy


def _records(seed, n=40, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    rounds = torch.randint(5, 30, (n,), generator=g)
    accepted = (rounds.float() * scale * torch.rand(n, generator=g)).round().long()
    return [{"tokens": int(a + r), "rounds": int(r), "accepted": int(a), "histogram": [int(r - a), int(a)]}
            for a, r in zip(accepted, rounds)]


def test_bootstrap_interval_equals_brute_force_resampling():
    records = _records(0)
    samples, seed = 300, 7
    index = torch.randint(len(records), (samples, len(records)), generator=torch.Generator().manual_seed(seed))
    brute = []
    for row in index.tolist():  # one resample at a time, the ratio of sums by hand
        brute.append(sum(records[i]["accepted"] for i in row) / sum(records[i]["rounds"] for i in row))
    brute = torch.tensor(brute, dtype=torch.float64)
    expected = [float(torch.quantile(brute, 0.025)), float(torch.quantile(brute, 0.975))]
    assert bootstrap_interval(records, "accepted", samples=samples, seed=seed) == pytest.approx(expected, abs=1e-12)
    point = ratio_of_sums(records, "accepted")
    assert expected[0] < point < expected[1]


def test_paired_ratio_interval():
    a, b = _records(1, scale=1.0), _records(1, scale=0.5)  # same prompts (rounds), b accepts about half as much
    same = paired_ratio_interval(a, a, "accepted")
    assert same["ratio"] == pytest.approx(1.0) and same["ci"] == pytest.approx([1.0, 1.0])
    better = paired_ratio_interval(a, b, "accepted")
    assert better["ratio"] == pytest.approx(ratio_of_sums(a, "accepted") / ratio_of_sums(b, "accepted"))
    assert 1.0 < better["ci"][0] <= better["ratio"] <= better["ci"][1] and better["p_ratio_above_1"] == 1.0
    # Pairing: the interval of a ratio of two strongly correlated arms is narrower than unpaired resampling.
    c = [dict(r, accepted=r["accepted"] + (i % 2)) for i, r in enumerate(a)]
    paired = paired_ratio_interval(c, a, "accepted")["ci"]
    assert paired[1] - paired[0] < 0.1
    with pytest.raises(ValueError, match="same prompts"):
        paired_ratio_interval(a, a[:-1], "accepted")


def test_summarize_histogram_and_acceptance_curve():
    records = [{"tokens": 7, "rounds": 4, "accepted": 3, "histogram": [2, 1, 0, 1]},
               {"tokens": 3, "rounds": 2, "accepted": 1, "histogram": [1, 1]}]
    summary = summarize(records)
    assert summary["tau"] == pytest.approx(10 / 6) and summary["expected_accepted"] == pytest.approx(4 / 6)
    assert summary["histogram"] == [3, 2, 0, 1]
    assert summary["p_accept_at_least"] == pytest.approx([3 / 6, 1 / 6, 1 / 6])


def test_greedy_records_equal_the_live_loop():
    """Per-prompt sums of greedy_records (from the target's greedy text) = the live loop's, prompt by prompt."""
    target = make_tiny_llama(num_layers=2, seed=3, tie_word_embeddings=False)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)
    drafter = make_tiny_llama(num_layers=1, seed=3, tie_word_embeddings=False)
    drafter.load_state_dict(target.state_dict(), strict=False)  # a 1-layer copy: right often, not always
    policy = AdaptiveWindowPolicy(4, 0.2)
    g = torch.Generator().manual_seed(0)
    prompts, responses, live = [], [], []
    for _ in range(6):
        prompt = torch.randint(8, 64, (1, 5), generator=g)
        out = speculative_generate(target, drafter, prompt, policy=policy, max_new_tokens=20, eos_token_id=[3])
        prompts.append(prompt[0].tolist())
        responses.append(out.new_tokens)
        live.append(out)
    data = Dataset.from_dict({"prompt_ids": prompts, "response_ids": responses})
    records = greedy_records(target, drafter, data, policy, max_new_tokens=20, eos_token_ids=[3], vocab_size=64)
    for record, out in zip(records, live):
        assert record["tokens"] == len(out.new_tokens) and record["rounds"] == len(out.accepted_per_round)
        assert record["accepted"] == sum(out.accepted_per_round)
    assert sum(r["accepted"] for r in records) > 0  # the drafter is right sometimes: the check is not vacuous


def test_sampled_records_match_the_live_loop_in_expectation():
    """Monte Carlo: E[A|y] of windows sampled after a context = the live loop's mean accepted tokens in its
    first round from that context, at T = 1, for a fixed and an adaptive window."""
    g = torch.Generator().manual_seed(0)
    target = make_bigram_llama(torch.randn(8, 8, generator=g) * 1.5)
    drafter = make_bigram_llama(torch.randn(8, 8, generator=g) * 1.5)
    prompt, response = [1, 2], [3, 4, 5, 1, 2, 3]
    n = 600
    data = Dataset.from_dict({"prompt_ids": [prompt] * n, "response_ids": [response] * n})
    policies = {"fixed": AdaptiveWindowPolicy(3), "adaptive": AdaptiveWindowPolicy(3, 0.4)}
    sampled = sampled_records(target, drafter, data, policies, max_window=3, vocab_size=8, pad_id=0, seed=1)
    context = held_out_contexts([prompt], [response], per_response=3)[1][None]  # what sampled_records uses
    assert context[0, -1] == response[0]
    generator = torch.Generator().manual_seed(2)
    for name, policy in policies.items():
        live = torch.tensor([
            speculative_generate(target, drafter, context, policy=policy, max_new_tokens=4, do_sample=True,
                                 eos_token_id=[], generator=generator).accepted_per_round[0]
            for _ in range(n)], dtype=torch.float64)
        estimate = torch.tensor([r["accepted"] for r in sampled[name]], dtype=torch.float64)
        standard_error = math.sqrt(live.var() / n + estimate.var() / n)
        assert abs(live.mean() - estimate.mean()) < 4 * standard_error, name
        assert estimate.var() < live.var()  # closed form: less variance than the live loop
    assert sum(r["drafted"] for r in sampled["adaptive"]) < 3 * n  # the threshold shortens some windows
    # several windows per prompt: one record per prompt, the same expectation, less spread between prompts
    pooled = sampled_records(target, drafter, data.select(range(150)), policies, max_window=3, vocab_size=8, pad_id=0,
                             seed=1, samples_per_context=4)
    for name in policies:
        one = torch.tensor([r["accepted"] for r in sampled[name]], dtype=torch.float64)
        four = torch.tensor([r["accepted"] for r in pooled[name]], dtype=torch.float64)
        assert len(four) == 150 and abs(four.mean() - one.mean()) < 4 * math.sqrt(one.var() / n + four.var() / 150)
        assert four.var() < 0.5 * one.var(), name


def test_training_budget_stops_probes_and_runs_milestones(tmp_path):
    from transformers import TrainerCallback, set_seed

    from ppow_trl.data import build_target_responses, compute_target_topk
    from ppow_trl.training.kd_trainer import KDConfig, KDTrainer
    from ppow_trl.models import make_drafter

    set_seed(0)
    tokenizer = make_tiny_tokenizer()
    target = make_tiny_llama(num_layers=2, seed=0, initializer_range=0.5)
    rows = [{"id": str(i), "messages": [{"role": "user", "content": f"w{i} w{i + 1}"}]} for i in range(8)]
    data = compute_target_topk(target, build_target_responses(target, tokenizer, Dataset.from_list(rows),
                                                              max_new_tokens=8, batch_size=8), top_k=8)
    probes, saved, step_ends = [], [], []
    budget = TrainingBudget(1.0, probe=lambda model: probes.append(model.training) or {"value": len(probes)},
                            probe_every=0.3, milestones={0.5: lambda model: saved.append(budget.elapsed)})

    class StepLog(TrainerCallback):  # runs after `budget`: the budget's step time at the end of every step
        def on_step_end(self, args, state, control, **kwargs):
            step_ends.append((state.global_step, budget.elapsed))

    args = KDConfig(output_dir=str(tmp_path), max_steps=10**6, per_device_train_batch_size=4, report_to="none",
                    save_strategy="no", disable_tqdm=True, use_cpu=True, logging_steps=10**6)
    trainer = KDTrainer(make_drafter(target, num_layers=1).train(), args, train_dataset=data,
                        processing_class=tokenizer, callbacks=[budget, StepLog()])
    trainer.train()
    # The budget, not max_steps, ended training, at the first step whose accumulated step time reached 1 s
    # (no wall-clock bound: how many steps that takes depends on the machine's load).
    steps, elapsed = [step for step, _ in step_ends], [seconds for _, seconds in step_ends]
    assert 0 < trainer.state.global_step < 10**6 and steps == list(range(1, trainer.state.global_step + 1))
    assert all(later > earlier for earlier, later in zip(elapsed, elapsed[1:]))  # every step adds time
    assert elapsed[-1] == budget.elapsed >= 1.0 and all(seconds < 1.0 for seconds in elapsed[:-1])
    history = budget.history
    assert history[0]["train_seconds"] == 0 and history[0]["step"] == 0
    assert history[-1]["train_seconds"] >= 1.0 and history[-1]["step"] == trainer.state.global_step
    assert [row["value"] for row in history] == list(range(1, len(history) + 1))
    assert all(later["step"] > earlier["step"] for earlier, later in zip(history, history[1:]))
    assert all(later["train_seconds"] >= earlier["train_seconds"] for earlier, later in zip(history, history[1:]))
    # A probe every time the step time crosses a multiple of 0.3 s (several multiples crossed in one step: one
    # probe), besides the first and the last row: counted from the step times the log recorded.
    before_stop = [0.0] + elapsed[:-1]
    crossings = sum(int(later // 0.3) > int(earlier // 0.3) for earlier, later in zip(before_stop, before_stop[1:]))
    assert len(history) == 2 + crossings
    assert len(saved) == 1 and saved[0] >= 0.5
    with pytest.raises(ValueError, match="> 0 seconds"):
        TrainingBudget(0)


def _fake_arm(name, scale, seed):
    greedy = {test: {key: _records(seed, n=12, scale=scale) for key in ("policy", "fixed_k")}
              for test in ("mtbench", "sharegpt_test")}
    sampling = {"mtbench": {key: [{"accepted": 0.1 * scale * (i % 3), "rounds": 1} for i in range(12)]
                            for key in ("policy", "fixed_k")}}
    return {"arm": name, "description": name, "config": {"drafter_layers": 2, "draft_vocab_size": 8192,
            "data": {"num_train_prompts": 10, "train_max_new_tokens": 8, "num_calibration": 2},
            "budget_seconds": 10.0, "warm_seconds": 5.0},
            "budget": {"train_step_seconds": 10.0, "optimizer_steps": 3, "trained_positions": 100},
            "curve": [{"train_seconds": 0.0, "step": 0, "held_out_tau_fixed_k": 1.0},
                      {"train_seconds": 10.0, "step": 3, "held_out_tau_fixed_k": 1.0 + scale / 10}],
            "policy": {"max_window": 3, "threshold": 0.2, "confidence_temperature": 1.0,
                       "calibration": {"predicted_speedup": 0.8}},
            "cost_model": {"drafter_cost": 0.1, "verify_cost": [1.0, 1.5]},
            "evaluation": {"greedy": greedy, "sampling": sampling},
            "machine": {"threads": 1, "platform": "test", "torch": torch.__version__}}


def test_report_is_generated_from_the_json_and_replaces_its_section(tmp_path):
    from ppow_trl.study.report import BEGIN, END, write_report

    (tmp_path / "arms").mkdir()
    for name, scale, seed in (("kd", 0.5, 1), ("ppow", 1.0, 1)):
        (tmp_path / "arms" / f"{name}.json").write_text(json.dumps(_fake_arm(name, scale, seed)))
    markdown = tmp_path / "BENCHMARKS.md"
    markdown.write_text(f"# Benchmarks\n\nbefore\n\n{BEGIN}\nold\n{END}\n\nafter\n")
    summary = write_report(tmp_path, markdown, reading="The reading.")
    text = markdown.read_text()
    assert "before" in text and "after" in text and "old" not in text and text.count(BEGIN) == 1
    assert "The reading." in text and "| ppow |" in text
    ratio = summary["ppow"]["greedy"]["mtbench"]["policy"]["ratio_to_kd"]["expected_accepted"]
    assert ratio["ratio"] == pytest.approx(ratio_of_sums(_records(1, 12, 1.0), "accepted")
                                           / ratio_of_sums(_records(1, 12, 0.5), "accepted"))
    assert f"{ratio['ratio']:.2f}" in text
    assert (tmp_path / "tau_over_training.png").is_file() and (tmp_path / "acceptance.png").is_file()
    write_report(tmp_path, markdown, reading="The reading.")
    assert markdown.read_text() == text  # regenerating is idempotent
    with pytest.raises(FileNotFoundError, match="study.py"):
        write_report(tmp_path / "empty", None)


def test_each_drafter_family_has_its_own_warm_start():
    """PPOW arms continue their own family's KD arm (never another family's), and the report lists each warm
    start before the PPOW arms that use it."""
    from ppow_trl.drafting import family_names
    from ppow_trl.study.arms import ARMS, ORDER, warm_start_of
    from ppow_trl.study.report import ARM_ORDER

    for name, arm in ARMS.items():
        assert arm.family in family_names() and (arm.kind == "eval") == (arm.drafter not in ("truncated", "eagle3",
                                                                                             "dflash"))
        if arm.starts_from_warm:
            assert ARMS[arm.kd_arm].drafter == arm.drafter and ORDER.index(arm.kd_arm) < ORDER.index(name)
            assert ARM_ORDER.index(warm_start_of(arm.drafter)) < ARM_ORDER.index(name)
    assert [n for n in ARMS if ARMS[n].saves_warm_start] == ["kd", "eagle3_kd", "dflash_kd"]
    assert warm_start_of("eagle3") == "eagle3_kd_warm" and warm_start_of("truncated") == "kd_warm"
