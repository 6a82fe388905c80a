"""The TensorBoard custom-scalars layout written by `tfmp.LossScaleMonitor`.

What can move comes first: under dynamic loss scaling the loss scale and the overflow
count, then the loss and metrics and the gradient statistics; without loss scaling the
flat loss-scale charts follow those, closed, their titles saying why. Each chart matches
its tags exactly (`tags`).
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary

from tfmp._src.monitor import tags

#: Chart descriptions by tag (Markdown; TensorBoard shows them behind an info icon).
DESCRIPTIONS = {
    tags.event("overflow_scale"): "Loss scale of a step skipped for non-finite gradients "
    "(or loss, under the loss guard), at that step (one point per skipped step).",
    "overflow_events": "One line per skipped step: what was non-finite, the scale before and after.",
    tags.event("update_ratio"): "||weights after - before|| / ||weights before|| of one step "
    "(global L2 norms). Below 2**-8, a bfloat16 copy of the weights would not move.",
    tags.event("bfloat16_relative_precision"): "2**-8: relative changes smaller than this are "
    "lost when a weight is stored in bfloat16.",
}
for _prefix in ("batch_", "epoch_"):
    DESCRIPTIONS.update({
        tags.window(_prefix, "loss_scale"): "Loss scale (1.0 without loss scaling).",
        tags.window(_prefix, "overflow_count"): "Skipped (non-finite) steps since training began.",
        tags.window(_prefix, "overflow_rate"): "Skipped steps / steps, over the logging window.",
        tags.window(_prefix, "skipped_steps"): "Skipped steps in the logging window.",
        tags.window(_prefix, "consecutive_overflows"): "Skipped steps in a row.",
    })


def _chart(title: str, tags: Sequence[str]) -> layout_pb2.Chart:
    """A line chart of the given exact tags (anchored regular expressions)."""
    return _pattern_chart(title, [f"^{re.escape(t)}$" for t in tags])


def _pattern_chart(title: str, patterns: Sequence[str]) -> layout_pb2.Chart:
    """A line chart of the tags matching any of `patterns` (regular expressions)."""
    return layout_pb2.Chart(title=title, multiline=layout_pb2.MultilineChartContent(tag=list(patterns)))


#: The charts of gradient statistics (``grad_stats_freq``) and the update ratio.
_GRADIENTS = (
    _chart("global gradient norm (unscaled)", [tags.event("grad_norm")]),
    _chart("update / weight (global norms) vs bfloat16's 2**-8",
           [tags.event("update_ratio"), tags.event("bfloat16_relative_precision")]),
)
#: Its float16 chart, drawn for a model computing in float16 only.
_FLOAT16_GRADIENTS = _chart(
    "float16 underflow / overflow / zero fractions", [tags.event(name) for name in tags.FLOAT16_ONLY])


def _training_charts(prefixes: Sequence[str], metrics: Sequence[str]) -> list:
    """Per level, one chart per metric, the loss first; epoch charts add its ``val_`` twin."""
    charts = []
    for prefix in prefixes:
        level = prefix.rstrip("_")
        for name in sorted(metrics, key=lambda name: name != "loss"):  # stable: loss first
            val = "(val_)?" if prefix == "epoch_" else ""
            pattern = f"^{re.escape(tags.METRICS + prefix)}{val}{re.escape(name)}$"
            charts.append(_pattern_chart(f"{name} ({level})", [pattern]))
    return charts


def build_layout(prefixes: Sequence[str], grad_stats: bool, metrics: Sequence[str] = (),
                 fixed_scale: Optional[str] = None, float16: bool = False) -> layout_pb2.Layout:
    """Builds the layout for the tags a monitor writes.

    Args:
        prefixes: The logging levels written: ``"batch_"`` and/or ``"epoch_"``.
        grad_stats: Bool. Whether gradient statistics are written.
        metrics: Names of the training metrics in Keras's logs, without ``val_`` ones.
        fixed_scale: Why the loss scale stays at 1 (`metrics.fixed_scale_reason`), or None.
        float16: Bool. Whether the model computes in float16 (draws the fractions chart).

    Returns:
        `layout_pb2.Layout`. Under loss scaling: per level a category "loss scaling
        (<level>)" holding the loss scale beside the overflow count, then "training"
        (one chart per metric, the loss first, epoch ones with their ``val_`` twin),
        "gradients and updates", "loss scaling: details" and "throughput" (closed).
        With `fixed_scale`, "training" and "gradients and updates" come first, and
        the pairs, titled with the reason, and the details follow them closed.
    """
    learning = []
    if metrics:
        learning.append(layout_pb2.Category(title="training", chart=_training_charts(prefixes, metrics)))
    if grad_stats:
        charts = list(_GRADIENTS) + ([_FLOAT16_GRADIENTS] if float16 else [])
        learning.append(layout_pb2.Category(title="gradients and updates", chart=charts))
    # A fixed scale draws flat lines: they follow, closed, the charts that move.
    closed = bool(fixed_scale and learning)
    pairs, details, speed = [], [], []
    for prefix in prefixes:
        level = prefix.rstrip("_")
        scale_title = f"loss scale ({level}, fixed at 1)" if fixed_scale else f"loss scale ({level})"
        pair = [
            _chart(scale_title, [tags.window(prefix, "loss_scale")]),
            _chart(f"overflow count ({level})", [tags.window(prefix, "overflow_count")]),
        ]
        title = (f"loss scale ({level}, fixed at 1: {fixed_scale})" if fixed_scale
                 else f"loss scaling ({level})")
        pairs.append(layout_pb2.Category(title=title, chart=pair, closed=closed))
        details += [
            _chart(f"overflow rate ({level})", [tags.window(prefix, "overflow_rate")]),
            _chart(
                f"skipped steps ({level})",
                [tags.window(prefix, "skipped_steps"), tags.window(prefix, "consecutive_overflows")],
            ),
            _chart(f"learning rate ({level})", [tags.window(prefix, "lr")]),
        ]
        speed.append(_chart(f"samples per second ({level})", [tags.window(prefix, "samples_per_second")]))
    details.append(_chart("overflow events (scale that overflowed)", [tags.event("overflow_scale")]))
    categories = learning + pairs if fixed_scale else pairs + learning
    categories += [
        layout_pb2.Category(title="loss scaling: details", chart=details, closed=closed),
        layout_pb2.Category(title="throughput", chart=speed, closed=True),
    ]
    return layout_pb2.Layout(category=categories)


def layout_summary(layout: layout_pb2.Layout) -> summary_pb2.Summary:
    """`layout` as the `Summary` the custom-scalars plugin reads (its ``custom_scalars__config__`` tag)."""
    return custom_scalar_summary.pb(layout)
