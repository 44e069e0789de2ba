"""Served side-by-side runs (``benchmarks/compiled_serving.py``, the main job's own evaluation) and the README's table.

Every speedup is against plain decoding at the row's own runtime and precision (``own_speedup`` raises
``MixedReferenceError`` otherwise), so no table credits speculation with what a precision or a runtime gained; the one
cross-runtime column compares every row with transformers' eager ``generate``.
"""

from __future__ import annotations

import re
from pathlib import Path

from .format import (CATALOG, COMMAND, RESULTS, ci, command_line, cpu_text, load, num, slug, table, threads_text,
                     without_local_paths)
from .page import Run, Section, section

HEADING, EAGER = "Compiled serving", "hf_generate_eager"
PROMPT_SETS = {"mtbench": "MT-bench", "code": "code", "sharegpt_test": "ShareGPT test"}
ARM = re.compile(r"(?P<kind>hf_generate_eager|hf_generate_compiled|compiled_plain|compiled_speculative|llama_cpp_plain|"
                 r"llama_cpp_speculative)(?:\[(?P<inner>[^\]]*)\])?")
WHAT = {"ppow": "the trained drafter alone", "prompt_lookup": "prompt lookup (no training)",
        "hybrid": "the trained drafter and prompt lookup (hybrid)", "eagle3": "an EAGLE-3 head"}
MAIN_JOB = "main_job.json"  # benchmarks/main_job.py: the current main job, which the README's prose reports


class MixedReferenceError(ValueError):
    """A row of a speedup column is compared with plain decoding at another runtime or precision than its own."""


def footing(arm: str) -> tuple[str, str]:
    """The (runtime, precision) an arm decodes on, read from its name (``compiled_speculative[ppow@int8]``)."""
    match = ARM.fullmatch(arm)
    if not match:
        raise MixedReferenceError(f"{arm!r}: not a served arm's name, so its runtime and precision are unknown")
    kind, inner = match["kind"], match["inner"] or ""
    if kind.startswith("hf_generate"):
        return kind, "fp32"
    if kind.startswith("llama_cpp"):
        return "llama.cpp", inner
    if kind == "compiled_plain":
        return "compiled", inner or "fp32"  # the main job's arms name no precision: fp32
    return "compiled", inner.rpartition("@")[2] if "@" in inner else "fp32"


def is_plain(arm: str) -> bool:
    return "speculative" not in arm


def own_speedup(name: str, arm: dict) -> tuple[str, float | None, list | None]:
    """(reference, speedup, 95% interval) of a row against plain decoding at its own runtime and precision."""
    stored = [key[len("speedup_vs_"):] for key in arm if key.startswith("speedup_vs_") and not key.endswith("_ci95")]
    same_footing = (ref for ref in stored if ARM.fullmatch(ref) and footing(ref) == footing(name))
    reference = arm.get("reference") or next(same_footing, name if is_plain(name) else None)
    if reference is None:
        raise MixedReferenceError(f"{name}: the JSON has no speedup against plain decoding at its own runtime and "
                                  f"precision {footing(name)}")
    if footing(reference) != footing(name):
        raise MixedReferenceError(f"{name} is compared with {reference}, which runs at {footing(reference)}, not at "
                                  f"its own {footing(name)}: a table compares every row with plain decoding at its "
                                  "own runtime and precision, so that speculation is not credited with their gains")
    if reference == name:
        return reference, 1.0, None
    key = "speedup_vs_reference" if "speedup_vs_reference" in arm else f"speedup_vs_{reference}"
    return reference, arm.get(key), arm.get(key + "_ci95")


