"""The public API is frozen: additions and removals are deliberate."""

import doctest
import importlib
import pathlib

import pytest

import tfmp

PUBLIC_API = {
    "AuditReport",
    "NumericsHandle",
    "DatasetReport",
    "ExportReport",
    "Float32Rules",
    "Registration",
    "MetricSummary",
    "Verdict",
    "Attachment",
    "CompareReport",
    "ChunkedCategoricalCrossentropy",
    "ChunkedSparseCategoricalCrossentropy",
    "DeviceFacts",
    "DoctorReport",
    "GpuFacts",
    "LoggingWarning",
    "LossScaleMonitor",
    "LossScaleOptimizer",
    "LossScaleWarning",
    "SkippedStepWarning",
    "SpeedProbe",
    "UnmatchedTargetWarning",
    "MemoryEstimate",
    "NonFiniteError",
    "PerformanceWarning",
    "PolicyDecision",
    "__version__",
    "attachment",
    "audit",
    "check_dataset",
    "check_numerics",
    "compare",
    "detach",
    "disable",
    "doctor",
    "enable",
    "estimate_kv_cache",
    "estimate_memory",
    "export",
    "float32_layers",
    "multi_worker_strategy",
    "force_float32",
    "policy_scope",
    "recommend_policy",
    "register_float32",
    "scaled_gradients",
    "step_scope",
    "to_float32",
    "unregister_float32",
}


def test_public_api_is_frozen():
    assert set(tfmp.__all__) == PUBLIC_API
    for name in sorted(PUBLIC_API - {"__version__"}):
        exported = getattr(tfmp, name)
        # The name is the object's own (no alias to something else), defined in
        # tfmp's implementation, and documented.
        assert exported.__name__ == name
        assert exported.__module__.startswith("tfmp._src."), (name, exported.__module__)
        assert (exported.__doc__ or "").strip(), f"tfmp.{name} has no docstring"


def _docstring_example_modules():
    """Every tfmp module whose source holds a docstring example, and its count.

    The count is of the ``>>> `` lines that are not comments: doctest runs each.
    """
    root = pathlib.Path(tfmp.__file__).resolve().parent
    found = {}
    for path in sorted(root.rglob("*.py")):
        lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        count = sum(1 for line in lines if line.startswith(">>> ") and not line.startswith(">>> #"))
        if count:
            relative = path.relative_to(root.parent).with_suffix("")
            found[".".join(relative.parts)] = count
    return found


DOCSTRING_EXAMPLE_MODULES = _docstring_example_modules()


def test_docstring_examples_are_discovered():
    # Modules known to carry examples are among those found.
    assert {
        "tfmp._src.policy.policy", "tfmp._src.numerics.check", "tfmp._src.monitor.state",
        "tfmp._src.loss_scale.optimizer", "tfmp._src.deployment.to_float32",
    } <= set(DOCSTRING_EXAMPLE_MODULES)


@pytest.mark.parametrize("name", sorted(DOCSTRING_EXAMPLE_MODULES))
def test_every_docstring_example_runs(name):
    """Each module's examples run once, here, as a user would paste them.

    No globals are injected (an example imports what it uses) and no option
    flags are set (an example prints its exact output). One id per module, so
    that a CI tier can name one, e.g. ``[tfmp._src.loss_scale.optimizer]``.
    """
    result = doctest.testmod(importlib.import_module(name))
    assert (result.attempted, result.failed) == (DOCSTRING_EXAMPLE_MODULES[name], 0), name


def test_non_finite_error_is_a_floating_point_error():
    assert issubclass(tfmp.NonFiniteError, FloatingPointError)
    error = tfmp.NonFiniteError("bad", layer="model/dense", phase="forward", step=3, kind="nan")
    assert (error.layer, error.phase, error.step, error.kind) == ("model/dense", "forward", 3, "nan")


def test_version_single_source():
    import configparser
    import pathlib

    cfg = configparser.ConfigParser()
    cfg.read(pathlib.Path(__file__).resolve().parents[1] / "setup.cfg")
    assert cfg["metadata"]["version"] == "attr: tfmp._version.__version__"
    assert tfmp.__version__.count(".") == 2


def test_every_package_folder_is_installed():
    """A folder without __init__.py imports from a checkout but is left out of the wheel."""
    import pathlib

    import setuptools

    root = pathlib.Path(tfmp.__file__).resolve().parents[1]
    folders = {
        ".".join(path.parent.relative_to(root).parts)
        for path in (root / "tfmp").rglob("*.py")
        if "__pycache__" not in path.parts
    }
    packaged = set(setuptools.find_packages(str(root), include=["tfmp", "tfmp.*"]))
    assert "tfmp._src.keras_hooks" in folders
    assert folders <= packaged, f"not packaged: {sorted(folders - packaged)}"


def test_every_public_name_is_imported_explicitly_for_type_checkers():
    """``from module import name as name``, one a name: what IDEs and type checkers read.

    The explicit ``as`` re-export is what strict type checkers (mypy
    ``--no-implicit-reexport``, pyright) count as public; `tfmp/py.typed` marks the
    package as typed (PEP 561).
    """
    import ast

    init = pathlib.Path(tfmp.__file__)
    tree = ast.parse(init.read_text(encoding="utf-8"))
    # The deferred-import `__getattr__` is hidden from type checkers (it would make
    # every misspelt `tfmp.name` valid to them): no module-level definition of it.
    assert "__getattr__" not in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.asname == alias.name:
                    imported.setdefault(alias.name, []).append(node.module)
    public = set(PUBLIC_API)
    assert set(imported) == public
    for name, modules in imported.items():
        assert len(modules) == 1, (name, modules)  # one door per name
        if name != "__version__":
            assert getattr(tfmp, name).__module__ == modules[0], name
    assert (init.parent / "py.typed").is_file()
