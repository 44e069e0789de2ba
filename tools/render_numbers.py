"""Generate docs/benchmarks.md and the README's results table from benchmarks/results/*.json.

    python tools/render_numbers.py            # write docs/benchmarks.md and the README block (`make numbers`)
    python tools/render_numbers.py --check    # regenerate in memory; exit 1 naming the stale files

Every figure on the benchmarks page and in the README's results table comes from the JSON files under
``benchmarks/results/`` (the study's from ``study/`` and ``study_converged/``, through the study's own section
builders in ``ppow_trl.study``); the prose around the tables states what each benchmark measures and what its
tables show, without numbers. ``tests/test_generated_docs.py`` runs the check, so a result committed without
regenerating, or a hand edit of a generated part, fails the tests.

The output is deterministic: files are read in sorted order, JSON objects in their stored order, floats with fixed
formats, and nothing about the render itself (no date, no host) is written. Only the part of README.md between
``<!-- results:begin -->`` and ``<!-- results:end -->`` is replaced; the rest of the README is left as it is.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path("benchmarks/results")
BENCHMARKS_PAGE = Path("docs/benchmarks.md")
README = Path("README.md")
README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"
COMMAND = "python tools/render_numbers.py"
# The README's table: compiled_serving.json's runs at this thread count.
README_SOURCE, README_THREADS = "compiled_serving.json", 1
COMPILED_SERVING_HEADING = "Compiled serving"
# Runs of benchmarks/compiled_serving.py kept in files of their own: heading suffix, and why the run is separate.
COMPILED_SERVING_SEPARATE_RUNS = {
    "compiled_serving_2threads_hybrid.json": (
        "with the hybrid", "kept apart so that the earlier rows at this thread count stay as they were."),
    "compiled_serving_xeon_amx.json": (
        "on an Intel Xeon with AMX", "a second machine, with AMX (bf16 and int8 matrix tiles); ratios compare only "
        "within one machine and one run."),
    "compiled_serving_xeon_amx_low_precision_drafters.json": (
        "on an Intel Xeon with AMX, drafters at the target's precision",
        "the same machine, after the warm-up's row check (int8), with each bf16 or int8 row's drafter converted too."),
    "compiled_serving_xeon_amx_split_fitted_lookup.json": (
        "on an Intel Xeon with AMX, split verify calls and fitted lookups",
        "the same machine, int8 verify calls split over graphs that agree (plain decoding on its own graph), prompt "
        "lookup at fitted hit rates, drafters at the target's precision."),
    "compiled_serving_xeon_amx_bf16_int8_fitted_lookup.json": (
        "on an Intel Xeon with AMX, bf16 and int8 on writing and code prompts",
        "the same machine and code as the run above, bf16 added, MT-bench's first 8 prompts (writing) and 8 code "
        "prompts, the main job's retrained drafter."),
    "compiled_serving_xeon_amx_round_costs.json": (
        "on an Intel Xeon with AMX, each round charged its own cost",
        "the same machine, prompts and drafter as the split/fitted-lookup run, with the online guard charging each "
        "drafting round its own window's cost (carried across generations) and the loop's host work from per-round "
        "medians."),
    "compiled_serving_xeon_amx_empty_windows.json": (
        "on an Intel Xeon with AMX, empty windows and the hybrid's lookups alone",
        "the same machine, prompts and drafter as the run above, with the serving calibration also searching rules "
        "whose rounds draft nothing when the first confidence is under h, and the hybrid without its trained "
        "drafter."),
    "compiled_serving_xeon_amx_eagle3.json": (
        "on an Intel Xeon with AMX, with an EAGLE-3 head",
        "the same machine, prompts and drafter as the run above, an EAGLE-3 head (the eagle3 recipe's) added: the "
        "compiled target's graphs return the hidden states it reads; the head itself runs eagerly."),
    "compiled_serving_xeon_amx_2threads.json": (
        "on an Intel Xeon with AMX, every row",
        "the same machine, drafter and code as the EAGLE-3 run (no EAGLE-3 head), at 2 threads, on 20 MT-bench and "
        "10 code prompts, with transformers' compiled generate and llama.cpp's rows."),
}


class MarkerError(ValueError):
    """A generated block's begin or end marker is missing, repeated or out of order."""


# ---------------------------------------------------------------------------------------------------------------
# Formatting


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading; GitHub gives the same for the plain headings here."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    value = re.sub(r"[^\w\s-]", "", value).strip().lower()
    return re.sub(r"[-\s]+", "-", value)


def num(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or isinstance(value, bool):
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and not math.isfinite(value):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def count(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else str(value)


def interval(pair, digits: int = 2) -> str:
    if not pair or any(v is None for v in pair):
        return ""
    return f"[{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"


def with_ci(value, pair, digits: int = 2, suffix: str = "") -> str:
    text = num(value, digits, suffix)
    ci = interval(pair, digits)
    return f"{text} {ci}" if ci and text != "-" else text


def percent(fraction, digits: int = 1) -> str:
    return "-" if fraction is None else f"{100 * fraction:.{digits}f}%"


def slash(values, digits: int = 2) -> str:
    return " / ".join(num(v, digits) for v in values) if values else "-"


def yes_no(value) -> str:
    return "-" if value is None else ("yes" if value else "no")


def table(header: list[str], rows: list[list]) -> list[str]:
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows] + [""])


def command_block(command: str | None, note: str | None = None, shell: bool = True) -> list[str]:
    """The command that reproduces a result, as its JSON records it (``shell=False``: a description, not a command)."""
    if not command:
        return [f"Command: not recorded in the JSON{'; ' + note if note else ''}.", ""]
    if not shell:
        return [f"Run as recorded: `{command}`", ""] + ([note, ""] if note else [])
    return ["Command:", "", "```bash", command, "```", ""] + ([note, ""] if note else [])


def threads_text(threads) -> str:
    return "-" if threads is None else f"{threads} thread{'s' if threads != 1 else ''}"


def machine_text(machine: dict | None = None, cpu: dict | None = None, **fields) -> str:
    """One line: the machine as the JSON records it (CPU, flags, cores, platform, versions, threads, precision)."""
    machine, cpu = machine or {}, cpu or {}
    model = cpu.get("model") or machine.get("cpu")
    hardware = []
    if model:
        hardware.append(str(model))
    cores = cpu.get("cores", machine.get("cpu_count"))
    if cores is not None:
        hardware.append(f"{cores} cores")
    flags = [f"{name} {yes_no(cpu[key])}" for key, name in (("avx512f", "AVX-512"), ("amx", "AMX")) if key in cpu]
    if flags:
        hardware.append(", ".join(flags))
    platform = machine.get("platform", fields.pop("platform", None))
    if platform:
        hardware.append(str(platform))
    device = machine.get("device", fields.pop("device", None))
    if device and device != "cpu":
        hardware.append(f"device {device}")
    software = [f"{name} {machine.get(name, fields.get(name))}" for name in ("torch", "transformers")
                if machine.get(name, fields.get(name))]
    threads = fields.get("threads", machine.get("torch_threads", machine.get("threads")))
    settings = []
    if threads is not None:
        settings.append(threads_text(threads))
    if fields.get("precision"):
        settings.append(f"precision {fields['precision']}")
    if fields.get("runtime"):
        settings.append(f"runtime {fields['runtime']}")
    date = machine.get("date") or fields.get("date")
    if date:
        settings.append(f"run on {date}")
    if not model and not platform:
        head = "not recorded"
        if cores is not None:
            head += f" ({cores} cores)"
    else:
        head = ", ".join(hardware)
        if not model:
            head += " (CPU model not recorded)"
    parts = [head] + ([", ".join(software)] if software else []) + ([", ".join(settings)] if settings else [])
    return "Machine: " + "; ".join(parts) + "."


def plots(results: Path, names: list[str]) -> list[str]:
    """Plots in the repository, named by path (the site does not serve files outside docs/)."""
    found = [name for name in names if (results / name).is_file()]
    if not found:
        return []
    return ["Plots (in the repository, not rendered here): "
            + ", ".join(f"`{RESULTS.as_posix()}/{name}`" for name in found) + ".", ""]


def script_tables(results: Path, names: list[str]) -> list[str]:
    found = [name for name in names if (results / name).is_file()]
    if not found:
        return []
    return ["The benchmark script's own tables: " + ", ".join(f"`{RESULTS.as_posix()}/{n}`" for n in found) + ".", ""]


def recorded(label: str, text: str | None) -> list[str]:
    """A text stored in the JSON (data, written with the result), quoted verbatim."""
    if not text:
        return []
    return [f"{label} (stored in the JSON with the result):", "", *[f"> {line}" if line else ">"
                                                                    for line in str(text).splitlines()], ""]


def load(path: Path) -> dict:
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------------------------
# Sections: each takes the results folder and returns (heading, lines) or None when its JSON is absent. ``SOURCES``
# names the JSON files each section reads, so that a result nobody renders shows up under "Other results".


def thread_setting(results: Path):
    data = load(results / "threads.json")
    summary = data["summary"]
    workloads, settings = [], []
    for key in summary:
        workload, _, threads = key.rpartition("@")
        if workload not in workloads:
            workloads.append(workload)
        if threads not in settings:
            settings.append(threads)
    header = ["workload"] + [f"{threads_text(int(t))}: median ms (p10, p90)" for t in settings]
    if len(settings) > 1:
        header += [f"median {threads_text(int(t))} / {threads_text(int(settings[0]))}" for t in settings[1:]]
    rows = []
    for workload in workloads:
        cells = [workload.replace("_", " ")]
        for t in settings:
            s = summary.get(f"{workload}@{t}")
            cells.append("-" if s is None else f"{s['median_ms']:.2f} ({s['p10_ms']:.2f}, {s['p90_ms']:.2f})")
        base = summary.get(f"{workload}@{settings[0]}")
        for t in settings[1:]:
            s = summary.get(f"{workload}@{t}")
            cells.append("-" if not (s and base) else f"{s['median_ms'] / base['median_ms']:.2f}")
        rows.append(cells)
    lines = [
        "Which torch thread setting to use on this machine (`benchmarks/threads.py`): a one-token cached decode step and "
        "a multi-token verification forward of SmolLM2-135M-Instruct, and a tiny model's forward, timed at each "
        "thread setting, the settings alternated round by round so that machine load hits them alike.", "",
        *command_block(data.get("command")),
        machine_text(data.get("machine"), precision=data.get("precision")) + f" Rounds: {data.get('rounds', '-')}.", "",
        *table(header, rows),
        "Reading: decode on this CPU is memory-bound, so extra threads buy little for a one-token step and can cost on "
        "tiny forwards (the ratio column). **Choice: one thread** for tests and benchmarks (`PPOW_TRL_NUM_THREADS` "
        "overrides it, `ppow_trl.utils.set_cpu_threads`): stability matters more than a small gain on verification, "
        "and the other core stays free for a second process (e.g. a 2-process recipe run). Earlier sessions saw two "
        "threads become erratic under load.", "",
    ]
    return "Thread setting", lines


def cost_model(results: Path):
    data = load(results / "cost_model.json")
    rows = data["rows"]
    k = max(len(r["verify_cost"]) for r in rows) - 1
    lines = [
        "The cost model of SmolLM2-135M-Instruct with truncated drafters (the target's first N layers), full output "
        "head against a reduced draft head (`benchmarks/cost_model.py`): `calibrate_cost_model` (round-robin timing, "
        "medians after warm-up) on one chat-template context, KV cache. `t_d/t_t` is a drafter step over a target step, "
        "`t_v(L)/t_t` a verification forward over L + 1 tokens over a target step, and the break-even accepted length "
        f"at a fixed window K is E[A] = K t_d/t_t + t_v(K)/t_t - 1: the expected accepted length at which a fixed-K "
        "round is exactly as fast as plain decoding.", "",
        *command_block(data.get("command")),
        machine_text(data.get("machine"), precision=data.get("precision"), threads=data.get("threads"))
        + f" Context: {data.get('context_tokens', '-')} tokens.", "",
        *table(["drafter layers", "head", "t_d/t_t", f"break-even E[A] at K = {k}", "target step ms", "drafter step ms"],
               [[r["drafter_layers"], r["head"], num(r["drafter_cost"], 3), num(r["break_even_accepted_at_K"]),
                 num(r["target_step_ms"], 1), num(r["drafter_step_ms"], 1)] for r in rows]),
        "Verification cost `t_v(L)/t_t` per row:", "",
        *table(["drafter layers", "head"] + [f"L = {i}" for i in range(k + 1)],
               [[r["drafter_layers"], r["head"]] + [num(v) for v in r["verify_cost"]] for r in rows]),
    ]
    dips = [L for L in range(1, k) if all(len(r["verify_cost"]) > L + 1 and r["verify_cost"][L] > r["verify_cost"][L + 1]
                                          for r in rows)]
    lines += [
        "Reading: the full output head is most of a small drafter's cost; the reduced head lowers `t_d/t_t` and the "
        "break-even accepted length at every depth (compare the rows of each depth). A drafter needs an E[A] above "
        "the break-even column before speculation pays on this machine."
        + (f" Verification cost is not monotone in L on this CPU: in every row `t_v(L)/t_t` exceeds "
           f"`t_v(L+1)/t_t` at L = {', '.join(str(L) for L in dips)}, a kernel-shape effect of the CPU matmuls, "
           "not noise; the cost model keeps measured values as they are (no monotone smoothing) so that the window "
           "policy can exploit such effects." if dips else ""), "",
    ]
    return "Cost model", lines


