"""The TensorBoard custom-scalars layout written by `tfmp.LossScaleMonitor`.

TensorBoard's Custom Scalars tab (`tensorboard.plugins.custom_scalar`) lays out
charts from a `Layout` proto found in the run's event files under the tag
``custom_scalars__config__``. The first categories put the loss scale and the
cumulative overflow count side by side, one category per logging level (batch,
epoch), so a halving of the scale lines up with the overflow that caused it; the
others hold the finer loss-scaling signals and, when enabled, the gradient statistics.
Each chart matches its tag exactly (the tags are listed in `tfmp._src.monitor.callback`).
"""

from __future__ import annotations

from typing import Sequence

from tensorboard.compat.proto import summary_pb2
from tensorboard.plugins.custom_scalar import layout_pb2
from tensorboard.plugins.custom_scalar import metadata as layout_metadata
from tensorboard.plugins.custom_scalar import summary as custom_scalar_summary

#: Tag under which the custom-scalars plugin looks for the layout.
LAYOUT_TAG = layout_metadata.CONFIG_SUMMARY_TAG


def _chart(title: str, tags: Sequence[str]) -> layout_pb2.Chart:
    """A line chart of the given exact tags (anchored regular expressions)."""
    return layout_pb2.Chart(
        title=title,
        multiline=layout_pb2.MultilineChartContent(tag=[f"^{t}$" for t in tags]),
    )


def build_layout(prefixes: Sequence[str], grad_stats: bool) -> layout_pb2.Layout:
    """Builds the layout for the tags a monitor writes.

    Args:
        prefixes: Sequence of strings, the logging levels written: ``"batch_"``
            and/or ``"epoch_"``.
        grad_stats: Bool. Whether gradient statistics are written.

    Returns:
        `layout_pb2.Layout`: per level a category "loss scaling (batch)" /
        "loss scaling (epoch)" holding exactly the loss scale and the overflow
        count (a category is one grid, so the two charts sit side by side), then
        "loss scaling: details", "throughput" and, with `grad_stats`,
        "gradients".
    """
    categories, details, speed = [], [], []
    for prefix in prefixes:
        level = prefix.rstrip("_")
        pair = [
            _chart(f"loss scale ({level})", [f"{prefix}loss_scale"]),
            _chart(f"overflow count ({level})", [f"{prefix}overflow_count"]),
        ]
        categories.append(
            layout_pb2.Category(title=f"loss scaling ({level})", chart=pair)
        )
        details += [
            _chart(f"overflow rate ({level})", [f"{prefix}overflow_rate"]),
            _chart(
                f"skipped steps ({level})",
                [f"{prefix}skipped_steps", f"{prefix}consecutive_overflows"],
            ),
            _chart(f"learning rate ({level})", [f"{prefix}lr"]),
        ]
        speed.append(
            _chart(f"samples per second ({level})", [f"{prefix}samples_per_second"])
        )
    details.append(
        _chart("overflow events (scale that overflowed)", ["overflow_scale"])
    )
    categories += [
        layout_pb2.Category(title="loss scaling: details", chart=details),
        layout_pb2.Category(title="throughput", chart=speed, closed=True),
    ]
    if grad_stats:
        categories.append(
            layout_pb2.Category(
                title="gradients",
                chart=[
                    _chart("global gradient norm (unscaled)", ["grad_norm"]),
                    _chart(
                        "float16 underflow / overflow / zero fractions",
                        [
                            "grad_underflow_fraction",
                            "grad_overflow_fraction",
                            "grad_zero_fraction",
                        ],
                    ),
                ],
            )
        )
    return layout_pb2.Layout(category=categories)


def layout_summary(layout: layout_pb2.Layout) -> summary_pb2.Summary:
    """Wraps a layout as the summary the custom-scalars plugin reads.

    Args:
        layout: `layout_pb2.Layout`.

    Returns:
        `Summary` from `tensorboard.plugins.custom_scalar.summary.pb`, with tag
        `LAYOUT_TAG`.
    """
    return custom_scalar_summary.pb(layout)
