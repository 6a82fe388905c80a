"""Every notebook in notebooks/ runs top to bottom; a cell error fails the suite."""

import os
import pathlib

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT_PER_CELL_S = 300


def run_notebook(path, workdir):
    """Executes the notebook at `path` with the current Python, in `workdir`."""
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook,
        timeout=TIMEOUT_PER_CELL_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    return notebook


@pytest.fixture(autouse=True)
def kernel_imports_this_checkout(monkeypatch):
    """Kernels start in a temporary folder: let them import tfmp and examples/ from here."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("TFMP_EXAMPLES", str(ROOT / "examples"))


def test_notebooks_exist():
    assert [p.name for p in NOTEBOOKS][:1] == ["01_quickstart.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, tmp_path):
    notebook = run_notebook(path, tmp_path)
    errors = [o for c in notebook.cells if c.cell_type == "code"
              for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_a_failing_cell_fails_the_run(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("x = 1"),
                      nbformat.v4.new_code_cell("raise RuntimeError('planted')")]
    path = tmp_path / "planted.ipynb"
    nbformat.write(notebook, path)
    with pytest.raises(CellExecutionError, match="planted"):
        run_notebook(path, tmp_path)
