"""Tests for tfmp.compare on scikit-learn's digits (1,797 real 8x8 images)."""

import dataclasses
import functools
import json
import math
import pathlib
import statistics

import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import tfmp
from tfmp._src.advisors import compare as _compare
from tfmp._src.advisors.compare_report import CompareReport, RunResult
from tfmp._src.policy.policy import resolve_policy

# One worker runs this module (conftest.ONE_WORKER_MODULES), so its module fixtures run once.

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


def _cpuinfo():
    """(model name, flags) of this machine's CPU from /proc/cpuinfo, or None (not Linux x86)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            fields = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines()
                          if ":" in line)
    except OSError:
        return None
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    if "model name" not in fields:
        return None
    return fields["model name"], set(fields.get("flags", "").split())


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
    # The device the runs were timed on. Without a GPU: this CPU, by its model name.
    cpu = _cpuinfo()
    if tf.config.list_physical_devices("GPU") or cpu is None:
        assert report.settings["device"].startswith(("CPU '", "GPU '"))
    else:
        name, flags = cpu
        assert report.settings["device"].startswith(f"CPU '{name}' (")
        if not flags & {"avx512_bf16", "amx_bf16"}:
            assert report.settings["device"] == f"CPU '{name}' (no bfloat16 flags)"
    assert report.runs[1].policy == "mixed_bfloat16"
    assert report.runs[0].steps_timed == 3


def test_policy_is_restored_when_a_run_fails(digits):
    keras.config.set_dtype_policy("mixed_bfloat16")

    def not_compiled():
        return keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])

    with pytest.raises(ValueError, match="Expected a callable returning a compiled"):
        tfmp.compare(not_compiled, digits[0], policies=POLICIES)
    with pytest.raises(ValueError, match=r"Received: build_model=<Sequential.*not make_model\(\)"):
        tfmp.compare(not_compiled(), digits[0], policies=POLICIES)
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


@pytest.mark.parametrize(
    "flags, policies, resolved",
    [
        ({"avx2"}, ("float32", "auto"), r"'float32' -> 'float32', 'auto' -> 'float32'"),
        ({"avx512_bf16"}, ("float32", "mixed_bfloat16", "auto"),
         r"'mixed_bfloat16' -> 'mixed_bfloat16', 'auto' -> 'mixed_bfloat16'"),
    ],
    ids=["cpu-without-bf16", "cpu-with-bf16"],
)
def test_policies_resolving_to_the_same_one_are_refused(digits, monkeypatch, flags, policies, resolved):
    facts = tfmp.DeviceFacts(cpu_name="test CPU", cpu_flags=frozenset(flags))
    monkeypatch.setattr(_compare, "resolve_policy", functools.partial(resolve_policy, device_facts=facts))
    with pytest.raises(ValueError, match=resolved + r", so the runs would be the same"):
        tfmp.compare(build_digits_model, digits[0], policies=policies)


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


# --- Several seeds: intervals, noise floor, per-example statistics, alternated timing.

SEEDS = 3


@pytest.fixture(scope="module")
def seeded(digits):
    train, val = digits
    return tfmp.compare(build_digits_model, train, val, policies=POLICIES, epochs=2,
                        seed=10, seeds=SEEDS, timing_rounds=3)


def test_each_seed_runs_every_policy_from_the_same_weights(seeded):
    assert seeded.seeds == [10, 11, 12] and seeded.settings["seeds"] == [10, 11, 12]
    assert [(r.seed, r.policy) for r in seeded.runs] == [
        (s, p) for s in (10, 11, 12) for p in POLICIES]
    checksums = [r.initial_weights_checksum for r in seeded.runs]
    assert checksums[0] == checksums[1] and checksums[2] == checksums[3]
    assert checksums[0] != checksums[2]  # another seed, other initial weights


def test_statistics_are_paired_by_seed(seeded):
    f32 = [r for r in seeded.runs if r.policy == "float32"]
    bf16 = [r for r in seeded.runs if r.policy == "mixed_bfloat16"]
    diffs = [100 * (b.final["val_accuracy"] - a.final["val_accuracy"]) for a, b in zip(f32, bf16)]
    summary = seeded.statistics()["mixed_bfloat16"]["val_accuracy"]
    assert summary.per_seed == pytest.approx(diffs)
    assert summary.mean == pytest.approx(np.mean(diffs))
    # 95% t-interval over 3 seeds. Student's t with 2 degrees of freedom has a
    # closed-form quantile, (2p - 1) * sqrt(2 / (4p(1 - p))): 4.3027 at p = 0.975.
    t_975 = 0.95 * math.sqrt(2 / (4 * 0.975 * 0.025))
    assert t_975 == pytest.approx(4.3027, abs=1e-4)  # as t tables give it
    half = t_975 * statistics.stdev(diffs) / math.sqrt(SEEDS)
    assert summary.ci_low == pytest.approx(statistics.mean(diffs) - half)
    assert summary.ci_high == pytest.approx(statistics.mean(diffs) + half)
    assert summary.noise_floor == pytest.approx(
        statistics.stdev([100 * r.final["val_accuracy"] for r in f32]))
    assert seeded.differences()["mixed_bfloat16"]["val_accuracy"] == summary.mean


def test_predictions_reproduce_val_accuracy_and_agreement(seeded, digits):
    labels = digits[1][1]
    assert seeded.val_labels == tuple(int(i) for i in labels)
    for run in seeded.runs:
        assert len(run.predictions) == len(labels)
        assert np.mean(np.asarray(run.predictions) == labels) == pytest.approx(
            run.final["val_accuracy"], abs=1e-6)
    agreement = seeded.agreement()["mixed_bfloat16"]
    f32 = [r for r in seeded.runs if r.policy == "float32"]
    bf16 = [r for r in seeded.runs if r.policy == "mixed_bfloat16"]
    # Counted example by example in plain Python.
    assert agreement["agreement"] == pytest.approx([
        sum(p == q for p, q in zip(a.predictions, b.predictions)) / len(labels)
        for a, b in zip(f32, bf16)])
    for table, a, b in zip(agreement["mcnemar"], f32, bf16):
        right = [(p == t, q == t) for p, q, t in zip(a.predictions, b.predictions, labels)]
        only_a = sum(1 for x, y in right if x and not y)
        only_b = sum(1 for x, y in right if y and not x)
        assert (table["only_reference"], table["only_other"]) == (only_a, only_b)
        # Exact two-sided McNemar: twice the smaller binomial(n, 1/2) tail, at most 1.
        n = only_a + only_b
        tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
        assert table["p_value"] == pytest.approx(min(1.0, 2 * tail))


def test_speed_is_the_median_of_alternated_paired_ratios(seeded):
    speed = seeded.speed
    assert list(speed) == ["float32", "mixed_bfloat16"]
    assert speed["float32"]["ratios"] == [1.0, 1.0, 1.0]
    bf16 = speed["mixed_bfloat16"]
    assert len(bf16["seconds"]) == 3 and all(s > 0 for s in bf16["seconds"])
    assert bf16["ratios"] == pytest.approx(
        [a / b for a, b in zip(speed["float32"]["seconds"], bf16["seconds"])])
    assert bf16["ratio"] == pytest.approx(float(np.median(bf16["ratios"])))


def test_seeded_verdict_matches_its_interval_and_rejudges(seeded):
    verdict = seeded.verdict()
    summary = seeded.statistics()[verdict.policy][verdict.metric]
    assert (verdict.ci_low, verdict.ci_high, verdict.n_seeds) == (
        summary.ci_low, summary.ci_high, SEEDS)
    # The rule against the default tolerance of 0.5 pp: inside +-0.5 passes,
    # entirely outside fails, across a bound is inconclusive.
    low, high = summary.ci_low, summary.ci_high
    expected = ("pass" if -0.5 <= low and high <= 0.5
                else "fail" if low > 0.5 or high < -0.5 else "inconclusive")
    assert verdict.status == expected
    wide = max(abs(s.ci_low) + abs(s.ci_high) for d in seeded.statistics().values()
               for m, s in d.items() if "acc" in m)
    assert seeded.verdict(tolerance=wide).status == "pass"
    data = json.loads(json.dumps(seeded.to_dict()))
    stats_ = data["statistics"][verdict.policy][verdict.metric]  # the metric that decided
    assert set(stats_) >= {"mean", "ci_low", "ci_high", "noise_floor"}
    assert stats_["mean"] == summary.mean and stats_["noise_floor"] == summary.noise_floor
    assert data["verdict"]["status"] == verdict.status
    assert "predictions" not in data["runs"][0]
    table = str(seeded)
    assert "95% interval" in table and "McNemar exact p" in table and str(verdict) in table


def _run(policy, seed, val_accuracy):
    return RunResult(requested=policy, policy=policy,
                     history={"val_accuracy": [val_accuracy]}, step_time_s=0.01,
                     samples_per_second=3200.0, steps_timed=10, wall_time_s=1.0,
                     initial_weights_checksum=float(seed), seed=seed)


def _planted(reference, other):
    runs = []
    for seed, (a, b) in enumerate(zip(reference, other)):
        runs += [_run("float32", seed, a), _run("mixed_bfloat16", seed, b)]
    return CompareReport(runs=tuple(runs), tolerance=0.5,
                         settings={"epochs": 1, "samples_per_step": 32})


def test_planted_five_point_drop_over_five_seeds_fails():
    reference = [0.90, 0.91, 0.89, 0.92, 0.90]
    report = _planted(reference, [r - d for r, d in zip(reference, (0.05, 0.045, 0.055, 0.052, 0.048))])
    verdict = report.verdict()
    assert verdict.status == "fail" and not verdict
    assert verdict.difference == pytest.approx(-5.0)
    assert verdict.ci_high < -0.5 and verdict.n_seeds == 5
    assert verdict.noise_floor == pytest.approx(np.std([100 * r for r in reference], ddof=1))
    # The guide in this checkout, as tfmp is imported from it (package data in a wheel).
    guide = pathlib.Path(__file__).resolve().parents[1] / "tfmp" / "docs" / "troubleshooting.md"
    assert "FAIL" in str(verdict)
    assert str(verdict).endswith(f". See {guide}#accuracy-drop-versus-float32")


def test_planted_noise_without_a_difference_is_inconclusive_with_a_seed_count():
    reference = [0.90, 0.92, 0.88, 0.91, 0.89]
    report = _planted(reference, [r + d for r, d in zip(reference, (-0.02, 0.02, -0.01, 0.01, 0.0))])
    verdict = report.verdict()
    assert verdict.status == "inconclusive" and verdict.difference == pytest.approx(0.0, abs=1e-9)
    assert verdict.seeds_needed == 41  # as in test_compare_stats: std sqrt(2.5) pp
    assert "about 41 seeds would decide it" in str(verdict)


def _timed(reference_s, other_s):
    ratios = [a / b for a, b in zip(reference_s, other_s)]
    return {"float32": {"step_time_s": statistics.median(reference_s), "ratio": 1.0,
                        "seconds": reference_s, "ratios": [1.0] * len(reference_s)},
            "mixed_bfloat16": {"step_time_s": statistics.median(other_s),
                               "ratio": statistics.median(ratios), "seconds": other_s,
                               "ratios": ratios}}


def test_the_speed_column_says_its_figure_and_a_disagreement_with_the_ms_step_column():
    """Injected timings as a busy machine gives them: three rounds whose paired ratios
    (0.91x, 1.33x, 0.97x: median 0.97x) and ms/step medians (20 vs 15 ms: 1.33x)
    tell opposite speeds; the table says which figure its column is, and says so."""
    planted = _planted([0.9, 0.9, 0.9], [0.9, 0.9, 0.9])
    busy = dataclasses.replace(planted, speed=_timed([0.010, 0.020, 0.030], [0.011, 0.015, 0.031]))
    table = str(busy)
    assert "Speed vs fp32: median over 3 alternated round(s) of float32's s/step / this policy's" in table
    row = next(line for line in table.splitlines() if line.startswith("mixed_bfloat16 "))
    assert row.split()[-3:] == ["15.00", f"{32 / 0.015:.0f}", "0.97x*"]
    assert "* mixed_bfloat16: paired ratio 0.97x, ms/step medians 1.33x, rounds 0.91x to 1.33x:" in table
    # Both faster, but 1.05x paired against 1.30x by the medians: marked too.
    apart = dataclasses.replace(planted, speed=_timed([0.010, 0.020, 0.030], [0.0095, 0.0154, 0.0286]))
    assert "paired ratio 1.05x, ms/step medians 1.30x" in str(apart)
    # Rounds that agree (1.10x each round): no mark, no footnote.
    idle = dataclasses.replace(planted, speed=_timed([0.011, 0.022, 0.033], [0.010, 0.020, 0.030]))
    row = next(line for line in str(idle).splitlines() if line.startswith("mixed_bfloat16 "))
    assert row.endswith(" 1.10x") and "* " not in str(idle)
    # Untimed: the column is the ratio of the two runs' step times, and says so.
    assert "Speed vs fp32: float32's median ms/step / this policy's (separate runs)." in str(planted)


def test_identical_runs_pass_with_a_zero_width_interval():
    reference = [0.90, 0.92, 0.88]
    verdict = _planted(reference, reference).verdict(tolerance=0.0)
    assert verdict.status == "pass" and verdict.ci_low == verdict.ci_high == 0.0


def test_seeds_bound_accepts_the_limit_and_refuses_one_more():
    """1000 seeds is the limit (each trains every policy); checked before any training."""
    from tfmp._src.advisors.compare import MAX_SEEDS, _seed_list

    assert MAX_SEEDS == 1000
    assert _seed_list(3, 1000) == tuple(range(3, 1003))
    assert len(_seed_list(0, list(range(1000)))) == 1000
    x, y = np.zeros((8, 4), "float32"), np.zeros((8,), "int32")
    for seeds in (1001, list(range(1001)), 10**12):
        with pytest.raises(ValueError) as info:
            tfmp.compare(build_digits_model, (x, y), policies=POLICIES, seeds=seeds)
        assert str(info.value).startswith("Invalid `seeds` argument. Expected ")
        assert "(at most 1000: each seed trains every policy once)" in str(info.value)


@pytest.mark.parametrize("seeds", [0, (1, 1), "3", (1.5,)])
def test_bad_seeds_use_the_error_template(digits, seeds):
    with pytest.raises(ValueError, match="Invalid `seeds` argument"):
        tfmp.compare(build_digits_model, digits[0], policies=POLICIES, seeds=seeds)
