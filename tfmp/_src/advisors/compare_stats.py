"""The statistics of `tfmp.compare`, on plain numbers (no Keras, no training).

* `paired_interval`: mean of per-seed differences (policy minus reference, same seed and
  data order, which removes what the two runs share) with a Student t interval.
* `decide`: "pass" when the interval lies within +-tolerance, "fail" when entirely
  outside, "inconclusive" when it straddles a bound.
* `seeds_needed`, `examples_needed`: how many seeds, or validation examples per seed,
  would make the interval narrow enough to decide.
* `agreement`, `mcnemar`: per-example comparisons of two classifiers, which see flipped
  predictions before the mean accuracy moves. McNemar's test is the exact one (a
  two-sided binomial test of the discordant pairs, `scipy.stats.binomtest`): the
  chi-square form is poor on the handful of discordant pairs two close policies give.

scipy (the ``compare`` extra) is imported on the first statistic; `scipy_stats` says
the fix when it is missing.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
MAX_SEEDS = 1000  # beyond this, `seeds_needed` says more seeds will not decide
#: The install command that brings `tfmp.compare`'s optional dependencies.
COMPARE_EXTRA = 'pip install "tfmp[compare]"'


def scipy_stats():
    """The `scipy.stats` module, imported on first use.

    Returns:
        Module `scipy.stats`.

    Raises:
        ModuleNotFoundError: scipy is not installed; the message names the extra
            that installs it.
    """
    try:
        from scipy import stats
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "tfmp.compare needs scipy (scipy.stats: Student t intervals and McNemar's exact "
            f"test). Expected scipy to be importable. Received: {error}. "
            f"Install tfmp's `compare` extra: {COMPARE_EXTRA}", name="scipy") from error
    return stats


@dataclasses.dataclass(frozen=True)
class Interval:
    """Mean of paired differences with its confidence interval.

    Attributes:
        mean: Float. Mean difference (policy minus reference), in the caller's unit.
        ci_low: Float. Lower bound of the interval; equals `mean` for one seed.
        ci_high: Float. Upper bound; equals `mean` for one seed.
        std: Float or None. Sample standard deviation (ddof=1) of the differences;
            None for one seed.
        n: Int. Number of paired differences (seeds).
        confidence: Float in (0, 1), e.g. 0.95.
    """

    mean: float
    ci_low: float
    ci_high: float
    std: Optional[float]
    n: int
    confidence: float

    @property
    def half_width(self) -> float:
        """Float. Half the interval's width; 0 for one seed."""
        return (self.ci_high - self.ci_low) / 2


@dataclasses.dataclass(frozen=True)
class McNemar:
    """McNemar's exact test on the per-example correctness of two classifiers.

    Attributes:
        only_reference: Int. Examples the reference got right and the other wrong.
        only_other: Int. Examples the other got right and the reference wrong.
        p_value: Float in [0, 1]. Two-sided exact binomial p-value of the
            discordant counts against p = 0.5; 1.0 when there are none.
    """

    only_reference: int
    only_other: int
    p_value: float


def paired_interval(differences: Sequence[float], confidence: float = 0.95) -> Interval:
    """Student t confidence interval of the mean of paired differences.

    Args:
        differences: Sequence of floats, one per seed (policy minus reference).
        confidence: Float in (0, 1). Coverage of the interval.

    Returns:
        `Interval`. With one difference the interval has zero width at it (no
        spread is known); with identical differences it has zero width too.

    Raises:
        ValueError: no differences, or one that is not finite.
    """
    values = np.asarray(differences, dtype="float64").reshape(-1)
    if values.size == 0 or not np.all(np.isfinite(values)):
        raise ValueError(
            "Invalid `differences` argument. Expected at least one finite float. "
            f"Received: differences={list(differences)!r}.")
    mean = float(values.mean())
    if values.size == 1:
        return Interval(mean, mean, mean, None, 1, confidence)
    std = float(values.std(ddof=1))
    half = float(scipy_stats().t.ppf((1 + confidence) / 2, values.size - 1)) * std / math.sqrt(values.size)
    return Interval(mean, mean - half, mean + half, std, int(values.size), confidence)


def noise_floor(reference_values: Sequence[float]) -> Optional[float]:
    """Seed-to-seed spread of the reference: sample standard deviation (ddof=1).

    Args:
        reference_values: Sequence of floats, the reference's metric per seed, in
            the unit differences are reported in.

    Returns:
        Float, or None for fewer than two values.
    """
    values = np.asarray(reference_values, dtype="float64").reshape(-1)
    return float(values.std(ddof=1)) if values.size >= 2 else None


