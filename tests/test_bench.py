"""python -m ppow_trl.bench on tiny models: outputs, losslessness, tau counting, summary statistics, metric."""

import copy
import json

import numpy as np
import pytest
import torch

from conftest import make_tiny_llama, make_tiny_tokenizer
from ppow_trl.bench import FAST_METHODS, METHODS, BenchDrafter, main, run_benchmark, summarize_records
from ppow_trl.metrics import load_speculative_metric, summarize
from ppow_trl.core.windowing import AdaptiveWindowPolicy

HF_LOOP_METHODS = ("hf_assisted", "hf_heuristic", "hf_confidence", "prompt_lookup", "hook")


def write_prompts(path, count=3):
    with open(path, "w") as file:
        for i in range(count):
            file.write(json.dumps({"id": f"p{i}", "prompt": " ".join(f"w{(7 * i + j) % 56}" for j in range(6))}) + "\n")
    return path


def tiny_target():
    return make_tiny_llama(num_layers=3, seed=0, initializer_range=0.5)


def noisy_copy(model, noise=0.02, seed=1):
    """A drafter that agrees with the target most of the time (so rounds accept tokens), not always."""
    drafter = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=g) * noise)
    return drafter


def available_methods():
    try:
        import ppow_trl.serving.assisted  # noqa: F401
    except ImportError:
        return [m for m in METHODS if m != "hook"]
    return list(METHODS)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One CLI run with every method, both modes, on tiny models (shared by the tests below)."""
    folder = tmp_path_factory.mktemp("bench")
    prompts = write_prompts(folder / "prompts.jsonl")
    target = tiny_target()
    drafters = [BenchDrafter("noisy", noisy_copy(target), AdaptiveWindowPolicy(max_window=4, threshold=0.3))]
    argv = ["--prompts", str(prompts), "--num-prompts", "3", "--max-new-tokens", "16", "--modes", "greedy", "sample",
            "--methods", *available_methods(), "--output", str(folder / "out" / "bench"), "--no-progress",
            "--cost-repeats", "1", "--warmup-tokens", "4"]
    report = main(argv, target=target, tokenizer=make_tiny_tokenizer(), drafters=drafters)
    return report, folder / "out"


def test_writes_json_markdown_png(run):
    report, out = run
    saved = json.loads((out / "bench.json").read_text())
    assert saved["settings"]["command"].startswith("python -m ppow_trl.bench --prompts")
    assert {"torch", "transformers", "torch_threads", "cpu", "platform"} <= set(saved["machine"])
    assert len(saved["records"]) == len(report["records"]) == 3 * 2 * len(available_methods())
    markdown = (out / "bench.md").read_text()
    assert "| greedy | fast_fixed | noisy |" in markdown and "fast_fixed / hf_assisted" in markdown
    assert (out / "bench.png").read_bytes()[:4] == b"\x89PNG"
    assert report["drafters"][0]["cost_ratio"] > 0  # calibrated, reported next to tau


def test_greedy_outputs_are_lossless(run):
    report, _ = run
    greedy = [r for r in report["records"] if r["mode"] == "greedy"]
    assert {r["method"] for r in greedy} == set(available_methods())
    assert all(r["lossless"] for r in greedy), [(r["label"], r["first_mismatch"]) for r in greedy if not r["lossless"]]
    assert all(r["lossless"] is None for r in report["records"] if r["mode"] == "sample")
    rows = [row for row in report["summary"] if row["mode"] == "greedy"]
    assert all(row["lossless"] for row in rows)


def test_tau_counting(run):
    report, _ = run
    records = report["records"]
    for r in records:
        if r["method"] in FAST_METHODS:
            # the hook count agrees with the loop's own stats; tau = generated / verification forwards (rounds)
            assert r["target_forwards"] == r["loop_target_forwards"] == r["rounds"] + 1
            assert r["tau"] == pytest.approx(r["tokens"] / r["rounds"]) == pytest.approx(r["loop_tau"])
            assert len(r["accepted_per_round"]) == r["rounds"]
        elif r["method"] == "target":
            assert r["target_forwards"] == r["verification_forwards"] == r["tokens"] and r["tau"] == 1.0
        else:  # HF's assisted loop: no separate prefill, every forward is a round
            assert r["method"] in HF_LOOP_METHODS
            assert r["verification_forwards"] == r["target_forwards"]
            assert r["tau"] == pytest.approx(r["tokens"] / r["target_forwards"])
    fast = [r for r in records if r["method"] in FAST_METHODS]
    assert max(r["tau"] for r in fast) > 1.2  # the noisy drafter is accepted: rounds yield several tokens
    same_k = [r for r in records if r["method"] in ("fast_fixed", "hf_assisted") and r["mode"] == "greedy"]
    by_method = {m: sum(r["target_forwards"] - (m == "fast_fixed") for r in same_k if r["method"] == m)
                 for m in ("fast_fixed", "hf_assisted")}
    assert by_method["fast_fixed"] == by_method["hf_assisted"]  # same drafter, same K, greedy: same rounds


def test_summary_statistics_match_numpy(run):
    report, _ = run
    records = report["records"]
    for row in report["summary"]:
        group = [r for r in records if r["mode"] == row["mode"] and r["label"] == row["label"]]
        speedups = [r["speedup"] for r in group]
        assert row["num_prompts"] == len(group) == 3
        assert row["speedup_median"] == pytest.approx(np.median(speedups))
        assert row["speedup_p25"] == pytest.approx(np.percentile(speedups, 25))
        assert row["speedup_p75"] == pytest.approx(np.percentile(speedups, 75))
        assert row["tokens_per_second_median"] == pytest.approx(np.median([r["tokens_per_second"] for r in group]))
        tokens, forwards = sum(r["tokens"] for r in group), sum(r["verification_forwards"] for r in group)
        assert row["tau"] == pytest.approx(tokens / forwards)
        assert row["tau_mean"] == pytest.approx(np.mean([r["tau"] for r in group]))
        if row["method"] in FAST_METHODS:
            assert sum(row["acceptance_histogram"]) == sum(r["rounds"] for r in group)
            assert sum(row["window_length_histogram"]) == sum(r["rounds"] for r in group)
    assert summarize_records(records) == report["summary"]


def test_evaluate_metric_loads_offline_and_matches_summary(run, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    report, _ = run
    records = report["records"]
    row = next(r for r in report["summary"] if r["method"] == "fast_adaptive" and r["mode"] == "greedy")
    group = [r for r in records if r["mode"] == "greedy" and r["label"] == row["label"]]
    baseline = {r["prompt_index"]: r for r in records if r["mode"] == "greedy" and r["method"] == "target"}
    metric = load_speculative_metric(keep_in_memory=True)
    result = metric.compute(
        generated_tokens=[r["tokens"] for r in group],
        target_forwards=[r["verification_forwards"] for r in group],
        seconds=[r["seconds"] for r in group],
        baseline_tokens=[baseline[r["prompt_index"]]["tokens"] for r in group],
        baseline_seconds=[baseline[r["prompt_index"]]["seconds"] for r in group],
    )
    for key in ("tau", "tau_mean", "speedup_median", "speedup_p25", "speedup_p75", "tokens_per_second_median"):
        assert result[key] == pytest.approx(row[key]), key
    assert "prefill" in result["tau_convention"]


def test_summarize_pools_tau_and_checks_inputs():
    result = summarize([64, 60], [32, 40], [2.0, 2.5], baseline_tokens=[64, 60], baseline_seconds=[4.0, 3.0])
    assert result["tau"] == pytest.approx(124 / 72) and result["tau_mean"] == pytest.approx(1.75)
    assert result["speedup_median"] == pytest.approx(np.median([2.0, 24 / 20]))
    assert summarize([5], [5], [1.0])["speedup_median"] is None
    with pytest.raises(ValueError, match="one per prompt"):
        summarize([1, 2], [1], [1.0, 1.0])
    with pytest.raises(ValueError, match="> 0"):
        summarize([1], [1], [0.0])


def test_cli_builds_drafters_from_folder_and_layers(tmp_path):
    """--drafter FOLDER (its saved policy) and --drafter-layers N (the CLI's own policy) on a given target."""
    target = tiny_target()
    folder = tmp_path / "drafter"
    noisy_copy(target).save_pretrained(folder)
    AdaptiveWindowPolicy(max_window=3, threshold=0.25).save_pretrained(folder)
    argv = ["--prompts", str(write_prompts(tmp_path / "p.jsonl", 2)), "--num-prompts", "2", "--max-new-tokens", "8",
            "--modes", "greedy", "--methods", "fast_adaptive", "hf_assisted", "--drafter", str(folder),
            "--drafter-layers", "2", "--max-window", "5", "--threshold", "0.1", "--cost-repeats", "0",
            "--output", str(tmp_path / "out" / "b"), "--no-progress"]
    report = main(argv, target=target, tokenizer=make_tiny_tokenizer())
    policies = {d["name"]: {k: d["policy"][k] for k in ("max_window", "threshold")} for d in report["drafters"]}
    assert policies == {"drafter": {"max_window": 3, "threshold": 0.25}, "layers2": {"max_window": 5, "threshold": 0.1}}
    assert all(d["policy"]["confidence_temperature"] == 1.0 for d in report["drafters"])
    assert report["settings"]["methods"] == ["target", "fast_adaptive", "hf_assisted"]  # target always runs
    assert all(r["lossless"] for r in report["records"])
    assert (tmp_path / "out" / "b.json").is_file()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompts", "missing.jsonl"], "--prompts missing.jsonl: no such file"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be a positive integer"),
        (["--max-new-tokens", "-3"], "--max-new-tokens must be a positive integer"),
        (["--drafter", "no/such/folder"], "--drafter no/such/folder: no such folder"),
    ],
)
def test_bad_arguments_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as error:
        main(argv)  # fails while parsing: no model is loaded
    assert error.value.code == 2
    assert message in capsys.readouterr().err


