"""The roofline of benchmarks/roofline.py on exact numbers, worked out by hand; no timing asserts."""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import report, roofline  # noqa: E402

speed_up = roofline.roofline_speed_up


def test_speed_up_scales_matmuls_by_the_ratio_and_the_rest_by_two():
    # step / (matmul / ratio + other / 2): 10 / (6 / 2 + 4 / 2) = 10 / 5.
    assert speed_up(10.0, 6.0, 4.0, 2.0) == 2.0
    # The same step as shares of 1: the unit does not matter.
    assert speed_up(1.0, 0.6, 0.4, 2.0) == pytest.approx(2.0)
    # What is neither matmul nor other (optimizer, host) keeps its time:
    # 12 / (8 / 4 + 2 / 2 + 2) = 12 / 5.
    assert speed_up(12.0, 8.0, 2.0, 4.0) == 2.4
    # No matmuls: the elementwise limit, 2x, whatever the matmul ratio.
    assert speed_up(8.0, 0.0, 8.0, 4.0) == 2.0
    assert speed_up(8.0, 0.0, 8.0, 100.0) == 2.0
    # All matmul: the ratio itself.
    assert speed_up(4.0, 4.0, 0.0, 2.5) == 2.5
    # Nothing scales: 1x.
    assert speed_up(3.0, 0.0, 0.0, 4.0) == 1.0


def test_a_matmul_ratio_below_one_promises_float32_matmuls():
    # 16-bit matmuls at half float32's speed (a CPU without bfloat16): the
    # matmuls stay at their float32 time (ratio taken as 1), not twice it:
    # 10 / (6 / 1 + 4 / 2) = 10 / 8, not 10 / (6 / 0.5 + 4 / 2) = 10 / 14.
    assert speed_up(10.0, 6.0, 4.0, 0.5) == 1.25
    assert speed_up(10.0, 6.0, 4.0, 1.0) == 1.25
    assert speed_up(4.0, 4.0, 0.0, 0.25) == 1.0  # all matmul: no speed-up, no slow-down


@pytest.mark.parametrize("args, name", [
    ((10.0, 6.0, 4.0, 0.0), "matmul_ratio"),
    ((10.0, 6.0, 4.0, float("nan")), "matmul_ratio"),
    ((0.0, 0.0, 0.0, 2.0), "step_time"),
    ((10.0, -1.0, 4.0, 2.0), "matmul_time"),
    ((10.0, 6.0, float("inf"), 2.0), "other_time"),
    ((10.0, 6.0, 5.0, 2.0), "other_time"),  # 6 + 5 > 10
    ((10.0, True, 4.0, 2.0), "matmul_time"),
])
def test_bad_times_are_refused_in_the_project_template(args, name):
    with pytest.raises(ValueError, match=rf"Invalid `{name}` argument\. Expected .*Received: {name}="):
        speed_up(*args)


def test_split_groups_the_profile_categories():
    shares = {"matmul": 0.5, "normalization": 0.0625, "softmax": 0.0625, "cast": 0.03125,
              "elementwise": 0.09375, "optimizer": 0.125, "other": 0.0, "host": 0.125}
    assert roofline.split(shares) == {"matmul": 0.5, "halved": 0.25, "kept": 0.25}
    with pytest.raises(ValueError, match=r"Invalid `shares` argument.*'optimizer', 'host'"):
        roofline.split({"matmul": 1.0})


def test_fractions_of_the_roofline_form_by_form_and_none_without_a_profile():
    r = {"tfmp_vs_float32": {"value": 1.0, "paired": 1.5, "fastest": 2.0}}
    models = {"mlp": {"ratios": dict(r), "roofline": {"split": {"matmul": 0.5, "halved": 0.25, "kept": 0.25}}},
              "cnn": {"ratios": dict(r), "roofline": None}}
    roofline.add_roofline_fractions(models, {"value": 0.5, "paired": 2.0, "fastest": 4.0})
    # value: ratio 0.5 taken as 1: 1 / (0.5 + 0.125 + 0.25) = 8 / 7; paired: 1 / (0.25 + 0.125 + 0.25)
    # = 1.6; fastest: 1 / (0.125 + 0.125 + 0.25) = 2.
    assert models["mlp"]["roofline"]["speed_up"] == pytest.approx({"value": 8 / 7, "paired": 1.6, "fastest": 2.0})
    assert models["mlp"]["ratios"]["tfmp_vs_float32_of_roofline"] == pytest.approx(
        {"value": 0.875, "paired": 0.9375, "fastest": 1.0})
    assert models["cnn"]["ratios"]["tfmp_vs_float32_of_roofline"] is None
    assert models["cnn"]["roofline"] is None
    # The printed cells: the paired roofline, the paired / fastest fractions; "n/a" unprofiled.
    assert report._roofline_cells(models["mlp"]) == ["1.60x", "94% / 100%"]
    assert report._roofline_cells(models["cnn"]) == ["n/a", "n/a"]