def compiled_runtime_settings(results: Path):
    data = load(results / "compiled_runtime_settings.json")
    rows = data["rows"]
    verify = sorted({key for r in rows for key in r if key.startswith("t_v")}, key=lambda k: int(re.sub(r"\D", "", k)))
    lines = [
        "The compiled runtime's inductor settings, chosen by measurement (`benchmarks/compiled_runtime_settings.py`): "
        "per setting the cold compile seconds (empty inductor cache), the warm start (a new process, cache filled), "
        "the one-token step `t_t` and the verification costs `t_v(L)/t_t`; the eager row is transformers' eager forward "
        "over its dynamic cache, as the serving loop ran before the compiled runtime. Each setting runs in child "
        "processes, so compiling one cannot warm another.", "",
        *command_block(data.get("command")),
        machine_text(cpu=data.get("cpu"), torch=data.get("torch")), "",
        *recorded("Setup", data.get("setup")),
        *table(["setting", "dtype", "t_t ms"] + [k.replace("/t_t", "/t_t") for k in verify]
               + ["cold compile s", "warm start s", "t_t ms after a warm start", "process s",
                  "warm memory GB (own / mapped files)", "cache on disk GB"],
               [[r["setting"], r.get("dtype", "-"), num(r.get("t_t_ms"), 2)] + [num(r.get(k), 3) for k in verify]
                + [num(r.get("cold_compile_s"), 1), num(r.get("warm_start_s"), 1), num(r.get("warm_t_t_ms"), 2),
                   num(r.get("process_s"), 1),
                   f"{num(r.get('warm_rss_anon_gb'), 2)} / {num(r.get('warm_rss_file_gb'), 2)}"
                   if r.get("warm_rss_anon_gb") is not None else "-", num(r.get("cache_disk_gb"), 2)] for r in rows]),
        "Rows without a dtype ran the fp32 weights (the script's convention). Settings: `freezing+max-autotune` is "
        "torch.compile over PyTorch's attention with the C++ and ATen GEMMs (the defaults before row independence); "
        "`row-independent` pads attention to K_max + 1 rows and uses only the C++ GEMM template, compiled by "
        "torch.compile in each process; `packaged` (the default) keeps the same graphs as AOTInductor packages on "
        "disk, built cold by worker processes, one more than the cores (3 here); `packaged-1-worker` and "
        "`packaged-2-workers` build the same packages one at a time in the serving process, or two at once. Reading: compiling (freezing + max-autotune) cuts the one-token step and flattens the verification "
        "costs against eager, at a one-off cold compile per machine; a torch.compile process still traces and freezes "
        "the model again from a filled cache (the warm-start column), a packaged one loads the finished graphs, and "
        "its C++ wrapper calls the kernels without Python in between (a shorter step). Building the packages side "
        "by side cut the cold compile from 430 s (one at a time) to 273-283 s. The memory column is the warm process's "
        "resident memory after loading (its own, and mapped files, from /proc/self/status): every row count's package "
        "holds its own copy of the packed weights, about 1.1 GB each for SmolLM2 fp32; the disk column is the whole "
        "inductor cache after the run (the 5 packages; AOTInductor's build folders are removed). Rows ran in separate "
        "processes at different times, and the timing columns of the three packaged rows (the same graphs) differ "
        "by up to 1.25x: compare timings across rows with that noise in mind. The runtime's design and its cache: the "
        "compiled runtime page.", "",
        *script_tables(results, ["compiled_runtime_settings.md"]),
    ]
    return "Compiled runtime settings", lines


def _served_rows(arms: dict) -> tuple[list[str], list[list[str]]]:
    """A served side-by-side table (``ppow_trl.bench.served``): numeric arms, or arms stored as formatted strings."""
    if all(isinstance(v, dict) and all(isinstance(x, str) for x in v.values()) for v in arms.values()):
        header = list(next(iter(arms.values())).keys())
        return ["arm"] + header, [[f"`{name}`"] + [arm.get(k, "-") for k in header] for name, arm in arms.items()]
    speedups = []
    for arm in arms.values():
        for key in arm:
            if key.startswith("speedup_vs_") and not key.endswith("_ci95") and key not in speedups:
                speedups.append(key)
    # names in code spans: "compiled_plain[fp32] [95% CI]" would read as a reference link to the site's autorefs
    header = ["arm", "ms/token [95% CI]", "tau"] + [f"speedup vs `{k[len('speedup_vs_'):]}` [95% CI]"
                                                     for k in speedups] + ["lossless", "= eager", "new tokens"]
    rows = []
    for name, arm in arms.items():
        rows.append([f"`{name}`", with_ci(arm.get("ms_per_token_median"), arm.get("ms_per_token_ci95"), 1),
                     num(arm.get("tau"))]
                    + [with_ci(arm.get(k), arm.get(k + "_ci95"), 2, "x") for k in speedups]
                    + [arm.get("lossless_prompts", "-"), arm.get("agrees_with_eager_prompts", "-"),
                       count(arm.get("new_tokens"))])
    return header, rows


def _verdicts(arms: dict, baseline_key: str) -> str:
    """Which speculative arms are faster / slower than the baseline with their interval, and which are not separated."""
    faster, slower, even = [], [], []
    for name, arm in arms.items():
        if not name.startswith("compiled_speculative") or baseline_key + "_ci95" not in arm:
            continue
        low, high = arm[baseline_key + "_ci95"]
        (faster if low > 1 else slower if high < 1 else even).append(f"`{name}`")
    parts = []
    for label, names in (("faster than compiled plain decoding (interval above 1)", faster),
                         ("not separated from it (interval includes 1)", even),
                         ("slower (interval below 1)", slower)):
        if names:
            parts.append(f"{label}: {', '.join(names)}")
    return "; ".join(parts)


def _lossless(arms: dict) -> str:
    spec = {n: a.get("lossless_prompts") for n, a in arms.items() if "_speculative" in n}
    if not spec:
        return ""
    ok = all(isinstance(v, str) and "/" in v and v.split("/")[0] == v.split("/")[1] for v in spec.values())
    return ("every speculative row lossless (tokens equal to plain decoding's at the same precision and runtime, "
            "on every prompt)" if ok else "not every speculative row is lossless: see the lossless column")


def _compiled_serving_runs(data: dict, threads_key: str, run_names: list[str]) -> list[str]:
    meta = (data.get("meta") or {}).get(threads_key, {})
    lines = [machine_text(cpu=meta.get("cpu"), torch=meta.get("torch"), threads=meta.get("threads"),
                          precision=_plain_precision(data, run_names),
                          runtime="per row (transformers' `generate` eager or compiled, ppow_trl's compiled runtime)"),
             ""]
    if meta.get("command"):
        lines += command_block(meta["command"])
    compile_s = meta.get("compile_s") or {}
    if compile_s:
        lines += ["Compile seconds of this run: " + ", ".join(f"{k} {v}" for k, v in compile_s.items()) + ".", ""]
    if meta.get("drafter"):
        lines += [f"Drafter (`compiled_speculative[ppow]`, and the hybrid's trained half): `{meta['drafter']}`; "
                  f"{meta.get('max_new_tokens', '-')} new tokens per prompt, greedy, batch 1.", ""]
    if (meta.get("settings") or {}).get("drafter_precision") == "target":
        lines += ["The drafters of the `@bf16` and `@int8` rows ran at their target's precision "
                  "(`--drafter-precision target`); the fp32 rows' drafters in fp32.", ""]
    for run in run_names:
        block = data["runs"][run]
        prompt_set = run.split("/", 1)[1]
        lines += [f"**{_PROMPT_SETS.get(prompt_set, prompt_set)}**: {block.get('prompts', '-')} prompts "
                  f"({block.get('skipped_too_long', 0)} longer than the static cache passed over)", ""]
        header, rows = _served_rows(block["arms"])
        lines += table(header, rows)
        verdict = _verdicts(block["arms"], "speedup_vs_compiled_plain[fp32]")
        lossless = _lossless(block["arms"])
        if verdict or lossless:
            lines += ["From the intervals: " + "; ".join(x for x in (verdict, lossless) if x) + ".", ""]
    llama_cpp = meta.get("llama_cpp") or {}
    if llama_cpp.get("skipped"):
        lines += [f"llama.cpp rows: not run ({llama_cpp['skipped']}).", ""]
    elif llama_cpp:
        lines += ["llama.cpp rows (llama-cpp-python): SmolLM2 exported to GGUF and quantized, files "
                  + ", ".join(f"{k} {v} MiB" for k, v in (llama_cpp.get("file_mb") or {}).items())
                  + f"; the drafter as llama-cpp-python's draft model at K = {llama_cpp.get('draft_window', '-')}"
                  + (f"; skipped: {llama_cpp['skipped_rows']}" if llama_cpp.get("skipped_rows") else "") + ".", ""]
    rules = meta.get("rules") or {}
    costs = meta.get("cost_models") or {}
    if costs:
        lines += ["Cost models on the compiled runtime (measured by the run):", ""]
        lines += table(["drafter", "runtime", "t_t ms", "t_d/t_t", "t_v(1..)/t_t", "loop overhead (o_0, o_r, o_d)"],
                       [[name, c.get("runtime", "-"), num(c.get("t_t_ms"), 2), num(c.get("t_d/t_t"), 4),
                         slash((c.get("t_v(L)/t_t") or [])[1:], 3),
                         slash(c.get("loop_overhead (o_0, o_r, o_d)"), 4) if c.get("loop_overhead (o_0, o_r, o_d)")
                         is not None else "-"] for name, c in costs.items()])
    if rules:
        lines += ["Served rules (`calibrate_for_serving` on the compiled runtime's costs):", "",
                  *[f"- {name}: {rule}" for name, rule in rules.items()], ""]
        margin = (meta.get("settings") or {}).get("served_min_speedup")
        near = [name for name, rule in rules.items()
                if (found := re.search(r"predicted ([0-9.]+)x", rule)) and float(found.group(1)) < 1.05
                and not rule.startswith("No speculation")]
        if margin is None and near:  # calibrated before the serving margin (SERVED_MIN_SPEEDUP) existed
            lines += [f"These rules were calibrated before the serving margin (a rule must be predicted at least "
                      f"1.05x): with it, {', '.join(near)} would serve K = 0, plain decoding.", ""]
    return lines


_PROMPT_SETS = {"mtbench": "MT-bench", "code": "code", "sharegpt_test": "ShareGPT test"}


def _plain_precision(data: dict, run_names: list[str]) -> str | None:
    """The precision the plain compiled arm's name records (``compiled_plain[fp32]``); other rows say theirs."""
    for run in run_names:
        for name in data["runs"][run]["arms"]:
            match = re.fullmatch(r"compiled_plain\[(\w+)\]", name)
            if match and match.group(1) == "fp32":
                return "fp32 (the rows that name another precision ran in it)"
    return None


def _threads_groups(data: dict) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for run in data["runs"]:
        groups.setdefault(run.split("/", 1)[0], []).append(run)
    return dict(sorted(groups.items(), key=lambda kv: int(re.sub(r"\D", "", kv[0]) or 0)))


