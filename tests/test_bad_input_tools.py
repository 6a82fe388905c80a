"""Bad input to tfmp's tools: export, to_float32, compare, doctor, the estimates, check_dataset, facts.

Each public call is given wrong values drawn by hypothesis and must refuse them
with the template error naming the argument (`assert_refused`), before any
training and before anything is written; where a wrong-looking value is handled,
the test checks the right result against a value written down here.
"""

import io
import math
import os

import keras
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tfmp
from _bad_input import (
    BAD_INPUT_SETTINGS, NEGATIVE_OR_ZERO_INTS, NON_BOOLS, NON_FINITE, NON_NUMBERS, NON_STRINGS, NOT_MODELS,
    assert_refused, covers, covered_names,
)
from tfmp._src.advisors import compare_stats


@pytest.fixture(scope="module")
def model():
    """Dense(4) on 3 features, built and called once (as a trained model would be)."""
    built = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    built(np.zeros((1, 3), "float32"))
    return built


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """The current folder is an empty tmp_path, so anything written there shows."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def build_never_called():
    raise AssertionError("compare trained: a bad argument was not refused before training")


XY = (np.zeros((8, 3), "float32"), np.zeros((8, 4), "float32"))
#: Two policies that differ on every machine (the default ("float32", "auto") does not
#: where "auto" picks float32); the mixed one's slowness here is warned of, and ignored.
POLICIES = ("float32", "mixed_bfloat16")
WRONG_SAMPLES = st.one_of(
    st.builds(np.zeros, st.sampled_from([(2, 5), (2,), (2, 3, 1), (0, 3)])),  # shape, rank, no rows
    st.just(np.full((2, 3), np.nan)), st.just(np.array([["a", "b", "c"]])),
    st.just([np.zeros((2, 3)), np.zeros((2, 3))]), st.just([[1.0, 2.0], [3.0]]),
)


# -- export and to_float32: refused before anything is written ---------------------------------


@covers("export", "to_float32")
@given(bad=NOT_MODELS)
@BAD_INPUT_SETTINGS
def test_export_and_to_float32_refuse_what_is_not_a_built_model(bad, in_tmp):
    assert_refused(lambda: tfmp.to_float32(bad), "model")
    assert_refused(lambda: tfmp.export(bad, "out"), "model")
    assert_refused(lambda: tfmp.to_float32(keras.Sequential([keras.layers.Dense(4)])), "model")
    assert os.listdir(in_tmp) == []


@covers("export")
@given(bad=st.one_of(NON_STRINGS.filter(lambda v: not isinstance(v, str)), st.sampled_from(["", "  "])))
@BAD_INPUT_SETTINGS
def test_export_refuses_a_path_that_is_no_path(model, in_tmp, bad):
    assert_refused(lambda: tfmp.export(model, bad), "path")
    assert_refused(lambda: tfmp.export(model, bad, format="tflite"), "path")
    assert os.listdir(in_tmp) == []


@covers("export")
def test_export_refuses_a_path_under_a_file_or_a_folder_of_other_files(model, in_tmp):
    (in_tmp / "file").write_text("x")
    (in_tmp / "notes").mkdir()
    (in_tmp / "notes" / "todo.txt").write_text("mine")
    assert_refused(lambda: tfmp.export(model, in_tmp / "file" / "model"), "path")
    assert_refused(lambda: tfmp.export(model, "file"), "path")
    assert_refused(lambda: tfmp.export(model, "notes"), "path")
    assert_refused(lambda: tfmp.export(model, "notes", format="tflite"), "path")
    assert sorted(os.listdir(in_tmp)) == ["file", "notes"]
    assert os.listdir(in_tmp / "notes") == ["todo.txt"]


@covers("export")
@given(format=st.one_of(NON_STRINGS, st.sampled_from(["onnx", "tflight", "SavedModel"])),
       weights=st.one_of(NON_STRINGS, st.sampled_from(["fp16", "int8"])))
@BAD_INPUT_SETTINGS
def test_export_refuses_format_and_weights(model, in_tmp, format, weights):
    assert_refused(lambda: tfmp.export(model, "out", format=format), "format")
    assert_refused(lambda: tfmp.export(model, "out.tflite", format="tflite", weights=weights), "weights")
    assert_refused(lambda: tfmp.export(model, "out", weights="float16"), "weights")
    assert os.listdir(in_tmp) == []


@covers("export")
@given(sample=WRONG_SAMPLES)
@BAD_INPUT_SETTINGS
def test_export_refuses_a_sample_that_does_not_fit_before_writing(model, in_tmp, sample):
    assert_refused(lambda: tfmp.export(model, "out", sample=sample), "sample")
    assert os.listdir(in_tmp) == []


@covers("export", "ExportReport")
def test_export_with_a_fitting_sample_writes_and_reports(model, in_tmp):
    report = tfmp.export(model, "out", sample=np.ones((2, 3), "int64"))  # ints convert to float32 exactly
    assert (report.path, report.format, report.sample_rows) == ("out", "tf_saved_model", 2)
    assert report.output_shapes == ((2, 4),) and report.max_abs_diff == 0.0
    assert os.listdir(in_tmp) == ["out"]
    # A second export to the same folder replaces the first, as a TFLite file is replaced.
    (in_tmp / "out" / "stale.txt").write_text("from the first export")
    again = tfmp.export(model, "out", sample=np.ones((2, 3), "int64"))
    assert again.max_abs_diff == 0.0 and os.listdir(in_tmp) == ["out"]
    assert "saved_model.pb" in os.listdir(in_tmp / "out")
    assert "stale.txt" not in os.listdir(in_tmp / "out")


@covers("ExportReport")
@given(field=st.sampled_from(["format", "size_bytes", "output_shapes", "max_abs_diff"]), bad=NON_NUMBERS)
@BAD_INPUT_SETTINGS
def test_export_report_refuses_wrong_fields(field, bad):
    good = dict(path="m", format="tflite", weights="float32", max_abs_diff=0.0, max_rel_diff=0.0,
                output_shapes=((2, 4),), output_dtypes=("float32",), size_bytes=10, sample_rows=2)
    assert_refused(lambda: tfmp.ExportReport(**{**good, field: bad}), field)
    assert str(tfmp.ExportReport(**good)).startswith("tfmp export: tflite (float32 weights) at m, 0.0 KiB")


# -- compare: refused before any training -------------------------------------------------------


@covers("compare")
@given(bad=st.one_of(NON_NUMBERS, NEGATIVE_OR_ZERO_INTS))
@BAD_INPUT_SETTINGS
def test_compare_refuses_bad_counts_and_seed_before_training(bad):
    for name in ("epochs", "batch_size", "timing_rounds"):
        assert_refused(lambda: tfmp.compare(build_never_called, XY, **{name: bad}), name)
    if not isinstance(bad, list) or not bad or len(set(bad)) < len(bad):  # distinct ints are seeds
        assert_refused(lambda: tfmp.compare(build_never_called, XY, seeds=bad), "seeds")
    if not isinstance(bad, int) or isinstance(bad, bool):
        assert_refused(lambda: tfmp.compare(build_never_called, XY, seed=bad), "seed")


@covers("compare")
@given(bad=st.one_of(NON_NUMBERS, NON_FINITE, st.floats(max_value=-1e-9, allow_nan=False)))
@BAD_INPUT_SETTINGS
def test_compare_refuses_bad_tolerance_before_training(bad):
    assert_refused(lambda: tfmp.compare(build_never_called, XY, tolerance=bad), "tolerance")


@covers("compare")
@given(bad=st.one_of(
    st.none(), st.integers(), st.just("float32"), st.just(["float32"]), st.just(["float32", "fp16"]),
    st.just(["float32", ["mixed_bfloat16"]]), st.just(("float32", None)), st.just(("mixed_bfloat16", "bfloat16")),
))
@BAD_INPUT_SETTINGS
@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")
def test_compare_refuses_bad_policies_before_training(bad):
    assert_refused(lambda: tfmp.compare(build_never_called, XY, policies=bad), "policies")


@covers("compare")
@given(bad=st.one_of(
    NOT_MODELS, st.just((np.zeros((8, 3)), np.zeros((7, 4)))), st.just((np.zeros((0, 3)), np.zeros((0, 4)))),
    st.just(("x", "y")), st.just((np.zeros((8, 3)),)), st.just((5, 6)),
))
@BAD_INPUT_SETTINGS
@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")
def test_compare_refuses_bad_data_before_training(bad):
    assert_refused(lambda: tfmp.compare(build_never_called, bad, policies=POLICIES), "train_data")
    if bad is not None:  # no validation data
        assert_refused(lambda: tfmp.compare(build_never_called, XY, bad, policies=POLICIES), "val_data")


@covers("compare")
@given(bad=NOT_MODELS)
@BAD_INPUT_SETTINGS
def test_compare_refuses_a_build_model_that_is_not_callable(bad, model):
    assert_refused(lambda: tfmp.compare(bad, XY), "build_model")
    assert_refused(lambda: tfmp.compare(model, XY), "build_model")


@covers("compare")
@pytest.mark.filterwarnings("ignore::tfmp.PerformanceWarning")  # 16-bit policies emulated on some CPUs
def test_compare_refuses_an_empty_dataset_before_training():
    import tensorflow as tf

    empty = tf.data.Dataset.from_tensor_slices(XY).batch(4).take(0)
    assert_refused(lambda: tfmp.compare(build_never_called, empty, policies=POLICIES), "train_data")


# -- the compare report types -----------------------------------------------------------------


def run_result(policy, accuracy):
    from tfmp._src.advisors.compare_report import RunResult

    return RunResult(policy, policy, {"accuracy": [accuracy]}, 1.0, 32.0, 3, 4.0, 10.0)


@covers("CompareReport", "MetricSummary", "Verdict")
@given(bad=NON_NUMBERS)
@BAD_INPUT_SETTINGS
def test_compare_report_types_refuse_wrong_fields(bad):
    runs = (run_result("float32", 0.5), run_result("mixed_bfloat16", 0.25))
    assert_refused(lambda: tfmp.CompareReport(runs=bad, tolerance=0.5, settings={}), "runs")
    assert_refused(lambda: tfmp.CompareReport(runs=runs[1:], tolerance=0.5, settings={}), "runs")
    assert_refused(lambda: tfmp.CompareReport(runs=runs, tolerance=bad, settings={}), "tolerance")
    interval = compare_stats.paired_interval([1.0], 0.95)
    assert_refused(lambda: tfmp.MetricSummary(bad, 1.0, 1.0, None, [1.0], "pp", interval), "mean")
    assert_refused(lambda: tfmp.MetricSummary(1.0, 1.0, 1.0, None, [1.0], "pp", bad), "interval")
    assert_refused(lambda: tfmp.Verdict("pass", True, "acc", "p", bad, 0.0, 0.0, 0.5, "pp", 1), "difference")
    assert_refused(lambda: tfmp.Verdict("maybe", True, "acc", "p", 0.0, 0.0, 0.0, 0.5, "pp", 1), "status")
    # A report built by hand judges as one built by compare: 0.25 - 0.5 = -25 pp.
    verdict = tfmp.CompareReport(runs=runs, tolerance=0.5, settings={}).verdict()
    assert (verdict.status, verdict.difference, verdict.unit) == ("fail", -25.0, "pp")


# -- doctor and the device facts --------------------------------------------------------------

T4 = tfmp.DeviceFacts(gpus=(tfmp.GpuFacts("Tesla T4", (7, 5)),))


@covers("doctor", "DoctorReport")
@given(bad=st.one_of(NOT_MODELS, st.just({"gpus": ()})))
@BAD_INPUT_SETTINGS
def test_doctor_refuses_bad_facts_probe_flag_and_file(bad):
    if bad is not None:  # None: this machine's facts, a probe measured, no printing
        assert_refused(lambda: tfmp.doctor(bad, file=None), "device_facts")
        assert_refused(lambda: tfmp.doctor(T4, speed_probe=bad, file=None), "speed_probe")
        assert_refused(lambda: tfmp.doctor(T4, file=bad), "file")
    assert_refused(lambda: tfmp.DoctorReport(bad), "data")


@covers("doctor")
@given(bad=NON_BOOLS)
@BAD_INPUT_SETTINGS
def test_doctor_refuses_a_non_bool_as_json(bad):
    assert_refused(lambda: tfmp.doctor(T4, as_json=bad, file=None), "as_json")


@covers("doctor")
def test_doctor_refuses_a_file_name_or_a_closed_file_and_writes_to_a_stream():
    assert_refused(lambda: tfmp.doctor(T4, file="notafile"), "file")
    closed = io.StringIO()
    closed.close()
    assert_refused(lambda: tfmp.doctor(T4, file=closed), "file")
    stream = io.StringIO()
    report = tfmp.doctor(T4, file=stream)
    assert stream.getvalue().startswith("tfmp doctor\n")
    assert report.data["recommendation"]["policy"] == "mixed_float16"  # T4: compute capability 7.5


@covers("DeviceFacts", "GpuFacts")
@given(bad=NON_STRINGS)
@BAD_INPUT_SETTINGS
def test_device_facts_refuse_wrong_fields(bad):
    assert_refused(lambda: tfmp.GpuFacts(bad, (8, 0)), "name")
    if bad is not None:
        assert_refused(lambda: tfmp.GpuFacts("A100", bad), "compute_capability")
    assert_refused(lambda: tfmp.GpuFacts("A100", ("8", "0")), "compute_capability")
    assert_refused(lambda: tfmp.DeviceFacts(gpus="abc"), "gpus")
    assert_refused(lambda: tfmp.DeviceFacts(gpus=[tfmp.GpuFacts("A100", (8, 0))]), "gpus")
    assert_refused(lambda: tfmp.DeviceFacts(cpu_name=bad), "cpu_name")
    assert_refused(lambda: tfmp.DeviceFacts(cpu_flags={"avx2"}), "cpu_flags")
    if not isinstance(bad, bool):
        assert_refused(lambda: tfmp.DeviceFacts(tpu=bad), "tpu")
    assert tfmp.GpuFacts("A100", None).cc_string == "unknown"


@covers("SpeedProbe")
@given(bad=st.one_of(NON_NUMBERS, NON_FINITE, st.floats(max_value=0.0)))
@BAD_INPUT_SETTINGS
def test_speed_probe_refuses_wrong_times_and_sizes(bad):
    assert_refused(lambda: tfmp.SpeedProbe(bad, 1.0, 1.0), "float32_ms")
    assert_refused(lambda: tfmp.SpeedProbe(1.0, 1.0, 1.0, batch=bad), "batch")
    assert_refused(lambda: tfmp.SpeedProbe(1.0, 1.0, 1.0, repeats=(1, 2)), "repeats")


# -- the estimates ------------------------------------------------------------------------------


@covers("estimate_memory", "MemoryEstimate")
@given(bad=NOT_MODELS, size=st.one_of(NON_NUMBERS, NEGATIVE_OR_ZERO_INTS, st.floats()))
@BAD_INPUT_SETTINGS
def test_estimate_memory_refuses_bad_arguments(model, bad, size):
    assert_refused(lambda: tfmp.estimate_memory(bad, 8), "model")
    assert_refused(lambda: tfmp.estimate_memory(model, size), "batch_size")
    assert_refused(lambda: tfmp.estimate_memory(model, 8, policy="mixed_float17"), "policy")
    assert_refused(lambda: tfmp.estimate_memory(model, 8, optimizer="adamw2"), "optimizer")
    if bad is not None and not isinstance(bad, str):  # None: the model's own; some strings name one
        assert_refused(lambda: tfmp.estimate_memory(model, 8, policy=bad), "policy")
        assert_refused(lambda: tfmp.estimate_memory(model, 8, optimizer=bad), "optimizer")
    assert_refused(lambda: tfmp.MemoryEstimate("float32", size, *[0] * 8), "batch_size")


@covers("estimate_memory", "MemoryEstimate")
def test_estimate_memory_of_the_dense_model():
    # Dense(4) on 3 features: 3*4 + 4 = 16 float32 parameters, 64 bytes; 8 rows x 4 outputs in float16.
    dense = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    estimate = tfmp.estimate_memory(dense, 8, policy="mixed_float16")
    assert (estimate.parameter_bytes, estimate.activation_bytes, estimate.float32_activation_bytes) == (64, 64, 128)


@covers("estimate_kv_cache")
@given(size=st.one_of(NON_NUMBERS, NEGATIVE_OR_ZERO_INTS, st.floats()),
       dtype=st.one_of(NON_STRINGS, st.sampled_from(["float17", "string", "mixed_nonsense", "resource"])))
@BAD_INPUT_SETTINGS
def test_estimate_kv_cache_refuses_bad_sizes_and_dtypes(size, dtype):
    for name in ("num_layers", "hidden_size", "seq_len", "batch_size"):
        sizes = dict(num_layers=2, hidden_size=8, seq_len=4, batch_size=1)
        assert_refused(lambda: tfmp.estimate_kv_cache(**{**sizes, name: size}), name)
    assert_refused(lambda: tfmp.estimate_kv_cache(2, 8, 4, 1, dtype=dtype), "dtype")
    # 2 (key and value) x 2 layers x 8 elements x 4 tokens x 1 sequence x 2 bytes.
    assert tfmp.estimate_kv_cache(2, 8, 4, 1, dtype="mixed_bfloat16") == 256


# -- check_dataset ------------------------------------------------------------------------------


@covers("check_dataset", "DatasetReport")
@given(bad=st.one_of(st.none(), st.integers(), st.text(max_size=5), st.binary(max_size=3), st.just([]),
                     st.builds(object), st.lists(st.one_of(st.integers(), st.floats()), min_size=1, max_size=3)))
@BAD_INPUT_SETTINGS
def test_check_dataset_refuses_what_is_no_data(bad):
    assert_refused(lambda: tfmp.check_dataset(bad), "dataset")
    assert_refused(lambda: tfmp.DatasetReport(bad if not isinstance(bad, str) else 5, 1.0, 1.0), "compute_dtype")


@covers("check_dataset")
@given(policy=st.one_of(NON_STRINGS, st.sampled_from(["fp16", "mixed_float32"])),
       count=st.one_of(NON_NUMBERS.filter(lambda v: v is not None), NEGATIVE_OR_ZERO_INTS))
@BAD_INPUT_SETTINGS
def test_check_dataset_refuses_bad_policy_and_counts(policy, count):
    x = np.ones((4, 3), "float32")
    if policy is not None:
        assert_refused(lambda: tfmp.check_dataset(x, policy=policy), "policy")
    assert_refused(lambda: tfmp.check_dataset(x, max_batches=count), "max_batches")
    assert_refused(lambda: tfmp.check_dataset(x, batch_size=count), "batch_size")


@covers("check_dataset", "DatasetReport")
def test_check_dataset_finds_the_planted_values():
    x = np.ones((4, 3), "float32")
    x[3, 1], x[0, 2] = math.inf, 70000.0  # Inf, and above float16's largest finite value 65504
    report = tfmp.check_dataset(x, policy="mixed_float16", batch_size=2)
    assert [(i.batch, i.feature, i.problem) for i in report.issues] == [(0, 2, "overflow"), (1, 1, "inf")]
    assert report.batches_checked == 2


def test_this_file_covers_its_half_of_the_public_names():
    import sys

    mine = {"export", "ExportReport", "to_float32", "compare", "CompareReport", "MetricSummary", "Verdict",
            "doctor", "DoctorReport", "estimate_memory", "estimate_kv_cache", "MemoryEstimate",
            "check_dataset", "DatasetReport", "DeviceFacts", "GpuFacts", "SpeedProbe"}
    assert covered_names([sys.modules[__name__]]) == mine
