"""Training loss, metrics and the flat-scale note of `tfmp.LossScaleMonitor`.

The loss and metrics come from the `logs` Keras hands every callback (no extra device
read), written as ``metrics/<level>_<name>``: the group keeps them apart from the
``batch_<name>`` / ``epoch_<name>`` tags `keras.callbacks.TensorBoard` may write into the
same run (two writers of one tag would interleave their points).
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Mapping, Optional

import keras

from tfmp._src.monitor import tags

#: Text tag of the note saying why the loss-scale chart is flat.
NOTE_TAG = "loss_scale_note"


def metric_scalars(prefix: str, logs: Optional[Mapping[str, Any]]) -> Dict[str, float]:
    """``metrics/<prefix><name>`` -> float for the real numbers of Keras's `logs`, in order.

    Entries that are not one real number (a metric returning a vector) and ``learning_rate``
    are left out.

    Example:
        >>> metric_scalars("batch_", {"loss": 0.5, "accuracy": 0.75})
        {'metrics/batch_loss': 0.5, 'metrics/batch_accuracy': 0.75}
    """
    scalars = {}
    for name, value in (logs or {}).items():
        number = None if name == "learning_rate" else _real(value)  # the monitor writes ``lr`` itself
        if number is not None:
            scalars[f"{tags.METRICS}{prefix}{name}"] = number
    return scalars


def _real(value: Any) -> Optional[float]:
    """`value` as a float if it is one real number (Python, NumPy scalar or 0-d array)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):  # NumPy's scalar types register here too
        return float(value)
    dtype = getattr(value, "dtype", None)
    if getattr(value, "shape", None) == () and getattr(dtype, "kind", "") in ("f", "i", "u"):
        return float(value)
    return None


def describe_metric(tag: str) -> str:
    """The chart description of a ``metrics/`` tag (Markdown)."""
    name = tag[len(tags.METRICS):]
    level, _, metric = name.partition("_")
    if metric.startswith("val_"):
        return f"Validation {metric[4:]} at the end of each epoch (Keras's `logs`)."
    return f"Training {metric}, Keras's running mean over the epoch so far, at each {level} logging point."


def scales_loss(optimizer: Any) -> bool:
    """Bool. Whether `optimizer` scales the loss: a Keras (or tfmp) `LossScaleOptimizer` not built
    with ``loss_scaling=False`` (tfmp's fixed-scale guard for bfloat16 and float32)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and bool(
        getattr(optimizer, "loss_scaling", True)
    )


def fixed_scale_reason(optimizer: Any, policy_name: str) -> Optional[str]:
    """Why the loss scale stays at 1, for chart titles; None when it can move (`scales_loss`).

    Example:
        >>> fixed_scale_reason(keras.optimizers.SGD(), "float32")
        'no loss scaling under float32'
    """
    return None if scales_loss(optimizer) else f"no loss scaling under {policy_name}"


def flat_scale_note(optimizer: Any, compute_dtype: str) -> Optional[str]:
    """Why the loss-scale chart stays at 1 (one line of Markdown), or None when the scale can move."""
    if scales_loss(optimizer):
        return None
    if compute_dtype == "float16":
        why = ("this float16 model's optimizer does not scale the loss, so small "
               "gradients can underflow: compile under tfmp.enable()")
    elif compute_dtype == "bfloat16":
        why = ("bfloat16 has float32's exponent range, so gradients do not "
               "underflow or overflow as in float16 and no loss scaling is needed")
    else:
        why = f"{compute_dtype} needs no loss scaling"
    return (
        f"The loss scale stays 1 (a flat chart): {why}. Watch the skipped steps "
        "(precision/*_overflow_count) and, with grad_stats_freq, optimizer/grad_norm and "
        "optimizer/update_ratio against 2**-8 instead."
    )