def test_run_benchmark_checks_its_inputs():
    target, tokenizer = tiny_target(), make_tiny_tokenizer()
    prompts = [{"messages": [{"role": "user", "content": "w1 w2"}]}]
    drafter = BenchDrafter("d", noisy_copy(target), AdaptiveWindowPolicy(max_window=2))
    with pytest.raises(ValueError, match="max_new_tokens must be a positive integer"):
        run_benchmark(target, tokenizer, [drafter], prompts, max_new_tokens=0)
    with pytest.raises(ValueError, match="need a drafter"):
        run_benchmark(target, tokenizer, [], prompts, methods=["target", "fast_fixed"], max_new_tokens=4)
    with pytest.raises(ValueError, match="methods must be among"):
        run_benchmark(target, tokenizer, [drafter], prompts, methods=["medusa"], max_new_tokens=4)
    with pytest.raises(ValueError, match="No prompts"):
        run_benchmark(target, tokenizer, [drafter], [], max_new_tokens=4)


def test_long_recipe_record_reads_a_real_serving_result():
    """benchmarks/long_recipe.py's summary of a compiled_serving.py result (a committed one): the served rule's and the
    hybrid's figures against compiled plain decoding, per prompt set, with the training run's tokens and hours."""
    import importlib.util
    import json
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("long_recipe", repo / "benchmarks" / "long_recipe.py")
    long_recipe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(long_recipe)
    serving = json.loads((repo / "benchmarks" / "results" / "compiled_serving_xeon_amx_eagle3.json").read_text())
    summary = {"train_tokens": 2_000_000, "minutes": 171.0, "cpu": {"model": "x"}, "config": {}}
    record = long_recipe.long_recipe_record(summary, serving, "eagle3")
    arm = serving["runs"]["threads1/mtbench"]["arms"]["compiled_speculative[eagle3]"]
    assert record["hours"] == 2.85 and record["train_tokens"] == 2_000_000
    assert record["mtbench"]["speedup"] == arm["speedup_vs_reference"] and record["mtbench"]["tau"] == arm["tau"]
    assert record["mtbench"]["lossless_prompts"] == arm["lossless_prompts"]
    assert "with_hybrid" not in record["code"]  # that file's hybrid is the standalone drafter's, not the head's
    assert record["code"]["with_prompt_lookup"]["speedup"] == (
        serving["runs"]["threads1/code"]["arms"]["compiled_speculative[prompt_lookup]"]["speedup_vs_reference"])
    assert record["mtbench"]["rule"].startswith("No speculation")  # that run served K = 0
    standalone = long_recipe.long_recipe_record(summary, serving, "standalone")
    assert standalone["mtbench"]["speedup"] == (
        serving["runs"]["threads1/mtbench"]["arms"]["compiled_speculative[ppow]"]["speedup_vs_reference"])
    assert standalone["code"]["with_hybrid"]["speedup"] == (
        serving["runs"]["threads1/code"]["arms"]["compiled_speculative[hybrid]"]["speedup_vs_reference"])


def test_data_routes_spend_a_budget_slice_by_slice():
    """benchmarks/data_routes.py: slices are built until the budget is spent (the last one that starts finishes);
    slices an earlier run built count at their recorded cost, not at the speed of reading them back."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "data_routes", Path(__file__).resolve().parents[1] / "benchmarks" / "data_routes.py")
    routes = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(routes)
    built = []

    def build(i):
        built.append(i)
        return f"slice{i}", 0.01 if i < 2 else 40.0  # 0 and 1 read back from a cache, the others built

    recorded = [40.0, 40.0]
    parts, seconds = routes.spend(100.0, 10, build, recorded)
    assert parts == ["slice0", "slice1", "slice2"] and seconds == [40.0, 40.0, 40.0] and recorded == seconds
    assert routes.spend(100.0, 2, build, [])[1] == [0.01, 0.01]  # the slices ran out first
