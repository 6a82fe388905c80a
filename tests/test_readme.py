"""README.md and the site's pages (docs/) stay true: the quickstart and the distributed
custom loop run and log, the names, keywords, defaults and paths they cite exist, the
tables list what is on disk, CI runs README's test command."""

import ast
import configparser
import contextlib
import inspect
import os
import pathlib
import re
import warnings

import keras
import pytest
from _docs import DOCS
from _docs import pages
from _docs import site_pages
from _events import read_run
from _events import steps
from _events import values
from _machines import ZEN4

import tfmp
from tfmp._src.monitor import tags
from tfmp._src.policy.hardware import injected_facts

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# README.md and every page of docs/: the facts below are checked wherever they are told.
PAGES = {page.relative_to(ROOT).as_posix(): page.read_text(encoding="utf-8") for page in site_pages()}
ALL_TEXT = "\n".join(PAGES.values())
CODE_BLOCKS = [code for text in PAGES.values() for code in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)]
# Inline code spans outside the fenced blocks.
CODE_SPANS = [span for text in PAGES.values()
              for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]


def _page(path):
    return PAGES[path]


def _quickstart():
    """The one Python block of README's "Quickstart" section."""
    section = README[README.index("## Quickstart"):]
    section = section[:section.index("\n## ")]
    [snippet] = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return snippet


def _quickstart_output():
    """The lines README shows the quickstart printing (the text block after it)."""
    section = README[README.index("## Quickstart"):]
    [output] = re.findall(r"```text\n(.*?)```", section[:section.index("\n## ")], flags=re.S)
    return output.splitlines()


@pytest.mark.parametrize("machine", ["this_machine", "bfloat16_cpu"])
def test_quickstart_snippet_runs_and_logs_every_batch(machine, tmp_path, monkeypatch, capsys):
    with contextlib.ExitStack() as stack:
        _quickstart_runs(machine, tmp_path, monkeypatch, stack)
    if machine == "bfloat16_cpu":  # what README says it prints on a Zen 4, line for line
        printed = capsys.readouterr().out.splitlines()
        shown = _quickstart_output()
        assert printed[0].startswith("tfmp policy: mixed_bfloat16 on CPU 'AMD EPYC")  # the CPU's name
        assert shown[0].startswith("tfmp policy: mixed_bfloat16 on CPU 'AMD EPYC' (avx512_bf16).")
        assert printed[0].split(". ", 1)[1] == shown[0].split(". ", 1)[1]
        assert printed[1:] == shown[1:]


def _quickstart_runs(machine, tmp_path, monkeypatch, stack):
    if machine == "bfloat16_cpu":  # "auto" as on a CPU with AVX512_BF16 (a Zen 4's facts)
        stack.enter_context(injected_facts(ZEN4))
    monkeypatch.chdir(tmp_path)
    before = keras.config.dtype_policy().name
    namespace = {}
    try:
        exec(compile(_quickstart(), "README.md", "exec"), namespace)
    finally:
        tfmp.disable()
    assert keras.config.dtype_policy().name == before
    decision = namespace["decision"]
    if machine == "bfloat16_cpu":
        assert decision.policy == "mixed_bfloat16"
        assert isinstance(namespace["model"].optimizer, tfmp.LossScaleOptimizer)
    run = read_run(tmp_path / "logs" / "quickstart")
    # load_digits: 1797 samples, batch 64 -> 29 batches per epoch, 2 epochs.
    assert steps(run, "precision/batch_loss_scale") == list(range(1, 59))
    assert steps(run, "precision/epoch_loss_scale") == [0, 1]
    if decision.policy == "float32":  # the model keeps its optimizer: no counts
        assert "precision/batch_overflow_count" not in run
    else:
        assert values(run, "precision/batch_overflow_count") == [0.0] * 58
    if decision.policy in ("float32", "mixed_bfloat16"):
        assert set(values(run, "precision/batch_loss_scale")) == {1.0}  # no loss scaling


def _custom_loop_snippet():
    """The distributed guide's custom loop driving the monitor under MirroredStrategy."""
    [snippet] = [code for code in re.findall(r"```python\n(.*?)```", _page("docs/guides/distributed.md"), flags=re.S)
                 if "callbacks.on_train_begin()" in code]
    return snippet


