"""The study's write-up: tables and plots generated from ``benchmarks/results/study/arms/*.json``.

``write_report(results)`` writes ``<results>/summary.json`` (every figure of the tables), three plots, and
replaces the part of ``docs/benchmarks.md`` between ``<!-- study:begin -->`` and ``<!-- study:end -->``, so the
section is never edited by hand. ``section`` builds that part from the summary; ``tools/render_numbers.py`` (which
regenerates the whole page) calls it too, so both give the same text. Intervals are 95% percentile bootstraps over
prompts (``evaluate``).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..drafting import get_family
from .arms import ARMS, BASELINE_DRAFTER, DRAFTER_FAMILY, KD_ARM, ORDER, WARM, WARM_STARTS, warm_start_of
from .evaluate import paired_ratio_interval, summarize

BEGIN, END = "<!-- study:begin -->", "<!-- study:end -->"
BASELINE = "kd"
TEST_SETS = {"mtbench": "MT-bench first turns", "sharegpt_test": "held-out ShareGPT prompts (test split, <= 512 tokens)"}
# Each family's warm start is listed right before the family's first PPOW arm (the truncated one first of all).
# each family's warm start just before its PPOW arm
_WARM_BEFORE = {"eagle3_ppow": warm_start_of("eagle3"), "dflash_ppow": warm_start_of("dflash")}
ARM_ORDER = [WARM] + [n for name in ORDER for n in ([_WARM_BEFORE[name]] if name in _WARM_BEFORE else []) + [name]]
RATIO_NAMES = {"accepted": "expected_accepted", "tokens": "tau"}


def load_arms(results: Path) -> dict[str, dict]:
    arms = {}
    for name in ARM_ORDER:
        path = Path(results) / "arms" / f"{name}.json"
        if path.is_file():
            arms[name] = json.loads(path.read_text())
    return arms


def summarize_arms(arms: dict[str, dict]) -> dict:
    """Per arm: greedy summaries (policy, fixed K) per test set, T = 1 summaries, ratios to KD with intervals."""
    out = {}
    base = arms.get(BASELINE)
    for name, arm in arms.items():
        row = {"description": arm["description"], "budget": arm["budget"], "policy": arm["policy"],
               "drafter_cost": arm["cost_model"]["drafter_cost"], "verify_cost": arm["cost_model"]["verify_cost"],
               # results written before the field existed: the family's unit
               "drafter_per_round": arm["cost_model"].get(
                   "drafter_per_round", get_family(DRAFTER_FAMILY.get(_family(name), _family(name))).cost_per_round)}
        # Greedy records carry tokens (tau is exact); T = 1 records only E[A|y] (tau = E[A] + 1, same ratio terms).
        for regime, numerators in (("greedy", ("accepted", "tokens")), ("sampling", ("accepted",))):
            row[regime] = {}
            for test, by_policy in arm["evaluation"][regime].items():
                row[regime][test] = {}
                for key, records in by_policy.items():
                    entry = summarize(records)
                    if base is not None:
                        reference = base["evaluation"][regime][test][key]
                        entry["ratio_to_kd"] = {
                            RATIO_NAMES[n]: paired_ratio_interval(records, reference, n) for n in numerators}
                    row[regime][test][key] = entry
        warm = _warm_of(name)
        if warm is not None and warm in arms:  # PPOW over its own family's KD warm start, paired over prompts
            for regime, numerators in (("greedy", ("accepted", "tokens")), ("sampling", ("accepted",))):
                for test, by_policy in arm["evaluation"][regime].items():
                    for key, records in by_policy.items():
                        reference = arms[warm]["evaluation"][regime][test][key]
                        row[regime][test][key]["ratio_to_warm"] = {
                            RATIO_NAMES[n]: paired_ratio_interval(records, reference, n) for n in numerators}
        calibration = arm["policy"].get("calibration") or {}
        row["predicted_speedup"] = calibration.get("predicted_speedup")
        out[name] = row
    return out


def _warm_of(name: str) -> str | None:
    """The warm start a PPOW arm continues (its family's), ``None`` for the other arms."""
    arm = ARMS.get(name)
    return warm_start_of(arm.drafter) if arm is not None and arm.starts_from_warm else None


def _family(name: str) -> str:
    if name in WARM_STARTS:
        return next(family for family in KD_ARM if warm_start_of(family) == name)
    return ARMS[name].drafter if name in ARMS else BASELINE_DRAFTER


def _ci(values, digits=2) -> str:
    return f"[{values[0]:.{digits}f}, {values[1]:.{digits}f}]"


def _ratio(entry, key="expected_accepted") -> str:
    ratio = entry.get("ratio_to_kd", {}).get(key)
    if ratio is None or ratio["ratio"] is None:
        return "-"
    return f"{ratio['ratio']:.2f} {_ci(ratio['ci'])}"


def _budget(budget: dict, warm: dict | None = None) -> str:
    if warm is not None:  # a PPOW arm: the KD warm start's budget, then its own
        return f"KD {_budget(warm)} + PPOW {_budget(budget)}"
    seconds = budget.get("train_step_seconds") or budget.get("train_seconds")
    items = [f"{seconds:.0f} s" if seconds is not None else "", f"{budget.get('optimizer_steps', 0)} steps"]
    if "trained_positions" in budget:
        items.append(f"{budget['trained_positions'] / 1000:.0f}k positions")
    if "trained_window_tokens" in budget:
        items.append(f"{budget['trained_window_tokens'] / 1000:.1f}k window tokens")
    return ", ".join(i for i in items if i)


def format_tables(summary: dict, wallclock: dict | None, config: dict | None = None) -> str:
    """The study's tables from ``summary`` (``summarize_arms``) and the wall-clock benchmark's JSON; ``config``
    (an arm's ``config``) supplies the evaluation's settings stated in the titles."""
    lines = []
    new_tokens = ((config or {}).get("data") or {}).get("eval_max_new_tokens")
    tokens = f", {new_tokens} new tokens" if new_tokens else ""
    for test, title in TEST_SETS.items():
        prompts = next((row["greedy"][test]["policy"]["prompts"] for row in summary.values() if test in row["greedy"]), 0)
        lines += [f"**{prompts} {title}, greedy{tokens}, exact tau** (E[A] = accepted drafted tokens per round; "
                  "tau = E[A] + 1 per round, EOS rounds included; ratios paired over prompts)", "",
                  "| arm | policy (K, h) | tau at policy [95% CI] | E[A] at policy | E[A] / KD at policy | "
                  "E[A] at fixed K=4 | E[A] / KD at K=4 |", "|---|---|---|---|---|---|---|"]
        for name, row in summary.items():
            greedy = row["greedy"].get(test)
            if not greedy:
                continue
            policy, fixed = greedy["policy"], greedy["fixed_k"]
            lines.append(
                f"| {name} | ({row['policy']['max_window']}, {row['policy']['threshold']:.2f}) | {policy['tau']:.3f} "
                f"{_ci(policy['tau_ci'], 3)} | {policy['expected_accepted']:.3f} | {_ratio(policy)} | "
                f"{fixed['expected_accepted']:.3f} {_ci(fixed['expected_accepted_ci'], 3)} | {_ratio(fixed)} |")
        lines.append("")
    lines += ["**MT-bench, sampling T = 1** (one window sampled per prompt after a third of its response; "
              "E[A|y] in closed form from the target's p; tau = E[A] + 1)", "",
              "| arm | tau at policy [95% CI] | E[A] / KD at policy | tau at fixed K=4 | E[A] / KD at K=4 | "
              "t_d/t_t | predicted speedup (calibration) | training budget |", "|---|---|---|---|---|---|---|---|"]
    for name, row in summary.items():
        sampling = row["sampling"].get("mtbench")
        if not sampling:
            continue
        policy, fixed = sampling["policy"], sampling["fixed_k"]
        predicted = row["predicted_speedup"]
        warm = summary[_warm_of(name)]["budget"] if _warm_of(name) in summary else None
        lines.append(f"| {name} | {policy['tau']:.3f} {_ci(policy['tau_ci'], 3)} | {_ratio(policy)} | "
                     f"{fixed['tau']:.3f} {_ci(fixed['tau_ci'], 3)} | {_ratio(fixed)} | {row['drafter_cost']:.3f} | "
                     f"{'-' if predicted is None else f'{predicted:.2f}x'} | {_budget(row['budget'], warm)} |")
    lines.append("")
    families = [name for name in summary if _family(name) != BASELINE_DRAFTER]
    if families:
        lines += ["**Drafter families** (MT-bench, greedy, exact tau at each arm's calibrated policy; t_d/t_t and "
                  "t_v(L)/t_t measured by `calibrate_cost_model` on this CPU, per drafted token (per round for the DFlash "
                  "block drafter, whose one forward drafts the window); predicted speedup = "
                  "the cost model's on the calibration contexts; PPOW / warm = E[A] of a PPOW arm over its own "
                  "family's KD warm start, paired over prompts)", "",
                  "| arm | family | tau [95% CI] | E[A] / KD (truncated) | PPOW / its warm start | t_d/t_t | "
                  "t_v(1..K)/t_t | predicted speedup |", "|---|---|---|---|---|---|---|---|"]
        for name, row in summary.items():
            if _family(name) == BASELINE_DRAFTER and name not in ("kd", "kd_warm", "ppow", "ppow_greedy"):
                continue
            greedy = row["greedy"]["mtbench"]["policy"]
            to_warm = greedy.get("ratio_to_warm")
            ratio = None if not to_warm else to_warm["expected_accepted"]["ratio"]
            warm = "-" if ratio is None else f"{ratio:.2f} {_ci(to_warm['expected_accepted']['ci'])}"
            verify = "/".join(f"{v:.2f}" for v in row["verify_cost"][1:])
            predicted = row["predicted_speedup"]
            per_round = " per round" if row.get("drafter_per_round") else ""  # one forward drafts the window
            lines.append(f"| {name} | {_family(name)} | {greedy['tau']:.3f} {_ci(greedy['tau_ci'], 3)} | "
                         f"{_ratio(greedy)} | {warm} | {row['drafter_cost']:.3f}{per_round} | {verify} | "
                         f"{'-' if predicted is None else f'{predicted:.2f}x'} |")
        lines.append("")
    if wallclock:
        settings = wallclock.get("settings", {})
        lines += ["**Wall-clock** (`ppow_trl.bench`, " + _bench_settings(settings) + ", greedy, interleaved prompt by "
                  "prompt; speedup = median over prompts of tokens/s ratio to the target)", "",
                  "| method | drafter | tau | speedup median [p25, p75] | lossless |", "|---|---|---|---|---|"]
        for row in wallclock["summary"]:
            lines.append(f"| {row['method']} | {row.get('drafter') or '-'} | {row['tau']:.2f} | "
                         f"{row['speedup_median']:.2f} [{row['speedup_p25']:.2f}, {row['speedup_p75']:.2f}] | "
                         f"{row['lossless_prompts']} |")
        lines.append("")
    return "\n".join(lines)


def _bench_settings(settings: dict) -> str:
    """``ppow_trl.bench``'s recorded settings as words: prompts, new tokens, precision, threads."""
    items = []
    if settings.get("num_prompts") is not None:
        items.append(f"{settings['num_prompts']} {_PROMPT_SETS.get(settings.get('prompts'), settings.get('prompts') or '')}"
                     " prompts".replace("  ", " "))
    if settings.get("max_new_tokens") is not None:
        items.append(f"{settings['max_new_tokens']} new tokens")
    if settings.get("precision"):
        items.append(str(settings["precision"]))
    if settings.get("threads") is not None:
        items.append(f"{settings['threads']} torch thread{'s' if settings['threads'] != 1 else ''}")
    return ", ".join(items)


_PROMPT_SETS = {"mtbench": "MT-bench", "code": "code"}


def plot_curves(arms: dict, path: Path) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    for name, arm in arms.items():
        if name in WARM_STARTS or not arm.get("curve"):
            continue
        xs = [row["train_seconds"] / 60 for row in arm["curve"]]
        ys = [row["held_out_tau_fixed_k"] for row in arm["curve"]]
        axis.plot(xs, ys, marker="o", markersize=3, label=name, linestyle="-" if name.startswith("kd") else "--")
    axis.set_xlabel("training time (minutes of optimizer steps; PPOW arms start from KD at the warm-start point)")
    axis.set_ylabel("held-out greedy tau, fixed K = 4")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def plot_acceptance(summary: dict, path: Path, arms=("kd_warm", "kd", "kd_tv", "ppow")) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(name, summary[name]["greedy"]["mtbench"]["fixed_k"]) for name in arms if name in summary]
    if not rows:
        return None
    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(rows)
    for i, (name, entry) in enumerate(rows):
        histogram = entry["histogram"]
        total = max(sum(histogram), 1)
        offset = (i - (len(rows) - 1) / 2) * width
        axes[0].bar([a + offset for a in range(len(histogram))], [c / total for c in histogram], width=width, label=name)
        axes[1].plot(range(1, len(entry["p_accept_at_least"]) + 1), entry["p_accept_at_least"], marker="o", label=name)
    axes[0].set_xlabel("accepted tokens A per round (MT-bench greedy, fixed K = 4)")
    axes[0].set_ylabel("fraction of rounds")
    axes[1].set_xlabel("position k in the window")
    axes[1].set_ylabel("P(A >= k)")
    if any(v > 0 for _, entry in rows for v in entry["p_accept_at_least"]):
        axes[1].set_yscale("log")
    for axis in axes:
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# The reading of the tables, without figures: every number on the page is generated from the JSON. The notes written
# when the arms ran (with the figures of that day, typed by hand) stay in ``<results>/reading.md``, outside the docs.
READING = """### What the study shows

**At equal wall-clock budget on this machine, token-level distillation beat every PPOW variant.** On both test sets
KD (forward KL) has the highest E[A]; PPOW is also below the direct-acceptance baseline (KD-TV); at fixed K, where the
window rule plays no part, the order is KD, then KD-TV, then every PPOW arm, then the KD warm start. The T = 1 table
has wide intervals (one window per prompt) and the same order.

- **KD spent the second half of the budget better than PPOW did.** Every PPOW arm continues the KD warm start; the
  full method (T = 1 expected-acceptance rewards) lowered greedy acceptance below its warm start, and the variants
  that did not lower it gained little over it.
- **Budget in signal, not seconds.** In the same seconds a KD arm trains on many more response positions, each with
  the target's full top-k distribution, than a PPOW arm trains drafted window tokens (the training-budget column),
  each costing target forwards (see "Trainer throughput") and rewarded by one noisy scalar per window.
- **The objective matters.** Rewarding greedy verification (`ppow_greedy`) did better than the default T = 1
  reward on the greedy measure.
- **Ablations** start from the same warm start with the same budget; their intervals overlap, and the seed-to-seed
  spread of PPOW was not measured (the `ppow_seed1` arm is defined but was not run), so none is separated from the
  others with certainty. Every ablation scored above the full method, which suggests an unlucky run or pieces that
  interfere at this scale.
- **The calibrated window rule** trades tau for drafting cost (policy columns against fixed-K columns); its
  predicted speedup is what it maximises, and with the acceptance reached here every trained drafter is predicted
  slower than the target alone on this CPU (the wall-clock table agrees).
- **EAGLE-3 heads** (`eagle3_*`): at this budget below the truncated drafter on acceptance, cheaper per drafted
  token, still learning when the budget ran out (steeper held-out curve); a higher learning rate did not help and
  PPOW did not move the head from its warm start. Steps and data, not the family, limit it here.
- **DFlash block drafters** (`dflash_*`): the weakest family at this budget on acceptance and on cost: one round
  applies the target's full output head to every slot of the block, which costs more than the per-token families'
  whole windows on this CPU (see "DFlash block"); PPOW on it is not conclusively better than its warm start.
- **Prompt lookup** (`prompt_lookup`, no training) has the best acceptance of the study and a negligible drafting
  cost; its calibrated prediction did not transfer to measured speed on MT-bench (see "Methods on SmolLM2").

What would change the answer: a budget in which KD has converged (the converged study below), a GPU (where the
target's verification of a window is nearly free), a stronger drafter with longer accepted windows, the served
regime in the reward, and more seeds.

The notes written when the arms ran, with the figures of that day, are kept in `benchmarks/results/study/reading.md`
(not generated: the tables above are the reference)."""


