"""Runs notebooks top to bottom and saves them with their outputs, as they are committed.

    python scripts/run_notebooks.py            # every notebooks/*.ipynb
    python scripts/run_notebooks.py notebooks/02_precision_comparison.ipynb

Each notebook runs in a fresh kernel in a new temporary folder, so its `logs/` go
there and not into the repository; the kernel imports tfmp from this checkout
(the repository root is put first on PYTHONPATH) and the helpers from
`examples/` (`TFMP_EXAMPLES`). A cell that raises stops the script and leaves
that notebook's file as it was. Before a notebook is saved, the lines TensorFlow
and CUDA print while they start (no GPU driver, oneDNN notices, float16 on a CPU
without AVX-512: `ENVIRONMENT_NOISE`) are dropped from its stderr outputs: they
describe the machine that ran it, not the notebook, and paths inside the
checkout (the guide tfmp's messages link) are written relative to it. Every
other output, tfmp's warnings included, is kept. Needs the `notebooks` extra (nbclient, ipykernel).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import tempfile
import time
from typing import Any, List, Optional, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
TIMEOUT_PER_CELL_S = 600

#: Lines of TensorFlow's and CUDA's start-up on stderr: absl's notice that logs go to
#: stderr, C++ log lines (``I0000 00:00:...`` / ``E0000 ...``) such as "Could not find
#: cuda drivers", "failed call to cuInit", "oneDNN custom operations are on" and
#: "oneDNN supports DT_HALF only on platforms with AVX-512", and the CPU build notice.
ENVIRONMENT_NOISE = re.compile(
    r"absl::InitializeLog|^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]|cuInit|CUDA error"
    r"|cuda drivers|cudart_stub|DT_HALF|oneDNN custom operations|TF_ENABLE_ONEDNN_OPTS"
    r"|This TensorFlow binary is optimized|rebuild TensorFlow with the appropriate compiler",
    re.M,
)


def drop_environment_noise(notebook: Any) -> int:
    """Removes `ENVIRONMENT_NOISE` lines from the stderr outputs of `notebook`, in place.

    An stderr output left empty is removed; other outputs are not touched.

    Args:
        notebook: `nbformat.NotebookNode`, version 4.

    Returns:
        Int: the number of lines removed.
    """
    removed = 0
    for cell in notebook.cells:
        if cell.cell_type != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream" and output.get("name") == "stderr":
                lines = output["text"].splitlines(keepends=True)
                clean = [line for line in lines if not ENVIRONMENT_NOISE.search(line)]
                removed += len(lines) - len(clean)
                if not clean:
                    continue
                output["text"] = "".join(clean)
            kept.append(output)
        cell["outputs"] = kept
    return removed


def relative_to_checkout(notebook: Any, root: pathlib.Path = ROOT) -> int:
    """Writes paths inside the checkout (tfmp's messages link its installed guide) relative to it, in place.

    Args:
        notebook: `nbformat.NotebookNode`, version 4.
        root: The checkout the kernel imported tfmp from.

    Returns:
        Int: the number of stream outputs changed.
    """
    prefix, changed = str(root) + os.sep, 0
    for cell in notebook.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") == "stream" and prefix in output["text"]:
                output["text"] = output["text"].replace(prefix, "")
                changed += 1
    return changed


def run(path: pathlib.Path) -> float:
    """Executes the notebook at `path` and writes it back with its outputs; returns seconds."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tfmp-notebook-") as workdir:
        NotebookClient(notebook, timeout=TIMEOUT_PER_CELL_S, kernel_name="python3",
                       resources={"metadata": {"path": workdir}}).execute()
    took = time.perf_counter() - start
    removed = drop_environment_noise(notebook)
    relative_to_checkout(notebook)
    nbformat.write(notebook, path)
    print(f"{path.name}: {took:.0f} s, {removed} start-up line(s) dropped")
    return took


def main(argv: Optional[Sequence[str]] = None) -> List[pathlib.Path]:
    parser = argparse.ArgumentParser(
        description="Run notebooks top to bottom in fresh kernels and save them with "
        "their outputs, without TensorFlow's and CUDA's start-up lines.")
    parser.add_argument("notebooks", nargs="*", type=pathlib.Path,
                        help="notebooks to run (default: every notebooks/*.ipynb)")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or sorted((ROOT / "notebooks").glob("*.ipynb"))
    for path in paths:
        if path.suffix != ".ipynb" or not path.is_file():
            parser.error(f"{path} is not a notebook file (*.ipynb)")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ["TFMP_EXAMPLES"] = str(ROOT / "examples")
    for path in paths:
        run(path)
    return paths


if __name__ == "__main__":
    main()
