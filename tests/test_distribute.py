"""tfmp under tf.distribute: MirroredStrategy on two logical CPUs, two-worker
MultiWorkerMirroredStrategy on loopback, XLA refusal, checkpoints across strategies.

The distributed cases run in processes of their own (see tests/_subproc.py): the
MirroredStrategy cases in one run of tests/_dist_case.py and the cluster as two
tests/_mw_worker.py processes. A module fixture starts all three at once (they
share the cores while the tests wait) and kills whatever still runs at the end.
Scales are powers of two, so every comparison of scales and counters is exact.
"""

import contextlib
import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from _events import read_run
from _subproc import free_ports
from _subproc import results
from _subproc import started

import tfmp
from tfmp._src import distribute as _distribute

# One worker runs this module (conftest.ONE_WORKER_MODULES), so its module fixtures run once.

# Bounds of each wait. On 2 idle cores the three processes take ~15 s of CPU each
# (TensorFlow's import included), the MirroredStrategy cases ~20 s more for the
# check_numerics runs; the bounds leave room for a busy machine.
CASES_TIMEOUT_S = 420
WORKERS_TIMEOUT_S = 300
CASES = ["replica_graphs", "fit", "keras_lso", "custom_loop", "xla", "checkpoint", "numerics", "master_copies"]
SCALES = [1024.0, 512.0, 512.0, 1024.0]  # finite, overflow, finite, finite (growth 2)


def worker_runs(log_dir):
    """(args, env) of both workers: TF_CONFIG with two free loopback ports."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(2)]}
    return [
        (
            ["--log-dir", str(log_dir)],
            {
                "TF_CONFIG": json.dumps(
                    {"cluster": cluster, "task": {"type": "worker", "index": index}}
                )
            },
        )
        for index in range(2)
    ]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The MirroredStrategy cases and the two workers, started together."""
    cases_dir = tmp_path_factory.mktemp("mirrored")
    workers_dir = tmp_path_factory.mktemp("workers")
    with contextlib.ExitStack() as stack:
        cases = stack.enter_context(started("_dist_case.py", [(CASES, {})], cases_dir))
        workers = stack.enter_context(
            started("_mw_worker.py", worker_runs(workers_dir / "logs"), workers_dir)
        )
        yield {"cases": cases, "workers": workers, "log_dir": workers_dir / "logs"}


@pytest.fixture(scope="module")
def mirrored(launched):
    """{case: result} of every case of tests/_dist_case.py."""
    return results(launched["cases"], CASES_TIMEOUT_S)[0]


def case(mirrored, name):
    result = mirrored[name]
    if "error" in result:
        pytest.fail(f"case {name!r} raised in the subprocess:\n{result['error']}")
    return result


def update_tolerance(before, after):
    """assert_allclose tolerances for a weight tensor trained from float16 gradients.

    Gradients are rounded to float16 (eps 2**-10): two runs that sum the same
    gradients in another order or split agree to a few float16 ulps of the update
    (`after - before`; the largest in the tensor, so that an element whose update
    cancels is not held to zero), plus float32 rounding of the weights themselves.
    """
    update = np.max(np.abs(np.asarray(after) - np.asarray(before)))
    return {
        "atol": 8 * float(np.finfo(np.float16).eps) * float(update),
        "rtol": 8 * float(np.finfo(np.float32).eps),
    }


def per_batch(result, name):
    """[[value on replica 0, value on replica 1] for each batch] of a variable."""
    return [batch["state"][name] for batch in result["batches"]]


# MirroredStrategy + model.fit ---------------------------------------------------------


def test_replica_threads_trace_what_the_attachment_decided(mirrored):
    """Built and compiled in a scope, traced after it in the replica threads: fused BN on
    both replicas (one kernel each), the 16-bit loss term summed in float32."""
    result = case(mirrored, "replica_graphs")
    assert result["replicas"] == 2
    assert result["fused_ops"] == 2
    assert result["last_call_reason"] == ""
    assert np.isfinite(result["loss"])


def test_the_injected_inf_reaches_replica_1_only(mirrored):
    result = case(mirrored, "fit")
    assert result["replicas"] == 2
    assert result["finite_per_replica"] == [
        [True, True],
        [True, False],
        [True, True],
        [True, True],
    ]


