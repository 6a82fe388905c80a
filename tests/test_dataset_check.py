"""Tests for tfmp.check_dataset (tfmp/_dataset_check.py)."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfmp
from tfmp._src.numerics.dataset import DatasetIssue

FLOAT16_MAX = 65504.0  # IEEE 754 binary16
FLOAT16_TINY = 2.0**-24  # its smallest subnormal, about 5.96e-8


def _clean(rows=64, features=4):
    return np.linspace(0.5, 1.5, rows * features, dtype="float32").reshape(rows, features)


def test_nan_planted_in_one_batch_is_reported_with_batch_and_feature():
    x, y = _clean(), np.zeros((64, 1), "float32")
    x[5 * 8 + 2, 3] = np.nan  # batch 5 of 8 rows, feature 3
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    report = tfmp.check_dataset(dataset, policy="mixed_float16")
    assert report.batches_checked == 8
    assert report.issues == [DatasetIssue(batch=5, component="x", feature=3, problem="nan", count=1)]
    assert not report.ok
    assert "batch 5, x feature 3: 1 value(s) NaN" in str(report)


def test_nan_planted_in_one_batch_is_named_by_check_dataset_and_by_fit():
    """The same dirty batch: the preflight finds it, and the hooks name the first layer."""
    x, y = _clean(), np.zeros((64, 2), "float32")
    x[3 * 8, 1] = np.nan
    report = tfmp.check_dataset((x, y), batch_size=8)
    assert [(i.batch, i.feature, i.problem) for i in report.issues] == [(3, 1, "nan")]
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="first"), keras.layers.Dense(2)], name="m")
    model.compile("sgd", "mse")
    tfmp.check_numerics(model)
    with pytest.raises(tfmp.NonFiniteError) as info:
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert (info.value.layer, info.value.step, info.value.kind) == ("first", 3, "nan")


def test_float16_range_overflow_and_underflow_and_inf():
    x = _clean(rows=16)
    x[0, 0] = 70000.0  # above 65504: becomes inf in float16
    x[1, 0] = -FLOAT16_MAX  # exactly representable: fine
    x[9, 2] = 1e-9  # nonzero below 2**-24: becomes 0
    x[10, 2] = FLOAT16_TINY  # the smallest subnormal itself: fine
    x[12, 1] = -np.inf
    report = tfmp.check_dataset(x, policy="mixed_float16", batch_size=8)
    assert report.compute_dtype == "float16"
    assert (report.max_value, report.smallest_subnormal) == (FLOAT16_MAX, FLOAT16_TINY)
    assert [(i.batch, i.feature, i.problem, i.count) for i in report.issues] == [
        (0, 0, "overflow", 1),
        (1, 1, "inf", 1),
        (1, 2, "underflow", 1),
    ]


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_values_float16_cannot_hold_are_fine_for_wider_dtypes(policy):
    x = _clean(rows=8)
    x[0, 0], x[1, 1] = 70000.0, 1e-9
    report = tfmp.check_dataset(x, policy=policy)
    assert report.ok and report.batches_checked == 1
    assert "0 issue(s) in 1 batch(es)" in str(report)


def test_policy_defaults_to_the_global_policy():
    keras.config.set_dtype_policy("mixed_float16")
    assert tfmp.check_dataset(_clean()).compute_dtype == "float16"
    assert tfmp.check_dataset(_clean(), policy=keras.DTypePolicy("mixed_bfloat16")).compute_dtype == "bfloat16"


def test_labels_and_dict_inputs_are_named_and_only_inputs_are_range_checked():
    x = {"age": _clean(rows=8, features=1)[:, 0], "pixels": _clean(rows=8, features=3)}
    x["pixels"][4, 2] = 1e6
    y = np.full((8,), 1e6, "float32")  # labels reach the loss in float32
    y[7] = np.nan
    report = tfmp.check_dataset([(x, y)], policy="mixed_float16")
    assert [(i.component, i.feature, i.problem) for i in report.issues] == [
        ("x/pixels", 2, "overflow"),
        ("y", None, "nan"),
    ]


def test_max_batches_limits_the_scan_and_is_required_for_infinite_datasets():
    x = _clean()
    x[-1, 0] = np.nan  # in the last batch only
    dataset = tf.data.Dataset.from_tensor_slices(x).batch(8)
    report = tfmp.check_dataset(dataset, max_batches=2)
    assert report.ok and report.batches_checked == 2
    with pytest.raises(ValueError, match="Invalid `max_batches` argument"):
        tfmp.check_dataset(dataset.repeat())
    assert tfmp.check_dataset(dataset.repeat(), max_batches=9).issues[0].batch == 7


def test_int_components_are_skipped():
    tokens = np.full((8, 5), 70000, "int64")
    with pytest.warns(UserWarning, match="no floating-point values in 1 batch"):
        report = tfmp.check_dataset((tokens, np.arange(8)), policy="mixed_float16")
    assert report.ok and report.values_checked == 0
    x = _clean(rows=8, features=3)
    report = tfmp.check_dataset((x, tokens), policy="mixed_float16")  # the float inputs are scanned
    assert report.ok and report.values_checked == 24


def test_a_data_set_of_strings_says_nothing_was_checked():
    text = tf.data.Dataset.from_tensor_slices((["a cat", "a dog", "nan"], [0, 1, 0])).batch(2)
    with pytest.warns(UserWarning, match=r"no floating-point values in 2 batch\(es\): nothing was checked"):
        report = tfmp.check_dataset(text)
    assert report.values_checked == 0 and report.batches_checked == 2
    assert str(report) == ("check_dataset: nothing checked in 2 batch(es): no floating-point values "
                           "(only strings or integers).")


def test_arrays_of_different_lengths_are_refused_naming_each():
    x, y = _clean(rows=64, features=3), np.zeros((5, 1), "float32")
    with pytest.raises(ValueError, match=r"(?s)Invalid `dataset` argument\. Expected arrays with the same number "
                       r"of samples .* Their lengths differ \(x: 64, y: 5\)"):
        tfmp.check_dataset((x, y))
    with pytest.raises(ValueError, match=r"\(x: 64, y: 64, sample_weight: 3\)"):
        tfmp.check_dataset((x, x, np.ones(3)))
    with pytest.raises(ValueError, match=r"\(x/a: 64, x/b: 5\)"):
        tfmp.check_dataset({"a": x, "b": y})


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"policy": "fp16"}, "Received: policy='fp16'"),
        ({"max_batches": 0}, "integer >= 1"),
        ({"batch_size": True}, "Received: batch_size=True"),
    ],
)
def test_invalid_arguments_use_the_error_template(kwargs, text):
    with pytest.raises(ValueError, match="Invalid `") as info:
        tfmp.check_dataset(_clean(), **kwargs)
    assert text in str(info.value)
    with pytest.raises(ValueError, match="Invalid `dataset` argument"):
        tfmp.check_dataset(42)


def test_the_scan_works_in_chunks_with_the_same_counts(monkeypatch):
    """A large batch needs no more scan memory than `_SCAN_CHUNK` values (issue 25)."""
    from tfmp._src.numerics import dataset as _dataset

    x = _clean(rows=64, features=4)
    x[3, 1], x[40, 1], x[41, 2], x[63, 0] = np.nan, np.inf, 1e6, 1e-9
    expected = tfmp.check_dataset(x, policy="mixed_float16", batch_size=64).issues
    # One batch of 64 rows; float16's range is 2**-24 (5.96e-8) to 65504.
    assert {(i.batch, i.component, i.feature, i.problem, i.count) for i in expected} == {
        (0, "x", 1, "nan", 1), (0, "x", 1, "inf", 1), (0, "x", 2, "overflow", 1),
        (0, "x", 0, "underflow", 1)}
    seen = []
    scan_rows = _dataset._scan_rows
    monkeypatch.setattr(_dataset, "_SCAN_CHUNK", 10)  # 2 rows of 4 features at a time
    monkeypatch.setattr(_dataset, "_scan_rows", lambda values, limits: seen.append(values.shape) or scan_rows(values, limits))
    assert tfmp.check_dataset(x, policy="mixed_float16", batch_size=64).issues == expected
    assert set(seen) == {(2, 4)} and len(seen) == 32


def test_x_with_no_targets_is_scanned_as_fit_takes_it():
    x = np.ones((10, 3), "float32")
    x[6, 2] = np.nan
    report = tfmp.check_dataset((x, None), batch_size=4)
    assert report.issues == [DatasetIssue(batch=1, component="x", feature=2, problem="nan", count=1)]


def test_a_refused_large_array_is_shown_by_shape_and_dtype():
    x, y = np.zeros((60000, 784), "float32"), np.zeros((5, 1), "float32")
    with pytest.raises(ValueError) as info:
        tfmp.check_dataset((x, y))
    message = str(info.value)
    assert "Received: dataset=(array(shape=(60000, 784), dtype=float32), array([[0.]," in message
    assert len(message) < 700  # NumPy's own summary of x alone is 613 characters
