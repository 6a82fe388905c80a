"""README.md stays true: its quickstart runs and CI runs its test command."""

import pathlib
import re

import keras

import tfmp

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_quickstart_snippet_runs(tmp_path, monkeypatch):
    snippets = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(snippets) == 1
    monkeypatch.chdir(tmp_path)
    before = keras.config.dtype_policy().name
    try:
        exec(compile(snippets[0], "README.md", "exec"), {})
    finally:
        tfmp.disable()
    assert keras.config.dtype_policy().name == before
    assert list((tmp_path / "logs" / "quickstart" / "train").glob("events.out.tfevents.*"))


def test_ci_runs_the_readme_test_command():
    setup_lines = re.findall(r"^\s*(python3 -m venv .*)$", README, flags=re.M)
    assert len(setup_lines) == 2, setup_lines
    test_command = setup_lines[1].split("&&")[-1].strip()
    assert test_command.startswith("python -m pytest")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1].strip() == test_command
    assert 'pip install --quiet ".[test]"' in "\n".join(ci_lines)