def _display(path: Path) -> str:
    """``path`` relative to the working directory when it lies under it (the repository's paths on the page)."""
    path = Path(path)
    try:
        return path.resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return path.as_posix()


def machine_text(machine: dict, unit: str = "arm") -> str:
    """The machine a study ran on, as its JSON records it (``unit``: what one torch thread count applies to)."""
    items = [machine.get("platform") or "platform not recorded"]
    if machine.get("cpu_count") is not None:
        items.append(f"{machine['cpu_count']} CPU cores (CPU model not recorded)")
    items.append(str(machine.get("precision", "precision not recorded")))
    if machine.get("threads") is not None:
        items.append(f"{machine['threads']} torch thread{'s' if machine['threads'] != 1 else ''} per {unit}")
    items += [f"{k} {machine[k]}" for k in ("torch", "transformers", "trl", "peft") if k in machine]
    return ", ".join(items)


def section(arms: dict[str, dict], summary: dict, wallclock: dict | None, reading: str | None = None,
            results_label: str = "benchmarks/results/study") -> str:
    """The study's part of the benchmarks page, between ``BEGIN`` and ``END``, from the arms' JSON (``load_arms``),
    their summary and the wall-clock benchmark's JSON."""
    first = next(iter(arms.values()))
    config, machine = first["config"], first["machine"]
    data = config["data"]
    plots = [(f"{results_label}/{name}", what) for name, what in (
        ("tau_over_training.png", "held-out tau over training"),
        ("acceptance.png", "acceptance histograms and per-position acceptance"),
        ("wallclock.png", "the wall-clock benchmark")) if wallclock or name != "wallclock.png"]
    lines = [
        BEGIN,
        "## The study",
        "",
        "PPOW against token-level distillation at equal training budget, with ablations and the other drafter "
        "families (`benchmarks/study.py`). Every arm trains the same drafter initialisation of its family on the same "
        "target-regenerated data for the same optimizer-step time, then is evaluated the same way: exact greedy tau on "
        "MT-bench first turns and held-out ShareGPT prompts at the arm's calibrated window rule and at fixed K, T = 1 "
        "closed-form E[A|y] on MT-bench, and the cost model measured on this CPU.",
        "",
        f"Generated from `{results_label}/` (the arms' JSON in `arms/`, `summary.json`, `wallclock.json`) by "
        "`python tools/render_numbers.py`; `python benchmarks/study.py --report-only` rewrites `summary.json`, the "
        "plots and this section from the arms. Do not edit by hand.",
        "",
        "Command (the whole study, resumable): `python benchmarks/study.py`; one arm: "
        "`python -m ppow_trl.study --run-arm <arm>`.",
        "",
        f"Machine: {machine_text(machine)}; arms ran side by side (`--jobs`).",
        "",
        f"Setup: target SmolLM2-135M-Instruct; drafter: the target's first {config['drafter_layers']} layers with a "
        f"{config['draft_vocab_size']}-token head (the `eagle3_*` and `dflash_*` arms train those families instead, with "
        f"their own warm starts); data: the target's greedy responses (<= {data['train_max_new_tokens']} tokens) to "
        f"{data['num_train_prompts']} ShareGPT train prompts (those under 512 prompt tokens)"
        + (f", its top-{data['top_k']}" if "top_k" in data else "") + ", "
        f"the last {data['num_calibration']} held out for calibration and the curve; budget "
        f"{config['budget_seconds']:.0f} s of optimizer-step time per arm (PPOW arms: KD for "
        f"{config['warm_seconds']:.0f} s, then PPOW). Arms and their settings: `ppow_trl/study/arms.py`, "
        "`ppow_trl/study/runner.py`.",
        "",
        "| arm | what it trains |",
        "|---|---|",
        *[f"| {name} | {arm['description']} |" for name, arm in arms.items()],
        "",
        format_tables(summary, wallclock, config),
        "Plots (in the repository, not rendered here): "
        + "; ".join(f"`{path}` ({what})" for path, what in plots) + ".",
        "",
        READING if reading is None else reading,
        END,
    ]
    return "\n".join(lines)


