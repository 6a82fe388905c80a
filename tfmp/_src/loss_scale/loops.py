"""Where `tfmp.LossScaleOptimizer` meets training loops: skipped steps said, stuck runs stopped.

`model.fit` runs `check` after each step and records each batch (the ``"batch"`` guard: a
NaN in the data can leave the loss finite); checks run between steps, not in the graph,
where XLA drops ``tf.debugging.Assert``. Custom loops: `scaled_gradients`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any, Callable, List, Optional, Tuple

import keras
import tensorflow as tf

from tfmp._src.attachment import record
from tfmp._src.constants import NON_FINITE_KINDS
from tfmp._src.errors import NonFiniteError, invalid_argument, opening, warn, warn_error
from tfmp._src.keras_hooks import surfaces, train_function, trainer
from tfmp._src.loss_scale import arguments, saved_form, state_check

#: Default of `max_consecutive_overflows`: more than the 24 halvings from 2**24 to 1.
DEFAULT_MAX_CONSECUTIVE_OVERFLOWS = 32
#: Overflows in a row at `min_scale` that count as stuck: the scale cannot go lower.
MIN_SCALE_PATIENCE = 3
#: Steps at the start of a fit that, all skipped, are warned about under loss scaling.
EARLY_STEPS = 8
#: Share of a fit's steps skipped (with at least `EARLY_STEPS` of them) that is warned about.
EARLY_RATE = 0.05
#: Keras's default `initial_scale`. Steps skipped from the optimizer's first step on at a higher scale
#: are the descent a higher start costs (``initial_scale=2**24``: about 8 steps), not a fault: unwarned.
DEFAULT_INITIAL_SCALE = 2.0**15
_BATCH_HOOK = "_tfmp_batch_check"  # on a model: its train_step hook


@dataclasses.dataclass
class Watch:
    """What the checks between steps remember of one optimizer (not saved)."""

    fit_start: Optional[Tuple[int, int]] = None  # (total_steps, overflow_count) as the warning window began
    warned_fit: Optional[Tuple[int, int]] = None  # the window `warn_early` warned about
    warned_run: Optional[int] = None  # the first skipped step of the stuck run `check` warned about
    checked: Optional[int] = 0  # overflow_count at the last `check` (None: check again)
    descent: int = 0  # steps of the initial descent (`initial_descent`), kept once the history wraps


class SkippedStepWarning(RuntimeWarning):
    """Steps of a fit were skipped for a cause loss scaling cannot fix, or too many of them.

    Make it an error with ``warnings.simplefilter("error", tfmp.SkippedStepWarning)``.
    """


#: The fix line of a skip whose first non-finite value a layer of the forward or backward pass made.
FIND_LAYER = "Fix: tfmp.check_numerics(model) finds the first layer that goes non-finite"
#: The fix line of a NaN loss: an XLA-compiled step gives NaN for a label TensorFlow's kernel refuses.
LABEL_NAN_FIX = ("Fix: tfmp.check_numerics(model) finds the first non-finite layer, or lower the learning rate; "
                 "under XLA, check labels.")


def cause(status: int, loss_scaling: bool) -> Tuple[str, str, str, str]:
    """(phase, kind, cause, fix) of the last skip from its `last_overflow_status` bits.

    Phase ``"scale"``, ``"batch"``, ``"loss"``, ``"values"`` or ``"gradients"``; kind ``"nan"``,
    ``"inf"``, ``"nan+inf"`` or ``""``; `cause` and `fix` are one line each of a message's opening.
    """
    if status & 32:
        return "scale", "", (
            "The loss scale itself was not a finite number > 0: a checkpoint or code assigned it."
        ), "Fix: restore a sound checkpoint, or check what assigns dynamic_scale (now min_scale)."
    batch = NON_FINITE_KINDS.get((status >> 2) & 3, "")
    loss = NON_FINITE_KINDS.get(status & 3, "")
    if batch:
        return "batch", batch, (
            f"The batch itself holds {batch} (inputs, targets or sample weights), not the model."
        ), "Fix: find the records with tfmp.check_dataset(dataset); a lower loss scale cannot help."
    if loss:
        where = ("float16 holds at most 65504" if loss_scaling else
                 "not an overflow: bfloat16 and float32 reach 3.4e38")
        return "loss", loss, (
            f"The loss itself is non-finite ({loss}; {where}): a lower loss scale cannot help."
        ), LABEL_NAN_FIX if "nan" in loss else f"{FIND_LAYER}, or lower the learning rate."
    if status & 16:
        return "values", "", (
            "The update would have written a non-finite value into a variable although the gradients were finite."
        ), "Fix: the learning rate (or the optimizer's epsilon) is too large or too small for these gradients."
    if loss_scaling:
        return "gradients", "", (
            "The loss is finite but the gradients overflow (float16 holds at most 65504) even at this scale."
        ), f"{FIND_LAYER}, or lower the learning rate."
    return "gradients", "", (
        "The loss is finite but a gradient is not: an inf or NaN born in the backward pass."
    ), f"{FIND_LAYER} (a custom gradient, sqrt or log at 0)."


def _read(optimizer: Any, name: str) -> int:
    return int(getattr(optimizer, name).numpy())


def start_fit(optimizer: Any) -> None:
    """At a `fit` or `train_on_batch` call: a new warning window once the last is `EARLY_STEPS` old.

    Raises:
        ValueError: (template) variables never initialized; (`state_check`) a scale or counter no run reaches.
    """
    watch = optimizer._watch
    if not optimizer.built:
        watch.fit_start = watch.fit_start or (0, 0)  # built by the first step: counters at 0
        return
    counter = optimizer.total_steps.numpy()
    if counter.shape != ():  # built in a trace that failed: Keras never initialized the variables
        raise invalid_argument(
            "optimizer", optimizer, "an optimizer whose variables were initialized",
            fix=f"The optimizer {optimizer.name!r} was built inside a first step that failed while "
            "tracing, so Keras never initialized its variables (slots, loss scale, counters). "
            "Compile the model again with a new optimizer, e.g. model.compile(keras.optimizers."
            f"{type(optimizer.inner_optimizer).__name__}(...), loss=...), then fit.")
    state_check.check_variables(optimizer)  # e.g. restored from a checkpoint: refused before a step runs
    total = int(counter)
    if watch.fit_start is None or total - watch.fit_start[0] >= EARLY_STEPS:
        watch.fit_start = (total, _read(optimizer, "overflow_count"))


def initial_descent(optimizer: Any) -> int:
    """Int >= 0: the steps from the optimizer's first on, each skipped at a scale above
    `DEFAULT_INITIAL_SCALE` (read from the overflow history); 0 without loss scaling."""
    if not optimizer.loss_scaling:
        return 0
    scale_before = dict(zip(optimizer.overflow_history_steps.numpy().tolist(),
                            optimizer.overflow_history_scales.numpy()[:, 0].tolist()))
    steps = 0
    while scale_before.get(steps, 0.0) > DEFAULT_INITIAL_SCALE:
        steps += 1
    return steps


def warn_early(optimizer: Any) -> None:
    """Warns (`SkippedStepWarning`) once per fit window at the first skip loss scaling cannot cause, or when
    the first `EARLY_STEPS` steps, or more than `EARLY_RATE` of at least `EARLY_STEPS`, were skipped.

    The initial descent from an `initial_scale` above Keras's default (`initial_descent`) is left out of
    the count: those skips are what starting higher costs, and the monitor logs each of them.
    """
    watch = optimizer._watch
    start_total, start_skips = watch.fit_start or (0, 0)
    if watch.warned_fit == (start_total, start_skips):
        return
    skips = _read(optimizer, "overflow_count") - start_skips
    if skips <= 0:
        return
    phase, _, why, fix = cause(_read(optimizer, "last_overflow_status"), optimizer.loss_scaling)
    not_overflow = phase != "gradients" or not optimizer.loss_scaling
    watch.descent = max(watch.descent, initial_descent(optimizer))
    descent = 0 if not_overflow else max(0, watch.descent - start_total)  # its steps in this window
    since = start_total + descent
    steps = _read(optimizer, "total_steps") - since
    skips -= descent
    all_first = steps >= EARLY_STEPS and skips == steps
    rate = skips >= EARLY_STEPS and skips > EARLY_RATE * steps
    if not (not_overflow or all_first or rate):
        return
    watch.warned_fit = (start_total, start_skips)
    warn(f"tfmp skipped step {_read(optimizer, 'last_overflow_step')} ({skips} of {steps} steps since step "
         f"{since}; scale {optimizer.loss_scale:g}): nothing written.", why, fix,
         SkippedStepWarning, section="nan-or-inf-loss")


def check(optimizer: Any) -> None:
    """`LossScaleOptimizer.raise_if_stuck` of a built `optimizer`; warns early (`warn_early`) after a skip."""
    overflows, watch = _read(optimizer, "overflow_count"), optimizer._watch
    if overflows == watch.checked:
        return  # no step skipped since the last check: the last step was finite
    warn_early(optimizer)
    limit = optimizer.max_consecutive_overflows
    consecutive = _read(optimizer, "consecutive_overflows")
    # Nothing to check again until a step is skipped, unless the run is overflowing.
    watch.checked = overflows if consecutive == 0 else None
    if consecutive < min(limit, MIN_SCALE_PATIENCE):
        return
    at_floor = _read(optimizer, "min_scale_overflows")
    if consecutive < limit and at_floor < MIN_SCALE_PATIENCE:
        return
    step, scale = _read(optimizer, "last_overflow_step"), optimizer.loss_scale
    phase, kind, why, fix = cause(_read(optimizer, "last_overflow_status"), optimizer.loss_scaling)
    if consecutive >= limit:
        rule = f"{consecutive} non-finite steps in a row (max_consecutive_overflows={limit})"
    else:
        rule = f"{at_floor} non-finite steps in a row at min_scale={optimizer.min_scale:g}"
    error = NonFiniteError(
        opening(f"Training is stuck: {rule}; last skipped step {step}, loss scale {scale:g}.", why, fix,
                "nan-or-inf-loss"),
        phase=phase, step=step, kind=kind or None,
        details={"scale": scale, "overflow_count": overflows, "consecutive_overflows": consecutive,
                 "min_scale_overflows": at_floor})
    if optimizer.on_stuck == "raise":
        raise error
    if watch.warned_run != step - consecutive + 1:  # the first skipped step names this run
        watch.warned_run = step - consecutive + 1
        warn_error(error, RuntimeWarning)


_live: "weakref.WeakSet[Any]" = weakref.WeakSet()  # tfmp optimizers not yet collected
_served: "weakref.WeakSet[Any]" = weakref.WeakSet()  # those an attached model's own hooks serve (`serve`)
_class_hooks: List[trainer.Hook] = []  # the stuck check's and the saved form's
_lock = threading.RLock()


def track(optimizer: Any) -> None:
    """Makes `model.fit` check `optimizer` after every step and save it in Keras's form: through class
    hooks until an attached model serves it (`serve`); `release_if_unused`, never a gc callback, takes them off."""
    with _lock:
        _live.add(optimizer)
        _hold_class_hooks()


def _installs(model: Any = None) -> list:
    """The installs of the stuck check's and the saved form's hooks, on `model` or (None) the class."""
    return [
        lambda: trainer.install_make_train_function_hook(_attach, owner="loss_scale.fit_check", model=model),
        lambda: trainer.install_compile_config_hook(saved_form.compile_config_in_keras_form, owner="saved_form",
                                                    model=model),
    ]


def _hold_class_hooks() -> None:
    with _lock:
        if any(not hook.active for hook in _class_hooks):  # one taken off from outside: start again
            for hook in _class_hooks:
                hook.remove()
            _class_hooks.clear()
        if not _class_hooks:
            _class_hooks.extend(surfaces.all_or_none(_installs()))


def release_if_unused() -> None:
    """Takes the class hooks off when an attached model serves every live tfmp optimizer (or none lives)."""
    with _lock:
        while _class_hooks and all(optimizer in _served for optimizer in _live):
            _class_hooks[-1].remove()
            _class_hooks.pop()


def serve(model: Any) -> None:
    """Gives attached `model` its own hooks (stuck check, batch record, saved form) before Keras makes its
    functions, so they bind the ``train_step`` hook. Raises what installing a hook raises, the model as before."""
    if not _serves_itself(model):
        surfaces.all_or_none(_installs(model) + [lambda: _batch_hook(model)])
        # Its wrapper's make hook goes on now, outermost, so the checks wrap the step scope.
        train_function.add_check(model, "stuck", functools.partial(_check_after_step, model))
    if getattr(model, "optimizer", None) in _live:  # at load, the optimizer comes later (`_attach`)
        serve_optimizer(model.optimizer)


def _serves_itself(model: Any) -> bool:
    return trainer.subscribed(model, "make_train_function", "loss_scale.fit_check")


def serve_optimizer(optimizer: Any) -> None:
    """Counts `optimizer` as served by its model's own checks (`custom_optimizers`): no class hook."""
    _served.add(optimizer)
    release_if_unused()


