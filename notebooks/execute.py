"""Execute the tutorial notebooks in order and write them back with their outputs (what `make notebooks` runs).

Notebook 3 uses what notebook 2 saved (`ppow-drafter/`), so the three run in one temporary working directory, as in
tests/test_notebooks.py, with the same environment (offline, no tokenizer threads, matplotlib inline). Each notebook's
existing outputs are cleared first; only after all three succeed are they written back (to notebooks/, or
--output-dir), with the note under each title (the cell `outputs-note`) naming the machine and the settings, and how
long the notebook took at fast and at full settings: every run records its seconds in `notebooks/timings.json`
(per notebook and mode, with the CPU), and the note reads both modes from there, so no timing is typed by hand.

    python notebooks/execute.py --fast     # PPOW_NOTEBOOK_FAST=1: the committed outputs (`make notebooks`)
    python notebooks/execute.py            # the notebooks' default (full) settings
    python notebooks/execute.py --clear    # strip the outputs again, nothing executed
    python notebooks/execute.py --refresh-notes   # rewrite the notes' timings from notebooks/timings.json only

On a failure nothing is written back: the partly executed notebook is left in the working directory (printed).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from ppow_trl.utils import cpu_name

NOTEBOOKS = Path(__file__).resolve().parent
ORDER = ("01_speculative_decoding_and_ppow.ipynb", "02_train_a_drafter.ipynb", "03_generate_with_a_drafter.ipynb")
ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "MPLBACKEND": "module://matplotlib_inline.backend_inline",
}
NOTE_ID = "outputs-note"
TIMINGS = NOTEBOOKS / "timings.json"
NO_OUTPUTS_NOTE = (
    "> **Outputs.** This copy has no outputs. `make notebooks` runs the three notebooks in order and writes them\n"
    "> back with their outputs (numbers and plots); this note then names the machine, the precision and the\n"
    "> settings they came from."
)


def clear_outputs(notebook) -> None:
    """Drop every code cell's outputs, execution count and timing metadata (in place)."""
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
            cell.metadata.pop("execution", None)


def execute_notebook(notebook, workdir: str | Path, timeout: int | None = 600) -> float:
    """Clear ``notebook``'s outputs, then run it (in place) with ``workdir`` as the kernel's working directory.

    The kernel inherits this process's environment. Raises ``CellExecutionError`` on the first failing cell.
    Returns the seconds it took. The notebook's metadata is kept as it was (nbclient adds the kernel's details)."""
    clear_outputs(notebook)
    metadata = copy.deepcopy(notebook.metadata)
    client = NotebookClient(notebook, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(workdir)}})
    start = time.perf_counter()
    try:
        client.execute()
    finally:
        notebook.metadata = metadata
    return time.perf_counter() - start


def error_outputs(notebook) -> list:
    return [output for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.get("outputs", []) if output.get("output_type") == "error"]


def load_timings(path: Path = TIMINGS) -> dict:
    """``{notebook: {"fast" | "full": {"seconds", "cpu", "date"}}}`` from earlier runs (empty when none)."""
    return json.loads(path.read_text()) if path.exists() else {}


def record_timings(seconds: dict, fast: bool, path: Path = TIMINGS) -> dict:
    """Merge this run's ``{notebook: seconds}`` under its mode into ``path`` (the other mode's entries stay)."""
    timings = load_timings(path)
    mode = "fast" if fast else "full"
    for name, value in seconds.items():
        timings.setdefault(name, {})[mode] = {"seconds": round(value), "cpu": cpu_name(),
                                              "date": datetime.date.today().isoformat()}
    path.write_text(json.dumps(timings, indent=2, sort_keys=True) + "\n")
    return timings


def timing_sentence(entry: dict) -> str:
    """How long one notebook took, per mode, as recorded (a mode never run says so)."""
    parts = []
    for mode, label in (("fast", "fast settings (`PPOW_NOTEBOOK_FAST=1`)"), ("full", "full (default) settings")):
        run = entry.get(mode)
        parts.append(f"about {max(1, round(run['seconds'] / 60))} min at {label} on {run['cpu']}" if run
                     else f"not yet timed at {label}")
    return "**Time to run:** " + "; ".join(parts) + " (`notebooks/timings.json`, written by `make notebooks`)."


