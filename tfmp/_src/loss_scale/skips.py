"""Skipped steps said at once: why a step was skipped, and the early warning.

Stuck detection (`loops.check`) raises only after `max_consecutive_overflows` skips in a
row, so a short fit could end with nothing said but ``inf``. After an execution of the
train function (or an eager `apply`) that skipped a step, `warn_early` warns once per
window (`SkippedStepWarning`): at the first skip that cannot be a loss-scale overflow (a
non-finite batch, loss or written value, or no loss scaling), or, under dynamic loss
scaling, when the first `EARLY_STEPS` steps of the fit were all skipped or more than
`EARLY_RATE` of its steps, at least `EARLY_STEPS`. A window starts at a `fit` or
`train_on_batch` call at least `EARLY_STEPS` steps after the last one began. The warning
names the step, the counts, the cause (`last_overflow_status`) and the tool that finds
the source; healthy steps read one scalar (`overflow_count`).
"""

from __future__ import annotations

import warnings
from typing import Any, Tuple

import tensorflow as tf

from tfmp._src.constants import NON_FINITE_KINDS
from tfmp._src.errors import invalid_argument, user_stacklevel

#: Steps at the start of a fit that, all skipped, are warned about under loss scaling.
EARLY_STEPS = 8
#: Share of a fit's steps skipped (with at least `EARLY_STEPS` of them) that is warned about.
EARLY_RATE = 0.05


class SkippedStepWarning(RuntimeWarning):
    """Steps of a fit were skipped for a cause loss scaling cannot fix, or too many of them.

    Make it an error with ``warnings.simplefilter("error", tfmp.SkippedStepWarning)``.
    """


def cause(status: int, loss_scaling: bool) -> Tuple[str, str, str]:
    """(phase, kind, sentence): why the last skipped step was skipped, from `last_loss_status`.

    Args:
        status: Int. The optimizer's `last_overflow_status` bits (see `STATUS_BITS`).
        loss_scaling: Bool. Whether the optimizer scales the loss dynamically.

    Returns:
        Tuple of strings: the phase (``"batch"``, ``"loss"``, ``"values"`` or
        ``"gradients"``), the kind (``"nan"``, ``"inf"``, ``"nan+inf"`` or ``""``)
        and a sentence naming the cause and what to look at.
    """
    batch = NON_FINITE_KINDS.get((status >> 2) & 3, "")
    loss = NON_FINITE_KINDS.get(status & 3, "")
    if batch:
        return "batch", batch, (
            f"The batch itself holds {batch} (its inputs, targets or sample weights): "
            "the data pipeline produced it; lowering the loss scale cannot help. Find the "
            "records with tfmp.check_dataset(dataset)."
        )
    if loss:
        where = ("(a float16 overflow: float16 holds at most 65504)" if loss_scaling else
                 "(not a range overflow of the compute dtype: bfloat16 and float32 hold up to "
                 "about 3.4e38, so the values themselves diverged)")
        return "loss", loss, (
            f"The loss itself is non-finite ({loss}): it comes from the forward pass "
            f"{where}, the data or the learning rate, and lowering the loss scale cannot help."
        )
    if status & 16:
        return "values", "", (
            "The update would have written a non-finite value into a trainable "
            "variable although the gradients were finite: the learning rate (or the "
            "optimizer's epsilon) is too large or too small for these gradients."
        )
    if loss_scaling:
        return "gradients", "", (
            "The loss is finite but the gradients overflow (float16 holds at most "
            "65504) even at this scale: look for exploding activations or gradients, "
            "or lower the learning rate."
        )
    return "gradients", "", (
        "The loss is finite but a gradient is not: an inf or NaN born in the "
        "backward pass (a custom gradient, a sqrt or log at 0)."
    )


def start_fit(optimizer: Any) -> None:
    """At a `fit` or `train_on_batch` call: a new window when the last began `EARLY_STEPS` steps ago."""
    start = getattr(optimizer, "_fit_start", None)
    if not optimizer.built:
        optimizer._fit_start = start or (0, 0)  # built by the first step: counters at 0
        return
    counter = optimizer.total_steps.numpy()
    if counter.shape != ():  # built in a trace that failed: Keras never initialized the variables
        raise invalid_argument(
            "optimizer", optimizer, "an optimizer whose variables were initialized",
            fix=f"The optimizer {optimizer.name!r} was built inside a first step that failed while "
            "tracing, so Keras never initialized its variables (slots, loss scale, counters). "
            "Compile the model again with a new optimizer, e.g. model.compile(keras.optimizers."
            f"{type(optimizer.inner_optimizer).__name__}(...), loss=...), then fit.")
    total = int(counter)
    if start is None or total - start[0] >= EARLY_STEPS:
        optimizer._fit_start = (total, int(optimizer.overflow_count.numpy()))


def warn_early(optimizer: Any) -> None:
    """Warns once per fit when its skipped steps call for it (see the module docstring).

    Call after a step of which `consecutive_overflows` is at least 1.

    Warns:
        tfmp.SkippedStepWarning: naming the step, the counts, the cause and the tool.
    """
    start_total, start_skips = getattr(optimizer, "_fit_start", (0, 0))
    if optimizer._warned_fit == (start_total, start_skips):
        return
    steps = int(optimizer.total_steps.numpy()) - start_total
    skips = int(optimizer.overflow_count.numpy()) - start_skips
    if skips <= 0:
        return
    status = int(optimizer.last_overflow_status.numpy())
    phase, _, sentence = cause(status, optimizer.loss_scaling)
    not_overflow = phase != "gradients" or not optimizer.loss_scaling
    all_first = steps >= EARLY_STEPS and skips == steps
    rate = skips >= EARLY_STEPS and skips > EARLY_RATE * steps
    if not (not_overflow or all_first or rate):
        return
    optimizer._warned_fit = (start_total, start_skips)
    step = int(optimizer.last_overflow_step.numpy())
    kept = "weights and optimizer slots keep their values"
    if tf.distribute.get_strategy().num_replicas_in_sync == 1:  # see step_state
        kept = "weights, optimizer slots and BatchNormalization statistics keep their values"
    warnings.warn(
        f"tfmp skipped step {step} ({skips} of the {steps} steps since step {start_total}; "
        f"loss scale {optimizer.loss_scale:g}): nothing was written ({kept}). {sentence} "
        "Run tfmp.check_numerics(model) to find the first layer that goes non-finite. "
        "Warned once per fit; stuck detection stops the run after "
        f"{optimizer.max_consecutive_overflows} skipped steps in a row.",
        SkippedStepWarning,
        stacklevel=user_stacklevel(),  # the user's fit() or apply
    )
