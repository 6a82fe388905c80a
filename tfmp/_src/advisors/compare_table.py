"""The text of a `CompareReport`: what ``print(report)`` shows.

Mean final metrics and speed per policy, the differences to float32 with their 95%
intervals and noise floor, per-example agreement and McNemar's p-values, the verdict.
"""

from __future__ import annotations

import statistics
from typing import List

import numpy as np

from tfmp._src.advisors.compare_report import CompareReport, is_accuracy_like


def _align(rows: List[List[str]]) -> List[str]:
    """Left-aligns the first column, right-aligns the others."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths))) for r in rows]


def format_report(report: CompareReport) -> str:
    """The table, intervals, per-example statistics and verdict, as one string."""
    seeds = report.seeds
    by_label = {}
    for run in report.runs:
        by_label.setdefault(run.label, []).append(run)
    metrics = list(report.baseline.history)
    speed_note = "median paired ratio" if report.speed else "medians of separate runs"
    header = ["policy"] + metrics + ["ms/step", "samples/s", "speed vs fp32"]
    rows = [header]
    base_step = statistics.median(r.step_time_s for r in by_label[report.baseline.label])
    for label, runs in by_label.items():
        cells = [label]
        for m in metrics:
            v = float(np.mean([r.final.get(m, float("nan")) for r in runs]))
            cells.append(f"{100 * v:.2f}%" if is_accuracy_like(m) else f"{v:.4f}")
        timed = report.speed.get(label)
        step = timed["step_time_s"] if timed else statistics.median(r.step_time_s for r in runs)
        ratio = timed["ratio"] if timed else base_step / step
        cells += [f"{1000 * step:.2f}", f"{report.settings['samples_per_step'] / step:.0f}",
                  f"{ratio:.2f}x"]
        rows.append(cells)
    settings = ", ".join(f"{k}={v}" for k, v in report.settings.items())
    lines = [f"tfmp.compare ({settings})",
             f"Mean final metrics over {len(seeds)} seed(s); speed: {speed_note}."]
    lines += _align(rows)
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
