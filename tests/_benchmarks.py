"""Runs one of benchmarks/ in its quick mode, as its command line does, and reads back its JSON."""

import importlib
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def benchmark_module(name):
    """The module ``benchmarks/<name>.py``, imported as its command line imports it."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(f"benchmarks.{name}")


def quick_run(name, tmp_path):
    """``python benchmarks/<name>.py --quick --json ...``, in this process.

    Returns:
        ``(module, written)``: the benchmark's module and the JSON it wrote, which
        must equal what its ``main`` returned.
    """
    module = benchmark_module(name)
    path = tmp_path / f"{name}.json"
    returned = module.main(["--quick", "--json", str(path)])
    written = json.loads(path.read_text(encoding="utf-8"))
    assert written == json.loads(json.dumps(returned))
    return module, written