def compiled_serving(results: Path):
    data = load(results / "compiled_serving.json")
    lines = [
        "The serving runtimes side by side (`benchmarks/compiled_serving.py`): transformers' `generate` (eager, and "
        "compiled with a static cache) against ppow_trl's compiled runtime, plain and speculative, greedy, batch 1, on "
        "MT-bench and code prompts, at each thread count asked for. Every arm runs on every prompt, back to back in a "
        "rotating order. Rows:", "",
        "- `hf_generate_eager`: `target.generate`, dynamic cache, eager (the baseline most users have);",
        "- `hf_generate_compiled`: `generate` with `cache_implementation=\"static\"` and a `CompileConfig` (inductor), "
        "transformers' documented route;",
        "- `compiled_plain[<precision>]`: ppow_trl's loop without a drafter on the compiled runtime "
        "(`ppow_trl.serving.runtime`), the target in fp32 or converted (`int8`: weight-only, `ppow_trl.compiled_runtime.precision`);",
        "- `compiled_speculative[<drafter>]` (fp32 target) and `compiled_speculative[<drafter>@<precision>]`: the loop "
        "with a drafter and the rule `calibrate_for_serving` chooses on that runtime's measured costs: the main job's "
        "drafter (`ppow`), prompt lookup, and the hybrid of the two (`ppow_trl.drafters.hybrid`: the looked-up token "
        "where the text repeats, the drafter's elsewhere);",
        "- `llama_cpp_plain[<gguf>]` and `llama_cpp_speculative[<gguf>]`: llama.cpp (llama-cpp-python) on SmolLM2 "
        "exported to GGUF (F16, Q8_0), alone and with the main job's drafter as its draft model.", "",
        "Per row: median ms/token [95% CI], tau (tokens per target forward), speedups against `compiled_plain[fp32]` "
        "and `hf_generate_eager` (ratio of total times [95% CI]), lossless prompts (tokens equal to plain decoding's "
        "at the same precision and runtime) and agreement with fp32 eager plain decoding (`= eager`).", "",
        *command_block(data.get("command"), "Each thread count's own command is given with its tables. A rerun skips "
                                            "thread counts already in the JSON with the same settings (`--force` "
                                            "reruns those asked for from scratch). A run that is killed resumes: "
                                            "the same command goes on from the prompt it was on, with the rules it "
                                            "calibrated (kept under the cache's `bench/compiled_serving/`)."),
    ]
    sections = [(COMPILED_SERVING_HEADING, lines)]
    for threads_key, runs in _threads_groups(data).items():
        count_ = re.sub(r"\D", "", threads_key)
        sections.append((f"{COMPILED_SERVING_HEADING} at {threads_text(int(count_))}",
                         _compiled_serving_runs(data, threads_key, runs)))
    for name, (suffix, why) in COMPILED_SERVING_SEPARATE_RUNS.items():
        if not (results / name).is_file():
            continue
        extra = load(results / name)
        for threads_key, runs in _threads_groups(extra).items():
            count_ = re.sub(r"\D", "", threads_key)
            sections.append((f"{COMPILED_SERVING_HEADING} at {threads_text(int(count_))} {suffix}",
                             [f"A separate run (`{RESULTS.as_posix()}/{name}`): {why}", "",
                              *([f"Reading: {extra['reading']}", ""] if extra.get("reading") else []),
                              *_compiled_serving_runs(extra, threads_key, runs)]))
    names = ["compiled_serving", *(Path(name).stem for name in COMPILED_SERVING_SEPARATE_RUNS)]
    sections[-1][1].extend(plots(results, [f"{name}.png" for name in names])
                           + script_tables(results, [f"{name}.md" for name in names]))
    return sections


def main_job_compiled(results: Path):
    data = load(results / "main_job_compiled.json")
    lines = [
        "The main job (`recipes/ppow_llama.py`, `runtime: compiled`: the offline default, or the config a run names) as "
        "run end to end: wall clock, the "
        "served rule decided on the compiled runtime's costs, and the job's own side-by-side evaluation of the served "
        "rule against compiled plain decoding and transformers' eager `generate`. One entry per recorded run, in the "
        "order they were recorded.", "",
    ]
    for i, run in enumerate(data["runs"], 1):
        lines += [f"**Run {i}**" + (f" ({run['label']})" if run.get("label") else ""), "",
                  *command_block(run.get("command"), shell=False),
                  machine_text(cpu=run.get("cpu"), runtime="compiled"), ""]
        facts = [("wall clock", run.get("wall_clock")), ("data", "; ".join(run.get("data", [])) or None),
                 ("training", "; ".join(run.get("kd", [])) or None),
                 ("compile", "; ".join(run.get("compile", [])) or None),
                 ("trainer's t_d/t_t", num(run.get("trainer_cost_ratio_t_d_over_t_t"), 4)
                  if run.get("trainer_cost_ratio_t_d_over_t_t") is not None else None),
                 ("served rule", run.get("served_rule")), ("hybrid's rule", run.get("hybrid_rule")),
                 ("prompt lookup's rule", run.get("lookup_rule")), ("reading", run.get("reading")),
                 ("hybrid reload check", run.get("hybrid_reload_check"))]
        lines += [f"- {label}: {value}" for label, value in facts if value] + [""]
        cost = run.get("cost_model")
        if cost:
            lines += [f"Cost model of the served drafter: t_d/t_t {num(cost.get('drafter_cost'), 3)}, t_v(1..)/t_t "
                      f"{slash(cost.get('verify_cost', [])[1:])} ({cost.get('description', '')}).", ""]
        overhead = run.get("loop_overhead")
        if overhead:
            lines += table(["loop", "per plain step s", "per drafting round s", "per drafted token s"],
                           [[name, num(o.get("plain_step"), 5), num(o.get("drafting_round"), 5),
                             num(o.get("drafted_token"), 5)] for name, o in overhead.items()])
        side_by_side = next((key for key in run if key.startswith("served_side_by_side")), None)
        served = run.get("served_evaluation") or (run.get(side_by_side) if side_by_side else None)
        if served:
            arms = served["arms"] if isinstance(served.get("arms"), dict) else served
            named = re.fullmatch(r"served_side_by_side_(\d+)_(\w+?)_(\d+)_tokens", side_by_side or "")
            what = served.get("prompts") or (f"{named.group(1)} {_PROMPT_SETS.get(named.group(2), named.group(2))} "
                                             f"prompts, {named.group(3)} new tokens (from the key's name)"
                                             if named else "")
            lines += [f"Served side by side: {what}" + (f"; runtime {served['runtime']}" if served.get("runtime")
                                                         else "") + ".", ""]
            header, rows = _served_rows({k: v for k, v in arms.items() if isinstance(v, dict)})
            lines += table(header, rows)
        if run.get("eager_evaluation"):
            lines += ["The job's evaluation on the eager routes, as it printed it:", "", "```text",
                      *run["eager_evaluation"], "```", ""]
    return "Main job on the compiled runtime", lines


_ROUTES = {
    "target": "`target.generate` alone",
    "hook[served]": "hook, served rule (HF's assisted loop with our rule)",
    "fast_adaptive[served]": "our loop, served rule",
    "fast_plain": "our loop at K = 0 (`fast_plain`)",
    "fast_adaptive[speculative]": "our loop, best speculative rule with the online guard",
    "fast_adaptive[speculative_unguarded]": "our loop, best speculative rule without the guard",
}


def shipped_drafter(results: Path):
    files = [name for name in ("speedup.json", "speedup_served.json", "speedup_served_code.json")
             if (results / name).is_file()]
    lines = [
        "Greedy speedup of the shipped drafter against the target alone, as users serve it (`benchmarks/speedup.py`): "
        "for each drafter folder and prompt set (MT-bench questions; code completion from `more-itertools`, which "
        "nothing here trains or tunes on), `ppow_trl.bench.run_benchmark` times every route interleaved prompt by "
        "prompt after a warm-up, on the eager runtime. Speedups: median per-prompt ratio with a 95% bootstrap interval "
        "over prompts; ms per round split into the target's forwards, the drafter's and the time outside the models.",
        "",
    ]
    for name in files:
        data = load(results / name)
        lines += [f"**`{RESULTS.as_posix()}/{name}`**", "", *command_block(data.get("command")),
                  machine_text(data.get("machine")), ""]
        for run_name, run in data["runs"].items():
            calibration = (run.get("policy") or {}).get("calibration") or {}
            cost = run.get("cost_model") or {}
            lines += [f"*{run_name}*: drafter `{run.get('drafter')}`, {run.get('num_prompts')} "
                      f"{_PROMPT_SETS.get(run.get('prompts'), run.get('prompts'))} prompts, {run.get('max_new_tokens')} "
                      f"new tokens, {run.get('precision')}, {threads_text(run.get('threads'))}, {run.get('date')}.", "",
                      f"Served rule: {run.get('served_rule', '-')}", "",
                      f"Cost model of the drafter as served: t_d/t_t {num(cost.get('drafter_cost'), 3)}, "
                      f"t_v(1..)/t_t {slash(cost.get('verify_cost', [])[1:])} ({cost.get('description', '')}).", ""]
            rows = []
            for row in run["rows"]:
                ms = row.get("ms_per_round") or {}
                rows.append([_ROUTES.get(row["label"], row["label"]), num(row.get("tau"), 3),
                             with_ci(row.get("speedup_median"), row.get("speedup_median_ci95"), 3),
                             row.get("lossless_prompts", "-"),
                             f"{num(ms.get('target'), 1)} / {num(ms.get('drafter'), 1)} / {num(ms.get('outside'), 1)}",
                             num(row.get("mean_window_length")), num(row.get("guard_plain_round_share"))])
            lines += table(["route", "tau", "speedup, median [95% CI]", "lossless",
                            "ms per round: target / drafter / outside", "mean window", "guard: plain-round share"], rows)
            best = calibration.get("best_speculative_speedup")
            unguarded = next((r for r in run["rows"] if r["label"] == "fast_adaptive[speculative_unguarded]"), None)
            if best is not None and unguarded is not None:
                lines += [f"Prediction against measurement: the calibration predicted {best:.3f}x for the best "
                          f"speculative rule on {calibration.get('num_contexts', '-')} held-out contexts; unguarded it "
                          f"measured {with_ci(unguarded['speedup_median'], unguarded.get('speedup_median_ci95'), 3, 'x')}.",
                          ""]
    lines += [
        "Reading: the served routes (K = 0 where the calibration predicts no gain) stay close to the target alone on "
        "both prompt sets and are lossless (intervals above). The online guard recovers much of what an unprofitable "
        "speculative rule loses by pausing most rounds (plain-round share), but cannot reach the target's speed where "
        "every probe pays a verification; so K = 0 is the right call where the calibration predicts less than 1x, and "
        "the guard is the net for a drafter that passed calibration and then meets harder text. The served-only "
        "reruns (`speedup_served*.json`) were measured after the loop stopped passing an all-ones attention mask to "
        "the target (which `generate`'s decoding steps drop). On the compiled runtime the same question has other "
        "answers: see \"Compiled serving\".", "",
        *script_tables(results, ["speedup.md", "speedup_served.md", "speedup_served_code.md"]),
    ]
    return "Speed of the shipped drafter", lines


_BENCH_TITLES = {
    "bench_smollm2": "Untrained drafter, every route",
    "bench_smollm2_all_methods": "Every method, greedy and sampled",
    "bench_prompt_lookup": "Prompt lookup as served",
}
_BENCH_READINGS = {
    "bench_smollm2": "Reading: with an untrained drafter (tau near 1) every speculative method is slower than the "
                     "target alone; what pays relative to a fixed window is the adaptive rule, by drafting fewer "
                     "doomed tokens (the comparisons, and the mean window column). Our loop's per-round saving over "
                     "HF's assisted loop with the same drafter and rounds is small on a CPU where a round costs "
                     "several target steps of model compute. The GPU case was not measured here.",
    "bench_smollm2_all_methods": "A smoke-sized run over every method and both modes (few prompts and tokens): it "
                                 "shows that every route runs and stays lossless in greedy mode, not their speeds.",
    "bench_prompt_lookup": "Reading: prompt lookup (the study's `prompt_lookup` arm) has the best acceptance of the "
                           "study with no training, but its calibrated rule was predicted above 1x on held-out "
                           "ShareGPT contexts and measured below the target on MT-bench (served rule and table): the "
                           "calibration contexts repeat far more than MT-bench answers, and the window rule always "
                           "drafts at least one token, so rounds without a match still pay a multi-token "
                           "verification. Calibrating on the served prompts, and a rule that drafts nothing when the "
                           "first confidence is below h, are the changes this points to.",
}


