"""README.md stays true: its quickstart runs and logs, its names and paths exist, CI runs its test command."""

import ast
import configparser
import contextlib
import inspect
import pathlib
import re
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from _events import read_run
from _events import steps
from _events import values
from _machines import ZEN4

import tfmp
from tfmp._src.policy.hardware import injected_facts

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CODE_BLOCKS = re.findall(r"```[a-z]*\n(.*?)```", README, flags=re.S)
# Inline code spans outside the fenced blocks.
CODE_SPANS = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", README, flags=re.S))


def _quickstart():
    snippets = re.findall(r"```python\n(.*?)```", README, flags=re.S)
    assert len(snippets) == 1
    return snippets[0]


@pytest.mark.parametrize("machine", ["this_machine", "bfloat16_cpu"])
def test_quickstart_snippet_runs_and_logs_every_batch(machine, tmp_path, monkeypatch):
    with contextlib.ExitStack() as stack:
        _quickstart_runs(machine, tmp_path, monkeypatch, stack)


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
    """The "Distributed training" section's loop driving the monitor: a bare ``` block
    (not the quickstart's ```python), since it uses names the section describes
    in prose: `model`, `dist_dataset` and `train_step`."""
    [snippet] = [code for code in CODE_BLOCKS if "callbacks.on_train_begin()" in code]
    return snippet


