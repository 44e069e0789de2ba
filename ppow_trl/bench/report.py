"""Reporting: per-method summaries and comparisons of the records ``run_benchmark`` collects, the machine it
ran on, and the outputs (JSON, Markdown table, PNG histograms of the fast loop)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from ..metrics import summarize
from ..serving.rule import describe_serving_rule
from ..utils import cpu_name
from ..core.verification import acceptance_histogram
from .runners import DRAFTER_METHODS, FAST_METHODS, METHODS, BenchDrafter

# (method, baseline): figures reported as median/p25/p75 of per-prompt tokens/s ratios
COMPARISONS = (("fast_fixed", "hf_assisted"), ("fast_adaptive", "hf_assisted"), ("hook", "hf_assisted"),
               ("fast_adaptive", "fast_fixed"), ("fast_adaptive", "hf_confidence"), ("hook", "fast_adaptive"))

# ---------------------------------------------------------------------------------------------------------
# Summaries of the records
# ---------------------------------------------------------------------------------------------------------


def _drafter_info(drafter: BenchDrafter) -> dict:
    cost = drafter.cost_model
    return {"name": drafter.name, "source": drafter.source, "policy": dict(vars(drafter.policy)),
            "parameters": sum(p.numel() for p in drafter.model.parameters()),
            "cost_ratio": None if cost is None else cost.drafter_cost,
            "cost_per_round": None if cost is None else cost.drafter_per_round,  # t_d of a block drafter's round
            "verify_cost": None if cost is None else cost.verify_cost,
            "served_rule": describe_serving_rule(drafter.policy, cost)}


def _group(records, keys):
    groups = defaultdict(list)
    for record in records:
        groups[tuple(record[k] for k in keys)].append(record)
    return groups


def summarize_records(records) -> list[dict]:
    """One row per (mode, method, drafter): ``ppow_trl.metrics.summarize`` plus losslessness and histograms."""
    by_prompt = {(r["mode"], r["prompt_index"]): r for r in records if r["method"] == "target"}
    rows = []
    for (mode, label), group in _group(records, ("mode", "label")).items():
        baseline = [by_prompt[(mode, r["prompt_index"])] for r in group]
        row = {"mode": mode, "method": group[0]["method"], "drafter": group[0]["drafter"], "label": label,
               **summarize([r["tokens"] for r in group], [r["verification_forwards"] for r in group],
                           [r["seconds"] for r in group], [b["tokens"] for b in baseline],
                           [b["seconds"] for b in baseline])}
        flags = [r["lossless"] for r in group if r["lossless"] is not None]
        row["lossless"] = all(flags) if flags else None
        row["lossless_prompts"] = f"{sum(flags)}/{len(flags)}" if flags else None
        row["drafter_forwards"] = sum(r["drafter_forwards"] for r in group)
        row.update(round_decomposition(group))
        if row["method"] in FAST_METHODS:
            k = group[0]["max_window"]
            accepted = [a for r in group for a in r["accepted_per_round"]]
            windows = [w for r in group for w in r["window_lengths"]]
            row["acceptance_histogram"] = acceptance_histogram(accepted, k)
            row["window_length_histogram"] = [windows.count(length) for length in range(k + 1)]
            row["mean_accepted"] = sum(accepted) / max(len(accepted), 1)
            row["mean_window_length"] = sum(windows) / max(len(windows), 1)
        rows.append(row)
    modes = list(dict.fromkeys(r["mode"] for r in records))
    return sorted(rows, key=lambda row: (modes.index(row["mode"]), METHODS.index(row["method"]), row["drafter"] or ""))


def round_decomposition(group) -> dict:
    """Where a round's time goes, over a group's calls (sums, so long prompts weigh as they cost): milliseconds
    per round in target forwards, drafter forwards and outside the models, the outside share, and the drafter's
    seconds per forward (to hold against the cost model's bare ``t_d``)."""
    if not all("target_seconds" in r for r in group):
        return {}
    rounds = sum(r["verification_forwards"] for r in group) or 1
    parts = {name: sum(r[f"{name}_seconds"] for r in group) for name in ("target", "drafter", "outside")}
    total = sum(r["seconds"] for r in group) or 1.0
    forwards = sum(r["drafter_forwards"] for r in group)
    return {"ms_per_round": {name: 1000 * value / rounds for name, value in parts.items()},
            "outside_share": parts["outside"] / total,
            "drafter_seconds_per_forward": parts["drafter"] / forwards if forwards else None}


def compare(records) -> list[dict]:
    """Per-prompt tokens/s ratios of method pairs (same drafter, same mode; ``COMPARISONS``): median and spread."""
    index = {(r["mode"], r["method"], r["drafter"], r["prompt_index"]): r for r in records}
    drafters = sorted({r["drafter"] for r in records if r["drafter"] is not None})
    out = []
    for mode in dict.fromkeys(r["mode"] for r in records):
        for method, baseline in COMPARISONS:
            for drafter in drafters:
                other = drafter if baseline in DRAFTER_METHODS else None
                pairs = [(r, index.get((mode, baseline, other, r["prompt_index"])))
                         for r in records if (r["mode"], r["method"], r["drafter"]) == (mode, method, drafter)]
                pairs = [(a, b) for a, b in pairs if b is not None]
                if not pairs:
                    continue
                stats = summarize([a["tokens"] for a, _ in pairs], [a["verification_forwards"] for a, _ in pairs],
                                  [a["seconds"] for a, _ in pairs], [b["tokens"] for _, b in pairs],
                                  [b["seconds"] for _, b in pairs])
                out.append({"mode": mode, "drafter": drafter, "method": method, "baseline": baseline,
                            "ratio_median": stats["speedup_median"], "ratio_p25": stats["speedup_p25"],
                            "ratio_p75": stats["speedup_p75"], "num_prompts": stats["num_prompts"]})
    return out


def machine_info(device: torch.device) -> dict:
    import transformers

    info = {"platform": platform.platform(), "machine": platform.machine(), "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "cpu": cpu_name(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "device": str(device), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    try:
        info["evaluate"] = importlib.metadata.version("evaluate")
    except importlib.metadata.PackageNotFoundError:
        pass
    return info


# ---------------------------------------------------------------------------------------------------------
# Outputs: JSON, Markdown, PNG
# ---------------------------------------------------------------------------------------------------------


def _fmt(value, digits=2):
    return "-" if value is None else f"{value:.{digits}f}"


def format_markdown(report: dict) -> str:
    settings, machine = report["settings"], report["machine"]
    lines = [
        "# Speculative decoding benchmark (`python -m ppow_trl.bench`)", "",
        f"Command: `{settings.get('command', 'run_benchmark(...)')}`", "",
        f"Target: {settings.get('target', '?')} ({settings.get('precision', '?')}), {settings['num_prompts']} prompts "
        f"({settings.get('prompts', '?')}), max_new_tokens={settings['max_new_tokens']}, batch 1, "
        f"{machine['torch_threads']} torch thread(s), {machine['device']} ({machine['cpu']}), "
        f"torch {machine['torch']}, "
        f"transformers {machine['transformers']}, {machine['date']}.", "",
        f"- {report['protocol']['tau']}.", f"- {report['protocol']['speedup']}; p25-p75 in brackets.",
        "- lossless: greedy output equal to the target's greedy output, token for token (prompts).", "",
        "| mode | method | drafter | speedup median [p25, p75] | tokens/s median | tau | lossless |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["summary"]:
        lines.append(
            f"| {row['mode']} | {row['method']} | {row['drafter'] or '-'} | {_fmt(row['speedup_median'])} "
            f"[{_fmt(row['speedup_p25'])}, {_fmt(row['speedup_p75'])}] | {_fmt(row['tokens_per_second_median'], 1)} "
            f"| {_fmt(row['tau'])} | {row['lossless_prompts'] or 'n/a (sampling)'} |")
    if report["comparisons"]:
        lines += ["", "Same drafter, same K, same prompts: per-prompt tokens/s ratio.", "",
                  "| mode | drafter | method / baseline | median [p25, p75] |", "|---|---|---|---|"]
        for c in report["comparisons"]:
            lines.append(f"| {c['mode']} | {c['drafter']} | {c['method']} / {c['baseline']} | "
                         f"{_fmt(c['ratio_median'])} [{_fmt(c['ratio_p25'])}, {_fmt(c['ratio_p75'])}] |")
    if report["drafters"]:
        lines += ["", "| drafter | K | h | parameters | cost ratio t_d/t_t | source |", "|---|---|---|---|---|---|"]
        for d in report["drafters"]:
            lines.append(f"| {d['name']} | {d['policy']['max_window']} | {d['policy']['threshold']} | "
                         f"{d['parameters'] / 1e6:.1f}M | {_fmt(d['cost_ratio'], 3)} | {d['source']} |")
        lines += [""] + [f"- {d['name']}: {d['served_rule']}" for d in report["drafters"] if d.get("served_rule")]
    fast = [row for row in report["summary"] if "acceptance_histogram" in row]
    if fast:
        lines += ["", "Fast loop: rounds by accepted length A and by window length L (0..K).", "",
                  "| mode | method | drafter | mean A | mean L | A histogram | L histogram |",
                  "|---|---|---|---|---|---|---|"]
        for row in fast:
            lines.append(f"| {row['mode']} | {row['method']} | {row['drafter']} | {_fmt(row['mean_accepted'])} | "
                         f"{_fmt(row['mean_window_length'])} | {row['acceptance_histogram']} | "
                         f"{row['window_length_histogram']} |")
    return "\n".join(lines) + "\n"


def plot_histograms(report: dict, path) -> Path | None:
    """Acceptance-length and window-length histograms (fraction of rounds) of the fast loops; None if none ran."""
    rows = [row for row in report["summary"] if "acceptance_histogram" in row]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(rows)
    for panel, (key, title) in enumerate((("acceptance_histogram", "accepted tokens A per round"),
                                          ("window_length_histogram", "window length L per round"))):
        for i, row in enumerate(rows):
            counts = row[key]
            total = max(sum(counts), 1)
            positions = [x + (i - (len(rows) - 1) / 2) * width for x in range(len(counts))]
            axes[panel].bar(positions, [c / total for c in counts], width=width,
                            label=f"{row['method']} [{row['drafter']}] {row['mode']}")
        axes[panel].set_xlabel(title)
        axes[panel].set_ylabel("fraction of rounds")
        axes[panel].set_xticks(range(max(len(row[key]) for row in rows)))
    axes[0].legend(fontsize=8)
    figure.suptitle(f"ppow_trl fast loop, {report['settings'].get('target', '')}", fontsize=10)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write_outputs(report: dict, prefix) -> dict:
    """Write ``prefix.json``, ``prefix.md`` and ``prefix.png``; returns the paths written."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    paths = {"json": prefix.with_suffix(".json"), "markdown": prefix.with_suffix(".md")}
    paths["json"].write_text(json.dumps(report, indent=1, default=str))
    paths["markdown"].write_text(format_markdown(report))
    png = plot_histograms(report, prefix.with_suffix(".png"))
    if png is not None:
        paths["png"] = png
    return paths