def bench_methods(results: Path):
    lines = [
        "`python -m ppow_trl.bench`: speculative-decoding methods side by side on SmolLM2-135M-Instruct, interleaved "
        "prompt by prompt after a warm-up, batch 1. tau = tokens generated / target forwards that yield tokens; speedup "
        "= median over prompts of the method's tokens/s over the target's on the same prompt, with p25/p75; lossless = "
        "greedy output equal to the target's, token for token. Methods: `target` alone; `hf_assisted` (HF's assisted "
        "generation, constant K), `hf_heuristic`, `hf_confidence` (HF's confidence threshold); `prompt_lookup` (HF's "
        "prompt lookup); `hook` (HF's assisted loop with our window rule); `fast_fixed` and `fast_adaptive` (our loop at "
        "fixed K and with our rule).", "",
    ]
    sections = [("Methods on SmolLM2", lines)]
    for path in sorted(results.glob("bench_*.json")):
        data = load(path)
        settings = data.get("settings", {})
        body = [f"From `{RESULTS.as_posix()}/{path.name}`.", "", *command_block(settings.get("command")),
                machine_text(data.get("machine"), precision=settings.get("precision"),
                             threads=settings.get("threads")),
                "", f"Settings: {settings.get('num_prompts', '-')} {_PROMPT_SETS.get(settings.get('prompts'), '')} "
                    f"prompts, {settings.get('max_new_tokens', '-')} new tokens, modes "
                    f"{', '.join(settings.get('modes', []))}, batch {settings.get('batch_size', '-')}.", ""]
        rows = [[s["mode"], s["method"], s.get("drafter") or "-",
                 f"{num(s['speedup_median'])} [{num(s['speedup_p25'])}, {num(s['speedup_p75'])}]",
                 num(s.get("tokens_per_second_median"), 1), num(s.get("tau")), s.get("lossless_prompts") or "-",
                 num(s.get("mean_window_length")), num(s.get("mean_accepted"), 3)] for s in data.get("summary", [])]
        body += table(["mode", "method", "drafter", "speedup median [p25, p75]", "tokens/s median", "tau", "lossless",
                       "mean window", "mean accepted"], rows)
        comparisons = data.get("comparisons") or []
        if comparisons:
            body += ["Same drafter, same prompts: per-prompt tokens/s ratio.", ""]
            body += table(["mode", "drafter", "method / baseline", "median [p25, p75]"],
                          [[c["mode"], c["drafter"], f"{c['method']} / {c['baseline']}",
                            f"{num(c['ratio_median'])} [{num(c['ratio_p25'])}, {num(c['ratio_p75'])}]"]
                           for c in comparisons])
        drafters = data.get("drafters") or []
        if drafters:
            body += table(["drafter", "source", "K", "h", "parameters", "t_d/t_t", "t_v(1..)/t_t"],
                          [[d["name"], d.get("source", "-"), (d.get("policy") or {}).get("max_window", "-"),
                            num((d.get("policy") or {}).get("threshold")), count(d.get("parameters")),
                            num(d.get("cost_ratio"), 3), slash((d.get("verify_cost") or [])[1:])] for d in drafters])
            body += [f"- {d['name']}: {d['served_rule']}" for d in drafters if d.get("served_rule")]
            body += [""] if any(d.get("served_rule") for d in drafters) else []
        if path.stem in _BENCH_READINGS:
            body += [_BENCH_READINGS[path.stem], ""]
        body += plots(results, [path.stem + ".png"]) + script_tables(results, [path.stem + ".md"])
        sections.append((_BENCH_TITLES.get(path.stem, path.stem.replace("_", " ")), body))
    return sections


def llama_cpp_serving(results: Path):
    data = load(results / "llama_cpp_serving.json")
    drafter = data.get("drafter") or {}
    cost = data.get("llama_cpp_cost_model") or {}
    lines = [
        "Which stack to serve SmolLM2-135M-Instruct on this CPU, and what our drafter does inside llama.cpp "
        "(`benchmarks/llama_cpp_serving.py`): MT-bench first turns (chat template), greedy, batch 1, all arms side by "
        "side prompt by prompt in one process. Arms: `transformers_fp32` (`target.generate` on the fp32 SmolLM2, the "
        "Q4_1 weights dequantized: our usual baseline); `llama_cpp_q4_1` (the shipped Q4_1 GGUF in llama.cpp's CPU "
        "kernels through llama-cpp-python); the same with the main job's drafter as llama-cpp-python's draft model "
        "(`LlamaCppDrafter`, fixed K, greedy drafts), quantized to q8_0 by llama.cpp's quantizer or in f32. Speed = "
        "decoding ms per token after the first (the prompt's forward excluded), as a per-prompt ratio to "
        "`llama_cpp_q4_1`, median with a bootstrap 95% interval.", "",
        *command_block(data.get("command")),
        machine_text(data.get("machine"), threads=data.get("threads")) + f" {data.get('num_prompts', '-')} prompts, at "
        f"most {data.get('max_new_tokens', '-')} new tokens.", "",
        *table(["what", "precision"], [[k, v] for k, v in (data.get("precision") or {}).items()]),
        f"Drafter: `{drafter.get('source', '-')}`, {drafter.get('layers', '-')} layers, its reduced head written over "
        f"the full vocabulary (greedy proposal unchanged on {percent(drafter.get('expanded_head_agreement'))} of prompt "
        "positions); files: " + ", ".join(f"{k} {v} MB" for k, v in (drafter.get("file_mb") or {}).items()) + ".", "",
    ]
    rows = []
    for name, arm in data["arms"].items():
        rows.append([f"`{name}`", num(arm.get("decode_ms_per_token_median"), 1), num(arm.get("first_token_ms_median"), 1),
                     with_ci(arm.get("speed_vs_llama_cpp_q4_1_median"), arm.get("speed_vs_llama_cpp_q4_1_ci95"), 3,
                             "x"),
                     num(arm.get("tau")), count(arm.get("rounds")), count(arm.get("tokens")),
                     arm.get("same_text_as_llama_cpp_q4_1", "-")])
    lines += table(["arm", "decode ms/token", "first token ms", "speed vs llama.cpp Q4_1 [95% CI]", "tau", "rounds",
                    "tokens", "same text as llama.cpp Q4_1"], rows)
    if cost:
        verify = cost.get("t_v_over_t_t") or {}
        lines += [f"llama.cpp's cost model on this machine: `t_t` {num(cost.get('t_t_ms'), 1)} ms (transformers fp32: "
                  f"{num(cost.get('transformers_fp32_t_t_ms'), 1)} ms); target `t_v(L)/t_t` with the all-position logits "
                  "verification needs: " + ", ".join(f"L = {L}: {num(v)}" for L, v in verify.items())
                  + "; drafter `t_d/t_t`: " + ", ".join(f"{k} {num(v)}" for k, v in (cost.get("t_d_over_t_t") or {})
                                                        .items()) + ".", ""]
    if data.get("batch_invariance_q4_1_max_abs_logit_diff") is not None:
        lines += ["Batch invariance of the Q4_1 target: largest absolute logit difference between llama.cpp's "
                  f"one-token and multi-token forwards over the first answer: "
                  f"{num(data['batch_invariance_q4_1_max_abs_logit_diff'], 3)}.", ""]
    programs = data.get("llama_speculative_simple") or {}
    if programs:
        lines += ["llama.cpp's own `llama-speculative-simple` with the same files (the first prompt; no plain baseline: "
                  "`--spec-draft-n-max 0` aborts, so these figures are absolute):", ""]
        lines += table(["--spec-draft-n-max", "drafted", "accepted", "decoded tokens", "decode ms/token"],
                       [[k, count(p.get("n_drafted")), count(p.get("n_accept")), count(p.get("decoded_tokens")),
                         num(1000 * p["decode_seconds"] / p["decoded_tokens"], 1)
                         if p.get("decode_seconds") and p.get("decoded_tokens") else "-"] for k, p in programs.items()])
    server = data.get("llama_server")
    if server:
        draft_max = re.search(r"--spec-draft-n-max (\d+)", server.get("command", ""))
        lines += [f"`llama-server` with the same pair (`--spec-draft-n-max {draft_max.group(1) if draft_max else '-'}`, "
                  f"one `/completion` request): {count(server.get('draft_n_accepted'))} of "
                  f"{count(server.get('draft_n'))} drafted tokens accepted, "
                  f"{num(server.get('predicted_per_token_ms'), 1)} ms per token over {count(server.get('predicted_n'))} "
                  "tokens. Rerun the programs alone with `--programs-only`.", ""]
    lines += [
        "Reading:",
        "",
        "- **Serve on llama.cpp.** Its Q4_1 target decodes several times faster than the fp32 target in transformers on "
        "this CPU (first two rows); any drafter served through transformers here starts that far behind.",
        "- **No drafter pays inside llama.cpp here either.** Verifying more than one token costs well above one decode "
        "step (the cost model: quantized matrix-matrix kernels for more than one token), and the drafter's acceptance "
        "is far below what would repay a round, so the served rule stays K = 0. Quantizing the drafter (q8_0 against "
        "f32) is what llama.cpp users need; it did not change tau.",
        "- **Speculative text is not plain text with a Q4_1 target.** llama.cpp's one-token and multi-token forwards "
        "of the Q4_1 model differ in their logits (batch invariance above), so most speculative answers differ from "
        "plain llama.cpp decoding for every K and both drafter files (the JSON stores the counts, not the texts). "
        "This is llama.cpp's numerics, not the drafter's: with an f32 target file and an f32 KV cache, speculative "
        "decoding through `LlamaCppDrafter` is token for token the plain text and transformers' text "
        "(`tests/test_llama_cpp.py`). transformers fp32 and llama.cpp Q4_1 rarely agree on a whole answer "
        "(llama.cpp's Q4_1 kernels quantize activations).",
        "- Caveats: one machine, one drafter (the main job's, weak); the drafter reads the prompt at its first call, "
        "inside the decode time (a small bias against the drafter arms). llama.cpp also lists EAGLE-3 and DFlash "
        "draft types (`--spec-type draft-eagle3`, `draft-dflash`); their GGUF layouts are not written here.", "",
    ]
    return "Serving on llama.cpp", lines


def _verify_tokens(arms: dict) -> str:
    """The window length in the JSON's key (``verify5_ms``: one evaluation of 5 tokens)."""
    for arm in arms.values():
        for key in arm:
            match = re.fullmatch(r"verify(\d+)_ms", key)
            if match:
                return match.group(1)
    return "multi"


def llama_cpp_amx_build(results: Path):
    data = load(results / "llama_cpp_amx_build.json")
    arms = data.get("arms") or {}
    lines = [
        "What the llama.cpp build for AMX CPUs costs (`benchmarks/llama_cpp_amx_build.py`): on a CPU with AMX, "
        "`make llama-cpp` builds llama.cpp with `GGML_NATIVE=OFF`, the CPU's instruction sets named one by one and the "
        "AMX backend off (`ppow_trl/interop/llama_cpp_build.py`), because the native build's AMX backend crashed on quantized "
        "models. What can be measured on any AVX-512 CPU is the price of leaving `-march=native`: the script builds "
        "those options here and times the shipped Q4_1 target in both builds side by side, arms alternated, each in a "
        "child process: decode (ms per token, one token per evaluation) and verify (one evaluation of a "
        f"{_verify_tokens(arms)}-token window).", "",
        *command_block(data.get("command")),
        machine_text(cpu=data.get("cpu")), "",
        *recorded("Model and settings", data.get("model")),
        f"Options of the AMX build: `{data.get('no_amx_options', '-')}`", "",
        *table(["build", "decode ms (median)", "decode evaluations", "verify ms (median)", "verify evaluations"],
               [[name, num((a.get("decode_ms") or {}).get("median"), 3), count((a.get("decode_ms") or {}).get("n")),
                 num((a.get("verify5_ms") or {}).get("median"), 3), count((a.get("verify5_ms") or {}).get("n"))]
                for name, a in arms.items()]),
    ]
    ratios = [(key, data[key]) for key in data if key.endswith("_ratio_no_amx_over_native")]
    if ratios:
        lines += table(["ratio (AMX-build options / native)", "median [95% CI]"],
                       [[key.replace("_ratio_no_amx_over_native", "").replace("_", " "),
                         with_ci(r.get("median_ratio"), r.get("ci95"), 3)] for key, r in ratios])
    info = data.get("system_info") or {}
    if info:
        lines += ["llama.cpp's system info of each build:", "", "```text",
                  *[f"{name}: {text.strip()}" for name, text in info.items()], "```", ""]
    lines += ["A ratio below 1 means the AMX build's options were faster than the native build here.", ""]
    return "llama.cpp build for AMX CPUs", lines


def dflash_block(results: Path):
    data = load(results / "dflash_block.json")
    arms = data["arms"]
    rows = []
    for name, arm in arms.items():
        greedy = arm.get("mtbench_greedy") or {}
        fixed, saved = greedy.get("fixed_block"), greedy.get("saved_policy")
        predicted = arm.get("predicted_speedup") or {}
        best = predicted.get("best") or {}
        unit = " per round" if arm.get("drafter_per_round") else " per token"
        rows.append([
            name if greedy else f"{name} (cost only)", num(arm.get("drafter_cost"), 3) + unit,
            "/".join(num(v) for v in arm.get("verify_cost", [])[1:]),
            with_ci(fixed["tau"], fixed.get("tau_ci"), 3) + f" (K = {fixed['policy'][0]})" if fixed else "-",
            f"{num(saved['tau'], 3)} (K = {saved['policy'][0]}, h = {saved['policy'][1]:.2f})" if saved else "-",
            num(predicted.get("fixed_block_k7"), 2, "x") if predicted else "-",
            num(predicted.get("fixed_k4"), 2, "x") if predicted else "-",
            f"{num(best.get('speedup'), 2, 'x')} ({best.get('max_window')}, {num(best.get('threshold'))})" if best
            else "-"])
    lines = [
        "DFlash block drafters: transformers' stock fixed block against the adaptive window "
        "(`benchmarks/dflash_block.py`, after the study's `dflash_*` arms). Stock "
        "`target.generate(assistant_model=drafter, speculation_type=\"dflash\")` proposes a full block every round; "
        "`load_assistant(folder, target=target)` adds the calibrated rule. The cost model is measured up to the full "
        "block (`t_d` is one cached round for the block drafters, head included; per drafted token for the per-token "
        "families measured alongside); tau is exact greedy on the study's MT-bench prompts; predicted speedups are the "
        "cost model's on the study's held-out calibration contexts.", "",
        *command_block(data.get("command")),
        machine_text(threads=data.get("threads"), precision=data.get("precision"))
        + f" Target: {data.get('target', '-')}; {data.get('mtbench_prompts', '-')} MT-bench prompts, "
        f"{data.get('max_new_tokens', '-')} new tokens; {data.get('contexts', '-')} calibration contexts.", "",
        *table(["drafter", "t_d/t_t", "t_v(1..)/t_t", "tau, fixed block [95% CI]", "tau, saved policy",
                "predicted: fixed block", "predicted: K = 4", "predicted: best (K, h)"], rows),
        "Reading: the block drafter trained here accepts almost nothing beyond its first slot, so the full block only "
        "adds verification cost and every window policy predicts well below the target's speed on this CPU; one "
        "round's drafting cost (mostly the target's full output head applied to every slot of the block) alone exceeds "
        "what the per-token families pay for several drafted tokens (the `t_d/t_t` column). On a GPU the head rows of "
        "a round are one cheap matrix product, which is DFlash's point; see the study's DFlash arms.", "",
    ]
    return "DFlash block", lines