def test_custom_loop_snippet_runs_as_written_and_logs_its_epoch(tmp_path, monkeypatch):
    """Run with the default strategy: the loop is the same code under MirroredStrategy
    (tests/test_distribute.py runs such loops on two logical CPUs)."""
    monkeypatch.chdir(tmp_path)
    strategy = tf.distribute.get_strategy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tfmp.PerformanceWarning)  # float16 on a CPU
        tfmp.enable("mixed_float16", loss_scale_options={"initial_scale": 2.0**4, "dynamic_growth_steps": 1000})
    try:
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        model.optimizer.build(model.trainable_variables)
        rng = np.random.default_rng(0)
        x, y = rng.random((32, 4), dtype="float32"), rng.random((32, 1), dtype="float32")
        dist_dataset = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8))

        def replica_fn(x, y):
            with tf.GradientTape() as tape:
                per_example = keras.losses.mean_squared_error(y, model(x, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=8)
            grads = tfmp.scaled_gradients(tape, loss, model.trainable_variables, model.optimizer)
            model.optimizer.apply(grads, model.trainable_variables)

        @tf.function
        def train_step(x, y):
            strategy.run(replica_fn, args=(x, y))

        namespace = {"keras": keras, "tfmp": tfmp, "model": model,
                     "dist_dataset": dist_dataset, "train_step": train_step}
        exec(compile(_custom_loop_snippet(), "README.md", "exec"), namespace)
    finally:
        tfmp.disable()
    run = read_run(tmp_path / "logs" / "run")
    assert run["precision/epoch_loss_scale"] == [(0, 16.0)]
    assert run["precision/epoch_overflow_count"] == [(0, 0.0)]
    assert int(model.optimizer.total_steps.numpy()) == 4


def _tfmp_references():
    """Every dotted name ``tfmp.a.b`` in the README's code, with the text around it."""
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
            assert hasattr(target, part), f"README names tfmp.{dotted} (in `{code}`): no {part!r}"
            target = getattr(target, part)


def _tfmp_calls():
    """(dotted name, keyword names) of each ``tfmp.f(..., k=...)`` call in the README's code."""
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
            assert keyword in parameters, f"README calls tfmp.{dotted}({keyword}=...): not a parameter"
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
    claims = dict(re.findall(r"`(\w+)` \(default ([^)]+)\)", README))
    assert claims == {"min_scale": "1", "max_scale": "2**24", "max_consecutive_overflows": "32"}
    parameters = inspect.signature(tfmp.LossScaleOptimizer).parameters
    for name, default in claims.items():
        assert parameters[name].default == _number(default), (name, default)


# Paths the README names that are not in the repository: what runs write, and a
# folder made by the set-up line.
# Folders a run writes (logs, exported artifacts, the venv) and layer paths ("encoder/...").
NOT_IN_THE_REPOSITORY = ("logs/", ".venv/", "exported/", "encoder/", "block/")  # outputs, layer paths


def _repository_paths():
    """Every path-like word (with a '/' or ending in .py/.md) of the README's code."""
    words = set()
    for code in CODE_BLOCKS + CODE_SPANS:
        for word in re.findall(r"[\w.\-/*<>]+", code):
            word = word.rstrip(".")
            if re.search(r"[*<>]", word) or word.startswith("/"):  # patterns, placeholders
                continue
            if "/" in word or re.search(r"\.(py|md)$", word):
                words.add(word)
    links = re.findall(r"\]\(([^)#:]+)\)", README)  # relative Markdown links
    return {w for w in words | set(links) if not w.startswith(NOT_IN_THE_REPOSITORY)}


def test_every_path_the_readme_names_exists():
    paths = _repository_paths()
    assert {"examples/train_digits.py", "tfmp/_src/keras_hooks/", ".ci/run",
            "tfmp/docs/troubleshooting.md", "train_digits.py"} <= paths
    missing = []
    for path in sorted(paths):
        if "/" in path:  # from the repository root, or from notebooks/ ("../examples")
            found = (ROOT / path).exists() or (ROOT / "notebooks" / path).exists()
        else:  # a bare file name, in the folder its sentence or table row names
            found = any(p for p in ROOT.rglob(path) if ".git" not in p.parts)
        if not found:
            missing.append(path)
    assert not missing, f"README names paths that do not exist: {missing}"


def test_layout_table_names_every_package_and_its_files():
    rows = re.findall(r"^\| `(tfmp/[^`]+)`(.*)\|$", README[README.index("## Layout"):], flags=re.M)
    named = {folder for folder, _ in rows}
    packages = {f"tfmp/_src/{p.name}/" for p in (ROOT / "tfmp" / "_src").iterdir()
                if p.is_dir() and list(p.glob("*.py"))}
    assert "tfmp/_src/keras_hooks/" in packages
    assert packages <= named, f"packages missing from the Layout table: {sorted(packages - named)}"
    for folder, rest in rows:
        for name in re.findall(r"`(\w+\.py)`", rest):
            if folder.endswith("/"):
                assert (ROOT / folder / name).is_file(), f"README: {folder}{name} does not exist"


def test_readme_tables_list_every_notebook_and_example_script():
    notebooks = set(re.findall(r"^\| `(\d\d_\w+)` \|", README, flags=re.M))
    assert notebooks == {p.stem for p in (ROOT / "notebooks").glob("*.ipynb")}
    scripts = set(re.findall(r"^\| `(examples/\w+\.py)` \|", README, flags=re.M))
    on_disk = {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")}
    helpers = {"examples/example_utils.py", "examples/example_args.py",
               "examples/tfds_preflight.py"}
    assert scripts == on_disk - helpers


def test_ci_runs_the_readme_test_command():
    setup_lines = re.findall(r"^\s*(python3 -m venv .*)$", README, flags=re.M)
    assert len(setup_lines) == 2, setup_lines
    test_command = setup_lines[1].split("&&")[-1].strip()
    assert test_command.startswith("python -m pytest")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines[-1].strip() == test_command
    assert 'pip install --quiet ".[test]"' in "\n".join(ci_lines)
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
    images = re.findall(r"!\[[^\]]*\]\((docs/images/[\w.]+\.png)\)", README)
    assert images == ["docs/images/tensorboard_main_job.png",
                      "docs/images/tensorboard_main_job_fp16.png"]
    for image in images:
        data = (ROOT / image).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(data) < 300 * 1024
    # The README says how to make each again: the main job's run, then the script on its logs.
    for policy, logs, image, options in [
        ("mixed_bfloat16", "logs/digits_bf16", images[0], " --window-size 1400,1650"),
        ("mixed_float16", "logs/digits_fp16", images[1], ""),
    ]:
        assert (f"python examples/train_digits.py --policy {policy} --filters 4 --units 16 "
                f"--log-dir {logs}") in README
        assert f"python scripts/tensorboard_screenshot.py {logs} --output {image}{options}\n" in README