def served_table(arms: dict) -> list[str]:
    """One prompt set: each row against its own plain decoding, and every row against transformers' eager generate."""
    if all(isinstance(x, str) for arm in arms.values() for x in arm.values()):  # an early run stored formatted cells
        header = list(next(iter(arms.values())))
        return table(["arm"] + header, [[f"`{n}`"] + [a.get(k, "-") for k in header] for n, a in arms.items()])
    faster, even, slower = "faster than its plain decoding", "not separated from it", "slower"
    rows, verdicts = [], {faster: [], even: [], slower: []}
    for name, arm in arms.items():
        reference, speedup, interval = own_speedup(name, arm)
        rows.append([f"`{name}`", ci(arm.get("ms_per_token_median"), arm.get("ms_per_token_ci95"), 1),
                     num(arm.get("tau")), "reference" if reference == name else ci(speedup, interval, 2, "x"),
                     ci(arm.get(f"speedup_vs_{EAGER}"), arm.get(f"speedup_vs_{EAGER}_ci95"), 2, "x"),
                     arm.get("lossless_prompts", "-"), arm.get("agrees_with_eager_prompts", "-")])
        if interval and not is_plain(name):
            verdicts[faster if interval[0] > 1 else slower if interval[1] < 1 else even].append(f"`{name}`")
    said = [f"{label}: {', '.join(names)}" for label, names in verdicts.items() if names]
    return table(["arm", "ms/token [95% CI]", "tau", "vs plain decoding, same runtime and precision [95% CI]",
                  f"vs `{EAGER}` [95% CI]", "lossless", "= eager"], rows) + (
        ["By the 95% intervals: " + "; ".join(said) + ".", ""] if said else [])


def runs(results: Path) -> list[tuple[str, str, str]]:
    """Every recorded run as (file, thread key, heading suffix), oldest first: benchmarks.toml's order, then any run
    it does not list yet (newer than all it lists)."""
    found = [(p.name, key) for p in sorted(results.glob("compiled_serving*.json")) for key in load(p).get("meta", {})]
    listed = [(r["file"], r["threads"], r["heading"]) for r in CATALOG["compiled_serving_run"]]
    new = [(name, key, f"at {threads_text(re.sub(r'[^0-9]', '', key))} (`{name}`)") for name, key in found
           if (name, key) not in {run[:2] for run in listed}]
    return [run for run in listed if run[:2] in found] + new


def prompt_sets(data: dict, key: str) -> list[tuple[str, str]]:
    """The runs at one thread count (``threads1/mtbench``, ...), each with its prompt set's name."""
    return [(run, PROMPT_SETS.get(name, name)) for run in data["runs"] for threads, _, name in [run.partition("/")]
            if threads == key]


def run_lines(data: dict, key: str, name: str) -> list[str]:
    """One run at one thread count: its reading, machine and command, a table per prompt set, its served rules."""
    meta = data["meta"][key]
    converted = (meta.get("settings") or {}).get("drafter_precision") == "target"
    lines = [f"Reading (stored with the result): {data['reading']}", ""] if data.get("reading") else []
    lines += [f"Machine: {cpu_text(meta.get('cpu'))}; torch {meta.get('torch', '-')}; "
              f"{threads_text(meta.get('threads'))}; {meta.get('max_new_tokens', '-')} new tokens per prompt, greedy, "
              f"batch 1; drafter `{meta.get('drafter', '-')}`"
              + ("; the bf16 and int8 rows' drafters at their target's precision" if converted else "") + ".", "",
              *command_line(meta.get("command") or data.get("command"), name)]
    for run, label in prompt_sets(data, key):
        block = data["runs"][run]
        lines += [f"**{label}**: {block.get('prompts', '-')} prompts ({block.get('skipped_too_long', 0)} longer than "
                  "the static cache passed over)", "", *served_table(block["arms"])]
    rules = meta.get("rules") or {}
    near = [a for a, r in rules.items() if (p := re.search(r"predicted ([0-9.]+)x", r)) and float(p[1]) < 1.05]
    lines += ["Served rules (`calibrate_for_serving` on the compiled runtime's measured costs):", "",
              *[f"- {arm}: {rule}" for arm, rule in rules.items()], ""] if rules else []
    if near and "served_min_speedup" not in (meta.get("settings") or {}):  # calibrated before the serving margin
        lines += [f"Calibrated before the serving margin (a rule must be predicted at least 1.05x): with it, "
                  f"{', '.join(near)} would serve K = 0.", ""]
    return lines