def gpu_check(results: Path):
    path = results / "gpu_cost_profile.json"
    lines = [
        "`benchmarks/gpu_check.py` on one GPU (no Hub access) runs the `cuda` tests and records their counts, builds "
        "random-weight models of Llama-3.1-8B shape (target, bf16, then 4-bit NF4 with bf16 compute) and "
        "Llama-3.2-1B shape (drafter, bf16), and measures with CUDA synchronisation, warm-up and medians: `t_t`, "
        "`t_v(L)/t_t` and `t_d/t_t` (`calibrate_cost_model`), and HF assisted generation's overhead per round (wall "
        "time of `target.generate(assistant_model=drafter)` at a constant window minus the time inside the two "
        "models' forwards, per round). `python benchmarks/gpu_check.py --tiny --out /tmp/gpu_tiny.json` runs the same "
        "code with tiny shapes on a CPU in seconds (a test does this).", "",
    ]
    if not path.is_file():
        return "GPU check", lines + [
            f"No result committed yet: `{RESULTS.as_posix()}/{path.name}` is written only by a run on a real GPU.", ""]
    data = load(path)
    versions = data.get("versions") or {}
    lines += [*command_block(data.get("command")),
              f"Machine: GPU {data.get('gpu') or 'not recorded'}, device {data.get('device', '-')}; "
              + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + f"; run on {data.get('date', '-')}.", "",
              f"Precision: {data.get('dtype', '-')}; KV cache of {data.get('cache_length', '-')} tokens; "
              f"{data.get('repeats', '-')} repeats after {data.get('warmup', '-')} warm-up calls."
              + (" Tiny shapes (`--tiny`)." if data.get("tiny") else ""), ""]
    tests = data.get("cuda_tests")
    if tests:
        lines += ["`cuda` tests: " + ", ".join(f"{k} {v}" for k, v in tests.items()) + ".", ""]
    rows = []
    for profile in data.get("profiles", []):
        overhead = profile.get("assisted_overhead") or {}
        assisted, plain = overhead.get("assisted") or {}, overhead.get("plain") or {}
        rows.append([profile.get("name"), profile.get("target_dtype", "-"), profile.get("target_quantization") or "-",
                     profile.get("drafter_dtype", "-"), num(1000 * profile["t_t_s"], 2) if profile.get("t_t_s") else "-",
                     num(profile.get("t_d_over_t_t"), 3), slash((profile.get("t_v_over_t_t") or [])[1:]),
                     num(1000 * assisted["overhead_per_round_s"], 2) if assisted.get("overhead_per_round_s") is not None
                     else "-", num(assisted.get("overhead_over_t_t")),
                     num(1000 * plain["overhead_per_round_s"], 2) if plain.get("overhead_per_round_s") is not None
                     else "-"])
    lines += table(["profile", "target", "quantization", "drafter", "t_t ms", "t_d/t_t", "t_v(1..)/t_t",
                    "HF assisted overhead ms/round", "overhead / t_t", "plain generate overhead ms/step"], rows)
    return "GPU check", lines


