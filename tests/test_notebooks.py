"""Every notebook in notebooks/ executes end to end, and is stored with its outputs.

Outputs are committed so that a reader sees the results and plots on the web;
``make notebooks`` regenerates them (scripts/run_notebooks.py).
"""

import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
sys.path.insert(0, str(ROOT / "scripts"))

from run_notebooks import execute  # noqa: E402


@pytest.mark.unit
def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.unit
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_with_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None for cell in code), (
        f"{path.name} is stored without outputs: run `make notebooks`")
    assert not any(out.get("output_type") == "error" for cell in code for out in cell.outputs)
    plots = ("plt." in cell.source or ".plot(" in cell.source for cell in code)
    if any(plots):
        assert any("image/png" in out.get("data", {}) for cell in code
                   for out in cell.outputs), f"{path.name}: its plots have no stored image"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path):
    execute(path, str(tmp_path))
