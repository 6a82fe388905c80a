"""The scalar tags of `tfmp.LossScaleMonitor`, named for TensorBoard's first screen.

TensorBoard's Time Series tab groups cards by the part of a tag before the first ``/``
and sorts them by name, so these groups come in the same order, and a tag on the same
card, under every policy. Text tags (``overflow_events``, ``monitor_notes``,
``loss_scale_note``) have no group.
"""

from __future__ import annotations

#: The groups: Keras's logs (sorts first); learning rate, gradient norm and update ratio;
#: loss scale, skipped steps and precision diagnostics; throughput and device memory.
METRICS, OPTIMIZER, PRECISION, SYSTEM = "metrics/", "optimizer/", "precision/", "system/"

#: The gradient statistics written only for a model computing in float16.
FLOAT16_ONLY = ("grad_underflow_fraction", "grad_overflow_fraction", "grad_zero_fraction")
#: Window scalars (written as ``<group><level>_<name>``, level ``batch`` or
#: ``epoch``) by name, with their group.
_WINDOW_GROUPS = {
    **dict.fromkeys(("loss_scale", "overflow_count", "skipped_steps", "overflow_rate", "consecutive_overflows"),
                    PRECISION),
    "lr": OPTIMIZER,
    "samples_per_second": SYSTEM,
}
#: Scalars written at the step they describe, by name, with their group.
_EVENT_GROUPS = {
    **dict.fromkeys(("overflow_scale", "bfloat16_relative_precision", *FLOAT16_ONLY), PRECISION),
    "grad_norm": OPTIMIZER,
    "update_ratio": OPTIMIZER,
}


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
