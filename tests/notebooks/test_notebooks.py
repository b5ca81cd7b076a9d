"""The notebooks run, top to bottom, on CPU: every cell of notebooks/*.ipynb executes without an error.

All notebooks run in ONE kernel, one after the other, each after `%reset -f` (so none can lean on another's
variables): jax starts once and compiled steps are reused. The model is a tiny random-weight Llama with SmolLM2's
tokenizer (`JAXINFER_NOTEBOOK_MODEL`, which every notebook reads): with the real model the four notebooks take
about 5.5 minutes on a 2-core machine, with this one well under a minute; run them by hand (or with this test and
the variable unset: `JAXINFER_NOTEBOOK_MODEL= pytest tests/notebooks`) to see real text. Their one-cell install
does nothing here (jaxinfer is importable from the checkout).
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = ["quickstart", "serving", "research_batch", "colab_tpu_gpu", "byo_flax_model"]


def _read(name: str) -> nbformat.NotebookNode:
    return nbformat.read(REPO / "notebooks" / f"{name}.ipynb", as_version=4)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_without_outputs_and_opens_with_the_install(name: str):
    nb = _read(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "clear the outputs before committing"
    assert "pip" in code[0].source and "install" in code[0].source.lower(), "the first code cell installs"


def test_notebooks_execute_on_cpu(monkeypatch, tmp_path):
    if os.environ.get("JAXINFER_NOTEBOOK_MODEL") is None:
        from tests.tiny_model import write_tiny_model

        write_tiny_model(tmp_path / "tiny")
        monkeypatch.setenv("JAXINFER_NOTEBOOK_MODEL", str(tmp_path / "tiny"))
    elif not os.environ["JAXINFER_NOTEBOOK_MODEL"]:
        monkeypatch.delenv("JAXINFER_NOTEBOOK_MODEL")  # empty: the notebooks' own default model
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
