"""`make deps-latest`: the newest versions setup.cfg's ranges allow, tested before they are adopted.

1. A scratch virtual environment (a temporary folder, or ``--venv``) gets ``make setup CONSTRAINTS=``: the same
   install as a user's, without the constraints file, so pip takes the newest versions the ranges allow. torch stays
   the Makefile's ``TORCH_SPEC`` (the CPU build users get; GPU users pick their own), and the wheels installed with
   ``--no-deps`` stay at their exact pins.
2. There: the fast tests (``pytest -m "not slow"``) and the main job's end-to-end smoke (tests/test_main_job.py).
3. A table, package by package: the pinned version (requirements/cpu-py311.txt), the newest installed, and the
   result of the runs for the packages that moved. Written to ``requirements/deps-latest.md``.

To adopt the newest versions once they pass: ``make lock`` (regenerates the constraints file), commit both.

    python tools/deps_latest.py [--venv DIR] [--skip-tests]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONSTRAINTS = REPO / "requirements" / "cpu-py311.txt"
REPORT = REPO / "requirements" / "deps-latest.md"
ENVIRONMENT_TOOLS = {"pip", "setuptools", "wheel"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(text: str) -> dict[str, str]:
    """``{package: version}`` from ``name==version`` lines (a local version label such as ``+cpu`` dropped)."""
    found = {}
    for line in text.splitlines():
        match = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;#+]+)", line.strip())
        if match:
            found[canonical(match.group(1))] = match.group(2)
    return found


def run(command: list[str], log: Path, **kwargs) -> tuple[int, float, str]:
    started = time.monotonic()
    with open(log, "a") as out:
        out.write(f"\n$ {' '.join(command)}\n")
        out.flush()
        result = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, **kwargs)
    tail = log.read_text().strip().splitlines()[-1:] or [""]
    return result.returncode, time.monotonic() - started, tail[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=None, help="scratch environment (default: a new temporary "
                        "folder; an existing one is reused as it is, so delete it to pick up newer releases)")
    parser.add_argument("--skip-tests", action="store_true", help="only install and compare versions")
    args = parser.parse_args()

    venv = args.venv or Path(tempfile.mkdtemp(prefix="ppow-deps-latest-")) / "venv"
    log = venv.parent / "deps-latest.log"
    print(f"Scratch environment {venv} (log {log})", flush=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    code, seconds, last = run(["make", "setup", f"PYTHON={python}", "CONSTRAINTS="], log)
    if code:
        print(f"make setup CONSTRAINTS= failed ({last}); see {log}")
        return code
    print(f"installed the newest versions in {seconds:.0f} s", flush=True)
    listed = json.loads(subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True,
                                       text=True, check=True).stdout)
    newest = {canonical(item["name"]): item["version"].split("+")[0] for item in listed}
    venv_python = subprocess.run([python, "-c", "import sys; print(sys.version.split()[0])"], capture_output=True,
                                 text=True).stdout.strip()
    pinned = pins(CONSTRAINTS.read_text())

    results = []
    if not args.skip_tests:
        env_runs = [("fast tests", [python, "-m", "pytest", "-q", "-n", "2", "-m", "not slow", "-p", "no:cacheprovider"]),
                    ("end-to-end smoke", [python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                          "tests/test_main_job.py"])]
        for label, command in env_runs:
            code, seconds, last = run(command, log)
            results.append((label, code == 0, seconds, last))
            print(f"{label}: {'passed' if code == 0 else 'FAILED'} in {seconds:.0f} s ({last})", flush=True)
    # One verdict for every package that moved: they are tested together, so a failure is not pinned on one.
    verdict = ("untested" if not results else
               "pass" if all(ok for _, ok, _, _ in results) else "FAIL")

    # The lock's packages only: the --no-deps wheels are pinned in the Makefile, and the environment's own tools
    # (pip, setuptools, wheel) are not what the project installs.
    rows = []
    for name in sorted(set(pinned) - ENVIRONMENT_TOOLS):
        old, new = pinned[name], newest.get(name, "not installed")
        if old != new:
            rows.append((name, old, new, verdict))
    lines = ["| package | pinned | newest | result |", "|---|---|---|---|"] if rows else [
        "Every package of the lock file is at its newest allowed version: nothing to adopt."]
    lines += [f"| {name} | {old} | {new} | {result} |" for name, old, new, result in rows]
    summary = [f"- {label}: {'passed' if ok else 'FAILED'} in {seconds:.0f} s ({last})"
               for label, ok, seconds, last in results]
    unchanged = len(set(pinned) - ENVIRONMENT_TOOLS) - len(rows)
    text = "\n".join([
        "# Newest allowed versions against the pinned ones",
        "",
        f"`make deps-latest` (tools/deps_latest.py), Python {venv_python}: {len(rows)} packages differ "
        f"from requirements/cpu-py311.txt, {unchanged} are the same.",
        "",
        *summary,
        "",
        *lines,
        "",
    ])
    REPORT.write_text(text)
    print("\n" + text)
    print(f"Written to {REPORT.relative_to(REPO)}. Adopt with `make lock` once they pass.")
    return 0 if verdict != "FAIL" else 1


if __name__ == "__main__":
    sys.exit(main())