def write_report(results: Path, benchmarks_md: Path = Path("docs/benchmarks.md"), reading: str | None = None) -> dict:
    """Summaries, plots and the benchmarks page's study section from the arms' JSON; returns the summary."""
    results = Path(results)
    arms = load_arms(results)
    if not arms:
        raise FileNotFoundError(f"No arm results under {results}/arms: run `python benchmarks/study.py` first.")
    summary = summarize_arms(arms)
    wallclock_path = results / "wallclock.json"
    wallclock = json.loads(wallclock_path.read_text()) if wallclock_path.is_file() else None
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    plot_curves(arms, results / "tau_over_training.png")
    plot_acceptance(summary, results / "acceptance.png")
    text_of_section = section(arms, summary, wallclock, reading, _display(results))
    if benchmarks_md is not None:
        text = Path(benchmarks_md).read_text() if Path(benchmarks_md).is_file() else "# Benchmarks\n"
        if BEGIN in text and END in text:
            text = text[: text.index(BEGIN)] + text_of_section + text[text.index(END) + len(END):]
        else:
            text = text.rstrip("\n") + "\n\n" + text_of_section + "\n"
        Path(benchmarks_md).parent.mkdir(parents=True, exist_ok=True)
        Path(benchmarks_md).write_text(text)
    return summary
