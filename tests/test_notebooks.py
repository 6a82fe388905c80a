"""Every notebook in notebooks/ runs top to bottom; a cell error fails the suite. A second
run in the same folder logs to a folder of its own (every notebook names its log folder
with `example_utils.new_run_dir`; 05, the quickest, is run twice). The notebooks are
committed with their outputs: those are checked too."""

import hashlib
import os
import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
TIMEOUT_PER_CELL_S = 300
MAX_NOTEBOOK_BYTES = 1_000_000  # committed with outputs: still reads on GitHub
# Absolute paths of a machine: a home or work folder, a temporary folder, a venv.
MACHINE_PATH = re.compile(r"(/home/|/work/|/tmp/|/Users/|site-packages|[A-Z]:\\\\)")


# 02 run again with small settings (its A/B timing and 5-seed tfmp.compare are slow)
# that stop float16 after its second step (TOO_SLOW = 0): the path a CPU with a
# crawling float16 takes is run on every CPU.
CRAWLING_FLOAT16 = "EPOCHS, WIDTH, SEEDS, TOO_SLOW = 4, 256, 2, 0"
KNOBS = re.compile(r"^[A-Z_, ]*\bEPOCHS\b[A-Z_, ]*=", re.M)


def run_notebook(path, workdir, override=None):
    """Executes a copy of the notebook at `path` in `workdir`; the file is not written.

    `override`: code run right after the cell that sets the notebook's knobs (EPOCHS...).
    """
    notebook = nbformat.read(path, as_version=4)
    if override:
        knobs = [i for i, c in enumerate(notebook.cells) if c.cell_type == "code" and KNOBS.search(c.source)]
        assert len(knobs) == 1, f"{path.name}: no single cell sets EPOCHS"
        notebook.cells.insert(knobs[0] + 1, nbformat.v4.new_code_cell(override))
    client = NotebookClient(
        notebook,
        timeout=TIMEOUT_PER_CELL_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    return notebook


def outputs_of(notebook):
    """Every output of every code cell, in order."""
    return [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def errors_in(notebook):
    return [o for o in outputs_of(notebook) if o.get("output_type") == "error"]


def stdout_of(notebook):
    return "".join(o.get("text", "") for o in outputs_of(notebook) if o.get("name") == "stdout")


def markdown_of(notebook):
    return "".join(o["data"]["text/markdown"] for o in outputs_of(notebook)
                   if "text/markdown" in o.get("data", {}))


@pytest.fixture(autouse=True)
def kernel_imports_this_checkout(monkeypatch):
    """Kernels start in a temporary folder: let them import tfmp and examples/ from here."""
    paths = [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    monkeypatch.setenv("TFMP_EXAMPLES", str(ROOT / "examples"))


def test_notebooks_exist():
    assert [p.name for p in NOTEBOOKS][:1] == ["01_quickstart.ipynb"]


def run_folders(workdir):
    """{topic: number of run folders} below ``workdir/logs``."""
    logs = workdir / "logs"
    return {topic.name: len(list(topic.iterdir())) for topic in logs.iterdir()} if logs.exists() else {}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path, tmp_path):
    committed = hashlib.sha256(path.read_bytes()).hexdigest()
    notebook = run_notebook(path, tmp_path)
    assert not errors_in(notebook)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == committed  # the file is untouched
    assert set(run_folders(tmp_path).values()) <= {1}  # one folder per run below logs/<topic>/


def test_a_second_run_in_the_same_folder_logs_to_a_folder_of_its_own(tmp_path):
    """The second run finds the first run's logs there and must not read them."""
    path = ROOT / "notebooks" / "05_loss_scale_dynamics.ipynb"
    assert not errors_in(run_notebook(path, tmp_path))
    assert not errors_in(run_notebook(path, tmp_path))
    assert run_folders(tmp_path) == {"dynamics": 2}


def test_precision_comparison_stops_a_crawling_float16(tmp_path):
    notebook = run_notebook(ROOT / "notebooks" / "02_precision_comparison.ipynb", tmp_path, CRAWLING_FLOAT16)
    assert not errors_in(notebook)
    assert "mixed_float16 stopped after 2 steps: " in stdout_of(notebook)
    table = markdown_of(notebook)
    assert "| `mixed_float16` | stopped after 2 steps |" in table
    assert "| `mixed_bfloat16` | " in table and "| `float32` | " in table


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_notebook_shows_its_outputs(path):
    """Executed top to bottom, figures included, small, and no path of the machine that ran it."""
    assert path.stat().st_size < MAX_NOTEBOOK_BYTES
    notebook = nbformat.read(path, as_version=4)
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1))
    assert not errors_in(notebook)
    assert all(c.outputs for c in code if "plt.show()" in c.source)
    figures = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(figures) == sum(c.source.count("plt.show()") for c in code)
    text = nbformat.writes(notebook)
    assert not MACHINE_PATH.search(text), MACHINE_PATH.search(text)


def test_a_failing_cell_fails_the_run(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("x = 1"),
                      nbformat.v4.new_code_cell("raise RuntimeError('planted')")]
    path = tmp_path / "planted.ipynb"
    nbformat.write(notebook, path)
    with pytest.raises(CellExecutionError, match="planted"):
        run_notebook(path, tmp_path)