def _attach(model: Any) -> None:
    """As Keras makes `model`'s train function: a model `serve` did not hook has the check and batch
    record while its optimizer is a tfmp one."""
    if record.detached(model):
        return
    optimizer = getattr(model, "optimizer", None)
    live = optimizer in _live
    if live:
        build_before_tracing(model, optimizer)
        start_fit(optimizer)
    if _serves_itself(model):
        if live:
            _served.add(optimizer)
    elif live and not train_function.has_check(model, "stuck"):
        train_function.add_check(model, "stuck", functools.partial(_check_after_step, model))
        _watch_batches(model)  # makes the train function again: the check above is kept
    elif not live and train_function.has_check(model, "stuck"):  # compiled with another one
        train_function.remove_check(model, "stuck")
        _unwatch_batches(model)
    release_if_unused()


def forget(model: Any) -> None:
    """Takes the stuck check and the batch record off `model` (`tfmp.detach`); class hooks serve its optimizer."""
    train_function.remove_check(model, "stuck")
    _unwatch_batches(model, remake=False)
    optimizer = getattr(model, "optimizer", None)
    if optimizer in _served:
        _served.discard(optimizer)
        _hold_class_hooks()


def _batch_hook(model: Any) -> trainer.Hook:
    hook = trainer.subscribe(model, "train_step", functools.partial(_recording_step, model), owner="loss_scale.batch")
    object.__setattr__(model, _BATCH_HOOK, hook)
    return hook