def test_fit_in_scope_trains_with_tfmp_optimizer(mirrored):
    result = case(mirrored, "fit")
    assert (result["optimizer_module"], result["optimizer"]) == (
        "tfmp._src.loss_scale.optimizer",
        "LossScaleOptimizer",
    )
    final = result["batches"][-1]
    assert final["iterations"] == 3
    assert all(np.isfinite(w).all() for w in final["weights"])
    assert final["weights"] != result["initial_weights"]
    assert result["stuck_check"]  # tfmp's stuck check wraps fit's train function


def test_all_replicas_share_one_scale_and_counters(mirrored):
    result = case(mirrored, "fit")
    for batch in result["batches"]:
        for name, copies in batch["state"].items():
            assert copies[0] == copies[1], (name, copies)
        for copies in batch["weights"]:
            assert copies[0] == copies[1]
    assert [copies[0] for copies in per_batch(result, "dynamic_scale")] == SCALES


def test_overflow_on_one_replica_skips_the_step_on_all(mirrored):
    result = case(mirrored, "fit")
    before, skipped, after = result["batches"][:3]
    assert skipped["weights"] == before["weights"]  # both replicas' copies
    assert after["weights"] != skipped["weights"]
    assert [b["iterations"] for b in result["batches"]] == [1, 1, 2, 3]
    # The loss and the batch were inf on replica 1 only; both copies of the status say so.
    assert skipped["state"]["last_loss_status"] == [2 + 8, 2 + 8]


def test_overflow_count_counts_each_skipped_step_once(mirrored):
    result = case(mirrored, "fit")
    assert per_batch(result, "overflow_count") == [[0, 0], [1, 1], [1, 1], [1, 1]]
    assert per_batch(result, "total_steps") == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert per_batch(result, "last_overflow_step")[-1] == [1, 1]


def test_keras_own_optimizer_misses_the_same_overflow(mirrored):
    # What the README warns about: Keras keeps replica 0's verdict, so the step with
    # the inf on replica 1 is applied, the scale grows and the weights turn NaN.
    result = case(mirrored, "keras_lso")
    assert result["iterations"] == 2
    assert result["scale"] == [2048.0, 2048.0]
    assert not result["weights_finite"]


def test_a_16_bit_variables_master_copy_trains_on_both_replicas_as_without_a_strategy(mirrored):
    result = case(mirrored, "master_copies")  # mixed_bfloat16, Adam, 8 steps
    assert result["dtypes"] == ["bfloat16", "float32"]
    copies, gains = np.array(result["copy_per_replica"]), np.array(result["gain_per_replica"])
    np.testing.assert_array_equal(copies[0], copies[1])
    np.testing.assert_array_equal(gains[0], gains[1])
    rounded = keras.ops.convert_to_numpy(keras.ops.cast(keras.ops.cast(copies[0], "bfloat16"), "float32"))
    np.testing.assert_array_equal(gains[0], rounded)
    assert np.abs(gains[0] - 1.0).max() > 2.0**-7  # Keras's bfloat16 Adam would not move it
    np.testing.assert_allclose(gains[0], result["gain_alone"], atol=2.0**-7)  # bfloat16 rounding, reduction order


def test_custom_loop_skips_when_any_replica_overflows(mirrored):
    steps = case(mirrored, "custom_loop")["steps"]
    assert [s["bad_replica"] for s in steps] == [1, 0, None]
    for s, scale, overflows in zip(steps[:2], [512.0, 256.0], [1, 2]):
        assert s["weights_after"] == s["weights_before"]
        assert s["state"]["dynamic_scale"] == [scale, scale]
        assert s["state"]["overflow_count"] == [overflows, overflows]
        assert s["iterations"] == 0
    clean = steps[2]
    assert clean["weights_after"] != clean["weights_before"]
    assert all(copies[0] == copies[1] for copies in clean["weights_after"])
    assert clean["iterations"] == 1
    assert clean["state"]["overflow_count"] == [2, 2]


# tfmp.check_numerics under MirroredStrategy ----------------------------------------
# The model and data of test_numerics.py: Dense d1 -> Lambda "divide" (by input
# feature 0) -> Dense d2, one global batch of 8 per step, 4 rows per replica. On one
# replica the zero at step 4 is reported as ("divide", "forward", 4, "inf").
ZERO_AT_4 = ["divide", "forward", 4, "inf"]
#: Steps of the 8 trace rows ending at divide in step 4 (4 rows per step: d1,
#: divide, d2, loss).
ZERO_AT_4_TRACE = [2, 2, 3, 3, 3, 3, 4, 4]


