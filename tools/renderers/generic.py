"""Benchmarks described, not coded: a ``[[benchmark]]`` of benchmarks.toml names its JSON files and where its tables
are in them (the file's header says how). Each file is one run, oldest first."""

from __future__ import annotations

import re
from pathlib import Path

from .format import auto, command_line, load, machine_text, table
from .page import Run, Section, section

STORED_TEXTS = ("what", "setup", "model", "note", "machine_note", "reading")  # a run's own words, quoted verbatim


def lookup(record, path: str):
    """The value at a dotted path; a key that itself holds dots ("L = 2..5") is taken whole."""
    if not path or (isinstance(record, dict) and path in record):
        return record.get(path) if path else record
    for key in path.split("."):
        record = record.get(key) if isinstance(record, dict) else None
    return record


def cell(record: dict, path: str) -> str:
    value, _, interval = path.partition("|")
    pair = lookup(record, interval) if interval else None
    return auto(lookup(record, value)) + (f" [{auto(pair[0])}, {auto(pair[1])}]" if pair else "")


def tables_at(data: dict, path: str) -> list[tuple[str, object]]:
    """``("", rows)`` for a plain path; ``(key, rows)`` for each mapping under the level a ``*`` stands for."""
    head, star, tail = path.partition("*")
    if not star:
        return [("", lookup(data, path))]
    return [(key, lookup(value, tail.lstrip("."))) for key, value in (lookup(data, head.rstrip(".")) or {}).items()
            if isinstance(value, dict)]


def records(spec: dict, rows) -> tuple[bool, list[tuple[str, dict]]]:
    """The rows of one table as (key, record), and whether the keys label them: the records of a mapping (a scalar
    becomes ``{"value": ...}``), or of a list, or the JSON itself as one unlabelled row."""
    only, columns = spec.get("only"), spec.get("columns")
    if isinstance(rows, dict) and (spec.get("path") or only):
        return True, [(k, rows[k] if isinstance(rows[k], dict) else {"value": rows[k]}) for k in only or rows
                      if k in rows and (isinstance(rows[k], dict) or not columns)]
    return False, [("", r) for r in (rows if isinstance(rows, list) else [rows]) if isinstance(r, dict)]


def render_table(spec: dict, data: dict) -> list[str]:
    """The tables one ``[[benchmark.table]]`` picks from a run's JSON (several where its path has a ``*``)."""
    lines = []
    for name, rows in tables_at(data, spec.get("path", "")):
        keyed, found = records(spec, rows)
        if spec.get("sort"):
            found.sort(key=lambda item: lookup(item[1], spec["sort"]) or 0)
        scalars = {k: k for _, r in found for k, v in r.items() if not isinstance(v, (dict, list))}
        fields = spec.get("columns") or scalars
        labelled = keyed and not spec.get("no_label")
        body = [([key] if labelled else []) + [cell(r, path) for path in fields.values()] for key, r in found]
        header = ([spec.get("label", "")] if labelled else []) + list(fields)
        keep = [i for i in range(len(header)) if any(row[i] != "-" for row in body)]  # no column of dashes only
        if body:
            lines += ([f"*{name}*:", ""] if name else []) + table([header[i] for i in keep],
                                                                  [[row[i] for i in keep] for row in body])
    return lines


def run_lines(spec: dict, data: dict, name: str) -> list[str]:
    """One run: the command and machine its JSON records, the texts it stores about itself, its tables."""
    meta = data["meta"] if isinstance(data.get("meta"), dict) and "command" in data["meta"] else data
    lines = [*command_line(meta.get("command") or (data.get("settings") or {}).get("command"), name),
             machine_text(meta), ""]
    omitted = tuple(spec.get("omit_sentences", []))  # a stored account of earlier runs, which the archive keeps
    for key in (k for k in STORED_TEXTS if isinstance(data.get(k), str)):
        sentences = re.split(r"(?<=\.) (?=[A-Z])", data[key])
        text = " ".join(s for s in sentences if not s.startswith(omitted))
        lines += [f"{key.replace('_', ' ').capitalize()} (stored with the result): {text}", ""]
    return lines + [line for t in spec.get("table", []) for line in render_table(t, data)]


def files(spec: dict, results: Path) -> list[Path]:
    """The result files a ``[[benchmark]]`` names, oldest run first."""
    return [path for pattern in spec["files"] for path in sorted(results.glob(pattern))]


def render(spec: dict, results: Path) -> Section | None:
    """A ``[[benchmark]]``'s section, one run per file (or its ``always`` text while no file exists)."""
    runs = [Run(f"`{p.name}`", run_lines(spec, load(p), p.name)) for p in files(spec, results)]
    return section(spec, runs or ([Run(None, [spec["always"], ""])] if spec.get("always") else []))
