"""The documentation runs as written: every Python block of README.md and of the site's
pages (docs/**/*.md, and the files they include with `--8<--`) executes as pasted,
unless a `<!-- not-run: reason -->` line right above it says why not; the API
reference lists every public name; the site's build is configured and run in CI."""

import configparser
import re
import sys

import keras
import pytest
from _docs import DOCS
from _docs import NOT_RUN
from _docs import ROOT
from _docs import blocks
from _docs import pages

import tfmp

# Blocks tests/test_readme.py runs itself, with checks of what they log.
RUN_BY_TEST_README = ('LossScaleMonitor("logs/quickstart"', "callbacks.on_train_begin()")


BLOCKS = blocks(pages())
PYTHON = [b for b in BLOCKS if b[2] == "python"]
TO_RUN = [b for b in PYTHON if b[4] is None and not any(key in b[3] for key in RUN_BY_TEST_README)]


def test_the_python_blocks_are_found_in_the_readme_and_every_guide():
    shown = {page for page, *_ in PYTHON}
    guides = {f"docs/guides/{p.name}" for p in (DOCS / "guides").glob("*.md")}
    # Every guide shows code, except the one about versions, installation and CI.
    assert guides - {"docs/guides/versions.md"} <= shown, sorted(guides - shown)
    assert "README.md" in shown and "docs/index.md" in shown
    # The blocks tests/test_readme.py runs are still there, once each.
    for key in RUN_BY_TEST_README:
        assert sum(key in code for *_, code, _reason in PYTHON) == 1, key


@pytest.mark.parametrize("block", TO_RUN, ids=[f"{page}:{line}" for page, line, *_ in TO_RUN])
def test_every_python_block_runs_as_pasted(block, tmp_path, monkeypatch):
    page, line, _, code, _ = block
    monkeypatch.chdir(tmp_path)  # what a block writes (logs/, exported/) stays there
    monkeypatch.setattr(sys, "argv", ["docs"])
    before = keras.config.dtype_policy().name
    namespace = {"__name__": "__main__"}
    try:
        exec(compile(code, f"{page}:{line}", "exec"), namespace)
    finally:
        namespace.clear()  # the block's models and optimizers go with it
        tfmp.disable()
        keras.config.set_dtype_policy(before)
        keras.backend.clear_session()


def test_each_not_run_marker_gives_a_reason_and_stands_right_above_a_block():
    for page in pages():
        text = page.read_text(encoding="utf-8")
        for match in NOT_RUN.finditer(text):
            reason = match.group(1).strip()
            where = f"{page.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            assert len(reason.split()) >= 3, f"{where}: say why the block does not run"
            assert re.match(r"\s*\n *```\w", text[match.end():]), f"{where}: no block right below"
    # The checks above read the markers: one made up here passes and fails as it should.
    assert NOT_RUN.fullmatch("<!-- not-run: needs two GPU hosts -->").group(1).strip() == "needs two GPU hosts"
    assert NOT_RUN.fullmatch("<!-- nothing -->") is None


def test_the_api_reference_documents_every_public_name():
    reference = (DOCS / "reference.md").read_text(encoding="utf-8")
    documented = re.findall(r"^::: tfmp\.(\w+)$", reference, flags=re.M)
    assert len(documented) == len(set(documented)), "a name documented twice"
    assert set(documented) == set(tfmp.__all__) - {"__version__"}


def test_the_site_is_configured_built_in_ci_and_its_packages_are_the_docs_extra():
    config = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert re.search(r"^docs_dir: docs$", config, flags=re.M)
    assert re.search(r"^strict: true$", config, flags=re.M)
    assert re.search(r"^\s+execute: false$", config, flags=re.M)  # the suite runs the notebooks
    # Every page of docs/ is in the navigation, and every page the navigation names exists.
    nav = set(re.findall(r":\s+([\w/.-]+\.(?:md|ipynb))$", config, flags=re.M))
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")
             if "hooks" not in p.relative_to(DOCS).parts}
    pages |= {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert nav == pages, (sorted(nav - pages), sorted(pages - nav))
    extras = configparser.ConfigParser()
    extras.read(ROOT / "setup.cfg")
    docs_extra = {re.split(r"[<>=~!; ]", line.strip())[0] for line in
                  extras["options.extras_require"]["docs"].splitlines() if line.strip()
                  and not line.strip().startswith("#")}
    assert docs_extra == {"mkdocs", "mkdocs-material", "mkdocstrings", "mkdocstrings-python",
                          "mkdocs-jupyter", "ruff"}  # Ruff: mkdocstrings wraps long signatures
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "mkdocs build --strict" in ci
    assert re.search(r'pip install --quiet "\.\[test,docs\]"', ci)


@pytest.mark.parametrize("text, expected", [
    ("Text.\n\n```python\nprint(1)\n```\n", [("python", "print(1)\n", None)]),
    ("<!-- not-run: needs a cluster of two hosts -->\n```python\nrun()\n```\n",
     [("python", "run()\n", "needs a cluster of two hosts")]),
    ("1. Step:\n\n   ```bash\n   pip install .\n   ```\n", [("bash", "pip install .\n", None)]),
])
def test_blocks_are_read_with_their_language_code_and_marker(text, expected, tmp_path):
    page = tmp_path / "page.md"
    page.write_text(text, encoding="utf-8")
    assert [(lang, code, reason) for _, _, lang, code, reason in blocks([page], tmp_path)] == expected
