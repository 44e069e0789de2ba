"""The converged study's report: ``summary.json``, the tau-curve plot and the generated BENCHMARKS.md section.

E[A] is pooled over seeds: each prompt's accepted tokens and rounds are summed over the seeds' records, so a ratio of
sums over prompts remains, with a percentile bootstrap over prompts (2000 resamples). The ratio to KD continued is
paired (the same prompts resampled for both). The seed spread is the E[A] of each seed separately.
"""

from __future__ import annotations

import json
from pathlib import Path

from .evaluate import SAMPLES_PER_CONTEXT, bootstrap_interval, paired_ratio_interval, ratio_of_sums

BASELINE = "kd_more"
START = "converged"
SECTION_START = "<!-- converged-study:start -->"
SECTION_END = "<!-- converged-study:end -->"
MODES = {("greedy", "fixed_k"): "greedy, fixed K", ("greedy", "policy"): "greedy, calibrated rule",
         ("sampling", "fixed_k"): "T = 1, fixed K", ("sampling", "policy"): "T = 1, calibrated rule"}


def load_results(results: Path) -> dict:
    """``{family: {"converged": result, "arms": {arm: {seed: result}}}}``."""
    out: dict = {}
    for path in sorted(results.glob("converged_*.json")):
        family = path.stem[len("converged_"):]
        out.setdefault(family, {"arms": {}})["converged"] = json.loads(path.read_text())
    for path in sorted((results / "arms").glob("*.json")):
        result = json.loads(path.read_text())
        family, seed = result["family"], result["seed"]
        arm = result["arm"][len(family) + 1:]
        out.setdefault(family, {"arms": {}})["arms"].setdefault(arm, {})[seed] = result
    return out


# T = 1 records drawn with fewer windows per prompt than the study's are left out (too noisy to compare)


def _records(result: dict, mode: str, test_set: str, rule: str) -> list[dict] | None:
    if mode == "sampling" and result.get("sampling_samples_per_context") != SAMPLES_PER_CONTEXT:
        return None
    return (result["evaluation"].get(mode, {}).get(test_set) or {}).get(rule)


def _pooled(records_by_seed: list[list[dict]]) -> list[dict]:
    """Per prompt: accepted and rounds summed over seeds."""
    return [{"accepted": sum(r[i]["accepted"] for r in records_by_seed),
             "rounds": sum(r[i]["rounds"] for r in records_by_seed)} for i in range(len(records_by_seed[0]))]


def summarize(results: Path) -> dict:
    """``summary.json``: per family, arm, test set and serving mode, E[A] with its interval, the per-seed E[A], and
    the paired ratio to KD continued with its interval; plus budgets and cost-model predictions."""
    data = load_results(results)
    summary = {"convention": "E[A] = accepted drafted tokens per verification round (tau = E[A] + 1 greedy); pooled "
                             "over seeds, 95% percentile bootstrap over prompts; ratios paired with kd_more",
               "families": {}}
    for family, parts in data.items():
        arms = {START: {0: parts["converged"]}} if "converged" in parts else {}
        arms.update(parts["arms"])
        rows = {}
        for arm, by_seed in arms.items():
            seeds = sorted(by_seed)
            first = by_seed[seeds[0]]
            entry = {"seeds": seeds, "budget": {s: by_seed[s]["budget"] for s in seeds}, "evaluation": {}}
            cost = first["cost_model"]
            for (mode, rule), label in MODES.items():
                for test_set in ("mtbench", "sharegpt_test"):
                    per_seed = [_records(by_seed[s], mode, test_set, rule) for s in seeds]
                    if any(r is None for r in per_seed):
                        continue
                    pooled = _pooled(per_seed)
                    value = {"expected_accepted": ratio_of_sums(pooled, "accepted"),
                             "ci": bootstrap_interval(pooled, "accepted"),
                             "per_seed": [ratio_of_sums(r, "accepted") for r in per_seed]}
                    base = arms.get(BASELINE)
                    if base and arm != BASELINE:
                        # the same seeds on both sides; the single converged start is paired with every KD seed
                        shared = sorted(base) if arm == START else [s for s in seeds if s in base]
                        ours = per_seed * len(shared) if arm == START else [per_seed[seeds.index(s)] for s in shared]
                        theirs = [_records(base[s], mode, test_set, rule) for s in shared]
                        if shared and all(r is not None for r in theirs):
                            value["ratio_to_kd_more"] = paired_ratio_interval(_pooled(ours), _pooled(theirs),
                                                                              "accepted")
                    if mode == "greedy" and rule == "fixed_k":
                        k = first["config"]["eval_max_window"]
                        verify = cost["verify_cost"][k] if k < len(cost["verify_cost"]) else None
                        if verify is not None:
                            value["predicted_speedup"] = (value["expected_accepted"] + 1) / (
                                k * cost["drafter_cost"] + verify)
                    entry["evaluation"].setdefault(test_set, {})[label] = value
            rows[arm] = entry
        summary["families"][family] = rows
    return summary


