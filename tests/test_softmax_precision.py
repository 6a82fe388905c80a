"""benchmarks/softmax_precision.py: runs (quick), its cases are all there and its errors are
measured against a float64 gradient; no timing asserts."""

import json
import pathlib
import sys

import numpy as np
import pytest
import tensorflow as tf

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import softmax_precision  # noqa: E402

LABELS = ["16-bit", "forced", "16-bit forward, float32 backward"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("softmax") / "out.json"
    softmax_precision.main(["--quick", "--json", str(path)])
    return json.loads(path.read_text())


def test_every_spread_and_row_length_is_measured_for_every_variant(quick):
    cases = quick["precision"]["cases"]
    assert [(c["spread"], c["row_length"]) for c in cases] == [
        (s, n) for n in (128, 2048) for s in (1.0, 5.0, 30.0)]
    for case in cases:
        assert list(case["errors"]) == LABELS
        assert case["values"] == 16 * case["row_length"]
        assert 0 <= case["forward_differing"] <= case["values"]
        assert all(0 < e["rows"] <= 16 for e in case["errors"].values())


def test_forced_gradient_is_rounded_once_and_the_16_bit_one_is_not(quick):
    for case in quick["precision"]["cases"]:
        # float32 math, one rounding to bfloat16 (2**-8 relative per value) at the end
        assert case["errors"]["forced"]["p99"] < 2**-7, case
    peaked = [c for c in quick["precision"]["cases"] if c["spread"] == 30.0]
    assert all(c["errors"]["16-bit"]["p99"] > 0.1 for c in peaked), peaked


def test_cost_pairs_the_variants_of_each_repeat(quick):
    cost = quick["cost"]
    assert cost["shape"] == [2, 2, 8, 8]
    assert set(cost["ms"]) == {"16-bit", "forced", "forced + XLA"}
    assert all(len(times) == 2 and min(times) > 0 for times in cost["ms"].values())
    forced = np.array(cost["ms"]["16-bit"]) / np.array(cost["ms"]["forced"])  # speed ratio
    assert cost["ratios"]["forced / 16-bit"]["paired"] == pytest.approx(float(np.median(forced)))


def test_the_float64_reference_is_the_analytic_gradient():
    scores = tf.constant([[0.0, np.log(3.0)]], tf.float64)  # softmax = (1/4, 3/4)
    upstream = tf.constant([[1.0, 0.0]], tf.float64)
    got = softmax_precision._gradient(tf.nn.softmax, scores, upstream)
    # d y0 / d s = y0 * (e0 - y) = (1/4 * 3/4, -1/4 * 3/4)
    np.testing.assert_allclose(got, [[3 / 16, -3 / 16]], rtol=1e-12)


def test_report_names_every_variant(quick):
    text = softmax_precision.markdown(quick)
    for label in LABELS + ["forced + XLA"]:
        assert label in text
