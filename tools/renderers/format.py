"""Cell formats (a value missing from a JSON, ``None`` or NaN, is written ``-``: a table never invents a figure), the
one table helper every renderer shares, and the lines every run shows (command, machine)."""

from __future__ import annotations

import json
import math
import re
import tomllib
import unicodedata
from pathlib import Path

RESULTS = Path("benchmarks/results")
COMMAND = "python tools/render_numbers.py"
CATALOG = tomllib.loads((Path(__file__).parent / "benchmarks.toml").read_text())  # what the pages show, in order
LOCAL_FOLDER = re.compile(r"(?<![\w.])/(?:work|tmp|root|home/[\w.-]+)/[\w.+-]+")
SHELL_COMMENT = re.compile(r"\s+#\s.*$", re.S)


def load(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def num(value, digits: int = 2, suffix: str = "") -> str:
    if value is None or isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}{suffix}"


def ci(value, pair, digits: int = 2, suffix: str = "") -> str:
    """``1.05x [0.99, 1.11]``: a value with its 95% interval when the JSON has one."""
    text = num(value, digits, suffix)
    return text if text == "-" or not pair or None in pair else f"{text} [{pair[0]:.{digits}f}, {pair[1]:.{digits}f}]"


def auto(value) -> str:
    """Any stored value as a cell: three significant digits, counts with separators, lists joined, intervals kept."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, str):
        return value or "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) >= 100):
        return f"{int(value):,}"
    if isinstance(value, float):  # three significant digits, and at least three decimals under 10 (1.169 vs 1.171)
        digits = 2 - math.floor(math.log10(abs(value) or 1))
        return num(value, max(digits, 3) if abs(value) < 10 else max(digits, 0))
    if isinstance(value, list) and len(value) == 2 and isinstance(value[1], list):  # [value, [low, high]]
        return f"{auto(value[0])} [{', '.join(map(auto, value[1]))}]"
    if isinstance(value, list):
        return " / ".join(map(auto, value))
    return "; ".join(f"{k} {auto(v)}" for k, v in value.items()) if isinstance(value, dict) else str(value)


def table(header: list[str], rows: list[list]) -> list[str]:
    """A Markdown table, then a blank line: the only table writer, so every page's tables escape alike."""
    def line(cells) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, rows), ""]


def command_line(command: str | None, result: str | None = None) -> list[str]:
    """The command a result's JSON (``result``) records, without its trailing shell comment (the running session's
    notes: what a reader needs of them goes in the benchmark's ``about``)."""
    source = f" (`{RESULTS.as_posix()}/{result}`)" if result else ""
    return [f"Command{source}: `{SHELL_COMMENT.sub('', command)}`" if command else
            f"Command{source}: not recorded in the JSON.", ""]


def threads_text(threads) -> str:
    return "-" if threads is None else f"{threads} thread{'s' if int(threads) != 1 else ''}"


def cpu_text(cpu: dict | None) -> str:
    """``Intel(R) Xeon(R) Processor, 2 cores, AVX-512 yes, AMX yes``, or what of it the JSON recorded."""
    cpu = cpu or {}
    flags = [f"{name} {auto(cpu[key])}" for key, name in (("avx512f", "AVX-512"), ("amx", "AMX")) if key in cpu]
    cores = [f"{cpu['cores']} cores"] if cpu.get("cores") else []
    return ", ".join([cpu.get("model") or "CPU model not recorded", *cores, *flags])


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
    """A run's own folders (``/work/cloneA/...``) as ``<local folder>/...``: a page names what a reader reproduces."""
    return LOCAL_FOLDER.sub("<local folder>", text)
