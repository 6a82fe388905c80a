"""The wheel a user installs: its license, the guide the messages name, the command.

One wheel is built per module (`installed`) from a copy of this checkout, offline
(``pip wheel --no-build-isolation --no-index``), and installed with ``--no-deps``
into a new virtual environment. That environment sees the running interpreter's
site-packages through a ``.pth`` file, for TensorFlow and the other dependencies
without downloading them: ``venv --system-site-packages`` would give it the base
interpreter's packages instead, which lack them when the tests run in a virtual
environment. ``.pth`` lines only add folders, so an editable install of tfmp in
the running environment (a meta path finder set up by its own ``.pth``) does not
reach the new one. Every command runs from a folder outside the checkout, with the
checkout off `PYTHONPATH`.
"""

import os
import pathlib
import shutil
import site
import subprocess
import sys
import zipfile

import pytest
from _subproc import MISSING_SKLEARN, ROOT, without_module

#: What a copy of the checkout leaves out: version control, build output, runs.
NOT_SOURCES = shutil.ignore_patterns(
    ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", "logs", "exported",
    ".pytest_cache", ".ipynb_checkpoints")
#: Prints an interpreter's site-packages and scripts folders, one a line.
WHERE = "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); print(p['scripts'])"


def _run(args, cwd, env=None, timeout=180):
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _clean_env(**extra):
    """This process's environment without PYTHONPATH (the checkout must not be importable)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1",
               TF_CPP_MIN_LOG_LEVEL="3", **extra)
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """Builds the wheel, installs it into a new virtual environment.

    Returns:
        Dict of `pathlib.Path`: ``wheel`` (the .whl); of the new environment
        ``python`` (its interpreter), ``purelib`` (its site-packages) and
        ``scripts`` (its console scripts); ``outside``, an empty folder outside
        the checkout, the working folder of every command.
    """
    base = tmp_path_factory.mktemp("packaging")
    source, dist, venv, outside = (base / n for n in ("source", "dist", "venv", "outside"))
    shutil.copytree(ROOT, source, ignore=NOT_SOURCES)
    outside.mkdir()
    built = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                  "--no-index", "-w", dist, source], cwd=outside, env=_clean_env())
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    [wheel] = dist.glob("tfmp-*.whl")

    made = _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=outside,
                env=_clean_env())
    assert made.returncode == 0, made.stderr[-3000:]
    python = venv / "bin" / "python"
    # Its own scheme's folders (a venv's, whatever scheme this interpreter uses).
    where = _run([python, "-c", WHERE], cwd=outside, env=_clean_env())
    assert where.returncode == 0, where.stderr[-3000:]
    purelib, scripts = (pathlib.Path(line) for line in where.stdout.splitlines())
    running = site.getsitepackages() + (
        [site.getusersitepackages()] if site.ENABLE_USER_SITE else [])
    (purelib / "running_environment.pth").write_text("\n".join(running) + "\n")
    # --ignore-installed: the running environment's tfmp (visible through the
    # .pth) is neither taken as already installed nor uninstalled.
    done = _run([python, "-m", "pip", "install", "--no-deps", "--no-index",
                 "--ignore-installed", wheel], cwd=outside, env=_clean_env())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {"wheel": wheel, "scripts": scripts, "python": python, "purelib": purelib,
            "outside": outside}


def test_wheel_holds_the_license_and_the_troubleshooting_guide(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = wheel.namelist()
        [dist_info] = {n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info")}
        # setuptools >= 70.1 writes license files to licenses/, older wheel builds beside METADATA
        [license_name] = [n for n in names if n in (f"{dist_info}/LICENSE",
                                                    f"{dist_info}/licenses/LICENSE")]
        license_text = wheel.read(license_name).decode("utf-8")
        metadata = wheel.read(f"{dist_info}/METADATA").decode("utf-8")
    assert license_text == (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert license_text.splitlines()[1:3] == [
        " " * 33 + "Apache License", " " * 27 + "Version 2.0, January 2004"]
    assert "tfmp/docs/troubleshooting.md" in names
    assert "Provides-Extra: notebooks" in metadata.splitlines()


def test_plain_install_pulls_no_optional_dependency_and_is_typed(installed):
    """``pip install tfmp`` brings TensorFlow, Keras and what every run needs, no more."""
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = wheel.namelist()
        [metadata] = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line.split(":", 1)[1].strip()
                    for line in wheel.read(metadata).decode("utf-8").splitlines()
                    if line.startswith("Requires-Dist:")]
    plain = sorted(r.split(">")[0].split("<")[0].split("=")[0].split(";")[0].strip()
                   for r in requires if "extra ==" not in r)
    assert plain == ["archspec", "keras", "numpy", "tensorboard", "tensorflow"]
    by_extra = {}
    for requirement in requires:
        if "extra ==" in requirement:
            name, marker = requirement.split(";", 1)
            by_extra.setdefault(marker.split("==")[1].strip(" '\""), set()).add(name.strip())
    assert {"scipy", "matplotlib"} <= by_extra["compare"]
    assert {"tensorflow-datasets", "scikit-learn"} <= by_extra["examples"]
    assert "tfmp/py.typed" in names  # PEP 561


def test_installed_tfmp_doctor_names_the_installed_guide(installed):
    result = _run([installed["scripts"] / "tfmp", "doctor"], cwd=installed["outside"],
                  env=_clean_env())
    assert result.returncode == 0, result.stderr[-3000:]
    guide = installed["purelib"] / "tfmp" / "docs" / "troubleshooting.md"
    assert f"troubleshooting guide: {guide}" in result.stdout.splitlines()
    assert guide.read_bytes() == (ROOT / "tfmp" / "docs" / "troubleshooting.md").read_bytes()


def test_installed_main_job_without_scikit_learn_says_the_fix(installed, tmp_path):
    result = _run([installed["python"], ROOT / "examples" / "train_digits.py"],
                  cwd=installed["outside"],
                  env=_clean_env(PYTHONPATH=without_module(tmp_path, "sklearn")), timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (1, "", MISSING_SKLEARN + "\n")


def test_no_tracked_file_holds_a_merge_conflict_marker_and_ci_parses():
    """A conflict left in a file breaks CI's script or a page without any test naming it."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    marked = []
    for name in tracked.splitlines():
        path = ROOT / name
        if not path.is_file() or path.suffix in (".png", ".ipynb", ".npz", ".keras", ".h5"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if any(line.startswith(("<<<<<<< ", ">>>>>>> ")) for line in text.splitlines()):
            marked.append(name)
    assert marked == []
    subprocess.run(["bash", "-n", str(ROOT / ".ci" / "run")], check=True)
