"""The report of `tfmp.compare`: per-run numbers, differences, verdict, table, plot.

Every number here was measured by `compare`; the report only re-reads them, so
`CompareReport.verdict` can judge again at any tolerance without training.
Units: accuracy-like metrics (accuracy, AUC, precision, recall; values in [0, 1])
differ in percentage points ("pp"); other metrics (losses) in percent of the
float32 value ("%").
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from tfmp._src.errors import invalid_argument
from tfmp._src.policy.policy import FLOAT32

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ACCURACY_SECTION = "docs/troubleshooting.md#accuracy-drop-versus-float32"
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
        step_time_s: Float. Median wall time of a training step in seconds, first
            step (graph tracing) excluded; includes callback overhead.
        samples_per_second: Float. Samples per step divided by `step_time_s`.
        steps_timed: Int. Steps the median was taken over.
        wall_time_s: Float. Seconds `Model.fit` took, tracing included.
        initial_weights_checksum: Float. Sum of |w| over trainable weights before
            training; equal across runs shows they started from the same weights.
    """

    requested: str
    policy: str
    history: Dict[str, List[float]]
    step_time_s: float
    samples_per_second: float
    steps_timed: int
    wall_time_s: float
    initial_weights_checksum: float

    @property
    def label(self) -> str:
        """String. ``"auto (mixed_bfloat16)"`` or just the policy name."""
        same = self.requested == self.policy
        return self.policy if same else f"{self.requested} ({self.policy})"

    @property
    def final(self) -> Dict[str, float]:
        """Dict of metric name to its value after the last epoch."""
        return {k: v[-1] for k, v in self.history.items()}


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether the mixed runs agree with float32 within a tolerance.

    Attributes:
        passed: Bool. ``abs(difference) <= tolerance``; also the truth value.
        metric: String. Metric with the largest difference, e.g. ``"val_accuracy"``.
        policy: String. Label of the run with that difference.
        difference: Float. That run's value minus float32's, in `unit`.
        tolerance: Float. In `unit`.
        unit: String. ``"pp"`` (percentage points, accuracy-like metrics) or
            ``"%"`` (percent of the float32 value, losses).
    """

    passed: bool
    metric: str
    policy: str
    difference: float
    tolerance: float
    unit: str

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        sign = "<=" if self.passed else ">"
        text = (f"{'PASS' if self.passed else 'FAIL'}: largest difference {self.metric} "
                f"{self.difference:+.3f} {self.unit} ({self.policy}) {sign} "
                f"tolerance {self.tolerance:.3f} {self.unit}")
        return text if self.passed else f"{text}. See {ACCURACY_SECTION}"



@dataclasses.dataclass(frozen=True)
class CompareReport:
    """Results of `compare`: one `RunResult` per policy, float32 first among equals.

    Attributes:
        runs: Tuple of `RunResult`, in the order the policies were given.
        tolerance: Float. Default tolerance of `verdict`.
        settings: Dict. Epochs, seed and samples per step the runs used.
    """

    runs: Tuple[RunResult, ...]
    tolerance: float
    settings: Dict[str, Any]

    @property
    def baseline(self) -> RunResult:
        """`RunResult` of the first float32 run."""
        return next(r for r in self.runs if r.policy == FLOAT32)

    def differences(self) -> Dict[str, Dict[str, float]]:
        """Final-metric differences against float32, per run label and metric.

        Returns:
            Dict of run label to dict of metric to (run - float32): percentage points
            for accuracy-like metrics, percent of the float32 value for the others.
        """
        base, out = self.baseline, {}
        for run in self.runs:
            if run is base:
                continue
            out[run.label] = {}
            for metric, value in run.final.items():
                ref = base.final.get(metric)
                if ref is None:
                    continue
                scale = 100.0 if is_accuracy_like(metric) else 100.0 / (abs(ref) or 1.0)
                out[run.label][metric] = (value - ref) * scale
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
            `Verdict` for the largest absolute difference found.

        Raises:
            ValueError: negative tolerance or a metric the runs did not record.
        """
        tolerance = self.tolerance if tolerance is None else float(tolerance)
        if not tolerance >= 0:
            raise invalid_argument("tolerance", tolerance, "a float >= 0")
        diffs = self.differences()
        names = sorted({m for d in diffs.values() for m in d})
        if metric is not None and metric not in names:
            raise invalid_argument("metric", metric, "a metric the runs recorded",
                                   choices=names, fix="Choose from: " + ", ".join(names))
        judged = [metric] if metric else ([m for m in names if is_accuracy_like(m)]
                                          or names)
        worst = max(((abs(d[m]), m, label, d[m]) for label, d in diffs.items()
                     for m in judged), default=(0.0, judged[0], "", 0.0))
        unit = "pp" if is_accuracy_like(worst[1]) else "%"
        return Verdict(worst[0] <= tolerance, worst[1], worst[2], worst[3],
                       tolerance, unit)

    def to_dict(self) -> Dict[str, Any]:
        """Everything as plain Python values (JSON-serializable)."""
        return {
            "settings": dict(self.settings),
            "baseline": self.baseline.label,
            "runs": [dict(dataclasses.asdict(r), label=r.label, final=r.final)
                     for r in self.runs],
            "differences": self.differences(),
            "verdict": dataclasses.asdict(self.verdict()),
        }

    def plot(self, path: Optional[str] = None) -> Figure:
        """Draws each metric's per-epoch curve for every policy.

        Args:
            path: String or None. When given, the figure is also saved there.

        Returns:
            `matplotlib.figure.Figure` with one axes per metric (training solid,
            validation dashed). Made without pyplot, so no backend state changes.
        """
        from matplotlib.figure import Figure  # noqa: F811 (lazy: optional dependency)
        from matplotlib.ticker import MaxNLocator

        bases = sorted({m.removeprefix("val_") for r in self.runs for m in r.history})
        fig = Figure(figsize=(4.5 * len(bases), 3.5), layout="constrained")
        for ax, base in zip(np.atleast_1d(fig.subplots(1, len(bases))), bases):
            for i, run in enumerate(self.runs):
                for prefix, style in (("", "-"), ("val_", "--")):
                    values = run.history.get(prefix + base)
                    if values:
                        ax.plot(range(1, len(values) + 1), values, style, color=f"C{i}",
                                label=f"{prefix}{base} {run.label}")
            ax.set(title=base, xlabel="epoch")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.legend(fontsize="small")
        if path is not None:
            fig.savefig(path)
        return fig

    def __str__(self) -> str:
        metrics = list(self.baseline.history)
        header = ["policy"] + metrics + ["ms/step", "samples/s", "speed vs fp32"]
        rows = [header]
        for run in self.runs:
            cells = [run.label]
            for m in metrics:
                v = run.final.get(m, float("nan"))
                cells.append(f"{100 * v:.2f}%" if is_accuracy_like(m) else f"{v:.4f}")
            cells += [f"{1000 * run.step_time_s:.2f}", f"{run.samples_per_second:.0f}",
                      f"{self.baseline.step_time_s / run.step_time_s:.2f}x"]
            rows.append(cells)
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        settings = ", ".join(f"{k}={v}" for k, v in self.settings.items())
        return "\n".join([f"tfmp.compare ({settings})"] + lines + [str(self.verdict())])

