"""The benchmarks of benchmarks.toml in page order: those it describes drawn by ``generic.render``, the others (results
that need arithmetic, or whose text another module writes) by the function its ``renderer`` names, here or in
``serving``."""

from __future__ import annotations

from pathlib import Path

from . import generic, serving
from .format import CATALOG, RESULTS, auto, command_line, load, table
from .page import Run, Section, section


def round_costs(spec: dict, results: Path) -> Section | None:
    """Served rounds by drafted length: the cost model's time against the measured one, unguarded and guarded."""
    runs = []
    for path in generic.files(spec, results):
        data = load(path)
        arms = {"cost model": data["cost_model_round_time"], **{k: data.get(k, {}) for k in (
            "unguarded", "guarded", "guarded_after_a_pause")}}
        rows = [[L] + [f"{auto(v['round_time_median'])} ({auto(v['rounds'])})" if isinstance(v, dict) else auto(v)
                       for v in (arm.get(L) for arm in arms.values())] for L in sorted(arms["unguarded"], key=int)]
        lines = [*generic.run_lines(spec, data, path.name), f"Served rule: {data.get('served_rule')}", ""]
        runs.append(Run(path.name, lines + table(["drafted L", *arms], rows)))
    return section(spec, runs)


def guard_simulation(spec: dict, results: Path) -> Section | None:
    """The online guard's arms on simulated rounds: speedup (drafting share) when the rule pays / when it collapses."""
    if not (path := results / spec["files"][0]).is_file():
        return None
    data = load(path)
    lines = command_line(data.get("command"), path.name)
    for length, rules in data["rules_by_new_tokens"].items():
        rows = [[f"K = {r['max_window']}, alpha {r['paying_alpha']}"] + [
            f"{a['paying']['speedup']:.3f}x ({a['paying']['drafting_fraction']:.0%}) / {a['collapsed']['speedup']:.3f}x"
            for a in r["arms"].values()] for r in rules]
        lines += [f"Generations of {auto(int(length))} tokens, paying / collapsed:", "",
                  *table(["rule", *rules[0]["arms"]], rows)]
    return section(spec, [Run(None, lines)], about=spec["about"].format(**data))


def study(spec: dict, results: Path) -> Section | None:
    """A study's section comes whole from its builder in ``ppow_trl.study``; the summary shows its first finding."""
    folder = spec["files"][0].rstrip("/")
    path, label = results / folder, f"{RESULTS.as_posix()}/{folder}"
    summary = load(path / "summary.json") if (path / "summary.json").is_file() else {}
    if folder == "study":
        from ppow_trl.study import report
        arms = report.load_arms(path) if summary else None
        clock = load(path / "wallclock.json") if (path / "wallclock.json").is_file() else None
        text = report.section(arms, summary, clock, results_label=label) if arms else None
    else:
        from ppow_trl.study import converged_report
        text = converged_report.section(path, summary, results_label=label) if summary.get("families") else None
    if not text:
        return None
    finding = _first_findings(text.split("\n### What", 1)[1]) if "\n### What" in text else []
    command = next((line for line in text.splitlines() if line.startswith("Command")), "")
    title = text.split("\n## ", 1)[1].split("\n", 1)[0]
    return Section(title, spec["group"], "", [Run(None, [text, ""])], headline=[command, "", *finding, ""])


def _first_findings(shows: str) -> list[str]:
    """The opening of a study's "What the study shows": its first paragraph, or the first sentence of each item."""
    block = shows.split("\n\n")[1]
    if not block.startswith("- "):
        return block.splitlines()
    return [f"- {' '.join(item.split()).split('. ', 1)[0].rstrip('.')}." for item in block[2:].split("\n- ")]


RENDERERS = {"compiled_serving": serving.compiled_serving, "main_job_compiled": serving.main_job_compiled,
             "round_costs": round_costs, "guard_simulation": guard_simulation, "study": study}


def sections(results: Path) -> list[Section]:
    """Every benchmark whose results exist, in page order, then "Other results" for files no entry names."""
    found = [RENDERERS.get(spec.get("renderer"), generic.render)(spec, results) for spec in CATALOG["benchmark"]]
    named = {p.name for spec in CATALOG["benchmark"] for p in generic.files(spec, results)}
    rest = [p.name for p in sorted(results.glob("*.json")) if p.name not in named]
    found.append(generic.render({"title": "Other results", "group": "Other", "files": rest, "about": "Result files "
                                 "no entry of `tools/renderers/benchmarks.toml` names yet: their fields as stored.",
                                 "table": [{}]}, results) if rest else None)
    return [s for s in found if s is not None]