@pytest.mark.parametrize("run", ["zero_on_1", "zero_on_0", "zero_on_1_eager"])
def test_check_numerics_names_the_step_and_layer_once(mirrored, run):
    result = case(mirrored, "numerics")[run]
    assert result["raised"] == [ZERO_AT_4 + [ZERO_AT_4_TRACE]]
    assert result["failures"] == [ZERO_AT_4] and result["failures_are_raised"] == [True]
    low, high = result["input_range"][0]
    assert low <= 0.0 <= high
    # Each replica's copy counted the 5 steps run (0-4), not the replicas' calls;
    # the failure was cleared on both copies once reported.
    assert result["step_copies"] == [5, 5]
    assert result["state_copies"] == [[0] * 5, [0] * 5]


def test_check_numerics_reports_a_nan_seen_by_replica_1_only(mirrored):
    result = case(mirrored, "numerics")
    assert result["nan_on_1_finite"][3] == [True, False]  # only replica 1's shard
    run = result["nan_on_1"]
    assert run["raised"] == [["d1", "forward", 3, "nan", [1, 1, 1, 2, 2, 2, 2, 3]]]
    assert [str(v) for v in run["input_range"][0]] == ["nan", "nan"]  # replica 1's rows
    assert run["step_copies"] == [4, 4]


def test_check_numerics_reports_the_earliest_layer_over_replicas(mirrored):
    # Step 4: replica 0's zero makes divide inf, replica 1's NaN reaches d1 first.
    run = case(mirrored, "numerics")["both"]
    assert run["raised"] == [["d1", "forward", 4, "nan", [2, 2, 2, 3, 3, 3, 3, 4]]]
    assert run["failures"] == [["d1", "forward", 4, "nan"]]


def test_check_numerics_names_a_gradient_that_is_nan_on_replica_1_only(mirrored):
    run = case(mirrored, "numerics")["backward"]
    # As on one replica: d1's kernel and bias get NaN gradients, but the backward
    # pass of sqrt made them (its output gradient is finite, its input gradient NaN,
    # on replica 1 only); the trace holds the loss row of step 0 only.
    assert run["raised"] == [["sqrt", "backward", 0, "nan", [0]]]
    assert run["variable"] == [[None, 2]]
    assert run["step_copies"] == [1, 1]


def test_check_numerics_warns_once_per_failing_step(mirrored):
    run = case(mirrored, "numerics")["warn"]
    # Plain SGD applies step 4's non-finite gradients, so step 5 finds d1 NaN.
    assert run["failures"] == [ZERO_AT_4, ["d1", "forward", 5, "nan"]]
    assert run["warnings"] == 2 and run["raised"] == []
    assert run["step_copies"] == [6, 6]


# XLA ----------------------------------------------------------------------------------


def test_jit_compile_is_turned_off_with_a_warning_under_enable(mirrored):
    result = case(mirrored, "xla")["enabled"]
    ours = [w for w in result["warnings"] if w[0] == "PerformanceWarning"]
    assert len(ours) == 1, result["warnings"]
    _, message, filename = ours[0]
    assert message.startswith("tfmp compiled model ")
    assert "with jit_compile=False: XLA cannot compile a step on 2 replicas" in message
    assert filename == "_dist_case.py"  # points at the user's compile() call
    assert result["jit_compile"] is False
    assert result["iterations"] == 2 and result["weights_finite"]


def test_jit_compile_without_enable_is_refused_before_any_step(mirrored):
    result = case(mirrored, "xla")["manual"]
    assert result["error"] == "ValueError"
    assert result["message"].startswith("XLA (jit_compile=True) cannot compile")
    assert "Compile the model with jit_compile=False" in result["message"]
    assert "Traceback" not in result["message"]
    assert result["iterations"] == 0


# Checkpoints across strategies --------------------------------------------------------


def test_keras_file_saved_under_mirrored_resumes_without_a_strategy(mirrored):
    result = case(mirrored, "checkpoint")
    saved = result["saved_mirrored"]
    assert (saved["dynamic_scale"], saved["overflow_count"], saved["total_steps"]) == (
        512.0,
        1,
        2,
    )
    assert result["loaded_class"] == "LossScaleOptimizer"
    assert result["loaded_state"] == saved
    # Two more steps give the same scale and counters as without the interruption.
    assert result["resumed_state"] == result["uninterrupted"]
    assert result["uninterrupted"]["dynamic_scale"] == 1024.0
    for saved, resumed, uninterrupted in zip(
        result["saved_weights"], result["resumed_weights"], result["uninterrupted_weights"]
    ):
        # Two half-batch float16 gradients summed (under the strategy) versus one
        # full-batch float16 gradient: they differ by float16 rounding of the
        # gradients, a few float16 ulps of the update the two steps made. An update
        # applied twice or not at all would differ by the whole update.
        np.testing.assert_allclose(
            resumed, uninterrupted, **update_tolerance(saved, uninterrupted)
        )