def compiled_serving(spec: dict, results: Path) -> Section | None:
    return section(spec, [Run(f"{HEADING} {suffix}", run_lines(load(results / name), key, name))
                          for name, key, suffix in runs(results)], title=HEADING)


def main_job_compiled(spec: dict, results: Path) -> Section | None:
    """The main job's runs on the compiled runtime: their facts and their own side-by-side evaluation."""
    found = []
    path = results / spec["files"][0]
    for i, run in enumerate(load(path)["runs"] if path.is_file() else [], 1):
        served = run.get(next((k for k in run if k.startswith("served_side_by_side")), "served_evaluation")) or {}
        arms = {k: v for k, v in (served.get("arms") or served).items() if isinstance(v, dict)}
        facts = [f"- {field.replace('_', ' ')}: {run[field]}" for field in (
            "wall_clock", "served_rule", "hybrid_rule", "lookup_rule", "reading") if run.get(field)]
        found.append(Run(f"Main job run {i}", [
            *([f"*{run['label']}*", ""] if run.get("label") else []), *command_line(run.get("command")),
            f"Machine: {cpu_text(run.get('cpu'))}.", "", *facts, "", *served_table(arms)]))
    return section(spec, found)


def readme_block(results: Path) -> str:
    """What goes between the README's results markers."""
    name, key, _ = runs(results)[-1]
    data = load(results / name)
    meta, sets = data["meta"][key], prompt_sets(data, key)
    served = [a for a in dict.fromkeys(a for run, _ in sets for a in data["runs"][run]["arms"]) if ":" not in a]
    rows = [_row(arm, [data["runs"][run]["arms"].get(arm) or {} for run, _ in sets])
            for arm in sorted(served, key=_reading_order)]  # ":best_speculative" rows force a rule nobody serves
    gpu = ("no GPU figures exist yet" if not (results / "gpu_cost_profile.json").is_file()
           else "GPU figures: [GPU check](docs/benchmarks.md#gpu-check)")
    return "\n".join([
        f"<!-- generated by `{COMMAND}` from benchmarks/results/{name}: do not edit by hand -->",
        f"Every figure here is SmolLM2-135M-Instruct on one CPU ({cpu_text(meta.get('cpu'))}) at "
        f"{threads_text(meta.get('threads'))}, greedy, batch 1, "
        + " and ".join(f"{data['runs'][run].get('prompts', '-')} {label}" for run, label in sets)
        + f" prompts of up to {meta.get('max_new_tokens', '-')} new tokens, from the newest side-by-side run "
        f"(`{RESULTS.as_posix()}/{name}`); {gpu}." + _drafter_scope(results, meta), "",
        "Each speedup is a ratio of total times [95% CI] against plain decoding on the row's own runtime and "
        "precision (the rows marked `reference`). The last column compares every row with transformers' eager "
        "`generate` in fp32, so it adds what the runtime and the precision gain to what speculation gains. tau: "
        "tokens per target forward; lossless: prompts whose tokens equal that plain decoding's.", "",
        *table(["row", "runtime, precision", "served rule", *[f"{label}: vs plain decoding" for _, label in sets],
                "tau", "lossless", "vs transformers' eager `generate`"], rows)[:-1], "",
        "The served rules with their cost models, every row and the earlier runs: "
        f"[docs/benchmarks.md](docs/benchmarks.md#{slug(HEADING)}).",
    ])


