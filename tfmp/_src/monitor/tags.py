"""The scalar tags of `tfmp.LossScaleMonitor`, named for TensorBoard's first screen.

TensorBoard opens on its Time Series tab, which groups the cards by the part of
the tag before the first ``/`` (a tag without one is a group of its own) and
sorts the groups, and the cards in each, by name. The monitor's scalars are
named so that the groups come in this order under every policy, and so that
runs under different policies put the same tag on the same card:

1. ``metrics/``: the training loss and metrics of Keras's logs
   (`tfmp._src.monitor.metrics`);
2. ``optimizer/``: the learning rate, with `grad_stats_freq` the gradient norm
   and the update ratio;
3. ``precision/``: the loss scale, the skipped-step counts and, with
   `grad_stats_freq`, bfloat16's relative precision (the update ratio's
   reference line) and, under float16 only, the float16 underflow, overflow and
   zero fractions of the gradients;
4. ``system/``: samples per second and GPU memory.

Without loss scaling the loss scale stays 1 and the counts 0 unless a step
goes non-finite: those flat lines come after what moves. The Custom Scalars
tab (`tfmp._src.monitor.layout`) puts the loss scale first where it moves.
Text tags (``overflow_events``, ``monitor_notes``, ``loss_scale_note``) are
on the Text tab and keep their names.
"""

from __future__ import annotations

#: Group of the loss and metrics of Keras's logs (sorts first).
METRICS = "metrics/"
#: Group of what the optimizer applies: learning rate, gradient norm, update ratio.
OPTIMIZER = "optimizer/"
#: Group of the loss scale, the skipped steps and the precision diagnostics.
PRECISION = "precision/"
#: Group of throughput and device memory.
SYSTEM = "system/"

#: Window scalars (written as ``<group><level>_<name>``, level ``batch`` or
#: ``epoch``) by name, with their group.
_WINDOW_GROUPS = {
    "loss_scale": PRECISION,
    "overflow_count": PRECISION,
    "skipped_steps": PRECISION,
    "overflow_rate": PRECISION,
    "consecutive_overflows": PRECISION,
    "lr": OPTIMIZER,
    "samples_per_second": SYSTEM,
}
#: Scalars written at the step they describe, by name, with their group.
_EVENT_GROUPS = {
    "overflow_scale": PRECISION,
    "grad_norm": OPTIMIZER,
    "update_ratio": OPTIMIZER,
    "bfloat16_relative_precision": PRECISION,
    "grad_underflow_fraction": PRECISION,
    "grad_overflow_fraction": PRECISION,
    "grad_zero_fraction": PRECISION,
}
#: The gradient statistics written only for a model computing in float16.
FLOAT16_ONLY = ("grad_underflow_fraction", "grad_overflow_fraction", "grad_zero_fraction")


def window(prefix: str, name: str) -> str:
    """The tag of window scalar `name` at level `prefix` (``"batch_"`` or ``"epoch_"``).

    GPU memory scalars (``gpu<i>_memory_mib``, ``gpu<i>_memory_peak_mib``) go
    to ``system/``.

    Example:
        >>> window("batch_", "loss_scale")
        'precision/batch_loss_scale'
    """
    group = SYSTEM if name.startswith("gpu") else _WINDOW_GROUPS[name]
    return f"{group}{prefix}{name}"


def event(name: str) -> str:
    """The tag of a scalar written at its own step (``overflow_scale``, a gradient statistic).

    Example:
        >>> event("grad_norm")
        'optimizer/grad_norm'
    """
    return _EVENT_GROUPS[name] + name
