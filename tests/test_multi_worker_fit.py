"""`model.fit` / `evaluate` / `predict` under MultiWorkerMirroredStrategy with tfmp,
on real worker processes (tests/_mw_fit_worker.py) on 127.0.0.1.

One module fixture starts every cluster at once (they share the cores while the
tests wait; each wait is bounded and whatever still runs is killed at the end):

* two workers, ``mixed_float16``, `tfmp.enable()` before the strategy is created;
* three workers, "auto" (``mixed_bfloat16``: the workers take a Zen 4's facts,
  tests/_machines.py), `tfmp.enable()` after it,
  plain Keras's `fit` first;
* two workers training with ``BackupAndRestore``, worker 1 ending itself in
  epoch 1 (then both are restarted, as a job scheduler would);
* one worker of a two-worker cluster whose peer never starts.

The chief of each cluster also trains the same model in one process on the same
global batches (``reference``). Scales are powers of two, so scales and counters
compare exactly; losses and weights within 16-bit tolerances.
"""

import contextlib
import json
import re
import time

import numpy as np
import pytest
from _events import read_run
from _subproc import free_ports
from _subproc import results
from _subproc import started

# One worker runs this module (conftest.ONE_WORKER_MODULES), so its module fixture runs once.

#: Bounds of each wait. On 2 idle cores the eight first processes take ~90 s of CPU
#: in all (TensorFlow's import is ~10 s each); the bounds leave room for a busy machine.
CLUSTER_TIMEOUT_S = 300
LONELY_TIMEOUT_S = 5  # the worker's own bound on waiting for its peer
STEPS, EPOCHS, PER_WORKER = 4, 2, 4
BAD_STEP = STEPS - 1
DIED = 17  # the exit code of a worker that ended itself (_mw_fit_worker.DIED)
#: Relative tolerance of a loss or weight trained in each 16-bit type against one
#: process on the same batches (the sums run in another order): a few units of the
#: type's precision (float16: 2**-10, bfloat16: 2**-7).
RTOL = {"mixed_float16": 8 * 2.0**-10, "mixed_bfloat16": 4 * 2.0**-7}


