"""The converged study's report: ``summary.json``, the tau-curve plot and the generated section of docs/benchmarks.md.

``section`` builds the section from the summary and the result files; ``tools/render_numbers.py`` (which regenerates
the whole page) calls it too, so both give the same text.

E[A] is pooled over seeds: each prompt's accepted tokens and rounds are summed over the seeds' records, so a ratio of
sums over prompts remains, with a percentile bootstrap over prompts (2000 resamples). The ratio to KD continued is
paired (the same prompts resampled for both). The seed spread is the E[A] of each seed separately.
"""

from __future__ import annotations

import json
from pathlib import Path

from .report import machine_text
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


# The reading of the tables, without figures: every number on the page is generated from the JSON. The notes written
# when the runs finished (with the figures of that day, typed by hand) stay in ``<results>/reading.md``.
READING = """### What the converged study shows

- **KD has converged.** Continuing KD from the converged point (`kd_more`) barely moved greedy E[A] and did not
  raise T = 1 E[A]: this is the regime the question is about, a drafter that imitation no longer improves.
- **PPOW with T = 1 rewards (`ppow_t1`) is the best PPOW arm** for the truncated drafter: above KD continued in every
  cell of its tables, with intervals above 1 at T = 1 on both test sets and at or near 1 greedy. Its seeds agree
  closely (per-seed values in the cells).
- **Against on-policy distillation** (`on_policy`): about even greedy, PPOW clearly better at T = 1. On-policy
  distillation is the best greedy arm and the worst T = 1 arm: its forward KL + TV on the drafter's own windows
  sharpens the argmax and lowers T = 1 acceptance below KD continued on ShareGPT; PPOW's reward is the serving
  quantity, so it improves both modes.
- **Cached greedy rewards** (`ppow_cache`; their throughput in "Cache rewards") bought several times the optimizer
  steps of the T = 1 arm (steps column) and did not turn them into more acceptance: the greedy reward is 0/1 per
  position and most windows of a converged small drafter earn A = 0 or 1, so the group advantage is sparse, while
  E[A|y] is a smooth function of the same window. The dense per-position credit (`ppow_dense`) did not change that.
- **EAGLE-3 head**: only KD continued and PPOW with cached rewards were run; they tie. PPOW got few optimizer steps in
  its budget because the head needs the target's hidden states for every rollout context and selection refresh (one
  target forward each); serving the features from the cache too is the change most likely to let PPOW refine it.

What limits the answer: wall-clock budgets on a shared machine (the same seconds gave different seeds different step
counts: steps column); the seeds listed above are the minimum asked for, not a precise spread; the greedy gains are
small in absolute terms for a small truncated drafter of a much deeper target, far from the paper's regime, so these
are relative figures about training signals, not a speedup claim (every predicted speedup stays below 1x on this
CPU; the cost models here were measured while other runs shared the machine: use "Cost model" for speed); the
converged EAGLE-3 head was capped, not early-stopped (the converged points table).

Adopted: the long recipe (`recipes/configs/offline_smollm2_long.yaml`) refines its converged KD drafter with T = 1
rewards; the main job keeps cached greedy rewards (greedy serving and a budget of minutes, where T = 1 rewards cost
several times more per step for little gain).

The notes written when the runs finished, with the figures of that day, are kept in
`benchmarks/results/study_converged/reading.md` (not generated: the tables above are the reference)."""


def _curve_tau(row: dict | None) -> str:
    return "-" if row is None else f"{row['held_out_tau_fixed_k']:.3f}"


def _converged_points(results: Path) -> list[str]:
    """Per family: where KD stopped (early stopping on held-out tau, or the step cap) and the curve's best point."""
    data = load_results(results)
    lines = ["**Converged points** (KD with early stopping on held-out exact greedy tau at fixed K; the best checkpoint "
             "is the start of every arm)", "",
             "| family | optimizer steps | step cap | stopped early | best step | held-out tau at the best step | "
             "held-out tau at the last step | trained positions |", "|---|---|---|---|---|---|---|---|"]
    rows = 0
    for family, parts in data.items():
        converged = parts.get("converged")
        if not converged:
            continue
        budget, curve = converged["budget"], converged.get("curve") or []
        best = next((row for row in curve if row.get("step") == budget.get("best_step")), None)
        last = curve[-1] if curve else None
        stopped = budget.get("stopped_early")
        stopped = "-" if stopped is None else ("yes" if stopped else "no (step cap)")
        positions = f"{budget['trained_positions']:,}" if "trained_positions" in budget else "-"
        lines.append(f"| {family} | {budget.get('optimizer_steps', '-')} | {budget.get('max_steps', '-')} | {stopped} | "
                     f"{budget.get('best_step', '-')} | {_curve_tau(best)} | {_curve_tau(last)} | {positions} |")
        rows += 1
    return lines + [""] if rows else []


_PROMPT_SETS = {"mtbench": "MT-bench", "code": "code"}