def trainer_throughput(results: Path):
    data = load(results / "trainer_throughput.json")
    rollout, training, memory = data.get("rollout") or {}, data.get("training") or {}, data.get("memory") or {}
    lines = [
        "PPOWTrainer throughput with a truncated drafter (`benchmarks/trainer_throughput.py`), measured in one run: "
        "rollout + verification of one generation batch with the shared-context KV cache (each context prefilled once "
        "for its G windows) against every window re-reading its context; full training steps with the loss's log-probs "
        "from TRL's generic path (`shared_context_logprobs=False`: each window recomputes its context) against the "
        "shared-context path (each context once per micro-batch), interleaved in chunks of steps with the same seeds, "
        "the first step of each chunk (selection refresh, cost-model measurement) excluded; and the peak memory of a "
        "training run of each arm in its own subprocess.", "",
        *command_block(data.get("command")),
        machine_text(data.get("machine"), precision=data.get("precision"), threads=data.get("threads"))
        + f" Windows per step: {data.get('windows_per_step', '-')}.", "",
    ]
    if rollout:
        shared, no_reuse = rollout.get("shared_kv") or {}, rollout.get("no_reuse") or {}
        ratio = no_reuse["median_s"] / shared["median_s"] if shared.get("median_s") and no_reuse.get("median_s") else None
        lines += [f"**Rollout + verification** (contexts of {', '.join(str(t) for t in rollout.get('context_tokens', []))}"
                  " tokens):", "",
                  *table(["path", "median s per batch", "windows / s"],
                         [["shared context KV cache", num(shared.get("median_s")), num(shared.get("windows_per_s"), 1)],
                          ["every window re-reads its context", num(no_reuse.get("median_s")),
                           num(no_reuse.get("windows_per_s"), 1)], ["**ratio**", num(ratio, 2, "x"), ""]])]
    if training:
        def target_s(arm):
            values = sorted(step["target_s"] for step in (training.get(arm) or {}).get("steps", []))
            return values[len(values) // 2] if values else None

        generic, shared = training.get("trl_generic") or {}, training.get("shared_context") or {}
        lines += ["**Full training steps**:", "",
                  *table(["loss path", "median s / step", "windows / s", "target forwards' share", "steps",
                          "target forwards s / step (median)"],
                         [[label, num(arm.get("median_step_s")), num(arm.get("windows_per_s")),
                           num(100 * arm["target_forward_share"], 1, "%") if arm.get("target_forward_share") is not None
                           else "-", len(arm.get("steps", [])), num(target_s(key))]
                          for key, label, arm in (("trl_generic", "TRL's generic loss path", generic),
                                                  ("shared_context", "shared-context loss path (default)", shared))]
                         + [["**ratio**", "", num(training.get("speedup_shared_over_generic"), 2, "x"), "", "", ""]])]
        bound = (generic.get("median_step_s") / target_s("shared_context")
                 if generic.get("median_step_s") and target_s("shared_context") else None)
        cost = training.get("cost_model") or {}
        if cost:
            lines += [f"Cost model measured by the trainer: t_d/t_t {num(cost.get('drafter_cost'), 3)}, t_v(1..)/t_t "
                      f"{slash(cost.get('verify_cost', [])[1:])}.", ""]
        if bound:
            lines += [f"Upper bound on the ratio from the drafter's side alone (generic step over the target's forwards "
                      f"in a shared-context step): {bound:.1f}x.", ""]
    if memory:
        lines += ["**Peak memory** during `train()` (own subprocess, VmHWM reset before):", "",
                  *table(["arm", "RSS before train MiB", "peak during train MiB", "peak above start MiB"],
                         [[m.get("arm", name), count(round(m["rss_before_train_mib"])),
                           count(round(m["peak_during_train_mib"])), count(round(m["peak_above_start_mib"]))]
                          for name, m in memory.items()])]
    if data.get("kd"):
        lines += kd_throughput_lines(data["kd"])
    lines += [
        "Reading: the shared-context path (`ppow_trl/training/window_logprobs.py`) computes the same log-probs and gradients "
        "(`tests/test_trainer_paths.py`) in less time and memory. What limits the ratio is the target's own forwards "
        "(prefill of the contexts and one pass over the windows with their cache): they cost the same in both arms "
        "and become most of a shared-context step. They are what a PPOW step is (the reward needs the target's "
        "probabilities for every window), so only a faster target (more threads, lower precision on hardware that "
        "runs it fast, a GPU) or fewer or shorter contexts per window would go further. Two rollout changes help both "
        "arms alike and are not separated by this script: contexts of very different lengths are prefilled in length "
        "buckets (`rollout.length_buckets`), and windows are sampled by inverse CDF (`verification.sample_categorical`) "
        "instead of `torch.multinomial`.", "",
    ]
    return "Trainer throughput", lines


def kd_warm_start(results: Path):
    data = load(results / "kd_warm_start.json")
    before, after = data.get("before") or {}, data.get("after") or {}
    cost = data.get("cost_model") or {}
    verify = cost.get("verify_cost") or []
    k = len(verify) - 1
    break_even = k * cost["drafter_cost"] + verify[k] if verify and cost.get("drafter_cost") is not None else None
    teacher_rate = data["train_tokens"] / data["topk_seconds"] if data.get("topk_seconds") else None
    lines = [
        "KD warm start of a SmolLM2 drafter on the cheap teacher-forced top-k path (`benchmarks/kd_warm_start.py`): the "
        "target's top-k distributions teacher-forced over existing ShareGPT replies (far cheaper per token than "
        "regenerating responses on a CPU), a truncated drafter distilled with `KDTrainer`, measured on held-out "
        "target-regenerated MT-bench responses: top-1 agreement (teacher forced), greedy simulated tau on drafted "
        "windows, and the cost model's speedup.", "",
        *command_block(data.get("command")),
        machine_text(data.get("machine"), precision=data.get("precision"), threads=data.get("threads")), "",
        f"Teacher: {count(data.get('train_tokens'))} training tokens labelled in {num(data.get('topk_seconds'), 0)} s "
        f"({num(teacher_rate, 0)} tokens/s); KD: {num(data.get('kd_seconds'), 0)} s; draft-head coverage of the held-out "
        f"target tokens: {percent(data.get('draft_vocab_coverage_held_out'))}; "
        f"cost model: t_d/t_t {num(cost.get('drafter_cost'), 3)}, t_v(1..{k})/t_t {slash(verify[1:])}; whole run "
        f"{num(data.get('total_seconds'), 0)} s.", "",
        *recorded("Held-out set", data.get("held_out")),
        *table(["held out", "top-1 agreement", "greedy simulated tau", "cost-model speedup", "windows", "tokens"],
               [[label, num(d.get("top1_agreement"), 3), num(d.get("greedy_simulated_tau"), 3),
                 num(d.get("cost_model_speedup"), 2, "x"), count(d.get("windows")), count(d.get("tokens"))]
                for label, d in (("before KD", before), ("after KD", after))]),
    ]
    log = data.get("kd_log") or []
    if log:
        lines += ["Training log (KDTrainer):", "",
                  *table(["step", "epoch", "KL", "top-1 agreement (training text)", "learning rate"],
                         [[row.get("step"), num(row.get("epoch")), num(row.get("kd/kl"), 2),
                           num(row.get("kd/top1_agreement"), 3), f"{row['learning_rate']:.2e}"
                           if row.get("learning_rate") is not None else "-"] for row in log])]
    lines += [
        "Reading: the cheap path works end to end, but off-policy tokens (ShareGPT text, not the target's own outputs) "
        "give a weak drafter: agreement on the target's own text trails agreement on the training text (the last log "
        "row), and the simulated tau stays below what this drafter needs to break even at its window"
        + (f" (tau {break_even:.2f} = K t_d/t_t + t_v(K)/t_t at K = {k})" if break_even else "")
        + ". A useful warm start needs far more tokens, ideally target-regenerated ones (the study's job).", "",
    ]
    return "KD warm start", lines


def eagle3_features(results: Path):
    data = load(results / "eagle3_features.json")
    step, per_token = data.get("median_step_seconds") or {}, data.get("median_seconds_per_trained_token") or {}
    lines = [
        "EAGLE-3 KD with cached target features against features recomputed per batch (`benchmarks/eagle3_features.py`):"
        " both arms run the same `KDTrainer` optimizer steps on the study's training responses; \"cached\" reads "
        "`compute_target_features`' float16 columns (built once, timed separately), \"on the fly\" runs one no-grad "
        "target forward per batch. Steps alternate between the arms so that machine load hits both alike; medians of "
        "per-step seconds, per response token.", "",
        *command_block(data.get("command")),
        machine_text(precision=data.get("precision"), threads=data.get("threads")), "",
        *recorded("Machine note", data.get("machine_note")),
        f"Settings: {data.get('steps_per_arm', '-')} steps per arm, batch {data.get('batch_size', '-')}, "
        f"{data.get('ttt_steps', '-')} training-time-test steps; response tokens per batch: "
        f"{', '.join(str(t) for t in data.get('response_tokens_per_batch', []))}; feature cache "
        f"{count(data.get('feature_cache_mib'))} MiB, loaded or built in "
        f"{num(data.get('feature_cache_load_or_build_seconds'), 1)} s.",
        "",
        *table(["features", "median s / step", "median s / trained token"],
               [[arm.replace("_", " "), num(step.get(arm), 2), num(per_token.get(arm), 4)] for arm in step]
               + [["**on the fly / cached**", num(data.get("ratio_on_the_fly_to_cached"), 2, "x"), ""]]),
        "Reading: caching the target's features makes the head's KD steps several times cheaper (the ratio), which is "
        "why the study's EAGLE-3 arms train on cached features.", "",
    ]
    return "EAGLE-3 features", lines


def cache_rewards(results: Path):
    data = load(results / "cache_rewards.json")
    agreement, teacher = data.get("agreement") or {}, data.get("teacher_forcing") or {}
    throughput = data.get("throughput") or {}
    differ = agreement.get("windows_with_different_rewards")
    lines = [
        "Greedy PPOW rewards from the cached text against the target-verified ones (`benchmarks/cache_rewards.py`), on "
        "the study's data: agreement on the same drafted windows verified both ways, and the training throughput of "
        "two PPOWTrainers (`reward_source=\"target\"` and `\"cache\"`, the study's PPOW settings, greedy acceptance) "
        "trained in alternating blocks of optimizer steps.", "",
        *command_block(data.get("command")),
        machine_text(platform=data.get("platform"), precision=data.get("precision"), threads=data.get("threads"))
        + f" Drafter: `{data.get('drafter', '-')}`.", "",
        *table(["agreement", "count"], [[k.replace("_", " "), count(v)] for k, v in agreement.items()]
               + [[f"teacher forcing: {k.replace('_', ' ')}", count(v)] for k, v in teacher.items()]
               + [["seconds for the agreement check", num(data.get("agreement_seconds"), 0)]]),
    ]
    arms = [(name, throughput[name]) for name in ("target", "cache") if isinstance(throughput.get(name), dict)]
    if arms:
        lines += table(["reward source", "steps", "median s / step", "steps / s", "window tokens", "window tokens / s"],
                       [[name, count(a.get("steps")), num(a.get("median_step_seconds")), num(a.get("steps_per_second"), 3),
                         count(a.get("window_tokens")), num(a.get("window_tokens_per_second"), 1)] for name, a in arms])
        lines += table(["ratio, cache / target", "value"],
                       [[k.replace("ratio_", "").replace("_", " "), num(v, 2, "x")] for k, v in throughput.items()
                        if k.startswith("ratio_")])
    verdict = ("agreed with the target-verified ones on every window checked" if differ == 0 else
               f"differed on {count(differ)} windows" if differ is not None else "were compared (see the table)")
    lines += [f"Reading: the cached rewards {verdict}, and made optimizer steps several times faster (ratios); the "
              "converged study's `ppow_cache` arms and the main job use them.", ""]
    return "Cache rewards", lines


DATA_SCALING_FILES = ("data_scaling.json", "data_scaling_eager_64tok.json")
"""The curve on the serving runtime's costs (the script's defaults), then the earlier reduced run on eager costs."""


def data_scaling(results: Path):
    lines = [
        "What data buys (`benchmarks/data_scaling.py`): held-out exact greedy tau of the KD drafter against the number "
        "of regenerated response tokens. One pool of ShareGPT train prompts is regenerated by the target; each point "
        "trains a fresh truncated drafter (the main job's family) by KD on the target's top-k over the shortest prefix "
        "of the pool holding that many response tokens, for the same number of epochs, then evaluates it: exact greedy "
        "tau with 95% bootstrap intervals on MT-bench and held-out ShareGPT test prompts, and the serving "
        "calibration's rules, predicted and measured.", "",
    ]
    for name in DATA_SCALING_FILES:
        if (results / name).is_file():
            lines += _data_scaling_run(load(results / name), name)
    lines += plots(results, ["data_scaling.png", "data_scaling_eager_64tok.png"])
    return "Data scaling", lines


def _data_seconds(data: dict):
    """Seconds spent regenerating and labelling: one figure (earlier runs) or one per block built."""
    seconds = data.get("data_seconds", data.get("data_seconds_first_run"))
    return sum(seconds.values()) if isinstance(seconds, dict) else seconds


def _data_scaling_run(data: dict, name: str) -> list[str]:
    points = sorted(data["points"].values(), key=lambda p: p["response_tokens"])
    runtime = data.get("runtime", "eager")
    if not points:
        return []
    fixed_key = next((k for k in points[0]["evaluation"]["mtbench"] if k.startswith("fixed_k")), "fixed_k4")
    k = re.sub(r"\D", "", fixed_key)
    share = next((p["evaluation"].get("sharegpt_test", {}).get(fixed_key, {}).get("prompts") for p in points), None)
    rows = []
    for p in points:
        mt = p["evaluation"]["mtbench"][fixed_key]
        sg = p["evaluation"].get("sharegpt_test", {}).get(fixed_key)
        rule = p.get("best_speculative_rule") or {}
        measured = p.get("measured_speedup_best_speculative") or {}
        row = [count(p["response_tokens"]), count(p["responses"]), count(p["kd_steps"]),
               f"{num(p.get('kd_seconds'), 0)} + {num(p.get('eval_seconds'), 0)}",
               with_ci(mt["tau"], mt.get("tau_ci"), 3), with_ci(sg["tau"], sg.get("tau_ci"), 3) if sg else "-"]
        if "speedup" in measured:  # measured side by side with plain decoding on the serving runtime
            served, served_measured = p.get("served_policy") or {}, p.get("measured_speedup_served") or {}
            row += [f"K = {rule.get('max_window', '-')}, h = {num(rule.get('threshold'))}: "
                    f"{num(p.get('predicted_speedup_best_speculative'), 3, 'x')} / "
                    f"{with_ci(measured['speedup'], measured.get('ci95'), 3, 'x')}, lossless "
                    f"{measured.get('lossless_prompts', '-')}",
                    "K = 0: plain decoding (not timed)" if not served.get("max_window") else
                    f"K = {served['max_window']}, h = {num(served.get('threshold'))}: "
                    f"{num(p.get('predicted_speedup_served'), 3, 'x')} / "
                    f"{with_ci(served_measured.get('speedup'), served_measured.get('ci95'), 3, 'x')}"]
        else:  # the earlier format: median per-prompt ratio against transformers' generate
            row.append(f"K = {rule.get('max_window', '-')}, h = {num(rule.get('threshold'))}: "
                       f"{num(p.get('predicted_speedup_best_speculative'), 3, 'x')} / "
                       f"{num(measured.get('speedup_median'), 3, 'x')}")
        rows.append(row)
    side_by_side = "speedup" in (points[0].get("measured_speedup_best_speculative") or {})
    header = ["response tokens", "responses", "KD steps", "seconds (KD + eval)", f"MT-bench tau, K = {k}",
              f"ShareGPT test ({share if share is not None else '-'}) tau, K = {k}"]
    if side_by_side:
        header += ["best speculative rule: predicted / measured vs plain [95% CI]",
                   "served rule: predicted / measured"]
    else:
        header += ["best speculative rule: predicted / measured"]
    first, last = points[0], points[-1]
    title = (f"### On the {runtime} runtime's costs (`{name}`)" if side_by_side
             else f"### Earlier reduced run, eager costs (`{name}`)")
    lines = [title, "", *command_block(data.get("command")),
             machine_text(cpu=data.get("cpu"), precision=data.get("precision"), threads=data.get("threads"),
                          torch=data.get("torch"), transformers=data.get("transformers"))
             + f" Processes: {data.get('processes', '-')}.", "",
             f"Pool: {count(data.get('pool_prompts'))} prompts"
             + (f" asked, regenerated so far in {data['pool_blocks']} blocks: " if data.get("pool_blocks") else ", ")
             + f"{count(data.get('pool_responses'))} responses, "
             f"{count(data.get('pool_tokens'))} response tokens ({data.get('max_new_tokens', '-')} new tokens at most; "
             f"regeneration and labelling {num(_data_seconds(data), 0)} s on the first run); "
             f"{num(data.get('epochs'), 0)} epochs per point.", ""]
    if side_by_side:
        lines += [f"Measured: our loop against plain decoding on the same runtime, side by side on the first "
                  f"{data.get('timed_prompts', '-')} MT-bench prompts that fit the static cache "
                  "(`ppow_trl.bench.served.compare_arms`: ratio of total times, 95% bootstrap interval). "
                  f"Runtime of the last point: {last.get('runtime', runtime)}.", ""]
    else:
        lines += ["Measured: the median per-prompt ratio of our loop against transformers' eager `generate` on a "
                  "few MT-bench prompts.", ""]
    lines += table(header, rows)
    if len(points) > 1 and last["response_tokens"] > first["response_tokens"]:
        slope = ((last["evaluation"]["mtbench"][fixed_key]["tau"] - first["evaluation"]["mtbench"][fixed_key]["tau"])
                 / math.log2(last["response_tokens"] / first["response_tokens"]))
        lines += [f"MT-bench tau per doubling of the data, first to last point: {slope:+.3f}.", ""]
    if side_by_side:
        paying = next((p for p in points if ((p.get("measured_speedup_best_speculative") or {}).get("ci95")
                                              or [0, 0])[0] > 1.0), None)
        paying_best = (paying or {}).get("measured_speedup_best_speculative") or {}
        lines += ["Reading: " + (
            f"the first point whose best speculative rule measured faster than plain decoding over its whole 95% "
            f"interval is {count(paying['response_tokens'])} tokens "
            f"({with_ci(paying_best['speedup'], paying_best['ci95'], 3, 'x')})."
            if paying else "no point's best speculative rule measured faster than plain decoding over its whole 95% "
                           "interval yet.")]
        guarded = [p for p in points if (p.get("served_policy") or {}).get("max_window")
                   and p["served_policy"] == {k: (p.get("best_speculative_rule") or {}).get(k)
                                              for k in ("max_window", "threshold")}
                   and (p.get("measured_speedup_served") or {}).get("speedup") is not None]
        for p in guarded:
            served, best = p["measured_speedup_served"], p["measured_speedup_best_speculative"]
            lines[-1] += (f" At {count(p['response_tokens'])} tokens the served rule is the best rule with the online "
                          f"guard: {served['speedup']:.3f}x (tau {served['tau']:.2f}) against {best['speedup']:.3f}x "
                          f"(tau {best['tau']:.2f}) without it.")
        for key, earlier in sorted((data.get("superseded") or {}).items(), key=lambda item: int(item[0])):
            now = data["points"].get(key)
            before = (earlier[-1].get("measured_speedup_served") or {}) if earlier else {}
            after = (now or {}).get("measured_speedup_served") or {}
            if before.get("speedup") is not None and after.get("speedup") is not None:
                then = earlier[-1].get("measured_speedup_best_speculative") or {}
                lines[-1] += (f" At {count(now['response_tokens'])} tokens an earlier run timed the served rule with "
                              f"the windowed guard: {with_ci(before['speedup'], before.get('ci95'), 3, 'x')} "
                              f"(tau {before['tau']:.2f}; the best rule unguarded measured {then.get('speedup', 0):.3f}x "
                              f"in that run); with the loss-budget guard it measured "
                              f"{with_ci(after['speedup'], after.get('ci95'), 3, 'x')} (tau {after['tau']:.2f}). Runs "
                              "of different sessions differ by the machine's state as well as by the guard: compare "
                              "guarded with unguarded within one run.")
        lines.append("")
    if not side_by_side:
        best = max(p.get("predicted_speedup_best_speculative") or 0.0 for p in points)
        lines += [f"Reading: on these eager costs the best rule at any point was predicted {best:.3f}x "
                  + ("(no rule paid); " if best < 1.0 else "; ")
                  + "the curve on the serving runtime's costs is the one above, when present.", ""]
    return lines


def guard_simulation(results: Path):
    data = load(results / "guard_simulation.json")
    by_length = data.get("rules_by_new_tokens") or {str(data.get("new_tokens")): data["rules"]}
    first = next(iter(by_length.values()))
    lines = [
        "The online guard on simulated rounds (`benchmarks/guard_simulation.py`): rule K drafts K tokens a round at "
        "per-token acceptance alpha, costing `b = K t_d + t_v(K)` target steps (compiled costs of the data-scaling "
        f"curve's 100k point: t_d = {data['drafter_cost']}, t_v(1..4) = "
        + " / ".join(str(v) for v in data["verify_cost"].values())
        + f"), through the real `SpeculationGuard`; {data['generations']} generations per cell. Each cell: speedup "
        "over plain decoding (tokens / steps) and the share of rounds that drafted, for the calibrated acceptance (the "
        f"rule pays) and for acceptance collapsed to {first[0]['collapsed_alpha']} with the same guard (a drafter out "
        "of its domain). `windowed` is the guard the loss budget replaced (pause when 8 rounds averaged under 0.95 b, "
        f"one probe round to resume). Command: `{data['command']}`.", "",
    ]
    for length, rules in by_length.items():
        arms = list(rules[0]["arms"])
        rows = []
        for rule in rules:
            cells = [f"K = {rule['max_window']}, alpha {rule['paying_alpha']}, b = {rule['break_even_tokens']:.2f}, "
                     f"sigma_A = {rule['spread']:.2f}"]
            for name in arms:
                arm = rule["arms"][name]
                cells.append(f"{arm['paying']['speedup']:.3f}x ({arm['paying']['drafting_fraction']:.0%}) / "
                             f"{arm['collapsed']['speedup']:.3f}x ({arm['collapsed']['drafting_fraction']:.0%})")
            rows.append(cells)
        lines += [f"Generations of {count(int(length))} tokens:", ""]
        lines += table(["rule"] + [f"{name}: paying / collapsed" for name in arms], rows) + [""]
        bursty = [case for case in rules[0]["arms"][arms[0]] if case.startswith("bursty_")]
        if bursty:
            rows = [[f"K = {rule['max_window']}, alpha " + " / ".join(
                        "{:.2f}-{:.2f}".format(*rule["bursty_alphas"][case]) for case in bursty)]
                    + [" / ".join(f"{rule['arms'][name][case]['speedup']:.3f}x" for case in bursty) for name in arms]
                    for rule in rules]
            lines += [f"Bursty text, generations of {count(int(length))} tokens (stretches of "
                      f"{data['burst_tokens']} tokens on average at alpha (1 + d) or alpha (1 - d); cells: d = "
                      + " / ".join(case.split("_", 1)[1] for case in bursty) + "):", ""]
            lines += table(["rule"] + arms, rows) + [""]
    lines += ["The served default is `loss_budget[5 sigma], across generations` (`DEFAULT_GUARD`): the same budget, "
              "with the time lost and a pause under way carried from one generation to the next; the other loss-budget "
              "arms start every generation afresh.", ""]
    return "The online guard", lines


def exact_tau_check(results: Path):
    data = load(results / "refactor_check.json")
    tau = data.get("tau") or {}
    keys = []
    for values in tau.values():
        keys += [k for k in values if k not in keys]
    lines = [
        "Exact greedy tau is deterministic (no sampling, no timing), so evaluating the same drafter with two checkouts "
        "of the code must give the same per-prompt accepted lengths (`benchmarks/exact_tau_check.py`). This check "
        "compared the code before and after the refactor that moved every drafter family behind "
        "`ppow_trl.drafting.DrafterFamily`, on the main job's drafter trained by each code.", "",
        *command_block(data.get("command")),
        "Machine: not recorded as fields (the description below names it).", "",
        *recorded("What was checked", data.get("what")),
        *table(["evaluation identical", "value"], [[k, yes_no(v)] for k, v in (data.get("evaluation_identical") or {})
                                                    .items()]),
        *table(["code / drafter"] + [f"tau {k}" for k in keys],
               [[name.replace("_", " / ")] + [num(values.get(k), 4) for k in keys] for name, values in tau.items()]),
    ]
    main_job = data.get("main_job") or {}
    if main_job:
        fields = []
        for values in main_job.values():
            fields += [k for k in values if k not in fields]
        lines += table(["main job"] + list(main_job), [[field] + [
            slash(values[field]) if isinstance(values.get(field), list) else
            (num(values[field], 3) if isinstance(values.get(field), float) else str(values.get(field, "-")))
            for values in main_job.values()] for field in fields])
    lines += recorded("Reading", data.get("reading"))
    return "Exact tau check", lines


def study(results: Path):
    folder = results / "study"
    if not (folder / "summary.json").is_file():
        return None
    from ppow_trl.study import report

    arms = report.load_arms(folder)
    if not arms:
        return None
    summary = load(folder / "summary.json")
    wallclock = load(folder / "wallclock.json") if (folder / "wallclock.json").is_file() else None
    text = report.section(arms, summary, wallclock, results_label=f"{RESULTS.as_posix()}/study")
    return "The study", [text, ""]


def converged_study(results: Path):
    folder = results / "study_converged"
    if not (folder / "summary.json").is_file():
        return None
    from ppow_trl.study import converged_report

    summary = load(folder / "summary.json")
    if not summary.get("families"):
        return None
    text = converged_report.section(folder, summary, results_label=f"{RESULTS.as_posix()}/study_converged")
    return "The converged study", [text, ""]


# (group, function, the result files it reads: a file name, or a folder for the studies)
def row_independence(results: Path):
    data = load(results / "row_independence.json")
    meta = data["meta"]
    ratio_key = "vs row_independent=False, t(L) ratio for L = 1..5 [95% CI]"

    def ratios(result: dict) -> str:
        pairs = result.get(ratio_key)
        return "; ".join(with_ci(value, ci, 2, "x") for value, ci in pairs) if pairs else "reference"

    lines = [
        "Does a verify pass compute bitwise what decode steps compute (`benchmarks/row_independence.py`)? For each "
        "precision and `CompileSettings(row_independent=...)` (`True` is the default: attention padded to `K + 1` query "
        "rows in every graph), SmolLM2 on the compiled runtime decodes 40 tokens one at a time, then verifies the same "
        "tokens in windows of L rows from the same cache states; a row counts as differing when any bit of its logits "
        "differs from the decode step's (one process per configuration). Then the costs, with both configurations of a "
        "precision in one process and their calls interleaved: the one-token step `t_t` (median [95% CI]), `t_v(L)/t_t` over a "
        f"200-token context, and each row-independent configuration's time per call against `row_independent=False` "
        f"at the same precision, for L = 1..5 rows (ratio of medians [95% bootstrap CI]; {data.get('timing_rounds', '?')} "
        "interleaved rounds).", "",
        *command_block(meta.get("command")),
        machine_text(cpu=meta.get("cpu"), torch=meta.get("torch"), threads=meta.get("threads")), "",
        *table(["precision", "row_independent", "rows differing, L = 2, 3, 4, 5", "t_t ms [95% CI]",
                "t_v(L)/t_t, L = 2..5", "time vs row_independent=False, L = 1..5", "warm-up s"],
               [[r["precision"], yes_no(r["row_independent"]),
                 ", ".join(r["rows_differing"][k] for k in ("2", "3", "4", "5")),
                 with_ci(r["t_t_ms"], r.get("t_t_ci_ms"), 2), slash(r["t_v(L)/t_t for L = 2..5 rows"]), ratios(r),
                 num(r["warm_up_s"], 0)] for r in data["results"]]),
        "Reading: with PyTorch's own attention (`row_independent=False`) every verified row differs in its last bits "
        "from the decode step's; with the default none does, so speculation is lossless by construction, and the "
        "ratio column says what that costs. Warm-up seconds include a cold compile where the cache was empty.", "",
    ]
    return "Row independence", lines


def round_costs(results: Path):
    files = sorted(results.glob("round_costs*.json"))
    if not files:
        return None
    lines = [
        "What a served round costs, by the number of tokens it drafted, against the cost model that chose the rule "
        "(`benchmarks/round_costs.py`): the drafter's rule is calibrated as `calibrate_for_serving` does, then MT-bench "
        "prompts are served plainly, with the rule unguarded (every round drafts) and with the rule as served "
        "(guarded), in turn prompt by prompt, and every round is timed (`SpeculativeOutput.round_seconds`). Round "
        "time: the rounds' median over the median plain round. L = 0 rounds of the guarded arm are the ones it paused; "
        "\"after a pause\": its drafting rounds that follow a paused one.", "",
    ]
    for path in files:
        data = load(path)
        lengths = sorted({*data["cost_model_round_time"], *data["unguarded"], *data["guarded"]}, key=int)

        def cell(arm: dict, length: str) -> str:
            row = arm.get(length)
            return "-" if not row else f"{num(row['round_time_median'], 3)} ({count(row['rounds'])})"

        lines += [f"`{RESULTS.as_posix()}/{path.name}`, {data.get('precision')} target, {data.get('prompts')}:", "",
                  *command_block(data.get("command")),
                  machine_text(cpu=data.get("cpu"), torch=data.get("torch"), threads=data.get("threads")), "",
                  f"Runtime: {data.get('runtime')}. Served rule: {data.get('served_rule')} Timed rule: K = "
                  f"{data['timed_rule']['max_window']}, h = {num(data['timed_rule']['threshold'])}; plain round "
                  f"{num(data.get('plain_round_ms'))} ms; tau " + " / ".join(
                      f"{name} {num(value, 3)}" for name, value in data.get("tau", {}).items()) + ".", "",
                  *table(["drafted L", "cost model", "unguarded (rounds)", "guarded (rounds)",
                          "guarded, after a pause (rounds)", "calibration windows"],
                         [[length, num(data["cost_model_round_time"].get(length), 3), cell(data["unguarded"], length),
                           cell(data["guarded"], length), cell(data.get("guarded_after_a_pause", {}), length),
                           count(data.get("calibration_windows", {}).get(length, 0))] for length in lengths]),
                  *recorded("Reading", data.get("reading"))]
    return "Served round costs", lines


def data_throughput(results: Path):
    data = load(results / "data_throughput.json")
    rows = data.get("rows") or {}
    lines = [
        "Training data per CPU-second (`benchmarks/data_throughput.py`): every route ends with the columns KD reads "
        "(prompt, response, the target's top-32 at each response position), measured side by side in one run, each "
        "on its own fresh cache folder split over the launched processes. Trained tokens per second: response tokens "
        "labelled over the route's wall-clock, all processes together.", "",
        *command_block(data.get("command")),
        machine_text(cpu=data.get("cpu"), torch=data.get("torch"), transformers=data.get("transformers"),
                     threads=data.get("threads_per_process"))
        + f" {data.get('processes', '-')} processes; regenerated answers of {data.get('regenerated_new_tokens', '-')} "
        f"tokens, teacher-forced answers cut at {data.get('teacher_forced_max_response_tokens', '-')}.", "",
        *table(["route", "how", "sequences", "trained tokens", "seconds", "trained tokens / s",
                "vs regenerate_generate", "checks"],
               [[f"`{name}`", row.get("route", ""), count(row.get("sequences")), count(row.get("trained_tokens")),
                 num(row.get("seconds"), 1), num(row.get("trained_tokens_per_second"), 1),
                 num(row.get("vs_regenerate_generate"), 2, "x"),
                 "; ".join(f"{key.replace('_', ' ')}: {num(value, 3) if isinstance(value, float) else value}"
                           for key, value in row.items() if key.startswith(("responses_equal", "top1_")))]
                for name, row in rows.items()]),
    ]
    return "Training data per CPU-second", lines


MAIN_JOB_FILES = ("main_job.json", "main_job_teacher_forced_only.json")


def main_job_runs(results: Path):
    lines = [
        "The main job as a new user runs it (`benchmarks/main_job.py`): the README's command on an empty cache "
        "(conversion, data, compiling included), its own summary kept. Measured: the served rule against plain "
        "decoding on the same runtime and precision, ratio of total times over the evaluation prompts [95% bootstrap "
        "interval].", "",
    ]
    rows = []
    for name in MAIN_JOB_FILES:
        if not (results / name).is_file():
            continue
        data = load(results / name)
        measured, lookup = data.get("measured") or {}, data.get("measured_with_prompt_lookup") or {}
        config, rule = data.get("config") or {}, data.get("served_rule") or {}
        rows.append([f"`{name}`", config.get("train_data", "-"), count(data.get("train_tokens")),
                     num(data.get("minutes"), 1), f"K = {rule.get('max_window', '-')}, h = {num(rule.get('threshold'))}",
                     with_ci(measured.get("speedup"), measured.get("ci95"), 3, "x"), num(measured.get("tau")),
                     measured.get("lossless_prompts", "-"), count(measured.get("prompts")),
                     with_ci(lookup.get("speedup"), lookup.get("ci95"), 3, "x")])
        cpu = data.get("cpu")
    lines += [machine_text(cpu=cpu, precision="fp32", runtime="compiled") + " Evaluation: MT-bench prompts, greedy, "
              "64 new tokens.", "",
              *table(["run", "data", "training tokens", "minutes", "served rule", "speedup vs compiled plain", "tau",
                      "lossless", "prompts", "with prompt lookup"], rows)]
    return "Main job, end to end", lines


def kd_throughput_lines(kd: dict) -> list[str]:
    """The KD part of trainer_throughput.json (``benchmarks/kd_throughput.py``)."""
    lines = ["**KD, before and after** (`benchmarks/kd_throughput.py`): the same data, steps and seed in each arm; "
             "before: fp32, random batches, the attention mask passed to SDPA; after: bf16 autocast where the CPU has "
             "it, length-grouped batches, right-padded batches without a mask. " + (kd.get("data") or ""), "",
             *command_block(kd.get("command")),
             machine_text(cpu=kd.get("cpu"), torch=kd.get("torch"), transformers=kd.get("transformers"),
                          threads=kd.get("threads")), ""]
    rows = []
    for family in ("standalone", "eagle3"):
        arms = kd.get(family)
        if not arms:
            continue
        for arm in ("before", "after"):
            a = arms[arm]
            curve = a.get("loss_curve") or []
            rows.append([family, arm, "bf16" if a.get("bf16_autocast") else "fp32", a.get("sampling"), count(a.get("steps")),
                         count(a.get("trained_tokens")), num(a.get("seconds"), 1),
                         num(a.get("trained_tokens_per_second"), 0), num(curve[0] if curve else None, 3),
                         num(curve[-1] if curve else None, 3), num(a.get("held_out_kl"), 3),
                         num(a.get("held_out_top1"), 3)])
        rows.append([family, "**ratio**", "", "", "", "", "", num(arms.get("speedup"), 2, "x"), "", "", "", ""])
    return lines + table(["drafter", "arm", "matmuls", "batches", "steps", "trained tokens", "s in steps",
                          "trained tokens / s", "first loss", "last loss", "held-out KL", "held-out top-1"], rows)


SECTIONS = [
    ("The machine and its costs", thread_setting, ["threads.json"]),
    ("The machine and its costs", cost_model, ["cost_model.json"]),
    ("The machine and its costs", compiled_runtime_settings, ["compiled_runtime_settings.json"]),
    ("The machine and its costs", row_independence, ["row_independence.json"]),
    ("Serving", compiled_serving, ["compiled_serving.json", *COMPILED_SERVING_SEPARATE_RUNS]),
    ("Serving", main_job_compiled, ["main_job_compiled.json"]),
    ("Serving", round_costs, ["round_costs*.json"]),
    ("Serving", shipped_drafter, ["speedup.json", "speedup_served.json", "speedup_served_code.json"]),
    ("Serving", bench_methods, ["bench_*.json"]),
    ("Serving", guard_simulation, ["guard_simulation.json"]),
    ("Serving", llama_cpp_serving, ["llama_cpp_serving.json"]),
    ("Serving", llama_cpp_amx_build, ["llama_cpp_amx_build.json"]),
    ("Serving", dflash_block, ["dflash_block.json"]),
    ("Serving", gpu_check, ["gpu_cost_profile.json"]),
    ("Training", data_throughput, ["data_throughput.json"]),
    ("Training", main_job_runs, list(MAIN_JOB_FILES)),
    ("Training", trainer_throughput, ["trainer_throughput.json"]),
    ("Training", kd_warm_start, ["kd_warm_start.json"]),
    ("Training", eagle3_features, ["eagle3_features.json"]),
    ("Training", cache_rewards, ["cache_rewards.json"]),
    ("Training", data_scaling, list(DATA_SCALING_FILES)),
    ("Training", exact_tau_check, ["refactor_check.json"]),
    ("Training", study, ["study/"]),
    ("Training", converged_study, ["study_converged/"]),
]
ALWAYS = {gpu_check}  # rendered even without their JSON (what the section would hold)


def _claimed(results: Path) -> set[str]:
    names = set()
    for _, _, sources in SECTIONS:
        for source in sources:
            names.update(p.name for p in results.glob(source) if source.endswith(".json"))
    return names


def other_results(results: Path):
    """A section for any top-level JSON that no section renders, so that a new result is never silently left out."""
    rest = sorted(p for p in results.glob("*.json") if p.name not in _claimed(results))
    if not rest:
        return None
    lines = ["Result files without a section of their own yet (add one to `tools/render_numbers.py`): their top-level "
             "fields as stored.", ""]
    for path in rest:
        data = load(path)
        lines += [f"**`{RESULTS.as_posix()}/{path.name}`**", "", *command_block(data.get("command")
                                                                             if isinstance(data, dict) else None)]
        if isinstance(data, dict):
            lines += table(["field", "value"], [[k, json.dumps(v, sort_keys=True) if not isinstance(v, (str, int, float))
                                                 or isinstance(v, bool) else v] for k, v in data.items()
                                                if not isinstance(v, (dict, list)) or len(json.dumps(v)) <= 200])
    return "Other results", lines


# ---------------------------------------------------------------------------------------------------------------
# The page and the README block


def _as_sections(result) -> list[tuple[str, list[str]]]:
    if result is None:
        return []
    return result if isinstance(result, list) else [result]


def render_benchmarks(results: Path) -> str:
    """docs/benchmarks.md from the JSON under ``results``."""
    results = Path(results)
    groups: dict[str, list[tuple[int, str, list[str]]]] = {}
    for group, function, sources in SECTIONS:
        present = any(any(results.glob(source.rstrip("/"))) for source in sources)
        if not present and function not in ALWAYS:
            continue
        for i, (heading, lines) in enumerate(_as_sections(function(results))):
            groups.setdefault(group, []).append((2 if i == 0 else 3, heading, lines))
    other = other_results(results)
    if other:
        groups.setdefault("Other", []).append((2, other[0], other[1]))
    out = [
        "# Benchmarks",
        "",
        "<!-- generated by `python tools/render_numbers.py` from benchmarks/results/: do not edit by hand -->",
        "",
        "Every number on this page is generated from the JSON files under `benchmarks/results/` by "
        "`python tools/render_numbers.py` (`make numbers`), which also writes the results table of the README; "
        "`python tools/render_numbers.py --check` fails when either is stale (`tests/test_generated_docs.py` runs it). "
        "To change a number, rerun the benchmark (its command is given with each section) and regenerate. Each section "
        "states what the benchmark measures, the command, the machine as its JSON records it, and the tables. Ratios "
        "measured side by side in one run are the robust figures; absolute times depend on the machine and its load "
        "(most runs shared a small CPU machine with other jobs).",
        "",
    ]
    for group, entries in groups.items():
        out.append(f"- {group}: " + ", ".join(f"[{heading}](#{slug(heading)})" for level, heading, _ in entries
                                               if level == 2))
    out.append("")
    for entries in groups.values():
        for level, heading, lines in entries:
            if lines and lines[0].startswith("<!-- "):  # a section builder's own text: its heading is inside
                out += lines
                continue
            out += [f"{'#' * level} {heading}", "", *lines]
    text = "\n".join(out)
    text = re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"
    text = without_local_paths(text)
    _check_headings(text)
    return text


LOCAL_FOLDER = re.compile(r"(?<![\w.])/(?:work|tmp|root|home/[\w.-]+)/[\w.+-]+")


def without_local_paths(text: str) -> str:
    """The JSON files record the folders a run used on its machine (``/work/cloneA/...``); the page names the part
    a reader can reproduce: ``<local folder>/outputs/...``."""
    return LOCAL_FOLDER.sub("<local folder>", text)


def _check_headings(text: str) -> None:
    """Headings must be unique (their anchors are linked) and every in-page link must name one."""
    headings = [line.lstrip("#").strip() for line in text.splitlines() if re.match(r"#{1,4} ", line)]
    anchors = [slug(h) for h in headings]
    links = set(re.findall(r"\]\(#([^)]+)\)", text))
    missing = links - set(anchors)
    if missing:
        raise ValueError(f"docs/benchmarks.md links to missing anchors: {sorted(missing)}")


def _speedup_cell(arm: dict, key: str) -> str:
    return with_ci(arm.get(key), arm.get(key + "_ci95"), 2, "x")


def render_readme_block(results: Path) -> str:
    """The README's results table: compiled_serving.json's runs at ``README_THREADS`` thread(s)."""
    results = Path(results)
    data = load(results / README_SOURCE)
    key = f"threads{README_THREADS}"
    runs = [name for name in data["runs"] if name.split("/", 1)[0] == key]
    if not runs:
        raise ValueError(f"{README_SOURCE} has no run at {README_THREADS} thread(s) for the README's table")
    meta = (data.get("meta") or {}).get(key, {})
    cpu = meta.get("cpu") or {}
    precision = _plain_precision(data, runs)
    arms: list[str] = []
    for run in runs:
        arms += [a for a in data["runs"][run]["arms"] if a not in arms]
    sets = [(run, _PROMPT_SETS.get(run.split("/", 1)[1], run.split("/", 1)[1])) for run in runs]
    flags = ", ".join(f"{name} {yes_no(cpu[k])}" for k, name in (("avx512f", "AVX-512"), ("amx", "AMX")) if k in cpu)
    machine = ", ".join(x for x in (cpu.get("model"), f"{cpu['cores']} cores" if "cores" in cpu else None, flags) if x)
    prompts = "; ".join(
        f"{data['runs'][run].get('prompts', '-')} {label} prompts"
        + (f" ({data['runs'][run]['skipped_too_long']} longer than the static cache passed over)"
           if data["runs"][run].get("skipped_too_long") else "")
        + f", {count(next(iter(data['runs'][run]['arms'].values())).get('new_tokens'))} new tokens"
        for run, label in sets)
    header = ["arm"]
    for _, label in sets:
        header += [f"{label}: vs compiled plain", "vs HF eager", "tau", "lossless"]
    rows = []
    for arm in arms:
        row = [f"`{arm}`"]
        for run, _ in sets:
            a = data["runs"][run]["arms"].get(arm)
            row += ["-"] * 4 if a is None else [
                _speedup_cell(a, "speedup_vs_compiled_plain[fp32]"), _speedup_cell(a, "speedup_vs_hf_generate_eager"),
                num(a.get("tau")), a.get("lossless_prompts", "-")]
        rows.append(row)
    lines = [
        f"<!-- generated by `{COMMAND}` from benchmarks/results/{README_SOURCE}: do not edit by hand -->",
        f"Greedy decoding of SmolLM2-135M-Instruct, batch 1, up to {meta.get('max_new_tokens', '-')} new tokens per "
        f"prompt, on {machine or 'a machine not recorded'}, {threads_text(meta.get('threads'))}, "
        f"{'fp32 unless a row names another precision' if precision else 'precision not recorded'}, torch {meta.get('torch', 'not recorded')}: "
        "transformers' `generate` (eager, compiled), ppow_trl's compiled runtime (fp32 and int8 targets), plain and "
        "with the served speculative rules, and llama.cpp where the run has it. "
        f"{prompts}. Speedups: ratio of total times [95% CI]; tau: tokens per target forward; lossless: prompts "
        "whose tokens equal plain decoding's at the same precision and runtime.",
        "",
        *table(header, rows)[:-1],
        "",
        f"Machine details, compile times, rules, cost models and the other thread counts: "
        f"[docs/benchmarks.md](docs/benchmarks.md#{slug(COMPILED_SERVING_HEADING)}).",
    ]
    return "\n".join(lines)


def replace_block(text: str, block: str, begin: str = README_BEGIN, end: str = README_END, name: str = "README.md") -> str:
    """``text`` with what lies between ``begin`` and ``end`` replaced by ``block``; nothing else changes."""
    for marker in (begin, end):
        found = text.count(marker)
        if found != 1:
            raise MarkerError(f"{name}: expected the marker {marker!r} once, found it {found} times; the generated "
                              f"results table goes between {begin!r} and {end!r} (each on its own line).")
    start, stop = text.index(begin), text.index(end)
    if stop < start:
        raise MarkerError(f"{name}: {end!r} comes before {begin!r}.")
    return text[: start + len(begin)] + "\n" + block.strip("\n") + "\n" + text[stop:]


def render_all(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file's expected content: ``{path relative to root: text}``."""
    root = Path(root)
    results = root / RESULTS
    readme = (root / README).read_text()
    return {BENCHMARKS_PAGE: render_benchmarks(results),
            README: replace_block(readme, render_readme_block(results), name=str(README))}


def stale(root: Path = ROOT) -> list[Path]:
    """The generated files whose content differs from a fresh render (relative paths)."""
    root = Path(root)
    return [path for path, text in render_all(root).items()
            if not (root / path).is_file() or (root / path).read_text() != text]


def check(root: Path = ROOT) -> str | None:
    """``None`` when everything is up to date, else the message naming the stale files and the command."""
    paths = stale(root)
    if not paths:
        return None
    return (f"Stale generated file(s): {', '.join(p.as_posix() for p in paths)}. Regenerate them from "
            f"benchmarks/results/*.json with `{COMMAND}` (or `make numbers`) and commit the result.")


def write(root: Path = ROOT) -> list[Path]:
    root = Path(root)
    written = []
    for path, text in render_all(root).items():
        target = root / path
        if not target.is_file() or target.read_text() != text:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            written.append(path)
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    if args.check:
        message = check(args.root)
        if message:
            print(message, file=sys.stderr)
            return 1
        print("docs/benchmarks.md and README.md's results table are up to date.")
        return 0
    written = write(args.root)
    print("wrote " + ", ".join(p.as_posix() for p in written) if written else "nothing to write: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
