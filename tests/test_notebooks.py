"""The tutorial notebooks run top to bottom (offline, CPU) in their small settings (PPOW_NOTEBOOK_FAST=1).

They run as `make notebooks` runs them (notebooks/execute.py): in order, in one working directory, each with its
outputs cleared first (the committed copies may carry outputs from `make notebooks`). Only errors are checked, and
that each notebook draws its plots; the outputs' values are never compared.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def _execute_module():
    """notebooks/execute.py (not a package module): its environment, order and execution helpers."""
    spec = importlib.util.spec_from_file_location("ppow_notebooks_execute", NOTEBOOKS / "execute.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _images(notebook) -> int:
    return sum("image/png" in output.get("data", {}) for cell in notebook.cells if cell.cell_type == "code"
               for output in cell.get("outputs", []))


def test_stale_outputs_are_cleared_before_execution(tmp_path, monkeypatch):
    """A notebook committed with outputs (an error among them) executes afresh: nothing stale survives."""
    execute = _execute_module()
    monkeypatch.chdir(tmp_path)
    cell = nbformat.v4.new_code_cell("print('fresh')")
    cell.execution_count = 7
    cell.outputs = [nbformat.v4.new_output("error", ename="OldError", evalue="stale", traceback=[]),
                    nbformat.v4.new_output("stream", name="stdout", text="stale\n")]
    kernelspec = {"display_name": "Python 3", "language": "python", "name": "python3"}
    notebook = nbformat.v4.new_notebook(cells=[cell], metadata={"kernelspec": kernelspec})
    execute.execute_notebook(notebook, tmp_path, timeout=60)
    assert not execute.error_outputs(notebook)
    assert [output.get("text") for output in cell.outputs] == ["fresh\n"] and cell.execution_count == 1
    assert notebook.metadata == {"kernelspec": kernelspec}  # kept as it was


@pytest.mark.slow
def test_notebooks_run_in_fast_mode(tmp_path, monkeypatch):
    """Executed in order in one working directory (a tmp_path): notebook 3 uses the adapter notebook 2 saved."""
    execute = _execute_module()
    for name, value in {**execute.ENVIRONMENT, "PPOW_NOTEBOOK_FAST": "1"}.items():
        monkeypatch.setenv(name, value)
    # jupyter_client reads the launching process's working directory even when a kernel path is given: make it one
    # that exists whatever ran before on this (xdist) worker.
    monkeypatch.chdir(tmp_path)
    timings = {}
    for name in execute.ORDER:
        notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
        # clears any committed outputs first; raises CellExecutionError on the first failing cell
        timings[name] = execute.execute_notebook(notebook, tmp_path, timeout=300)
        errors = execute.error_outputs(notebook)
        assert not errors, f"{name}: {errors}"
        assert _images(notebook) >= 2, f"{name}: expected its acceptance histogram and tau plot"
    assert (tmp_path / "ppow-drafter" / "adapter_config.json").is_file()
    assert (tmp_path / "my-assistant" / "ppow_window_policy.json").is_file()
    assert (tmp_path / "bench" / "notebook.md").is_file() and (tmp_path / "bench" / "notebook.png").is_file()
    print({name: round(seconds, 1) for name, seconds in timings.items()})


def test_timings_are_recorded_per_mode_and_read_into_the_note(tmp_path):
    """A fast run keeps the full run's timing (and vice versa), and the note states both modes from the file."""
    execute = _execute_module()
    path = tmp_path / "timings.json"
    execute.record_timings({"a.ipynb": 610.0}, fast=False, path=path)
    recorded = execute.record_timings({"a.ipynb": 95.0, "b.ipynb": 20.0}, fast=True, path=path)
    assert recorded["a.ipynb"]["full"]["seconds"] == 610 and recorded["a.ipynb"]["fast"]["seconds"] == 95
    assert execute.load_timings(path) == recorded
    sentence = execute.timing_sentence(recorded["a.ipynb"])
    assert "about 2 min at fast settings" in sentence and "about 10 min at full (default) settings" in sentence
    assert "not yet timed at full" in execute.timing_sentence(recorded["b.ipynb"])
    assert execute.timing_sentence(recorded["a.ipynb"]) in execute.outputs_note(True, recorded["a.ipynb"])