def outputs_note(fast: bool, entry: dict | None = None) -> str:
    """The note under an executed notebook's title: where and with which settings its outputs were made, and how
    long it takes in each mode."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "?"
    settings = ("**fast settings** (`PPOW_NOTEBOOK_FAST=1`: fewer prompts, tokens and steps than the defaults)"
                if fast else "the default (full) settings")
    note = (f"> **Outputs** from `make notebooks` on {datetime.date.today().isoformat()}: {cpu_name()}, "
            f"{os.cpu_count()} CPU cores, {platform.platform()}, python {platform.python_version()}, torch "
            f"{torch_version}; fp32; {settings}. Timings depend on the machine and its load.")
    return note + ("\n>\n> " + timing_sentence(entry) if entry is not None else "")


def set_note(notebook, text: str) -> None:
    for cell in notebook.cells:
        if cell.get("id") == NOTE_ID:
            cell.source = text
            return


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", action="store_true", help="small settings (PPOW_NOTEBOOK_FAST=1), as the test runs")
    parser.add_argument("--clear", action="store_true", help="only strip the outputs (and reset the note); no run")
    parser.add_argument("--refresh-notes", action="store_true",
                        help="rewrite each note's timing from notebooks/timings.json (after a run to --output-dir); "
                             "the committed outputs stay, made at fast settings")
    parser.add_argument("--output-dir", type=Path, default=NOTEBOOKS,
                        help="where the executed notebooks are written (default: notebooks/, in place)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell (default 1800)")
    args = parser.parse_args(argv)
    args.output_dir = args.output_dir.resolve()
    notebooks = {name: nbformat.read(NOTEBOOKS / name, as_version=4) for name in ORDER}

    if args.clear:
        for name, notebook in notebooks.items():
            clear_outputs(notebook)
            set_note(notebook, NO_OUTPUTS_NOTE)
            nbformat.write(notebook, args.output_dir / name)
        print(f"cleared {len(notebooks)} notebooks in {args.output_dir}")
        return 0

    if args.refresh_notes:
        recorded = load_timings()
        for name, notebook in notebooks.items():
            set_note(notebook, outputs_note(True, recorded.get(name, {})))
            nbformat.write(notebook, args.output_dir / name)
        print(f"refreshed the notes of {len(notebooks)} notebooks from {TIMINGS}")
        return 0

    os.environ.update(ENVIRONMENT)
    os.environ["PPOW_NOTEBOOK_FAST"] = "1" if args.fast else "0"
    workdir = Path(tempfile.mkdtemp(prefix="ppow_notebooks_"))
    os.chdir(workdir)  # jupyter_client also reads the launching process's working directory
    timings = {}
    for name, notebook in notebooks.items():
        print(f"[notebooks] {name} ({'fast' if args.fast else 'full'} settings) in {workdir} ...", flush=True)
        try:
            timings[name] = execute_notebook(notebook, workdir, args.timeout)
        except CellExecutionError as error:
            nbformat.write(notebook, workdir / name)
            print(f"[notebooks] {name} failed; nothing written back. Partly executed copy: {workdir / name}\n{error}",
                  file=sys.stderr)
            return 1
        print(f"[notebooks] {name}: {timings[name]:.0f}s", flush=True)
    recorded = record_timings(timings, args.fast)
    for name, notebook in notebooks.items():
        set_note(notebook, outputs_note(args.fast, recorded.get(name, {})))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for name, notebook in notebooks.items():
        nbformat.write(notebook, args.output_dir / name)
    os.chdir(NOTEBOOKS)
    shutil.rmtree(workdir, ignore_errors=True)
    print(f"[notebooks] wrote {', '.join(ORDER)} to {args.output_dir}; {sum(timings.values()):.0f}s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
