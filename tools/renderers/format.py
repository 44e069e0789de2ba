"""Cell formats and the one table helper every renderer shares.

A value missing from a JSON (``None``, NaN) is written ``-``, so that a table never invents a figure.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
import unicodedata
from pathlib import Path

RESULTS = Path("benchmarks/results")
CATALOG = tomllib.loads((Path(__file__).parent / "benchmarks.toml").read_text())  # what the pages show, in order
LOCAL_FOLDER = re.compile(r"(?<![\w.])/(?:work|tmp|root|home/[\w.-]+)/[\w.+-]+")


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def num(value, digits: int = 2, suffix: str = "") -> str:
    """A float with ``digits`` decimals; strings pass through (some JSONs store formatted cells)."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def ci(value, pair, digits: int = 2, suffix: str = "") -> str:
    """``1.05x [0.99, 1.11]``: a value with its 95% interval when the JSON has one."""
    text = num(value, digits, suffix)
    if text == "-" or not pair or None in pair:
        return text
    return f"{text} [{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"


def auto(value) -> str:
    """Any stored value as a cell: three significant digits, counts with separators, lists joined, intervals kept."""
    if value is None or isinstance(value, str):
        return value or "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 100):
        return f"{int(value):,}"
    if isinstance(value, float):  # three significant digits, and at least three decimals under 10 (1.169 vs 1.171)
        digits = 2 - math.floor(math.log10(abs(value) or 1))
        return "-" if not math.isfinite(value) else num(value, max(digits, 3) if abs(value) < 10 else max(digits, 0))
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], list):  # [value, [low, high]]
        return f"{auto(value[0])} [{', '.join(map(auto, value[1]))}]"
    if isinstance(value, list):
        return " / ".join(map(auto, value))
    return "; ".join(f"{k} {auto(v)}" for k, v in value.items()) if isinstance(value, dict) else str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table, then a blank line: the only table writer, so every page's tables escape alike."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows] + [""])


SHELL_COMMENT = re.compile(r"\s+#\s.*$", re.S)


def command_line(command: str | None, result: str | None = None) -> list[str]:
    """The command that reproduces a result, as its JSON (``result``, under benchmarks/results/) records it, without
    a trailing shell comment (``  # ...``: notes of the session that ran it; what a reader needs of them goes in the
    benchmark's ``about`` in benchmarks.toml)."""
    source = f" (`{RESULTS.as_posix()}/{result}`)" if result else ""
    command = SHELL_COMMENT.sub("", command) if command else command
    return [f"Command{source}: `{command}`" if command else f"Command{source}: not recorded in the JSON.", ""]


def threads_text(threads) -> str:
    return "-" if threads is None else f"{threads} thread{'s' if int(threads) != 1 else ''}"


def cpu_text(cpu: dict | None) -> str:
    """``Intel(R) Xeon(R) Processor, 2 cores, AVX-512 yes, AMX yes``, or what of it the JSON recorded."""
    cpu = cpu or {}
    flags = [f"{name} {auto(cpu[key])}" for key, name in (("avx512f", "AVX-512"), ("amx", "AMX")) if key in cpu]
    return ", ".join([cpu.get("model") or "CPU model not recorded"] + ([f"{cpu['cores']} cores"] if cpu.get("cores")
                                                                       else []) + flags)


def machine_text(data: dict) -> str:
    """One line: the machine and settings a result records (older JSONs keep them under ``machine``)."""
    machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    cpu = data.get("cpu") if isinstance(data.get("cpu"), dict) else {"model": machine.get("cpu"),
                                                                      "cores": machine.get("cpu_count")}
    parts = [cpu_text(cpu)] + [f"{name} {value}" for name in ("torch", "transformers")
                               if isinstance(value := data.get(name) or machine.get(name), str)]
    threads = data.get("threads", data.get("threads_per_process", machine.get("torch_threads")))
    parts += [threads_text(threads)] if isinstance(threads, int) else []
    parts += [f"{key} {data[key]}" for key in ("precision", "runtime") if isinstance(data.get(key), str)]
    return "Machine: " + "; ".join(parts + ([f"run on {machine['date'][:10]}"] if machine.get("date") else [])) + "."


def slug(heading: str) -> str:
    """The anchor MkDocs (Python-Markdown's toc) gives a heading; GitHub gives the same for the plain headings here."""
    value = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", value).strip().lower())


def without_local_paths(text: str) -> str:
    """The JSON files record the folders a run used on its machine (``/work/cloneA/...``); a page names the part a
    reader can reproduce: ``<local folder>/outputs/...``."""
    return LOCAL_FOLDER.sub("<local folder>", text)
