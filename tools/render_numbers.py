"""Generate docs/benchmarks.md, docs/benchmarks-archive.md and the README's results table from benchmarks/results.

    python tools/render_numbers.py            # write them (`make numbers`)
    python tools/render_numbers.py --check    # regenerate in memory; exit 1 naming the stale files

Every figure comes from the JSON under ``benchmarks/results/``, rendered by ``tools/renderers/`` deterministically
(sorted files, stored JSON order, fixed formats); only the README's part between ``<!-- results:begin -->`` and
``<!-- results:end -->`` is replaced. ``tests/test_generated_docs.py`` runs the check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/renderers, also when this file is loaded by path

from renderers import catalog, page, serving  # noqa: E402  (the tests check serving's reference rule)
from renderers.format import COMMAND, RESULTS, without_local_paths  # noqa: E402,F401  (the tests call it)
from renderers.serving import HEADING as COMPILED_SERVING_HEADING, MixedReferenceError  # noqa: E402,F401

ROOT = Path(__file__).resolve().parent.parent
README, README_BEGIN, README_END = Path("README.md"), "<!-- results:begin -->", "<!-- results:end -->"


class MarkerError(ValueError):
    """A results marker of the README is missing, repeated or out of order."""


def replace_block(text: str, block: str, name: str = "README.md") -> str:
    """``text`` with what lies between the results markers replaced by ``block``; nothing else changes."""
    for marker in (README_BEGIN, README_END):
        if text.count(marker) != 1:
            raise MarkerError(f"{name}: expected the marker {marker!r} once, found it {text.count(marker)} times; the "
                              f"generated results table goes between {README_BEGIN!r} and {README_END!r}.")
    start, stop = text.index(README_BEGIN), text.index(README_END)
    if stop < start:
        raise MarkerError(f"{name}: {README_END!r} comes before {README_BEGIN!r}.")
    return text[: start + len(README_BEGIN)] + "\n" + block.strip("\n") + "\n" + text[stop:]


def render_all(root: Path = ROOT) -> dict[Path, str]:
    """Every generated file's expected content: ``{path relative to root: text}``."""
    results, readme = Path(root) / RESULTS, (Path(root) / README).read_text()
    pages = page.render(catalog.sections(results))
    return {**pages, README: replace_block(readme, serving.readme_block(results), str(README))}


def stale(root: Path = ROOT) -> dict[Path, str]:
    """The generated files whose content differs from a fresh render: ``{relative path: fresh content}``."""
    return {path: text for path, text in render_all(root).items()
            if not (Path(root) / path).is_file() or (Path(root) / path).read_text() != text}


def check(root: Path = ROOT) -> str | None:
    """``None`` when everything is up to date, else the message naming the stale files and the command."""
    paths = stale(root)
    return (f"Stale generated file(s): {', '.join(p.as_posix() for p in paths)}. Regenerate them from "
            f"benchmarks/results/*.json with `{COMMAND}` (or `make numbers`) and commit the result.") if paths else None


def write(root: Path = ROOT) -> list[Path]:
    """Write the generated files that changed; returns their paths."""
    changed = stale(root)
    for path, text in changed.items():
        (Path(root) / path).parent.mkdir(parents=True, exist_ok=True)
        (Path(root) / path).write_text(text)
    return list(changed)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated file is stale; write nothing")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository root (default: this checkout)")
    args = parser.parse_args(argv)
    if args.check:
        message = check(args.root)
        print(message or "The benchmarks pages and README.md's results table are up to date.",
              file=sys.stderr if message else sys.stdout)
        return 1 if message else 0
    written = write(args.root)
    print("wrote " + ", ".join(p.as_posix() for p in written) if written else "nothing to write: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
