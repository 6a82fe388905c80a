"""Every notebook in notebooks/ runs top to bottom; a cell error fails the suite. A second
run in the same folder logs to a folder of its own (every notebook names its log folder
with `example_utils.new_run_dir`; 05, the quickest, is run again in its kernel, as "Run
All" a second time would). The notebooks are committed with their outputs, as
`scripts/run_notebooks.py` saves them: those are checked too."""

import hashlib
import os
import pathlib
import re
import sys

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import run_notebooks  # noqa: E402

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
RUN_TWICE = "05_loss_scale_dynamics.ipynb"
TIMEOUT_PER_CELL_S = 300
MAX_NOTEBOOK_BYTES = 1_000_000  # committed with outputs: still reads on GitHub
# Absolute paths of a machine: a home or work folder, a temporary folder, a venv.
MACHINE_PATH = re.compile(r"(/home/|/work/|/tmp/|/Users/|site-packages|[A-Z]:\\\\)")
# What TensorFlow and CUDA printed on a machine without a GPU, as once committed.
START_UP_LINES = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796161791.853522    6936 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "E0000 00:00:1796161800.798456    6936 cuda_platform.cc:52] failed call to cuInit: "
    "INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
    "I0000 00:00:1796103065.051169   29505 port.cc:153] oneDNN custom operations are on. You may "
    "see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
    "E0000 00:00:1796103099.980359   29505 util.cc:131] oneDNN supports DT_HALF only on "
    "platforms with AVX-512. Falling back to the default Eigen-based implementation if present.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
]


def run_notebook(path, workdir, runs=1):
    """Executes copies of the notebook at `path` in `workdir`; the file is not written.

    With `runs` > 1 the notebook runs again, top to bottom, in the same kernel and folder.
    Returns the executed copies, one per run.
    """
    copies = [nbformat.read(path, as_version=4) for _ in range(runs)]
    client = NotebookClient(
        copies[0],
        timeout=TIMEOUT_PER_CELL_S,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    with client.setup_kernel():
        for notebook in copies:
            client.nb = notebook
            client.reset_execution_trackers()
            for index, cell in enumerate(notebook.cells):
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
    return copies


def outputs_of(notebook):
    """Every output of every code cell, in order."""
    return [o for c in notebook.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def errors_in(notebook):
    return [o for o in outputs_of(notebook) if o.get("output_type") == "error"]


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
    """05 runs twice in one folder: the second run finds the first run's logs and must not read them."""
    committed = hashlib.sha256(path.read_bytes()).hexdigest()
    runs = 2 if path.name == RUN_TWICE else 1
    notebooks = run_notebook(path, tmp_path, runs)
    assert [errors_in(notebook) for notebook in notebooks] == [[]] * runs
    assert hashlib.sha256(path.read_bytes()).hexdigest() == committed  # the file is untouched
    assert set(run_folders(tmp_path).values()) <= {runs}  # one folder per run below logs/<topic>/
    if runs == 2:
        assert run_folders(tmp_path) == {"dynamics": 2}


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


def outputs_text(output):
    """The text an output shows: a stream's text, a result's text data, a traceback."""
    data = output.get("data", {})
    return "".join([output.get("text", "")] + [v for k, v in data.items() if k.startswith("text/")]
                   + output.get("traceback", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_committed_outputs_hold_no_environment_noise(path):
    """No line of TensorFlow's or CUDA's start-up (no GPU driver, oneDNN) was committed."""
    notebook = nbformat.read(path, as_version=4)
    noise = [(index, line) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"
             for output in cell.outputs for line in outputs_text(output).splitlines()
             if run_notebooks.ENVIRONMENT_NOISE.search(line)]
    assert not noise, f"{path.name}: rerun python scripts/run_notebooks.py {path.name}: {noise[:3]}"


@pytest.mark.parametrize("line", START_UP_LINES)
def test_start_up_lines_are_noise(line):
    assert run_notebooks.ENVIRONMENT_NOISE.search(line)


def test_run_notebooks_drops_start_up_lines_and_keeps_the_rest():
    notebook = nbformat.v4.new_notebook()
    stderr = nbformat.v4.new_output("stream", name="stderr", text="".join(
        line + "\n" for line in START_UP_LINES[:2] + ["UserWarning: keep me"] + START_UP_LINES[2:]))
    only_noise = nbformat.v4.new_output("stream", name="stderr", text=START_UP_LINES[2] + "\n")
    stdout = nbformat.v4.new_output("stream", name="stdout", text="tfmp.PerformanceWarning: kept\n")
    notebook.cells = [nbformat.v4.new_code_cell("x = 1", outputs=[stderr, only_noise, stdout])]
    assert run_notebooks.drop_environment_noise(notebook) == len(START_UP_LINES) + 1
    assert [o.get("text") for o in notebook.cells[0].outputs] == [
        "UserWarning: keep me\n", "tfmp.PerformanceWarning: kept\n"]


def test_run_notebooks_writes_the_guide_link_relative_to_the_checkout():
    notebook = nbformat.v4.new_notebook()
    guide = f"Guide: {ROOT / 'tfmp' / 'docs' / 'troubleshooting.md'}#nan-or-inf-loss\n"
    stderr = nbformat.v4.new_output("stream", name="stderr", text="SkippedStepWarning: step 3\n" + guide)
    other = nbformat.v4.new_output("stream", name="stdout", text="/elsewhere/file.txt\n")
    notebook.cells = [nbformat.v4.new_code_cell("x = 1", outputs=[stderr, other])]
    assert run_notebooks.relative_to_checkout(notebook) == 1
    assert [o["text"] for o in notebook.cells[0].outputs] == [
        "SkippedStepWarning: step 3\nGuide: tfmp/docs/troubleshooting.md#nan-or-inf-loss\n", "/elsewhere/file.txt\n"]


def test_a_failing_cell_fails_the_run(tmp_path):
    notebook = nbformat.v4.new_notebook()
    notebook.cells = [nbformat.v4.new_code_cell("x = 1"),
                      nbformat.v4.new_code_cell("raise RuntimeError('planted')")]
    path = tmp_path / "planted.ipynb"
    nbformat.write(notebook, path)
    with pytest.raises(CellExecutionError, match="planted"):
        run_notebook(path, tmp_path)
