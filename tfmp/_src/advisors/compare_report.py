"""The report of `tfmp.compare`: per-run numbers, intervals, verdict, plot and text.

It keeps every number `compare` measured, so `CompareReport.verdict` can judge again at
any tolerance without training. Accuracy-like metrics differ in percentage points
("pp"), others (losses) in percent of float32's value at the same seed ("%").
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from tfmp._src.advisors import compare_stats
from tfmp._src.constants import TROUBLESHOOTING_GUIDE
from tfmp._src.errors import invalid_argument
from tfmp._src.policy.policy import FLOAT32
from tfmp._src.report_fields import (
    ANY, BOOL, INT, POSITIVE_INT, REAL, STRING, Kind, check_fields, dict_of, instance_of, list_of,
    one_of, optional, tuple_of,
)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ACCURACY_SECTION = f"{TROUBLESHOOTING_GUIDE}#accuracy-drop-versus-float32"
_ACCURACY_WORDS = ("acc", "auc", "precision", "recall")


def is_accuracy_like(metric: str) -> bool:
    """True for metrics in [0, 1] judged in percentage points (accuracy, AUC...)."""
    return any(word in metric.removeprefix("val_") for word in _ACCURACY_WORDS)


@dataclasses.dataclass(frozen=True)
class RunResult:
    """What one run measured.

    Attributes:
        requested: String. Policy as requested, e.g. ``"auto"``.
        policy: String. Keras policy it ran under, e.g. ``"mixed_bfloat16"``.
        history: Dict of metric name to list of per-epoch floats (`History.history`).
        step_time_s: Float. Median seconds per training step, the first (tracing) excluded.
        samples_per_second: Float. Samples per step divided by `step_time_s`.
        steps_timed: Int. Steps the median was taken over.
        wall_time_s: Float. Seconds `Model.fit` took, tracing included.
        initial_weights_checksum: Float. Sum of |w| over trainable weights before
            training; equal across runs when they start from the same weights.
        seed: Int. Seed of the run.
        predictions: Tuple of ints or None. Predicted class per validation example.
    """

    requested: str
    policy: str
    history: Dict[str, List[float]]
    step_time_s: float
    samples_per_second: float
    steps_timed: int
    wall_time_s: float
    initial_weights_checksum: float
    seed: int = 0
    predictions: Optional[Tuple[int, ...]] = None

    @property
    def label(self) -> str:
        """String. ``"auto (mixed_bfloat16)"`` or just the policy name."""
        return self.policy if self.requested == self.policy else f"{self.requested} ({self.policy})"

    @property
    def final(self) -> Dict[str, float]:
        """Dict of metric name to its value after the last epoch."""
        return {k: v[-1] for k, v in self.history.items()}


@dataclasses.dataclass(frozen=True)
class MetricSummary:
    """One metric of one policy against float32, over the seeds.

    Attributes:
        mean: Float. Mean of the per-seed differences (policy minus float32), `unit`.
        ci_low: Float. Lower bound of the 95% Student t interval; `mean` for one seed.
        ci_high: Float. Upper bound; `mean` for one seed.
        noise_floor: Float or None. Standard deviation of float32's own final value
            over the seeds, in `unit` (None for one seed).
        per_seed: List of floats. The difference at each seed, in seed order.
        unit: String. ``"pp"`` or ``"%"``.
        interval: `compare_stats.Interval` the bounds come from.

    Raises:
        ValueError: (template) a bound not a number, `per_seed` not a list of
            numbers, `unit` not ``"pp"`` or ``"%"``, `interval` not an Interval.
    """

    mean: float
    ci_low: float
    ci_high: float
    noise_floor: Optional[float]
    per_seed: List[float]
    unit: str
    interval: compare_stats.Interval

    def __post_init__(self) -> None:
        check_fields(self, mean=REAL, ci_low=REAL, ci_high=REAL, noise_floor=optional(REAL),
                     per_seed=list_of(REAL), unit=_UNIT,
                     interval=instance_of(compare_stats.Interval, "a compare_stats.Interval"))

    def to_dict(self) -> Dict[str, Any]:
        """Plain values: mean, ci_low, ci_high, noise_floor, n_seeds, unit, per_seed."""
        return {"mean": self.mean, "ci_low": self.ci_low, "ci_high": self.ci_high,
                "noise_floor": self.noise_floor, "n_seeds": self.interval.n,
                "unit": self.unit, "per_seed": list(self.per_seed)}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether the mixed runs agree with float32 within a tolerance.

    Attributes:
        status: String. ``"pass"`` (the interval lies within +-tolerance),
            ``"fail"`` (entirely outside) or ``"inconclusive"`` (it straddles a
            bound; never with one seed, whose interval is the difference itself).
        passed: Bool. ``status == "pass"``; also the truth value.
        metric: String. Metric that decided, e.g. ``"val_accuracy"``.
        policy: String. Label of the run that decided.
        difference: Float. Mean difference to float32 over the seeds, in `unit`.
        ci_low: Float. Lower bound of its 95% interval.
        ci_high: Float. Upper bound.
        tolerance: Float. In `unit`, as the bounds.
        unit: String. ``"pp"`` (accuracy-like metrics) or ``"%"`` (of float32's value).
        n_seeds: Int. Seeds the interval is over.
        noise_floor: Float or None. float32's seed-to-seed standard deviation.
        seeds_needed: Int or None. When inconclusive: seeds that would decide, at
            the spread observed.
        examples_needed: Int or None. When inconclusive on a classifier's validation
            accuracy: validation examples per seed that would decide (same caveat).

    Raises:
        ValueError: (template) a field of another type than the one above.
    """

    status: str
    passed: bool
    metric: str
    policy: str
    difference: float
    ci_low: float
    ci_high: float
    tolerance: float
    unit: str
    n_seeds: int
    noise_floor: Optional[float] = None
    seeds_needed: Optional[int] = None
    examples_needed: Optional[int] = None

    def __post_init__(self) -> None:
        check_fields(self, status=one_of(*_SEVERITY), passed=BOOL, metric=STRING, policy=STRING,
                     difference=REAL, ci_low=REAL, ci_high=REAL, tolerance=REAL, unit=_UNIT,
                     n_seeds=POSITIVE_INT, noise_floor=optional(REAL), seeds_needed=optional(INT),
                     examples_needed=optional(INT))

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        u = self.unit
        text = (f"{self.status.upper()}: {self.metric} {self.policy} {self.difference:+.3f} {u}, "
                f"95% interval [{self.ci_low:+.3f}, {self.ci_high:+.3f}] {u} "
                f"(tolerance +-{self.tolerance:.3f} {u}, {self.n_seeds} seed"
                f"{'s' if self.n_seeds != 1 else ''}")
        if self.noise_floor is not None:
            text += f", float32 noise floor {self.noise_floor:.3f} {u}"
        text += ")"
        if self.n_seeds == 1:
            text += ("; one seed gives no interval and may judge run-to-run noise: "
                     "pass seeds=5")
        elif self.status == compare_stats.INCONCLUSIVE:
            more = (f"about {self.seeds_needed} seeds would decide it"
                    if self.seeds_needed else "more seeds would not decide it")
            if self.examples_needed:
                more += f", or about {self.examples_needed} validation examples per seed"
            text += f"; {more}"
        return text if self.passed else f"{text}. See {ACCURACY_SECTION}"