def _fmt(value: dict | None, key: str = "expected_accepted") -> str:
    if not value:
        return "-"
    point, ci = value.get(key), value.get("ci")
    if point is None:
        return "-"
    return f"{point:.3f} [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else f"{point:.3f}"


def tables(summary: dict) -> str:
    lines = []
    for family, rows in summary["families"].items():
        for test_set in ("mtbench", "sharegpt_test"):
            lines += [f"**{family}, {test_set}**: E[A] (pooled over seeds, 95% CI) / ratio to KD continued (paired CI)",
                      "", "| arm | steps | " + " | ".join(MODES.values()) + " |",
                      "|---|---|" + "---|" * len(MODES)]
            for arm, entry in rows.items():
                steps = "/".join(str(b.get("optimizer_steps", "-")) for b in entry["budget"].values())
                cells = []
                for label in MODES.values():
                    value = entry["evaluation"].get(test_set, {}).get(label)
                    if value is None:
                        cells.append("-")
                        continue
                    seeds = ", ".join(f"{v:.3f}" for v in value["per_seed"])
                    ratio = value.get("ratio_to_kd_more")
                    ratio_text = f"<br>x{_fmt(ratio, 'ratio')}" if ratio and ratio.get("ratio") is not None else ""
                    cells.append(f"{_fmt(value)}<br>seeds {seeds}{ratio_text}")
                lines.append(f"| {arm} | {steps} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plot_curves(results: Path, out: Path) -> None:
    """Held-out tau (fixed K, 48 held-out responses) from the converged point on, per family and arm (mean of seeds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = load_results(results)
    fig, axes = plt.subplots(1, max(len(data), 1), figsize=(6 * max(len(data), 1), 4), squeeze=False)
    for ax, (family, parts) in zip(axes[0], data.items()):
        for arm, by_seed in sorted(parts["arms"].items()):
            for seed, result in sorted(by_seed.items()):
                curve = result["curve"]
                ax.plot([row["train_seconds"] for row in curve], [row["held_out_tau_fixed_k"] for row in curve],
                        label=f"{arm} s{seed}", linestyle="-" if seed == 0 else "--")
        ax.set_title(f"{family}: from the converged drafter")
        ax.set_xlabel("extra optimizer-step seconds")
        ax.set_ylabel("held-out exact greedy tau (K = 4)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def write_report(results: Path, benchmarks_md: Path) -> dict:
    results = Path(results)
    summary = summarize(results)
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    if not summary["families"]:
        return summary
    plot_curves(results, results / "tau_after_convergence.png")
    reading = results / "reading.md"
    section = "\n".join([
        SECTION_START,
        "## The converged study (generated by `python benchmarks/study_converged.py --report-only`)",
        "",
        tables(summary),
        f"![held-out tau after convergence]({results / 'tau_after_convergence.png'})",
        "",
        reading.read_text() if reading.is_file() else "",
        SECTION_END,
    ])
    path = Path(benchmarks_md)
    text = path.read_text() if path.is_file() else ""
    if SECTION_START in text:
        head, rest = text.split(SECTION_START, 1)
        tail = rest.split(SECTION_END, 1)[1] if SECTION_END in rest else ""
        text = head + section + tail
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    path.write_text(text)
    return summary
