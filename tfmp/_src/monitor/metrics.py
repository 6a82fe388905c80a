"""Training loss, metrics and the flat-scale note of `tfmp.LossScaleMonitor`.

The loss and compiled metrics come from the `logs` Keras hands every callback
(already Python numbers: Keras converts them once for all callbacks), so logging
them costs no extra read from the device. Keras reports each as its running mean
over the epoch so far. They are written under the tag group ``metrics/``:
``metrics/batch_<name>`` at the monitor's batch logging points and
``metrics/epoch_<name>`` (validation ones as ``metrics/epoch_val_<name>``) at
each epoch's end. The group keeps them apart from the ``batch_<name>`` /
``epoch_<name>`` tags of `keras.callbacks.TensorBoard`, which may write into the
same run: two writers of one tag in one run would interleave their points.
"""

from __future__ import annotations

import numbers
from typing import Any, Dict, Mapping, Optional

import keras

from tfmp._src.monitor import tags

#: Group (prefix before ``/``) of the tags of Keras's logs; sorts first (`tags`).
GROUP = tags.METRICS
#: Keys of `logs` not written: the monitor logs the learning rate itself (``lr``).
_SKIPPED = frozenset({"learning_rate"})
#: Text tag of the note saying why the loss-scale chart is flat.
NOTE_TAG = "loss_scale_note"


def metric_scalars(prefix: str, logs: Optional[Mapping[str, Any]]) -> Dict[str, float]:
    """The scalar numbers of Keras's `logs` as monitor tags.

    Args:
        prefix: String. ``"batch_"`` or ``"epoch_"``.
        logs: Mapping from metric name to value, as Keras passes it to
            callbacks, or None. Entries that are not real numbers (e.g. a metric
            returning a vector) and ``learning_rate`` are left out.

    Returns:
        Dict from ``metrics/<prefix><name>`` to float, in the order of `logs`.

    Example:
        >>> metric_scalars("batch_", {"loss": 0.5, "accuracy": 0.75})
        {'metrics/batch_loss': 0.5, 'metrics/batch_accuracy': 0.75}
    """
    scalars = {}
    for name, value in (logs or {}).items():
        number = None if name in _SKIPPED else _real(value)
        if number is not None:
            scalars[f"{GROUP}{prefix}{name}"] = number
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
    name = tag[len(GROUP):]
    level, _, metric = name.partition("_")
    if metric.startswith("val_"):
        return f"Validation {metric[4:]} at the end of each epoch (Keras's `logs`)."
    return f"Training {metric}, Keras's running mean over the epoch so far, at each {level} logging point."


def scales_loss(optimizer: Any) -> bool:
    """Whether `optimizer` scales the loss, so that its scale can move.

    Args:
        optimizer: The model's optimizer. A Keras (or tfmp) `LossScaleOptimizer`
            scales the loss unless built with ``loss_scaling=False`` (tfmp's
            fixed-scale guard for bfloat16 and float32); any other optimizer
            does not.

    Returns:
        Bool.
    """
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and bool(
        getattr(optimizer, "loss_scaling", True)
    )


def fixed_scale_reason(optimizer: Any, policy_name: str) -> Optional[str]:
    """Why the loss scale stays at 1, for chart titles; None when it can move.

    Args:
        optimizer: The model's optimizer (see `scales_loss`).
        policy_name: String. The model's dtype policy, e.g. ``"mixed_bfloat16"``.

    Returns:
        String such as ``"no loss scaling under mixed_bfloat16"``, or None
        under loss scaling.

    Example:
        >>> fixed_scale_reason(keras.optimizers.SGD(), "float32")
        'no loss scaling under float32'
    """
    return None if scales_loss(optimizer) else f"no loss scaling under {policy_name}"


def flat_scale_note(optimizer: Any, compute_dtype: str) -> Optional[str]:
    """Why the loss-scale chart stays at 1, or None when the scale can move.

    Args:
        optimizer: The model's optimizer (see `scales_loss`).
        compute_dtype: String. The model's compute dtype, e.g. ``"bfloat16"``.

    Returns:
        One line of Markdown, or None under dynamic loss scaling.
    """
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
