"""Tests for tfmp.compare on scikit-learn's digits (1,797 real 8x8 images)."""

import functools
import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import tfmp
from tfmp._src.advisors import compare as _compare
from tfmp._src.policy.policy import recommend_policy, resolve_policy

EPOCHS = 3
# Named, not "auto": on a CPU without bfloat16 "auto" resolves to float32 too.
POLICIES = ("float32", "mixed_bfloat16")


@pytest.fixture(scope="module")
def digits():
    data = load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1437], y[:1437]), (x[1437:], y[1437:])


def build_digits_model():
    model = keras.Sequential([
        keras.Input((64,)),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(10),
        keras.layers.Activation("softmax", dtype="float32"),
    ])
    model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy",
                  metrics=["accuracy"])
    return model


@pytest.fixture(scope="module")
def report(digits):
    train, val = digits
    return tfmp.compare(build_digits_model, train, val, policies=POLICIES, epochs=EPOCHS, seed=0)


def test_each_policy_really_ran(report):
    assert [(r.requested, r.policy) for r in report.runs] == [
        ("float32", "float32"), ("mixed_bfloat16", "mixed_bfloat16")]
    for run in report.runs:
        assert set(run.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}
        assert all(len(v) == EPOCHS for v in run.history.values())
        assert run.step_time_s > 0 and run.steps_timed == EPOCHS * 45 - 1
        assert run.samples_per_second == pytest.approx(32 / run.step_time_s)
    first, second = report.runs
    assert first.initial_weights_checksum == second.initial_weights_checksum
    assert first.history["loss"] != second.history["loss"]  # different arithmetic


def test_float32_numbers_match_an_independent_run(report, digits):
    (x, y), val = digits
    keras.utils.set_random_seed(0)
    history = build_digits_model().fit(x, y, batch_size=32, epochs=EPOCHS,
                                       validation_data=val, shuffle=True, verbose=0)
    assert report.baseline.history["loss"] == pytest.approx(
        history.history["loss"], rel=1e-6)


def test_verdict_flips_below_the_measured_difference(report):
    measured = report.verdict()
    gap = abs(measured.difference)
    assert gap > 0
    assert measured.unit == "pp" and "accuracy" in measured.metric
    assert report.verdict(tolerance=gap).passed
    failed = report.verdict(tolerance=gap / 2)
    assert not failed and "troubleshooting.md#accuracy-drop" in str(failed)
    assert failed.difference == measured.difference  # judged again, not retrained


def test_differences_are_percentage_points_against_float32(report):
    base, other = report.runs
    diffs = report.differences()[other.label]
    expected = 100 * (other.final["val_accuracy"] - base.final["val_accuracy"])
    assert diffs["val_accuracy"] == pytest.approx(expected)
    loss = report.verdict(metric="val_loss")
    assert loss.unit == "%" and loss.metric == "val_loss"


def test_verdict_rejects_unknown_metric_and_negative_tolerance(report):
    with pytest.raises(ValueError, match="Received: metric='val_acc'"):
        report.verdict(metric="val_acc")
    with pytest.raises(ValueError, match="Received: tolerance=-1"):
        report.verdict(tolerance=-1)


def test_table_dict_and_plot(report, tmp_path):
    table = str(report)
    assert "float32" in table and "val_accuracy" in table and "samples/s" in table
    assert str(report.verdict()) in table
    data = json.loads(json.dumps(report.to_dict()))
    assert data["runs"][0]["final"]["loss"] == report.runs[0].final["loss"]
    assert data["verdict"]["passed"] == report.verdict().passed
    figure = report.plot(tmp_path / "curves.png")  # pyplot-free Figure: Agg canvas
    assert len(figure.axes) == 2
    assert (tmp_path / "curves.png").stat().st_size > 0


def test_tf_data_input(digits):
    (x, y), _ = digits
    ds = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).batch(64)
    report = tfmp.compare(build_digits_model, ds, policies=("float32", "mixed_bfloat16"),
                          epochs=1)
    assert report.settings["samples_per_step"] == 64
    assert report.settings["device"] == recommend_policy().device
    assert report.runs[1].policy == "mixed_bfloat16"
    assert report.runs[0].steps_timed == 3


def test_policy_is_restored_when_a_run_fails(digits):
    keras.config.set_dtype_policy("mixed_bfloat16")

    def not_compiled():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])

    with pytest.raises(ValueError, match="Expected a callable returning a compiled"):
        tfmp.compare(not_compiled, digits[0], policies=POLICIES)
    assert keras.config.dtype_policy().name == "mixed_bfloat16"


@pytest.mark.parametrize(
    "policies, fragment",
    [
        (("mixed_bfloat16", "mixed_float16"), "including 'float32'"),
        (("float32",), "at least two distinct"),
        (("float32", "float32"), "at least two distinct"),
        (("float32", "fp16"), "Did you mean 'mixed_float16'"),
    ],
)
def test_bad_policies_use_the_error_template(digits, policies, fragment):
    with pytest.raises(ValueError, match=fragment):
        tfmp.compare(build_digits_model, digits[0], policies=policies)


def test_policies_resolving_to_the_same_one_are_refused(digits, monkeypatch):
    no_bf16 = tfmp.DeviceFacts(cpu_name="test CPU", cpu_flags=frozenset({"avx2"}))
    monkeypatch.setattr(_compare, "resolve_policy", functools.partial(resolve_policy, device_facts=no_bf16))
    with pytest.raises(ValueError, match=r"'auto' -> 'float32'.*would be the same"):
        tfmp.compare(build_digits_model, digits[0], policies=("float32", "auto"))


def test_negative_tolerance_is_rejected_before_training(digits):
    with pytest.raises(ValueError, match="Received: tolerance=-0.1"):
        tfmp.compare(build_digits_model, digits[0], tolerance=-0.1)


def test_bad_data_uses_the_error_template():
    with pytest.raises(ValueError, match="Received: train_data="):
        tfmp.compare(build_digits_model, np.zeros((4, 64)), policies=POLICIES)


def test_failing_run_restores_policy_and_compile(digits):
    before = keras.config.dtype_policy().name
    original_compile = keras.Model.compile

    def broken_model():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        tfmp.compare(broken_model, digits[0], policies=("mixed_bfloat16", "float32"))
    assert keras.config.dtype_policy().name == before
    assert keras.Model.compile is original_compile