def _watch_batches(model: Any) -> None:
    """Hooks `model`'s ``train_step`` to hand each batch to `record_batch`; makes the train function again."""
    hook = vars(model).get(_BATCH_HOOK)
    if hook is not None and hook.active:
        return
    _batch_hook(model)
    model.make_train_function(force=True)


def _unwatch_batches(model: Any, *, remake: bool = True) -> None:
    """Takes the ``train_step`` hook off `model`; with `remake`, the train function is made again without it."""
    hook = vars(model).pop(_BATCH_HOOK, None)
    if hook is not None and hook.active:
        hook.remove()
        if remake:
            model.make_train_function(force=True)


def _recording_step(model: Any, next_step: Callable) -> Callable:
    @functools.wraps(next_step)
    def train_step(data: Any) -> Any:
        optimizer = getattr(model, "optimizer", None)
        record_batch = getattr(optimizer, "record_batch", None)
        if record_batch is not None and getattr(optimizer, "built", False):
            record_batch(data)
        return next_step(data)

    return train_step


def build_before_tracing(model: Any, optimizer: Any) -> None:
    """Builds `optimizer` before the first trace (as Keras does under a strategy): a failed trace would
    leave every slot and counter uninitialized."""
    if not optimizer.built and model.built and model.trainable_variables:
        with model.distribute_strategy.scope():
            optimizer.build(model.trainable_variables)


