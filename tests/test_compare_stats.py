"""Tests for tfmp/_src/advisors/compare_stats.py on constructed inputs with known answers."""

import math

import numpy as np
import pytest

from tfmp._src.advisors import compare_stats as cs

T_975_DF2 = 4.302652729749464  # Student t, 97.5% quantile, 2 degrees of freedom (tables: 4.303)


def test_identical_predictions_agree_fully_and_give_a_zero_width_interval():
    predictions = [3, 1, 4, 1, 5, 9, 2, 6]
    assert cs.agreement(predictions, list(predictions)) == 1.0
    interval = cs.paired_interval([0.0, 0.0, 0.0, 0.0, 0.0])
    assert (interval.mean, interval.ci_low, interval.ci_high, interval.std) == (0, 0, 0, 0)
    assert cs.decide(interval, 0.5) == cs.PASS
    table = cs.mcnemar([True, False, True], [True, False, True])
    assert (table.only_reference, table.only_other, table.p_value) == (0, 0, 1.0)


def test_agreement_counts_equal_labels():
    assert cs.agreement([0, 1, 2, 3], [0, 1, 2, 0]) == 0.75


def test_interval_is_student_t_with_known_quantile():
    interval = cs.paired_interval([1.0, 2.0, 3.0])  # mean 2, std 1, n 3
    half = T_975_DF2 / math.sqrt(3)
    assert interval.mean == 2.0 and interval.std == 1.0 and interval.n == 3
    assert interval.ci_low == pytest.approx(2 - half, rel=1e-12)
    assert interval.ci_high == pytest.approx(2 + half, rel=1e-12)
    assert interval.half_width == pytest.approx(half, rel=1e-12)


def test_one_seed_gives_the_difference_itself():
    interval = cs.paired_interval([-0.67])
    assert (interval.ci_low, interval.ci_high, interval.std, interval.n) == (-0.67, -0.67, None, 1)
    assert cs.decide(interval, 0.5) == cs.FAIL and cs.decide(interval, 0.67) == cs.PASS
    assert cs.seeds_needed(interval, 0.5) is None
    assert cs.noise_floor([0.9]) is None


def test_planted_five_point_drop_over_five_seeds_fails():
    interval = cs.paired_interval([-5.0, -4.5, -5.5, -5.2, -4.8])
    assert interval.mean == pytest.approx(-5.0)
    assert interval.ci_high < -0.5
    assert cs.decide(interval, 0.5) == cs.FAIL


def test_zero_difference_with_large_spread_is_inconclusive_and_says_how_many_seeds():
    interval = cs.paired_interval([-2.0, 2.0, -1.0, 1.0, 0.0])  # std sqrt(2.5)
    assert interval.mean == 0.0 and interval.std == pytest.approx(math.sqrt(2.5))
    assert cs.decide(interval, 0.5) == cs.INCONCLUSIVE
    needed = cs.seeds_needed(interval, 0.5)
    # t(n-1) * sqrt(2.5) / sqrt(n) < 0.5 first holds at n = 41 (t(40) = 2.021, t(39) = 2.023).
    assert needed == 41
    from scipy import stats
    assert stats.t.ppf(0.975, needed - 1) * interval.std / math.sqrt(needed) < 0.5
    assert stats.t.ppf(0.975, needed - 2) * interval.std / math.sqrt(needed - 1) >= 0.5


def test_seeds_needed_is_none_when_the_mean_sits_on_the_bound():
    interval = cs.paired_interval([0.4, 0.6])
    assert cs.decide(interval, 0.5) == cs.INCONCLUSIVE
    assert cs.seeds_needed(interval, 0.5) is None


def test_interval_touching_the_tolerance_passes_and_one_beyond_fails():
    inside = cs.Interval(0.0, -0.5, 0.5, 0.1, 5, 0.95)
    outside = cs.Interval(0.8, 0.6, 1.0, 0.1, 5, 0.95)
    assert cs.decide(inside, 0.5) == cs.PASS
    assert cs.decide(outside, 0.5) == cs.FAIL
    assert cs.decide(cs.Interval(-0.8, -1.0, -0.6, 0.1, 5, 0.95), 0.5) == cs.FAIL


def test_mcnemar_exact_p_value_of_a_known_table():
    # 12 discordant examples, 10 against 2: p = 2 * (C(12,0) + C(12,1) + C(12,2)) / 2**12.
    reference = [True] * 10 + [False] * 2 + [True] * 30 + [False] * 8
    other = [False] * 10 + [True] * 2 + [True] * 30 + [False] * 8
    table = cs.mcnemar(reference, other)
    assert (table.only_reference, table.only_other) == (10, 2)
    assert table.p_value == pytest.approx(158 / 4096, rel=1e-12)
    assert cs.mcnemar(other, reference).p_value == pytest.approx(158 / 4096, rel=1e-12)


def test_noise_floor_is_sample_standard_deviation():
    assert cs.noise_floor([97.0, 98.0, 99.0]) == pytest.approx(1.0)


def test_examples_needed_from_the_discordant_fraction():
    # 10% discordant, balanced: variance 0.1; margin 0.5 pp = 0.005; z = 1.95996.
    reference = np.array([True] * 90 + [False] * 10)
    other = np.array([True] * 85 + [False] * 5 + [True] * 5 + [False] * 5)
    needed = cs.examples_needed(reference, other, mean_pp=0.0, tolerance_pp=0.5)
    assert needed == math.ceil(1.959963984540054 ** 2 * 0.1 / 0.005 ** 2)  # 15366
    assert cs.examples_needed(reference, reference, 0.0, 0.5) is None


@pytest.mark.parametrize("call", [
    lambda: cs.paired_interval([]),
    lambda: cs.paired_interval([1.0, float("nan")]),
    lambda: cs.agreement([1, 2], [1]),
    lambda: cs.mcnemar([], []),
])
def test_bad_inputs_raise_value_error(call):
    with pytest.raises(ValueError, match="Received"):
        call()