_SEVERITY = {compare_stats.PASS: 0, compare_stats.INCONCLUSIVE: 1, compare_stats.FAIL: 2}
_UNIT = one_of("pp", "%")
_RUNS = Kind("a tuple of RunResult including a float32 run (the baseline)",
             lambda runs: tuple_of(instance_of(RunResult, "")).accepts(runs)
             and any(run.policy == FLOAT32 for run in runs))


@dataclasses.dataclass(frozen=True)
class CompareReport:
    """Results of `compare`: one `RunResult` per policy and seed.

    Attributes:
        runs: Tuple of `RunResult`, seed by seed, policies in the order given.
        tolerance: Float. Default tolerance of `verdict`.
        settings: Dict. Epochs, seeds and samples per step the runs used.
        speed: Dict of run label to ``{"step_time_s", "ratio", "seconds",
            "ratios"}`` from the alternated timing; ``ratio`` is the median of
            paired ratios float32 seconds / this policy's (> 1: faster). Empty when
            not timed.
        val_labels: Tuple of ints or None. Validation class labels, for the
            per-example statistics.

    Raises:
        ValueError: (template) `runs` not a tuple of `RunResult` with a float32
            run, `tolerance` not a number, `settings` or `speed` not a dict with
            string keys, `val_labels` not None or a tuple of ints.
    """

    runs: Tuple[RunResult, ...]
    tolerance: float
    settings: Dict[str, Any]
    speed: Dict[str, Dict[str, Any]] = dataclasses.field(default_factory=dict)
    val_labels: Optional[Tuple[int, ...]] = None

    def __post_init__(self) -> None:
        check_fields(self, runs=_RUNS, tolerance=REAL, settings=dict_of(STRING, ANY),
                     speed=dict_of(STRING, ANY), val_labels=optional(tuple_of(INT)))

    @property
    def seeds(self) -> List[int]:
        """List of ints. The seeds, in the order they ran."""
        return list(dict.fromkeys(r.seed for r in self.runs))

    @property
    def baseline(self) -> RunResult:
        """`RunResult` of the float32 run of the first seed."""
        return next(r for r in self.runs if r.policy == FLOAT32)

    def _by_seed(self) -> Dict[str, Dict[int, RunResult]]:
        out: Dict[str, Dict[int, RunResult]] = {}
        for run in self.runs:
            out.setdefault(run.label, {})[run.seed] = run
        return out

    def statistics(self, confidence: float = 0.95) -> Dict[str, Dict[str, MetricSummary]]:
        """Per compared policy and metric: mean difference, interval, noise floor.

        Args:
            confidence: Float in (0, 1). Coverage of the intervals.

        Returns:
            Dict of run label (float32 left out) to metric to `MetricSummary`.
        """
        runs = self._by_seed()
        reference = runs[self.baseline.label]
        out: Dict[str, Dict[str, MetricSummary]] = {}
        for label, by_seed in runs.items():
            if label == self.baseline.label:
                continue
            out[label] = {}
            for metric in by_seed[self.seeds[0]].final:
                if metric not in reference[self.seeds[0]].final:
                    continue
                accuracy = is_accuracy_like(metric)
                refs = [reference[s].final[metric] for s in self.seeds]
                scales = [100.0 if accuracy else 100.0 / (abs(r) or 1.0) for r in refs]
                diffs = [(by_seed[s].final[metric] - r) * k
                         for s, r, k in zip(self.seeds, refs, scales)]
                interval = compare_stats.paired_interval(diffs, confidence)
                ref_scale = 100.0 if accuracy else 100.0 / (abs(float(np.mean(refs))) or 1.0)
                floor = compare_stats.noise_floor([r * ref_scale for r in refs])
                out[label][metric] = MetricSummary(
                    interval.mean, interval.ci_low, interval.ci_high, floor, diffs,
                    "pp" if accuracy else "%", interval)
        return out

    def differences(self) -> Dict[str, Dict[str, float]]:
        """Mean final-metric differences against float32, per run label and metric.

        Returns:
            Dict of run label to metric to the mean over seeds of (run - float32),
            in ``"pp"`` or ``"%"`` as `MetricSummary.unit`.
        """
        return {label: {m: s.mean for m, s in metrics.items()}
                for label, metrics in self.statistics().items()}

    def _correctness(self, label: str) -> List[Tuple[np.ndarray, np.ndarray]]:
        """Per seed, (float32 correct, `label` correct) boolean vectors; [] if unknown."""
        if self.val_labels is None:
            return []
        truth, runs, out = np.asarray(self.val_labels), self._by_seed(), []
        for s in self.seeds:
            ref, other = runs[self.baseline.label][s], runs[label][s]
            if ref.predictions is None or other.predictions is None:
                return []
            out.append((np.asarray(ref.predictions) == truth,
                        np.asarray(other.predictions) == truth))
        return out

    def agreement(self) -> Dict[str, Dict[str, Any]]:
        """Per-example comparison with float32 at the same seed (classifiers).

        Returns:
            Dict of run label to ``{"agreement": [float per seed], "mcnemar":
            [{"only_reference", "only_other", "p_value"} per seed]}``: the fraction
            of validation predictions equal to float32's and McNemar's exact test on
            per-example correctness. Empty when no predictions were recorded.
        """
        out: Dict[str, Dict[str, Any]] = {}
        runs = self._by_seed()
        for label in runs:
            pairs = self._correctness(label) if label != self.baseline.label else []
            if not pairs:
                continue
            out[label] = {
                "agreement": [compare_stats.agreement(runs[self.baseline.label][s].predictions,
                                                      runs[label][s].predictions)
                              for s in self.seeds],
                "mcnemar": [dataclasses.asdict(compare_stats.mcnemar(ref, other))
                            for ref, other in pairs],
            }
        return out

    def verdict(self, tolerance: Optional[float] = None,
                metric: Optional[str] = None) -> Verdict:
        """Judges the stored numbers again; no training happens.

        Args:
            tolerance: Float >= 0 or None (the report's). Percentage points for
                accuracy-like metrics, percent of float32's value for losses.
            metric: String or None. Metric to judge; None judges every
                accuracy-like metric, or the losses when there is none.

        Returns:
            `Verdict`: "fail" if any judged interval lies outside the tolerance,
            else "inconclusive" if any straddles it, else "pass"; it names the
            metric and policy that decided (the farthest interval among those).

        Raises:
            ValueError: (template) a tolerance that is not a number >= 0, or a
                metric the runs did not record.
        """
        tolerance = self.tolerance if tolerance is None else tolerance
        if not REAL.accepts(tolerance) or not tolerance >= 0:
            raise invalid_argument("tolerance", tolerance, "a float >= 0",
                                   fix="Pass e.g. tolerance=0.5 (percentage points), or None for the report's own.")
        tolerance = float(tolerance)
        summaries = self.statistics()
        names = sorted({m for d in summaries.values() for m in d})
        if metric is not None and metric not in names:
            raise invalid_argument("metric", metric, "a metric the runs recorded",
                                   choices=names, fix=(f"Choose from: {', '.join(names)}; e.g. metric={names[0]!r}."
                                                       if names else "Pass metric=None."))
        judged = [metric] if metric else ([m for m in names if is_accuracy_like(m)] or names)
        candidates = [(label, m, s, compare_stats.decide(s.interval, tolerance))
                      for label, d in summaries.items() for m, s in d.items() if m in judged]
        label, m, s, status = max(candidates, key=lambda c: (
            _SEVERITY[c[3]], max(abs(c[2].ci_low), abs(c[2].ci_high))))
        seeds_needed = examples_needed = None
        if status == compare_stats.INCONCLUSIVE:
            seeds_needed = compare_stats.seeds_needed(s.interval, tolerance)
            pairs = self._correctness(label) if m.startswith("val_") and "acc" in m else []
            if pairs:
                examples_needed = compare_stats.examples_needed(
                    np.concatenate([p[0] for p in pairs]),
                    np.concatenate([p[1] for p in pairs]), s.mean, tolerance)
        return Verdict(status, status == compare_stats.PASS, m, label, s.mean, s.ci_low,
                       s.ci_high, tolerance, s.unit, s.interval.n, s.noise_floor,
                       seeds_needed, examples_needed)

    def to_dict(self) -> Dict[str, Any]:
        """Everything as plain Python values (JSON-serializable).

        Returns:
            Dict with ``settings``, ``baseline``, ``runs`` (without predictions),
            ``differences``, ``statistics`` (per compared policy and metric:
            ``mean``, ``ci_low``, ``ci_high``, ``noise_floor``, ``n_seeds``,
            ``unit``, ``per_seed``), ``agreement``, ``speed`` and ``verdict``.
        """
        runs = []
        for r in self.runs:
            row = dataclasses.asdict(r)
            row.pop("predictions")
            runs.append(dict(row, label=r.label, final=r.final))
        return {
            "settings": dict(self.settings),
            "baseline": self.baseline.label,
            "runs": runs,
            "differences": self.differences(),
            "statistics": {label: {m: s.to_dict() for m, s in d.items()}
                           for label, d in self.statistics().items()},
            "agreement": self.agreement(),
            "speed": {label: dict(v) for label, v in self.speed.items()},
            "verdict": dataclasses.asdict(self.verdict()),
        }

    def plot(self, path: Optional[str] = None) -> Figure:
        """Draws each metric's per-epoch curve for every policy and seed.

        Args:
            path: String or None. When given, the figure is also saved there.

        Returns:
            `matplotlib.figure.Figure`, one axes per metric (training solid, validation
            dashed, a colour per policy, a line per seed), made without pyplot.
        """
        from matplotlib.figure import Figure  # lazy: optional dependency
        from matplotlib.ticker import MaxNLocator

        bases = sorted({m.removeprefix("val_") for r in self.runs for m in r.history})
        colours = {label: f"C{i}" for i, label in enumerate(self._by_seed())}
        fig = Figure(figsize=(4.5 * len(bases), 3.5), layout="constrained")
        for ax, base in zip(np.atleast_1d(fig.subplots(1, len(bases))), bases):
            for run in self.runs:
                for prefix, style in (("", "-"), ("val_", "--")):
                    values = run.history.get(prefix + base)
                    if values:
                        first = run.seed == self.seeds[0]
                        ax.plot(range(1, len(values) + 1), values, style,
                                color=colours[run.label], alpha=1.0 if first else 0.4,
                                label=f"{prefix}{base} {run.label}" if first else None)
            ax.set(title=base, xlabel="epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize="small")
        if path is not None:
            fig.savefig(path)
        return fig

    def __str__(self) -> str:
        return format_report(self)


def _align(rows: List[List[str]]) -> List[str]:
    """Left-aligns the first column, right-aligns the others."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


# Paired ratio and ratio of the ms/step medians further apart than this (relative) are
# reported as a disagreement. A choice, not a measurement: below it, on the same side
# of 1.00x, both figures tell the reader the same.
SPEED_DISAGREEMENT = 0.05


def _speed_disagreement(label: str, timed: Optional[Dict[str, Any]],
                        reference: Optional[Dict[str, Any]]) -> Optional[str]:
    """A footnote when the paired ratio and the ms/step medians tell different speeds.

    Both come from the same rounds, but the median of per-round ratios and the ratio of
    per-policy medians part when the machine's load changes between rounds: then the
    table's speed column and its ms/step column would contradict each other unsaid.

    Returns:
        String (the footnote, starting with "*") or None when they agree: on the same
        side of 1.00x and within `SPEED_DISAGREEMENT` of each other.
    """
    if not timed or not reference or not timed["step_time_s"] > 0:
        return None
    paired = timed["ratio"]
    medians = reference["step_time_s"] / timed["step_time_s"]
    if (paired >= 1.0) == (medians >= 1.0) and abs(paired / medians - 1.0) <= SPEED_DISAGREEMENT:
        return None
    ratios = timed["ratios"]
    return (f"* {label}: paired ratio {paired:.2f}x, ms/step medians {medians:.2f}x, rounds "
            f"{min(ratios):.2f}x to {max(ratios):.2f}x: the load changed while timing, so "
            "neither is reliable; time again on an idle machine or with more timing_rounds.")


def format_report(report: CompareReport) -> str:
    """The table, intervals, per-example statistics and verdict, as one string."""
    seeds = report.seeds
    by_label = {}
    for run in report.runs:
        by_label.setdefault(run.label, []).append(run)
    metrics = list(report.baseline.history)
    header = ["policy"] + metrics + ["ms/step", "samples/s", "speed vs fp32"]
    rows = [header]
    base_step = statistics.median(r.step_time_s for r in by_label[report.baseline.label])
    notes = []
    for label, runs in by_label.items():
        cells = [label]
        for m in metrics:
            v = float(np.mean([r.final.get(m, float("nan")) for r in runs]))
            cells.append(f"{100 * v:.2f}%" if is_accuracy_like(m) else f"{v:.4f}")
        timed = report.speed.get(label)
        step = timed["step_time_s"] if timed else statistics.median(r.step_time_s for r in runs)
        ratio = timed["ratio"] if timed else base_step / step
        note = _speed_disagreement(label, timed, report.speed.get(report.baseline.label))
        cells += [f"{1000 * step:.2f}", f"{report.settings['samples_per_step'] / step:.0f}",
                  f"{ratio:.2f}x" + ("*" if note else "")]
        rows.append(cells)
        notes += [note] if note else []
    settings = ", ".join(f"{k}={v}" for k, v in report.settings.items())
    if report.speed:
        rounds = len(next(iter(report.speed.values()))["seconds"])
        speed_note = (f"Speed vs fp32: median over {rounds} alternated round(s) of float32's "
                      "s/step / this policy's in the same round (> 1: faster);\nms/step, "
                      "samples/s: each policy's median over those rounds.")
    else:
        speed_note = "Speed vs fp32: float32's median ms/step / this policy's (separate runs)."
    lines = [f"tfmp.compare ({settings})",
             f"Mean final metrics over {len(seeds)} seed(s).", speed_note]
    lines += _align(rows)
    lines += notes
    lines.append("")
    lines.append("Difference to float32 (paired by seed): mean, 95% interval, "
                 "float32's seed-to-seed std (noise floor)")
    diff_rows = [["policy", "metric", "mean", "95% interval", "noise floor"]]
    for label, summaries in report.statistics().items():
        for m, s in summaries.items():
            floor = "-" if s.noise_floor is None else f"{s.noise_floor:.3f} {s.unit}"
            diff_rows.append([label, m, f"{s.mean:+.3f} {s.unit}",
                              f"[{s.ci_low:+.3f}, {s.ci_high:+.3f}] {s.unit}", floor])
    lines += _align(diff_rows)
    for label, values in report.agreement().items():
        agree = ", ".join(f"{100 * a:.1f}%" for a in values["agreement"])
        p_values = ", ".join(f"{t['p_value']:.3g}" for t in values["mcnemar"])
        lines.append(f"Per validation example, {label} vs float32 per seed: predictions "
                     f"agree {agree}; McNemar exact p = {p_values}")
    lines.append(str(report.verdict()))
    return "\n".join(lines)
