"""The statistics of `tfmp.compare`, on plain numbers: intervals, verdicts, McNemar.

Differences are paired by seed and judged by a Student t interval. McNemar's test is the
exact binomial one: the chi-square form is poor on the few discordant pairs two close
policies give. scipy (the ``compare`` extra) is imported on first use.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import numpy as np

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"
MAX_SEEDS = 1000  # also the most seeds `tfmp.compare` takes
COMPARE_EXTRA = 'pip install "tfmp[compare]"'


def scipy_stats():
    """`scipy.stats`, imported on first use; a missing scipy names the extra that installs it."""
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
    """Mean of paired differences (policy minus reference) with its confidence interval.

    Attributes:
        mean: Float. Mean difference, in the caller's unit.
        ci_low: Float. Lower bound; equals `mean` for one seed.
        ci_high: Float. Upper bound; equals `mean` for one seed.
        std: Float or None. Sample standard deviation (ddof=1); None for one seed.
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
    """McNemar's exact test: discordant counts and the two-sided binomial p-value (1.0 for none)."""

    only_reference: int
    only_other: int
    p_value: float


def paired_interval(differences: Sequence[float], confidence: float = 0.95) -> Interval:
    """Student t interval of the mean of per-seed differences; zero width for one difference."""
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
    """Seed-to-seed sample standard deviation of the reference; None for fewer than two values."""
    values = np.asarray(reference_values, dtype="float64").reshape(-1)
    return float(values.std(ddof=1)) if values.size >= 2 else None


def decide(interval: Interval, tolerance: float) -> str:
    """PASS when the interval lies within +-`tolerance`, FAIL entirely outside, else INCONCLUSIVE."""
    if -tolerance <= interval.ci_low and interval.ci_high <= tolerance:
        return PASS
    if interval.ci_low > tolerance or interval.ci_high < -tolerance:
        return FAIL
    return INCONCLUSIVE


def seeds_needed(interval: Interval, tolerance: float) -> Optional[int]:
    """Smallest n with ``t(n-1) * std / sqrt(n) < |tolerance - |mean||``, mean and spread kept.

    None for one seed, or when even `MAX_SEEDS` seeds would not decide.
    """
    if interval.std is None:
        return None
    margin = abs(tolerance - abs(interval.mean))  # to the nearer bound
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
    """Fraction of examples on which two classifiers predict the same label."""
    a, b = np.asarray(predictions_a).reshape(-1), np.asarray(predictions_b).reshape(-1)
    if a.size == 0 or a.shape != b.shape:
        raise ValueError(
            "Invalid predictions. Expected two non-empty sequences of equal length. "
            f"Received: lengths {a.size} and {b.size}.")
    return float(np.mean(a == b))


def mcnemar(correct_reference: Sequence[bool], correct_other: Sequence[bool]) -> McNemar:
    """McNemar's exact test on per-example correctness: do two classifiers err alike?"""
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
    """Validation examples per seed that would resolve an accuracy difference (in pp).

    The n whose normal interval, variance ``(p_disc - d**2) / n`` (discordant fraction,
    signed imbalance), is narrower than the distance from `mean_pp` to the nearer bound.
    None when the mean sits on a bound or the runs never disagree.
    """
    ref = np.asarray(correct_reference, dtype=bool).reshape(-1)
    other = np.asarray(correct_other, dtype=bool).reshape(-1)
    d = (other.astype(float) - ref.astype(float))
    variance = float(np.mean(d * d) - np.mean(d) ** 2)
    margin = abs(tolerance_pp - abs(mean_pp)) / 100
    if variance <= 0 or margin == 0:
        return None
    z = float(scipy_stats().norm.ppf((1 + confidence) / 2))
    return int(math.ceil(z * z * variance / (margin * margin)))