def test_custom_loop_snippet_runs_as_written_and_logs_its_epoch(tmp_path, monkeypatch):
    """Run as pasted, in this process (one CPU: one replica; tests/test_distribute.py runs
    such loops on two logical CPUs)."""
    monkeypatch.chdir(tmp_path)
    namespace = {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 on a CPU
            exec(compile(_custom_loop_snippet(), "docs/guides/distributed.md", "exec"), namespace)
        assert namespace["strategy"].num_replicas_in_sync >= 1
        optimizer = namespace["model"].optimizer
        assert isinstance(optimizer, tfmp.LossScaleOptimizer)
        # 64 examples in global batches of 16: 4 steps, all finite at the scale 2**4.
        assert int(optimizer.total_steps.numpy()) == 4
        assert int(optimizer.overflow_count.numpy()) == 0
    finally:
        namespace.clear()
        tfmp.disable()
    run = read_run(tmp_path / "logs" / "run")
    assert run["precision/epoch_loss_scale"] == [(0, 16.0)]
    assert run["precision/epoch_overflow_count"] == [(0, 0.0)]


def _tfmp_references():
    """Every dotted name ``tfmp.a.b`` in the code of README and the site, with the text around it."""
    found = {}
    for code in CODE_BLOCKS + CODE_SPANS:
        for match in re.finditer(r"\btfmp((?:\.[A-Za-z_]\w*)+)", code):
            found.setdefault(match.group(1)[1:], code)
    return found


def test_every_tfmp_name_in_the_readme_exists():
    references = _tfmp_references()
    assert {"enable", "LossScaleMonitor", "check_numerics", "estimate_kv_cache"} <= set(references)
    for dotted, code in references.items():
        target = tfmp
        for part in dotted.split("."):
            assert hasattr(target, part), f"the docs name tfmp.{dotted} (in `{code}`): no {part!r}"
            target = getattr(target, part)


def _tfmp_calls():
    """(dotted name, keyword names) of each ``tfmp.f(..., k=...)`` call in the docs' code."""
    calls = []
    for code in CODE_BLOCKS + CODE_SPANS:
        try:
            tree = ast.parse(code)
        except SyntaxError:  # prose in backticks, bash lines
            continue
        for node in ast.walk(tree):
            # tfmp.f(...) and tfmp.a.f(...), not a method of what a tfmp call returns
            if isinstance(node, ast.Call) and re.fullmatch(r"tfmp(\.\w+)+", ast.unparse(node.func)):
                keywords = [k.arg for k in node.keywords if k.arg is not None]
                calls.append((ast.unparse(node.func)[len("tfmp."):], keywords, len(node.args)))
    return calls


def test_every_keyword_the_readme_passes_is_accepted():
    calls = _tfmp_calls()
    assert ("LossScaleMonitor", ["update_freq"], 1) in calls  # the quickstart's
    for dotted, keywords, positional in calls:
        function = tfmp
        for part in dotted.split("."):
            function = getattr(function, part)
        parameters = inspect.signature(function).parameters
        for keyword in keywords:
            assert keyword in parameters, f"the docs call tfmp.{dotted}({keyword}=...): not a parameter"
        positional_slots = [
            p for p in parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        has_varargs = any(p.kind == p.VAR_POSITIONAL for p in parameters.values())
        assert has_varargs or positional <= len(positional_slots), dotted


def _number(text):
    """``"1"``, ``"32"`` or ``"2**24"`` as a float."""
    base, _, exponent = text.partition("**")
    return float(base) ** float(exponent or 1)


def test_defaults_the_readme_states_are_the_real_ones():
    # "`min_scale` (default 1)": each such claim, against LossScaleOptimizer's signature.
    claims = dict(re.findall(r"`(\w+)` \(default ([^)]+)\)", ALL_TEXT))
    assert claims == {"min_scale": "1", "max_scale": "2**24", "max_consecutive_overflows": "32"}
    parameters = inspect.signature(tfmp.LossScaleOptimizer).parameters
    for name, default in claims.items():
        assert parameters[name].default == _number(default), (name, default)


# Paths the docs name that are not in the repository: folders a run writes (logs,
# exported artifacts, the venv, a temporary folder "$out"), layer paths ("encoder/..."),
# and the monitor's TensorBoard tags ("metrics/batch_loss", "precision/").
NOT_IN_THE_REPOSITORY = ("logs/", ".venv/", ".venv-test/", "exported/", "encoder/", "block/", "out/",
                         tags.METRICS, tags.OPTIMIZER, tags.PRECISION, tags.SYSTEM)


def _repository_paths():
    """Every path-like word (with a '/' or ending in .py/.md) of the docs' code, from the
    repository root, and every relative Markdown link, from its page's folder."""
    words = set()
    for code in CODE_BLOCKS + CODE_SPANS:
        for word in re.findall(r"[\w.\-/*<>]+", code):
            word = word.rstrip(".")
            if re.search(r"[*<>]", word) or word.startswith("/"):  # patterns, placeholders
                continue
            if "/" in word or re.search(r"\.(py|md)$", word):
                words.add(word)
    words = {w for w in words if not w.startswith(NOT_IN_THE_REPOSITORY)}
    for path, text in PAGES.items():
        folder = pathlib.PurePosixPath(path).parent
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):  # relative Markdown links
            words.add(os.path.normpath(folder / link))
    return words


def test_every_path_the_readme_names_exists():
    paths = _repository_paths()
    assert {"examples/train_digits.py", "tfmp/_src/keras_hooks/", ".ci/run",
            "tfmp/docs/troubleshooting.md", "train_digits.py", "docs/guides/policy.md",
            "benchmarks/README.md", "docs/images/tensorboard_main_job.png"} <= paths
    missing = []
    for path in sorted(paths):
        if "/" in path:  # from the repository root, notebooks/ ("../examples") or, in
            # docs/architecture.md's tables, tfmp/_src/ ("policy/enable.py")
            found = any((ROOT / folder / path).exists() for folder in ("", "notebooks", "tfmp/_src"))
        else:  # a bare file name, in the folder its sentence or table row names
            found = any(p for p in ROOT.rglob(path) if ".git" not in p.parts)
        if not found:
            missing.append(path)
    assert not missing, f"the docs name paths that do not exist: {missing}"


def test_layout_table_names_every_package_and_its_files():
    """docs/architecture.md's table of tfmp/_src/: every package and module, and each file it names."""
    architecture = _page("docs/architecture.md")
    layout = architecture[architecture.index("## Layout"):]
    layout = layout[:layout.index("\n## ")]
    rows = re.findall(r"^\| `(\w+/|\w+\.py)` \|(.*)\|$", layout, flags=re.M)
    named = {entry for entry, _ in rows}
    source = ROOT / "tfmp" / "_src"
    packages = {f"{p.name}/" for p in source.iterdir() if p.is_dir() and list(p.glob("*.py"))}
    modules = {p.name for p in source.glob("*.py") if p.name != "__init__.py"}
    assert "keras_hooks/" in packages and "errors.py" in modules
    assert packages | modules <= named, f"missing from the Layout table: {sorted(packages | modules - named)}"
    for entry, rest in rows:
        if entry.endswith("/"):
            for name in re.findall(r"`(\w+\.py)`", rest):
                assert (source / entry / name).is_file(), f"docs/architecture.md: {entry}{name} does not exist"


def test_readme_tables_list_every_notebook_and_example_script():
    examples = _page("docs/examples.md")
    notebooks = set(re.findall(r"^\| `(\d\d_\w+)` \|", examples, flags=re.M))
    assert notebooks == {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    scripts = set(re.findall(r"^\| `(examples/\w+\.py)` \|", examples, flags=re.M))
    on_disk = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}
    helpers = {"examples/example_utils.py", "examples/example_args.py",
               "examples/tfds_preflight.py"}
    assert scripts == on_disk - helpers


def test_extras_table_lists_what_each_extra_installs():
    """docs/guides/versions.md's table against setup.cfg's [options.extras_require]."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    extras = {
        name: {re.split(r"[<>=~!; ]", line.strip())[0].lower() for line in value.splitlines()
               if line.strip() and not line.strip().startswith("#")}
        for name, value in config["options.extras_require"].items()
    }
    versions = _page("docs/guides/versions.md")
    rows = dict(re.findall(r"^\| `(\w+)` \| ([^|]+) \|", versions, flags=re.M))
    assert set(rows) == set(extras), (sorted(rows), sorted(extras))
    for name, installs in rows.items():
        listed = {package.strip().lower() for package in installs.split(",")}
        assert listed == extras[name], f"extra {name!r}: the table says {sorted(listed)}, setup.cfg {sorted(extras[name])}"


def test_readme_fits_a_first_reading():
    """README is the first hour: a few hundred lines, every capability pointing to its guide."""
    assert len(README.splitlines()) <= 250
    # No tracker numbers of this project anywhere in the docs; upstream ones name their repository.
    for page in pages():  # with the files the site includes (benchmarks/README.md...)
        for match in re.finditer(r"(\b[\w.-]+/[\w.-]+ )?[Ii]ssues? \d+", page.read_text(encoding="utf-8")):
            assert match.group(1), f"{page}: {match.group(0)!r}"
    guides = {f"docs/guides/{p.name}" for p in (DOCS / "guides").glob("*.md")}
    linked = set(re.findall(r"\]\((docs/guides/[\w-]+\.md)(?:#[^)]*)?\)", README))
    assert guides == linked, sorted(guides ^ linked)


def test_ci_runs_the_readme_test_command():
    setup_lines = re.findall(r"^\s*(python3 -m venv .*)$", README, flags=re.M)
    assert len(setup_lines) == 2, setup_lines
    test_command = setup_lines[1].split("&&")[-1].strip()
    assert test_command.startswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    tiers = [line.strip() for line in ci.splitlines() if line.strip().startswith("tier ")]
    # The last tier, in the environment the site's build (the first of those tiers) used.
    assert tiers[-1] == f'tier "README\'s test command" {test_command}'
    assert "mkdocs build --strict --quiet " in tiers[-4]
    # README's install, with the docs extra the site's build needs.
    assert 'pip install --quiet ".[test,docs]"' in ci
    # Every run names its slowest tests (setup.cfg's addopts, read by both CI tiers).
    addopts = configparser.ConfigParser()
    addopts.read(ROOT / "setup.cfg")
    assert re.search(r"--durations=\d+", addopts["tool:pytest"]["addopts"])


def test_modules_with_expensive_fixtures_are_one_unit_of_work():
    """What `--dist loadscope` sends to one worker (tests/conftest.py)."""
    from conftest import ONE_WORKER_MODULES, scheduling_unit

    assert "--dist loadscope" in README
    assert scheduling_unit("tests/test_distribute.py::test_a[x-y]") == "tests/test_distribute.py"
    assert scheduling_unit("tests/test_enable.py::test_a[x-y]") == "tests/test_enable.py::test_a[x-y]"
    assert sorted(ONE_WORKER_MODULES) == sorted(
        name for name in ONE_WORKER_MODULES if (ROOT / "tests" / name).is_file())


def test_main_job_screenshots_are_in_the_repository_with_their_commands():
    tensorboard = _page("docs/guides/tensorboard.md")
    images = re.findall(r"!\[[^\]]*\]\(\.\./(images/[\w.]+\.png)\)", tensorboard)
    assert images == ["images/tensorboard_main_job.png", "images/tensorboard_main_job_fp16.png"]
    for image in images:
        data = (DOCS / image).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) < 300 * 1024
    # The guide says how to make each again: the main job's run, then the script on its
    # logs, both in a new temporary folder, never over the pictures in docs/images/.
    assert 'out="$(mktemp -d)"\n' in tensorboard
    for policy, logs, image, options in [
        ("mixed_bfloat16", '"$out/digits_bf16"', images[0], " --window-size 1400,1650"),
        ("mixed_float16", '"$out/digits_fp16"', images[1], " --dashboard custom_scalars"),
    ]:
        assert (f"python examples/train_digits.py --policy {policy} --filters 4 --units 16 "
                f"--log-dir {logs}\n") in tensorboard
        name = pathlib.PurePosixPath(image).name
        assert (f'python scripts/tensorboard_screenshot.py {logs} --output "$out/{name}"{options}\n'
                in tensorboard)
    assert "--output docs/images" not in ALL_TEXT