def cluster_runs(workers, args, per_worker=lambda index: []):
    """(args, env) of each worker: TF_CONFIG naming `workers` free loopback ports."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(workers)]}
    return [
        (
            [*args, *per_worker(index)],
            {"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}})},
        )
        for index in range(workers)
    ], cluster


def backup_args(root, die_at=None):
    def per_worker(index):
        extra = ["--backup", str(root / f"backup{index}"), "--progress", str(root / f"progress{index}.jsonl")]
        if die_at is not None and index == 1:
            extra += ["--die-at", str(die_at)]
        return extra

    return per_worker


#: The clusters each test reads; the fixture starts only those of the selected tests
#: (the oldest CI tier runs the contract test alone).
NEEDS = {
    "test_plain_keras_fit_still_fails_under_multi_worker_and_tfmp_fit_matches_one_process": {"three"},
    "test_two_float16_workers_enabled_before_the_strategy_skip_the_same_steps": {"two"},
    "test_dict_inputs_train_alike_on_every_worker": {"two", "three"},
    "test_steps_per_execution_above_one_is_refused_at_compile_and_at_fit": {"two"},
    "test_a_model_saved_under_the_strategy_opens_without_one_with_its_scale_and_counters": {"two"},
    "test_backup_and_restore_resumes_every_worker_with_the_same_scale_and_counters": {"backup"},
    "test_a_worker_whose_peer_never_starts_ends_in_bounded_time_naming_it": {"lonely"},
}


@pytest.fixture(scope="module")
def launched(tmp_path_factory, request):
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    needed = set().union(*(NEEDS[name] for name in selected))
    root = tmp_path_factory.mktemp("multi_worker")
    folders = {name: root / name for name in ("two", "three", "backup", "backup_again", "lonely")}
    for folder in folders.values():
        folder.mkdir()
    runs = {
        "two": cluster_runs(2, ["--policy", "mixed_float16", "--order", "before",
                                "--log-dir", str(folders["two"] / "logs")])[0],
        "three": cluster_runs(3, ["--policy", "auto", "--machine", "zen4", "--order", "after", "--plain",
                                  "--log-dir", str(folders["three"] / "logs")])[0],
        "backup": cluster_runs(2, ["--policy", "mixed_float16"], backup_args(root, die_at=1))[0],
    }
    lonely_runs, lonely_cluster = cluster_runs(2, ["--timeout", str(LONELY_TIMEOUT_S)])
    runs["lonely"] = lonely_runs[:1]  # its peer never starts
    with contextlib.ExitStack() as stack:
        launches = {name: stack.enter_context(started("_mw_fit_worker.py", runs[name], folders[name]))
                    for name in runs if name in needed}
        yield {"launches": launches, "root": root, "folders": folders, "stack": stack,
               "lonely_cluster": lonely_cluster}


def case(result, name):
    found = result[name]
    if isinstance(found, dict) and "error" in found and "Traceback" in str(found["error"]):
        pytest.fail(f"case {name!r} raised in worker {result['pid']}:\n{found['error']}")
    return found


def expected_scales(policy, epochs):
    """The scale after each step: growth x2 every 2 finite steps, halved at each overflow
    (the last step of each epoch); fixed at 1.0 without loss scaling (bfloat16)."""
    if policy != "mixed_float16":
        return [1.0] * (STEPS * epochs)
    scale, finite, scales = 2.0**10, 0, []
    for step in range(STEPS * epochs):
        if step % STEPS == BAD_STEP:
            scale, finite = scale / 2, 0
        else:
            finite += 1
            if finite == 2:
                scale, finite = scale * 2, 0
        scales.append(scale)
    return scales


def check_cluster(found, policy, workers):
    """Every worker took the same steps as one process on the same global batches."""
    assert [r["replicas"] for r in found] == [workers] * workers
    assert [r["is_chief"] for r in found] == [True] + [False] * (workers - 1)
    assert {r["policy"] for r in found} == {policy}
    fits = [case(r, "fit") for r in found]
    reference = case(found[0], "reference")
    # Worker N's share of each global batch is its own: the inf is in the last worker's only.
    for index, fit in enumerate(fits):
        assert fit["finite_shards"] == [not (index == workers - 1 and step == BAD_STEP) for step in range(STEPS)]
    assert fits[0]["optimizer"] == "LossScaleOptimizer"
    # One verdict per step on every worker: the same scale and counters everywhere,
    # and the same as one process that saw the whole batch.
    scales = expected_scales(policy, EPOCHS)
    for fit in fits:
        assert fit["scales"] == scales == reference["scales"]
        assert fit["state"] == fits[0]["state"]
        assert fit["weights"] == fits[0]["weights"]
        assert fit["losses"] == fits[0]["losses"]
        assert (fit["evaluate"], fit["predict"]) == (fits[0]["evaluate"], fits[0]["predict"])
    state = fits[0]["state"]
    assert (state["overflow_count"], state["total_steps"], state["iterations"]) == (
        EPOCHS, STEPS * EPOCHS, (STEPS - 1) * EPOCHS)
    assert {k: state[k] for k in ("overflow_count", "total_steps", "iterations", "dynamic_scale")} == {
        k: reference["state"][k] for k in ("overflow_count", "total_steps", "iterations", "dynamic_scale")}
    rtol = RTOL[policy]
    finite = [i for i in range(STEPS * EPOCHS) if i % STEPS != BAD_STEP]
    np.testing.assert_allclose([fits[0]["losses"][i] for i in finite],
                               [reference["losses"][i] for i in finite], rtol=rtol)
    assert all(not np.isfinite(fits[0]["losses"][i]) for i in range(BAD_STEP, STEPS * EPOCHS, STEPS))
    for got, want in zip(fits[0]["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)))
    np.testing.assert_allclose(fits[0]["evaluate"], reference["evaluate"], rtol=rtol)
    np.testing.assert_allclose(fits[0]["predict"], reference["predict"], rtol=rtol,
                               atol=rtol * np.max(np.abs(reference["predict"])))


@pytest.fixture(scope="module")
def two(launched):
    return results(launched["launches"]["two"], CLUSTER_TIMEOUT_S)


@pytest.fixture(scope="module")
def three(launched):
    return results(launched["launches"]["three"], CLUSTER_TIMEOUT_S)


def test_plain_keras_fit_still_fails_under_multi_worker_and_tfmp_fit_matches_one_process(three):
    """When this fails at its first assertion, Keras fixed keras-team/keras#20585:
    tfmp's fix then steps aside by itself (it acts only on that error); remove
    tfmp/_src/keras_hooks/multi_worker.py and this assertion."""
    for result in three:
        assert re.match(r"ValueError: Attempt to convert a value \(PerReplica:", case(result, "plain")["error"])
    check_cluster(three, "mixed_bfloat16", 3)


def test_two_float16_workers_enabled_before_the_strategy_skip_the_same_steps(two, launched):
    check_cluster(two, "mixed_float16", 2)
    # The monitor writes on the chief only.
    log_dir = launched["folders"]["two"] / "logs"
    events = sorted(p.name for p in (log_dir / "train").iterdir())
    assert len(events) == 1 and f".{two[0]['pid']}." in events[0], events
    assert [v for _, v in read_run(log_dir)["precision/batch_loss_scale"]] == expected_scales("mixed_float16", EPOCHS)


def test_dict_inputs_train_alike_on_every_worker(two, three):
    for found in (two, three):
        dicts = [case(r, "dict") for r in found]
        assert all(np.isfinite(d["loss"]).all() for d in dicts)
        assert all(d == dicts[0] for d in dicts)


def test_steps_per_execution_above_one_is_refused_at_compile_and_at_fit(two):
    for result in two:
        for error in case(result, "refused").values():
            assert error is not None and error.startswith(
                "Invalid `steps_per_execution` argument. Expected 1 for model")
            assert "across 2 workers" in error and "Received: steps_per_execution=2 (of type int)." in error
            assert "Compile with steps_per_execution=1" in error


def test_a_model_saved_under_the_strategy_opens_without_one_with_its_scale_and_counters(two):
    trained = case(two[0], "fit")
    opened = case(two[0], "reference")["opened"]
    assert opened["optimizer"] == "LossScaleOptimizer"
    assert opened["state"] == trained["state"]
    assert opened["weights"] == trained["weights"]


def read_progress(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_backup_and_restore_resumes_every_worker_with_the_same_scale_and_counters(launched):
    root, backup = launched["root"], launched["launches"]["backup"]
    deadline = time.monotonic() + CLUSTER_TIMEOUT_S
    (first, _, first_log), (second, _, second_log) = backup
    while second.poll() is None and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert second.poll() == DIED, second_log.read_text(errors="replace")[-3000:]
    first.kill()  # left waiting for its peer in a collective op: the scheduler ends it
    first.wait()
    before = [read_progress(root / f"progress{i}.jsonl") for i in range(2)]
    for lines in before:  # both reached epoch 1, then stopped inside it
        assert [(e["event"], e["epoch"]) for e in lines] == [("begin", 0), ("end", 0), ("begin", 1)]
    saved = before[0][1]  # what BackupAndRestore saved at the end of epoch 0
    again, _ = cluster_runs(2, ["--policy", "mixed_float16"], backup_args(root))
    folder = launched["folders"]["backup_again"]
    relaunched = launched["stack"].enter_context(started("_mw_fit_worker.py", again, folder))
    found = results(relaunched, CLUSTER_TIMEOUT_S)
    after = [read_progress(root / f"progress{i}.jsonl")[3:] for i in range(2)]
    for lines in after:  # resumed at epoch 1 with the saved step, scale and counters
        assert [(e["event"], e["epoch"]) for e in lines] == [("begin", 1), ("end", 1), ("begin", 2), ("end", 2)]
        assert {k: v for k, v in lines[0].items() if k != "event"} == {
            k: v for k, v in saved.items() if k != "event"} | {"epoch": 1}
    assert saved["overflow_count"] == 1 and saved["iterations"] == STEPS - 1
    assert saved["scale"] == expected_scales("mixed_float16", 1)[-1]
    finals = [case(r, "backup") for r in found]
    assert finals[0] == finals[1]
    reference = case(found[0], "reference")  # three epochs in one process, uninterrupted
    for key in ("overflow_count", "total_steps", "iterations", "dynamic_scale"):
        assert finals[0]["state"][key] == reference["state"][key], key
    assert finals[0]["state"]["dynamic_scale"] == expected_scales("mixed_float16", 3)[-1]
    for got, want in zip(finals[0]["weights"], reference["weights"]):
        rtol = RTOL["mixed_float16"]
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * np.max(np.abs(want)))


def test_a_worker_whose_peer_never_starts_ends_in_bounded_time_naming_it(launched):
    ((process, _, log_path),) = launched["launches"]["lonely"]
    try:
        process.wait(timeout=CLUSTER_TIMEOUT_S)
    except Exception:  # noqa: BLE001
        pytest.fail("the lonely worker still waits for its peer")
    text = log_path.read_text(errors="replace")
    assert process.returncode == -9, text[-3000:]
    missing = launched["lonely_cluster"]["worker"][1]
    assert (f"tfmp.multi_worker_strategy: the cluster of TF_CONFIG did not form within {LONELY_TIMEOUT_S} s. "
            "This process is worker 0 of ") in text
    assert f"Peers where no server answers: worker 1 at {missing}. Start every task" in text
