"""The notebooks run, top to bottom, on CPU: every cell of notebooks/*.ipynb executes without an error.

All notebooks run in ONE kernel, one after the other, each after `%reset -f` (so none can lean on another's
variables): jax starts once and the compiled steps of the shared small settings are reused, which keeps the CI
time to about a minute. Their one-cell install does nothing here (jaxinfer is importable from the checkout).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["quickstart", "serving", "research_batch", "colab_tpu_gpu"]


def _read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs_and_opens_with_the_install(name: str):
    nb = _read(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the outputs before committing"
    assert "pip" in code[0].source and "install" in code[0].source.lower(), "the first code cell installs"


def test_notebooks_execute_on_cpu(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    cells = []
    for name in NOTEBOOKS:
        cells.append(nbformat.v4.new_code_cell(f"%reset -f\nprint('### notebooks/{name}.ipynb')"))
        cells.extend(_read(name).cells)
    nb = nbformat.v4.new_notebook(cells=cells, metadata=_read(NOTEBOOKS[0]).metadata)
    # Raises CellExecutionError naming the failing cell (and, from the marker cells, its notebook).
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert all(f"### notebooks/{name}.ipynb" in printed for name in NOTEBOOKS)
