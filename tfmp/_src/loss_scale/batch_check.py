"""The batch a train step receives, seen by the ``"batch"`` guard of `tfmp.LossScaleOptimizer`.

A NaN in the data can leave the loss finite: ``relu(NaN)`` is 0 in TensorFlow, so
an MLP with ReLU gives a finite loss while the first layer's gradient is NaN, and
a guard that checks only the loss lets the step write NaN into the weights. The
``"batch"`` guard therefore checks the batch too. `watch` hooks a model's
``train_step`` (the instance's, owner ``"loss_scale.batch"``), once, when `fit` or
`train_on_batch` first makes its train function while its optimizer is a tfmp
one (and makes the train function again with it); the hook hands the step's ``data`` to the optimizer's `record_batch` before
Keras's (or the user's) ``train_step`` runs. It acts while the step is traced
only: the check itself is two reductions per float tensor of the batch in the
step's graph, made as the step starts. Under every guard the finding goes into
`last_loss_status`, so a skip is explained (a NaN in the data is no loss-scale
overflow); only the ``"batch"`` guard (and ``"values"`` without loss scaling)
skips by it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from tfmp._src.keras_hooks import trainer

_ATTR = "_tfmp_batch_check"


def watch(model: Any) -> None:
    """Hooks `model`'s ``train_step`` to record each batch for the ``"batch"`` guard (idempotent).

    Called right after Keras made the train function, which holds the
    ``train_step`` it was made with: the function is made again (not yet
    traced, so nothing is lost) to take the hooked one.
    """
    hook = vars(model).get(_ATTR)
    if hook is not None and hook.active:
        return
    hook = trainer.subscribe(model, "train_step", functools.partial(_wrap, model), owner="loss_scale.batch")
    object.__setattr__(model, _ATTR, hook)
    model.make_train_function(force=True)


def unwatch(model: Any, *, remake: bool = True) -> None:
    """Takes the ``train_step`` hook off `model` (its optimizer is no longer a tfmp one, or it was detached).

    Called as Keras makes the train function, before it is traced: with `remake`
    the function is made again to take Keras's own ``train_step``.
    """
    hook = vars(model).pop(_ATTR, None)
    if hook is not None and hook.active:
        hook.remove()
        if remake:
            model.make_train_function(force=True)


def _wrap(model: Any, next_step: Callable) -> Callable:
    @functools.wraps(next_step)
    def train_step(data: Any) -> Any:
        optimizer = getattr(model, "optimizer", None)
        record = getattr(optimizer, "record_batch", None)
        if record is not None and getattr(optimizer, "built", False):
            record(data)
        return next_step(data)

    return train_step
