"""Where `tfmp.LossScaleOptimizer` meets training loops.

`model.fit`: stuck detection. A run is stuck when it keeps skipping steps: lowering
the loss scale has not made the gradients finite, or cannot (the scale is at
`min_scale`, or the loss itself is NaN). The counters live in optimizer variables;
`check` reads them between steps and `track` makes `fit` call it.

Custom loops: `scaled_gradients` (Keras 3 dropped tf.keras 2's `get_scaled_loss`).
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, List

import keras
import tensorflow as tf

from tfmp._src.attachment import record
from tfmp._src.errors import NonFiniteError, invalid_argument, user_stacklevel
from tfmp._src.keras_hooks import surfaces, train_function, trainer
from tfmp._src.loss_scale import arguments, batch_check, saved_form, skips

#: Default of `max_consecutive_overflows`: more than the 24 halvings that take the
#: scale from `max_scale` 2**24 down to 1, so a healthy start never trips it.
DEFAULT_MAX_CONSECUTIVE_OVERFLOWS = 32
#: Consecutive overflows at `min_scale` after which the run counts as stuck: the
#: scale cannot be lowered any further, so retrying only burns batches.
MIN_SCALE_PATIENCE = 3


def check(optimizer: Any) -> None:
    """Raises or warns, per `optimizer.on_stuck`, when the run is stuck.

    Reads one scalar variable on a healthy step; after a skipped step, warns
    early when the skips call for it (`skips.warn_early`).

    Args:
        optimizer: `tfmp.LossScaleOptimizer`, built.

    Raises:
        NonFiniteError: With `on_stuck="raise"`, when `consecutive_overflows`
            reached `max_consecutive_overflows` or `min_scale_overflows` reached
            `MIN_SCALE_PATIENCE`.
    """
    overflows = int(optimizer.overflow_count.numpy())
    if overflows == optimizer._checked_overflows:
        return  # no step skipped since the last check: the last step was finite
    skips.warn_early(optimizer)
    limit = optimizer.max_consecutive_overflows
    consecutive = int(optimizer.consecutive_overflows.numpy())
    # Nothing to check again until a step is skipped, unless the run is overflowing.
    optimizer._checked_overflows = overflows if consecutive == 0 else None
    if consecutive < min(limit, MIN_SCALE_PATIENCE):
        return
    at_floor = int(optimizer.min_scale_overflows.numpy())
    if consecutive < limit and at_floor < MIN_SCALE_PATIENCE:
        return
    error = _diagnose(optimizer, consecutive, at_floor)
    if optimizer.on_stuck == "raise":
        raise error
    first_skipped = error.step - consecutive + 1  # identifies this run of overflows
    if optimizer._warned_run != first_skipped:
        optimizer._warned_run = first_skipped
        warnings.warn(str(error), RuntimeWarning, stacklevel=user_stacklevel())


def _diagnose(optimizer: Any, consecutive: int, at_floor: int) -> NonFiniteError:
    """Builds the error: a non-finite loss versus gradient overflow."""
    step = int(optimizer.last_overflow_step.numpy())
    scale = optimizer.loss_scale
    phase, kind, cause = skips.cause(int(optimizer.last_overflow_status.numpy()), optimizer.loss_scaling)
    if consecutive >= optimizer.max_consecutive_overflows:
        rule = (
            f"{consecutive} non-finite steps in a row "
            f"(max_consecutive_overflows={optimizer.max_consecutive_overflows})"
        )
    else:
        rule = (
            f"{at_floor} non-finite steps in a row at min_scale={optimizer.min_scale:g}"
        )
    message = (
        f"Training is stuck: {rule}; last skipped step {step}, loss scale {scale:g}. "
        f"{cause} Run tfmp.check_numerics(model) to find the first layer that "
        "produces it."
    )
    details = {
        "scale": scale,
        "overflow_count": int(optimizer.overflow_count.numpy()),
        "consecutive_overflows": consecutive,
        "min_scale_overflows": at_floor,
    }
    return NonFiniteError(message, phase=phase, step=step, kind=kind or None, details=details)


_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # tfmp optimizers not yet collected
_class_hooks: List[trainer.Hook] = []  # the stuck check's and the saved form's
_lock = threading.RLock()


def track(optimizer: Any) -> None:
    """Makes `model.fit` call `optimizer.raise_if_stuck()` after every step.

    Called by every `tfmp.LossScaleOptimizer` when it is created. Why a check
    between steps: `fit` runs the step in a `tf.function`, XLA-compiled by default
    on GPUs, where `tf.debugging.Assert` is dropped and `tf.py_function` does not
    compile; an error raised inside the graph would also reach the caller as a
    `tf.errors.OpError`, not as `NonFiniteError`. While at least one such optimizer
    exists, a hook on Keras's ``make_train_function`` (see `keras_hooks`) adds the
    check to each model whose optimizer is one, when its ``fit`` starts; the check
    reads one scalar per step, and `fit` already waits for each step's result. A
    custom loop in a `tf.function` calls `optimizer.raise_if_stuck()` itself.

    Beside it, a hook on Keras's ``get_compile_config`` saves such an optimizer
    in Keras's form, so plain Keras opens the file (`saved_form`).

    The hooks come off in `release_if_unused`, once the last such optimizer has been
    garbage-collected: at the next ``make_train_function`` or `tfmp.disable()`.
    Never from a garbage-collection callback, which can run in any thread while
    another holds the hooks' lock.

    Args:
        optimizer: `tfmp.LossScaleOptimizer`.
    """
    with _lock:
        _live.add(optimizer)
        if any(not hook.active for hook in _class_hooks):  # one taken off from outside: start again
            for hook in _class_hooks:
                hook.remove()
            _class_hooks.clear()
        if not _class_hooks:
            _class_hooks.extend(surfaces.all_or_none([
                lambda: trainer.install_make_train_function_hook(_attach, owner="loss_scale.fit_check"),
                lambda: trainer.install_compile_config_hook(
                    saved_form.compile_config_in_keras_form, owner="saved_form"),
            ]))


def untrack(optimizer: Any) -> None:
    """Forgets `optimizer` (one made only to check options), then `release_if_unused`."""
    with _lock:
        _live.discard(optimizer)
    release_if_unused()


def release_if_unused() -> None:
    """Takes the ``make_train_function`` and ``get_compile_config`` hooks off when no tfmp optimizer is alive."""
    with _lock:
        while not _live and _class_hooks:
            _class_hooks[-1].remove()
            _class_hooks.pop()


def _attach(model: Any) -> None:
    """Adds the stuck check and the batch record to `model` when its optimizer is a tfmp one.

    Not to a model `tfmp.detach` gave back to Keras: its optimizer still skips and
    counts non-finite steps, and `fit` runs Keras's train function alone.
    """
    if record.detached(model):
        return
    optimizer = getattr(model, "optimizer", None)
    if optimizer in _live:
        build_before_tracing(model, optimizer)
        skips.start_fit(optimizer)
    if optimizer in _live and not train_function.has_check(model, "stuck"):
        train_function.add_check(model, "stuck", functools.partial(_check_after_step, model))
        batch_check.watch(model)  # makes the train function again: the check above is kept
    elif optimizer not in _live and train_function.has_check(model, "stuck"):  # compiled with another one
        train_function.remove_check(model, "stuck")
        batch_check.unwatch(model)
    release_if_unused()


def forget(model: Any) -> None:
    """Takes the stuck check and the batch record off `model` (`tfmp.detach`), without making its train function."""
    train_function.remove_check(model, "stuck")
    batch_check.unwatch(model, remake=False)


def build_before_tracing(model: Any, optimizer: Any) -> None:
    """Builds `optimizer` for `model`'s trainable variables now, when both can be.

    Without a `tf.distribute` strategy Keras builds the optimizer inside the first
    trace of the train function; its variables are initialized when that function
    first runs, so a step that fails while tracing (a shape mismatch in the loss,
    a bug in a custom `train_step`) leaves every slot and counter uninitialized
    (read back as an empty array) and the optimizer unusable. Built here, as
    Keras's own symbolic build does under a strategy
    (``optimizer.build(model.trainable_variables)``), they are created eagerly and
    survive a failed trace. A model not built yet keeps Keras's order.
    """
    if not optimizer.built and model.built and model.trainable_variables:
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)


def _check_after_step(model: Any, logs: Any) -> Any:
    optimizer = getattr(model, "optimizer", None)
    if optimizer in _live and optimizer.built:
        optimizer.raise_if_stuck()
    return logs


def scaled_gradients(
    tape: tf.GradientTape,
    loss: Any,
    variables: Sequence[Any],
    optimizer: keras.optimizers.Optimizer,
) -> list:
    """Gradients of `optimizer.scale_loss(loss)`, for `optimizer.apply` in a custom loop.

    Keras 3's `apply` unscales the gradients itself, so pass these on unchanged::

        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tfmp.scaled_gradients(tape, loss, model.trainable_variables, opt)
        opt.apply(grads, model.trainable_variables)

    When the step runs in a `tf.function`, call `opt.raise_if_stuck()` after it
    (eager `apply` and `model.fit` do so already). Works for any Keras optimizer: a `LossScaleOptimizer` multiplies by its current
    scale (and records whether the loss is finite), a plain one by its
    `loss_scale_factor`, if any. Code moved from tf.keras 2 may instead keep
    `get_scaled_loss` and `get_unscaled_gradients` followed by `apply_gradients`.

    Args:
        tape: `tf.GradientTape` that recorded `loss` and has not yet computed
            gradients (unless persistent); the scaling is recorded on it too.
        loss: Scalar float tensor. The unscaled loss (float32 under mixed policies).
        variables: Sequence of `keras.Variable`, e.g. `model.trainable_variables`.
        optimizer: `keras.optimizers.Optimizer`. The optimizer that will apply them.

    Returns:
        List with one tensor per variable (None if unconnected), still multiplied
        by the loss scale.

    Raises:
        ValueError: (template) `tape` is not a `tf.GradientTape`; `loss` is not
            a scalar float tensor (a Python number or list, which the tape did
            not record, or a vector loss, which needs a reduction first);
            `variables` is not a non-empty list or tuple of variables or
            tensors; `optimizer` is not a `keras.optimizers.Optimizer`.
            Checked in Python: once per trace inside a `tf.function`.
    """
    if not isinstance(tape, tf.GradientTape):
        raise invalid_argument(
            "tape", tape, "the tf.GradientTape that recorded the loss",
            fix="Compute the loss inside `with tf.GradientTape() as tape:` and pass that tape.",
        )
    variables = arguments.check_gradient_arguments(loss, variables, optimizer)
    with tape:
        scaled_loss = optimizer.scale_loss(loss)
    return tape.gradient(scaled_loss, variables)
