"""``--help`` of every example and of the `tfmp` command answers before TensorFlow loads.

Each case runs in a fresh interpreter with ``-X importtime``, whose report on stderr
names every module imported: TensorFlow and Keras must not be among them (their
start-up takes about 6 s and prints its own log lines first). Wall-clock times are
not asserted (the test machine is shared).
"""

import os
import pathlib
import subprocess
import sys

import pytest
from _subproc import MISSING_SKLEARN, ROOT, script_env, without_module

EXAMPLES = sorted(
    path.name for path in (ROOT / "examples").glob("*.py")
    if path.name not in {"example_args.py", "example_utils.py", "tfds_preflight.py"}
)
HEAVY = ("tensorflow", "keras", "tensorflow_datasets")


def imported_modules(importtime_stderr):
    """Top-level names of the modules an ``-X importtime`` report lists."""
    names = set()
    for line in importtime_stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            names.add(name.split(".")[0])
    return names


def run_importtime(args, env=None):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", *args],
        capture_output=True, text=True, timeout=120, env=env or script_env(), cwd=ROOT,
    )
    return result, imported_modules(result.stderr)


def test_every_example_script_is_covered():
    assert EXAMPLES == [
        "custom_training_loop.py", "export_model.py", "train_digits.py",
        "train_image_classifier.py", "train_multi_worker.py", "train_text_transformer.py",
    ]


@pytest.mark.parametrize("script", EXAMPLES)
def test_example_help_before_tensorflow(script):
    result, modules = run_importtime([str(ROOT / "examples" / script), "--help"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"usage: {script} [-h]")
    assert "--policy" in result.stdout
    assert "argparse" in modules  # the report is read: this one is always there
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_example_usage_error_before_tensorflow():
    result, modules = run_importtime(
        [str(ROOT / "examples" / "train_digits.py"), "--epochs", "0"])
    assert result.returncode == 2
    assert "expected a whole number >= 1, received '0'" in result.stderr
    assert not modules & set(HEAVY)


@pytest.mark.parametrize("script", ["train_digits.py", "custom_training_loop.py",
                                    "export_model.py", "train_multi_worker.py"])
def test_missing_scikit_learn_stops_before_tensorflow(script, tmp_path):
    """The digits scripts without the `examples` extra: the fix at once, no traceback."""
    env = script_env()
    env["PYTHONPATH"] = os.pathsep.join([without_module(tmp_path, "sklearn"), env["PYTHONPATH"]])
    result, modules = run_importtime([str(ROOT / "examples" / script), "--epochs", "1"], env)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1] == MISSING_SKLEARN
    assert "Traceback" not in result.stderr
    assert "argparse" in modules  # the report is read
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


CONSOLE_SCRIPT = """import re, sys
from _tfmp_command import run
if __name__ == "__main__":
    sys.argv[0] = re.sub(r"(-script\\.pyw|\\.exe)?$", "", sys.argv[0])
    sys.exit(run())
"""


@pytest.fixture
def console_script(tmp_path):
    """A copy of the script pip writes for setup.cfg's `tfmp = _tfmp_command:run`."""
    path = tmp_path / "tfmp"
    path.write_text(CONSOLE_SCRIPT)
    return str(path)


@pytest.mark.parametrize(
    "args, usage",
    [
        (["-m", "tfmp", "--help"], "usage: tfmp [-h] COMMAND ..."),
        (["-m", "tfmp", "doctor", "--help"], "usage: tfmp doctor [-h] [--json]"),
        (["CONSOLE_SCRIPT", "--help"], "usage: tfmp [-h] COMMAND ..."),
        (["CONSOLE_SCRIPT", "doctor", "--help"], "usage: tfmp doctor [-h] [--json]"),
    ],
    ids=["python-m-tfmp", "python-m-tfmp-doctor", "tfmp", "tfmp-doctor"],
)
def test_tfmp_help_before_tensorflow(args, usage, console_script):
    args = [console_script if arg == "CONSOLE_SCRIPT" else arg for arg in args]
    result, modules = run_importtime(args)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(usage)
    assert "_tfmp_command" in modules  # the report is read: the command's module is there
    assert not modules & set(HEAVY), sorted(modules & set(HEAVY))


def test_installed_console_script_help():
    """The `tfmp` command installed next to this interpreter, where there is one."""
    command = pathlib.Path(sys.executable).parent / "tfmp"
    if not command.exists():
        pytest.skip("no `tfmp` console script next to this interpreter")
    result = subprocess.run([str(command), "--help"], capture_output=True, text=True,
                            timeout=120, env=script_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("usage: tfmp [-h] COMMAND ...")


def run_python(*args):
    """Stdout words of this interpreter run with `args`, in a process of its own."""
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=300, env=script_env(), cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_import_tfmp_imports_everything_as_before():
    """Versions checked, TensorFlow loaded, the optimizer registered for load_model."""
    code = (
        "import sys, tfmp\n"
        "loaded = 'tensorflow' in sys.modules and 'enable' in vars(tfmp)\n"
        "import keras\n"
        "registered = keras.saving.get_registered_object('tfmp>LossScaleOptimizer')\n"
        "print(loaded, registered is tfmp.LossScaleOptimizer)\n"
    )
    assert run_python("-c", code) == ["True", "True"]


def test_the_module_python_m_runs_is_read_as_cpython_parses_its_command_line():
    from tfmp import _module_run_by_python

    assert _module_run_by_python(["python", "-B", "-X", "importtime", "-m", "tfmp", "doctor"]) == "tfmp"
    assert _module_run_by_python(["python", "-Bmtfmp"]) == "tfmp"
    assert _module_run_by_python(["python", "-Werror", "-m", "mypkg.train"]) == "mypkg.train"
    assert _module_run_by_python(["python", "-c", "import tfmp", "-m", "tfmp"]) is None
    assert _module_run_by_python(["python", "train.py", "-m", "tfmp"]) is None
    assert _module_run_by_python(["python", "--", "-m", "tfmp"]) is None  # runs a file named -m
    assert _module_run_by_python(["python"]) is None


def test_python_m_tfmp_imports_public_names_on_first_use():
    code = ("import sys; sys.orig_argv = [sys.executable, '-m', 'tfmp']; import tfmp; "
            "before = 'tensorflow' in sys.modules; enable = tfmp.enable; "
            "print(before, 'tensorflow' in sys.modules, enable.__module__, 'enable' in dir(tfmp))")
    assert run_python("-c", code) == ["False", "True", "tfmp._src.policy.enable", "True"]


def test_a_program_run_with_python_m_gets_tfmp_registered(tmp_path):
    """``python -m mypkg.train`` with ``import tfmp`` in mypkg/__init__.py: all imported."""
    package = tmp_path / "mypkg"
    package.mkdir()
    (package / "__init__.py").write_text("import tfmp\n")
    (package / "train.py").write_text(
        "import keras, tfmp\n"
        "print(keras.saving.get_registered_object('tfmp>LossScaleOptimizer') is tfmp.LossScaleOptimizer,"
        " 'enable' in vars(tfmp))\n")
    env = {**script_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{script_env().get('PYTHONPATH', '')}"}
    result = subprocess.run([sys.executable, "-m", "mypkg.train"], capture_output=True, text=True,
                            timeout=300, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True"]


def test_unknown_attribute_is_an_attribute_error():
    import tfmp

    with pytest.raises(AttributeError, match="module 'tfmp' has no attribute 'enabel'"):
        tfmp.enabel  # noqa: B018