def _check_after_step(model: Any, logs: Any) -> Any:
    optimizer = getattr(model, "optimizer", None)
    if optimizer in _live:
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

    In a `tf.function` step, call `opt.raise_if_stuck()` after it (eager `apply` and
    `model.fit` do). Any Keras optimizer works: a `LossScaleOptimizer` multiplies by its
    scale (and records whether the loss is finite), a plain one by its `loss_scale_factor`, if any.
    Clip only after `opt.get_unscaled_gradients` (or with the inner optimizer's
    `global_clipnorm`): a `LossScaleOptimizer` refuses these gradients clipped while scaled,
    traced (a clipping op) or eager (shrunk or cut from these very tensors).

    Args:
        tape: `tf.GradientTape` that recorded `loss` and has not yet computed gradients
            (unless persistent); the scaling is recorded on it too.
        loss: Scalar float tensor. The unscaled loss (float32 under mixed policies).
        variables: Sequence of `keras.Variable`, e.g. `model.trainable_variables`.
        optimizer: `keras.optimizers.Optimizer`. The optimizer that will apply them.

    Returns:
        List with one tensor per variable (None if unconnected), still multiplied by the
        loss scale.

    Raises:
        ValueError: (template) `tape` is not a `tf.GradientTape`; `loss` is not a scalar
            float tensor; `variables` is not a non-empty list or tuple of variables or
            tensors; `optimizer` is not a `keras.optimizers.Optimizer`. Checked once per
            trace inside a `tf.function`.
    """
    if not isinstance(tape, tf.GradientTape):
        raise invalid_argument(
            "tape", tape, "the tf.GradientTape that recorded the loss",
            fix="Compute the loss inside `with tf.GradientTape() as tape:` and pass that tape.",
        )
    variables = arguments.check_gradient_arguments(loss, variables, optimizer)
    with tape:
        scaled_loss = optimizer.scale_loss(loss)
    grads = tape.gradient(scaled_loss, variables)
    note = getattr(optimizer, "_note_handed_out", None)  # a tfmp.LossScaleOptimizer's: eager, `apply` tells
    if note is not None:                                  # a clip of them (`guard.cut_while_scaled`)
        note(grads)
    return grads
