"""The tutorial notebooks run top to bottom (offline, CPU) in their small settings (PPOW_NOTEBOOK_FAST=1)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
ORDER = ("01_speculative_decoding_and_ppow.ipynb", "02_train_a_drafter.ipynb", "03_generate_with_a_drafter.ipynb")


@pytest.mark.slow
def test_notebooks_run_in_fast_mode(tmp_path, monkeypatch):
    """Executed in order in one working directory (a tmp_path): notebook 3 uses the adapter notebook 2 saved."""
    monkeypatch.setenv("PPOW_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    # jupyter_client reads the launching process's working directory even when a kernel path is given: make it one
    # that exists whatever ran before on this (xdist) worker.
    monkeypatch.chdir(tmp_path)
    timings = {}
    for name in ORDER:
        notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
        client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        start = time.perf_counter()
        client.execute()  # raises CellExecutionError on the first failing cell
        timings[name] = time.perf_counter() - start
        errors = [out for cell in notebook.cells if cell.cell_type == "code"
                  for out in cell.get("outputs", []) if out.get("output_type") == "error"]
        assert not errors, f"{name}: {errors}"
    assert (tmp_path / "ppow-drafter" / "adapter_config.json").is_file()
    assert (tmp_path / "my-assistant" / "ppow_window_policy.json").is_file()
    assert (tmp_path / "bench" / "notebook.md").is_file() and (tmp_path / "bench" / "notebook.png").is_file()
    print({name: round(seconds, 1) for name, seconds in timings.items()})