def _drafter_scope(results: Path, meta: dict) -> str:
    """Which trained drafter the rows measured: the current main job's only when the run read the folder that job
    writes (its ``merged/``) on the same CPU model."""
    drafter = meta.get("drafter")
    if not drafter:
        return ""
    said = f" The trained drafter in these rows is `{without_local_paths(drafter)}`"
    if not (results / MAIN_JOB).is_file():
        return said + " (the run's `--drafter`)."
    job, where = load(results / MAIN_JOB), f"`{RESULTS.as_posix()}/{MAIN_JOB}`"
    output = re.search(r"--output_dir\s+(\S+)", job.get("job") or "")
    output = output[1] if output else "outputs/ppow-smollm2-offline"
    machine = (job.get("cpu") or {}).get("model") or "CPU model not recorded"
    if drafter.rstrip("/").endswith(f"{output.rstrip('/')}/merged") and machine == (meta.get("cpu") or {}).get("model"):
        return said + f", the folder the main job writes, on the CPU model of the current main job ({where})."
    rule = job.get("served_rule") or {}
    served = f", served K = {rule['max_window']}" if rule.get("max_window") is not None else ""
    return said + (f" (the run's `--drafter`), not the drafter of the current main job ({where}: {machine}{served}), "
                   "which the main job's own evaluation measures.")


def _reading_order(arm: str) -> tuple:
    """ppow_trl's fp32 rows, its other precisions, transformers, llama.cpp; each plain row before its speculation."""
    runtime, precision = footing(arm)
    rank = ["compiled", "hf_generate_eager", "hf_generate_compiled", "llama.cpp"].index(runtime)
    return rank, precision != "fp32", precision, not is_plain(arm)


def _what(arm: str, stored: dict) -> str:
    """What a row is, in words; a hybrid whose served rule is its lookups alone is named so."""
    if arm.startswith("hf_"):
        return "transformers `generate`"
    if is_plain(arm):
        return "plain decoding"
    if arm.startswith("llama_cpp"):
        return "llama.cpp's draft model hook, the trained drafter"
    drafter = ARM.fullmatch(arm)["inner"].partition("@")[0]
    if drafter == "hybrid" and "lookups alone" in (stored.get("rule") or ""):
        return "the hybrid served as prompt lookup alone (its trained drafter proposes nothing)"
    return WHAT.get(drafter, drafter)


def _short_rule(arm: dict) -> str:
    """The served rule in short (``K = 4, h = 0.15``), ``K = 0 (plain decoding)`` when speculation does not pay."""
    rule = arm.get("rule") or ""
    if arm.get("draft_window"):  # llama.cpp's draft hook drafts a fixed window
        return f"K = {arm['draft_window']} (fixed)"
    if rule.startswith("No speculation"):
        return "K = 0 (plain decoding)"
    window = re.match(r"K = \d+, h = [0-9.]+", rule)
    alone = " (lookups alone)" if "lookups alone" in rule else ""  # a hybrid served without its trained drafter
    return (window[0] if window else rule.split(";")[0] or "-") + alone


def _row(arm: str, per_set: list[dict]) -> list:
    """One row: what it is, where it runs, its rule, its speedup per prompt set, tau, lossless, vs HF eager."""
    speedups = []
    for a in per_set:
        reference, speedup, interval = own_speedup(arm, a) if a else (None, None, None)
        speedups.append("-" if not a else "reference" if reference == arm else ci(speedup, interval, 2, "x"))

    def join(values: list[str]) -> str:  # "reference", not "reference / reference"
        return " / ".join(dict.fromkeys(values) if "reference" in values else values)

    stored = next(a for a in per_set if a)
    return [f"{_what(arm, stored)}: `{arm}`", " ".join(footing(arm)).replace("hf_generate_", "transformers "),
            _short_rule(stored), *speedups, join([num(a.get("tau")) for a in per_set]),
            join([str(a.get("lossless_prompts", "-")) for a in per_set]),
            join([num(a.get(f"speedup_vs_{EAGER}"), 2, "x") for a in per_set])]