def test_tf_checkpoint_saved_under_mirrored_restores_without_a_strategy(mirrored):
    result = case(mirrored, "checkpoint")
    assert result["restored_state"] == result["saved_mirrored"]


def test_keras_file_saved_without_a_strategy_resumes_under_mirrored(mirrored):
    result = case(mirrored, "checkpoint")
    saved = result["saved_plain"]
    assert (saved["dynamic_scale"], saved["step_counter"], saved["total_steps"]) == (
        512.0,
        1,
        3,
    )
    for name, value in saved.items():
        assert result["into_mirrored_state"][name] == [value, value], name
    after = result["into_mirrored_after_step"]
    assert after["dynamic_scale"] == [1024.0, 1024.0]  # second finite step: growth
    assert after["total_steps"] == [4, 4]
    assert after["overflow_count"] == [1, 1]
    assert all(copies[0] == copies[1] for copies in result["into_mirrored_weights"])


# MultiWorkerMirroredStrategy: two local processes -------------------------------------


def test_two_workers_agree_and_only_the_chief_writes_events(launched):
    chief, other = results(launched["workers"], WORKERS_TIMEOUT_S)
    log_dir = launched["log_dir"]
    assert (chief["is_chief"], other["is_chief"]) == (True, False)
    assert chief["replicas"] == other["replicas"] == 2
    assert chief["optimizer"] == "LossScaleOptimizer"
    # Worker 1's overflow skipped the step on both workers; one scale, one count.
    assert chief["scales"] == other["scales"] == SCALES
    assert chief["state"] == other["state"]
    assert (chief["state"]["overflow_count"], chief["iterations"]) == (1, 3)
    assert chief["weights"] == other["weights"]
    assert all(np.isfinite(w).all() for w in chief["weights"])
    events = sorted(p.name for p in (log_dir / "train").iterdir())
    assert len(events) == 1 and f".{chief['pid']}." in events[0], events
    scalars = read_run(log_dir)
    assert [v for _, v in scalars["precision/batch_loss_scale"]] == SCALES
    assert [v for _, v in scalars["precision/batch_overflow_count"]] == [0.0, 1.0, 1.0, 1.0]


# Helpers, in this process -------------------------------------------------------------


class _Extended:
    @property
    def should_save_summary(self):
        raise NotImplementedError


class _ClusterStrategy:
    """Just what is_chief reads from a multi-worker strategy."""

    def __init__(self, cluster, task_type, task_id):
        self.extended = _Extended()
        self.cluster_resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(cluster), task_type=task_type, task_id=task_id
        )


WORKERS = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
WITH_CHIEF = {"chief": ["127.0.0.1:3"], **WORKERS}


@pytest.mark.parametrize(
    "cluster, task_type, task_id, expected",
    [
        (WORKERS, "worker", 0, True),
        (WORKERS, "worker", 1, False),
        (WITH_CHIEF, "chief", 0, True),
        (WITH_CHIEF, "worker", 0, False),
        ({"evaluator": ["127.0.0.1:4"], **WORKERS}, "evaluator", 0, False),
    ],
)
def test_is_chief_follows_the_tf_config_convention(
    cluster, task_type, task_id, expected
):
    assert (
        _distribute.is_chief(_ClusterStrategy(cluster, task_type, task_id)) is expected
    )


def test_single_process_strategies_count_as_chief():
    assert _distribute.is_chief() is True
    assert _distribute.is_chief(tf.distribute.OneDeviceStrategy("/cpu:0")) is True
    assert _distribute.replicas_in_sync() == 1


def test_any_replica_is_the_identity_on_one_replica():
    flags = [tf.constant(True), tf.constant(False)]
    assert [bool(f) for f in _distribute.any_replica(flags)] == [True, False]
    assert bool(_distribute.all_replicas_finite(tf.constant(False))) is False


def test_xla_is_kept_on_a_single_replica():
    with tfmp.policy_scope("float32"):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse", jit_compile=True)
    assert model.jit_compile is True
    assert _distribute.turn_off_xla_if_replicated(model) is False