def _wallclock(wallclock: dict | None) -> list[str]:
    if not wallclock:
        return []
    settings = wallclock.get("settings", {})
    lines = ["**Measured speed of the best arm of each family** (`ppow_trl.bench`, "
             f"{settings.get('num_prompts', '-')} {_PROMPT_SETS.get(settings.get('prompts'), settings.get('prompts', ''))} "
             "prompts, "
             f"{settings.get('max_new_tokens', '-')} new tokens, {settings.get('precision', '')}, "
             f"{settings.get('threads', '-')} torch thread(s), greedy, interleaved prompt by prompt; speedup = median "
             "over prompts of the tokens/s ratio to the target)", "",
             f"Command: `{settings.get('command', 'not recorded')}`", "",
             "| method | drafter | tau | speedup median [p25, p75] | lossless |", "|---|---|---|---|---|"]
    for row in wallclock.get("summary", []):
        lines.append(f"| {row['method']} | {row.get('drafter') or '-'} | {row['tau']:.2f} | "
                     f"{row['speedup_median']:.2f} [{row['speedup_p25']:.2f}, {row['speedup_p75']:.2f}] | "
                     f"{row['lossless_prompts']} |")
    rules = [(d["name"], d["served_rule"]) for d in wallclock.get("drafters", []) if d.get("served_rule")]
    if rules:
        lines += ["", *[f"- {name}: {rule}" for name, rule in rules]]
    return lines + [""]


def _setup(results: Path) -> list[str]:
    data = load_results(results)
    first = next((result for parts in data.values() for by_seed in parts["arms"].values()
                  for result in by_seed.values()), None)
    if first is None:
        return []
    config = first.get("converged_config") or {}
    machine = first.get("machine") or {}
    arms = {}
    for parts in data.values():
        for arm, by_seed in parts["arms"].items():
            arms.setdefault(arm, next(iter(by_seed.values())).get("description", ""))
    lines = [f"Machine: {machine_text(machine, unit='run')}; runs side by side (`--jobs`).", ""]
    if config:
        lines += [f"Setup: each arm trains for {config.get('extra_seconds', '-'):.0f} s of optimizer-step time from its "
                  f"family's converged drafter, under seeds {', '.join(str(s) for s in config.get('seeds', []))}; "
                  f"the converging KD evaluates held-out tau every {config.get('eval_steps', '-')} steps and stops "
                  f"after {config.get('patience', '-')} evaluations without a new best (step caps: "
                  + ", ".join(f"{family} {cap}" for family, cap in config.get("max_kd_steps", [])) + "). E[A] is pooled "
                  "over seeds with a 95% bootstrap interval over prompts; ratios are paired with KD continued "
                  "(`kd_more`) on the same seeds; T = 1 values average several sampled windows per prompt.", ""]
    lines += ["| arm | what it trains |", "|---|---|", *[f"| {arm} | {what} |" for arm, what in arms.items()], ""]
    return lines


def section(results: Path, summary: dict, reading: str | None = None,
            results_label: str = "benchmarks/results/study_converged") -> str:
    """The converged study's part of the benchmarks page, between ``SECTION_START`` and ``SECTION_END``."""
    results = Path(results)
    wallclock_path = results / "wallclock.json"
    wallclock = json.loads(wallclock_path.read_text()) if wallclock_path.is_file() else None
    plots = [(f"{results_label}/{name}", what) for name, what in (
        ("tau_after_convergence.png", "held-out tau after convergence"), ("wallclock.png", "measured speed"))
             if wallclock or name != "wallclock.png"]
    return "\n".join([
        SECTION_START,
        "## The converged study",
        "",
        "KD to convergence, then PPOW and its rivals refine the converged drafter at equal extra budget "
        "(`benchmarks/study_converged.py`): does window-level RL improve a drafter that imitation can no longer "
        "improve? Evaluated as the study evaluates (exact greedy tau at fixed K and at the calibrated rule, T = 1 "
        "closed-form E[A|y]).",
        "",
        f"Generated from `{results_label}/` (`converged_*.json`, `arms/`, `summary.json`, `wallclock.json`) by "
        "`python tools/render_numbers.py`; `python benchmarks/study_converged.py --report-only` rewrites "
        "`summary.json`, the plot and this section. Do not edit by hand.",
        "",
        "Command: `python benchmarks/study_converged.py` (every stage; reruns skip finished runs).",
        "",
        *_setup(results),
        *_converged_points(results),
        tables(summary),
        *_wallclock(wallclock),
        "Plots (in the repository, not rendered here): " + "; ".join(f"`{p}` ({w})" for p, w in plots) + ".",
        "",
        READING if reading is None else reading,
        SECTION_END,
    ])


def write_report(results: Path, benchmarks_md: Path = Path("docs/benchmarks.md"), reading: str | None = None) -> dict:
    results = Path(results)
    summary = summarize(results)
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    if not summary["families"]:
        return summary
    plot_curves(results, results / "tau_after_convergence.png")
    try:
        label = results.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        label = results.as_posix()
    text_of_section = section(results, summary, reading, label)
    path = Path(benchmarks_md)
    text = path.read_text() if path.is_file() else ""
    if SECTION_START in text:
        head, rest = text.split(SECTION_START, 1)
        tail = rest.split(SECTION_END, 1)[1] if SECTION_END in rest else ""
        text = head + text_of_section + tail
    else:
        text = text.rstrip() + "\n\n" + text_of_section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return summary