def decide(interval: Interval, tolerance: float) -> str:
    """Judges an interval against +-`tolerance`.

    Args:
        interval: `Interval` of the difference.
        tolerance: Float >= 0, in the interval's unit.

    Returns:
        String. ``"pass"`` when the interval lies within [-tolerance, tolerance],
        ``"fail"`` when it lies entirely outside it, ``"inconclusive"`` otherwise.
    """
    if -tolerance <= interval.ci_low and interval.ci_high <= tolerance:
        return PASS
    if interval.ci_low > tolerance or interval.ci_high < -tolerance:
        return FAIL
    return INCONCLUSIVE


def _margin(mean: float, tolerance: float) -> float:
    """Distance from `mean` to the nearer of the bounds -tolerance, +tolerance."""
    return abs(tolerance - abs(mean))


def seeds_needed(interval: Interval, tolerance: float) -> Optional[int]:
    """Seeds for which the t-interval would be narrow enough to decide.

    Assumes the observed mean and spread stay what they are: the answer is the
    smallest n with ``t(n-1) * std / sqrt(n) < |tolerance - |mean||``.

    Args:
        interval: `Interval` from at least two seeds.
        tolerance: Float >= 0.

    Returns:
        Int >= 2, or None when unknown (one seed, no spread measured) or when even
        `MAX_SEEDS` seeds would not decide (the mean sits on a bound).
    """
    if interval.std is None:
        return None
    margin = _margin(interval.mean, tolerance)
    if interval.std == 0:
        return interval.n if margin > 0 else None
    if margin == 0:
        return None
    q = (1 + interval.confidence) / 2
    for n in range(2, MAX_SEEDS + 1):
        if scipy_stats().t.ppf(q, n - 1) * interval.std / math.sqrt(n) < margin:
            return n
    return None


def agreement(predictions_a: Sequence[int], predictions_b: Sequence[int]) -> float:
    """Fraction of examples on which two classifiers predict the same label.

    Args:
        predictions_a: Sequence of int labels, one per validation example.
        predictions_b: Same length, same examples in the same order.

    Returns:
        Float in [0, 1]; 1.0 for identical predictions.

    Raises:
        ValueError: the sequences differ in length or are empty.
    """
    a, b = np.asarray(predictions_a).reshape(-1), np.asarray(predictions_b).reshape(-1)
    if a.size == 0 or a.shape != b.shape:
        raise ValueError(
            "Invalid predictions. Expected two non-empty sequences of equal length. "
            f"Received: lengths {a.size} and {b.size}.")
    return float(np.mean(a == b))


def mcnemar(correct_reference: Sequence[bool], correct_other: Sequence[bool]) -> McNemar:
    """McNemar's exact test: do two classifiers err on the same examples?

    Args:
        correct_reference: Sequence of bools, True where the reference was right.
        correct_other: Same examples, True where the other classifier was right.

    Returns:
        `McNemar` with the discordant counts and the exact two-sided p-value.

    Raises:
        ValueError: the sequences differ in length or are empty.
    """
    ref = np.asarray(correct_reference, dtype=bool).reshape(-1)
    other = np.asarray(correct_other, dtype=bool).reshape(-1)
    if ref.size == 0 or ref.shape != other.shape:
        raise ValueError(
            "Invalid correctness vectors. Expected two non-empty sequences of equal "
            f"length. Received: lengths {ref.size} and {other.size}.")
    b, c = int(np.sum(ref & ~other)), int(np.sum(~ref & other))
    p = 1.0 if b + c == 0 else float(scipy_stats().binomtest(b, b + c, 0.5).pvalue)
    return McNemar(b, c, min(p, 1.0))


def examples_needed(correct_reference: Sequence[bool], correct_other: Sequence[bool],
                    mean_pp: float, tolerance_pp: float,
                    confidence: float = 0.95) -> Optional[int]:
    """Validation examples per seed that would resolve an accuracy difference.

    The accuracy difference measured on n examples varies, from the choice of
    examples alone, with variance ``(p_disc - d**2) / n`` (p_disc: fraction of
    discordant examples, d: their signed imbalance). The answer is the n for which
    the normal interval from that part alone is narrower than the distance from
    `mean_pp` to the nearer bound. It does not shrink the training (seed) noise.

    Args:
        correct_reference: Sequence of bools per example, from one seed.
        correct_other: Same examples, the other policy at the same seed.
        mean_pp: Float. Mean accuracy difference, percentage points.
        tolerance_pp: Float >= 0. Percentage points.
        confidence: Float in (0, 1).

    Returns:
        Int, or None when the mean sits on a bound or the runs never disagree.
    """
    ref = np.asarray(correct_reference, dtype=bool).reshape(-1)
    other = np.asarray(correct_other, dtype=bool).reshape(-1)
    d = (other.astype(float) - ref.astype(float))
    variance = float(np.mean(d * d) - np.mean(d) ** 2)
    margin = _margin(mean_pp, tolerance_pp) / 100
    if variance <= 0 or margin == 0:
        return None
    z = float(scipy_stats().norm.ppf((1 + confidence) / 2))
    return int(math.ceil(z * z * variance / (margin * margin)))
