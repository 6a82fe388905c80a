"""The scalar tags of `tfmp.LossScaleMonitor`, named for TensorBoard's first screen.

TensorBoard's Time Series tab groups cards by the part of the tag before the first ``/``
and sorts groups and cards by name. The groups come in this order under every policy,
and runs under different policies put the same tag on the same card: ``metrics/``
(Keras's logs, `tfmp._src.monitor.metrics`), ``optimizer/`` (learning rate, gradient
norm, update ratio), ``precision/`` (loss scale, skipped-step counts, bfloat16's relative
precision, float16's gradient fractions), ``system/`` (samples per second, GPU memory).
Without loss scaling the flat scale and counts come after what moves. Text tags
(``overflow_events``, ``monitor_notes``, ``loss_scale_note``) keep their names.
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
