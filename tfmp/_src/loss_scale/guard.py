"""What `tfmp.LossScaleOptimizer` checks before applying a step, and whether the loss was scaled.

Guards (the `guard` argument). A step is skipped, and counted, when its check fails:

- ``"gradients"``: every gradient finite on every replica. What dynamic loss
  scaling needs (an overflow shows up only in the gradients), and it also
  catches a finite loss whose backward pass overflows. Its cost: every update
  waits until all gradients are computed and checked (`benchmarks/guard_cost.py`,
  MLP of 10.5 M parameters, Adam, batch 256, 2-core AVX512_BF16 CPU,
  2026-12-01: 1.06x plain Keras's step time in bfloat16, 1.11x in float32).
- ``"loss"``: the loss passed to `scale_loss` in the same step is finite (one
  scalar, checked before the backward pass). A bad batch or a diverging run
  gives a non-finite loss; an inf or NaN born in the backward pass alone is not
  caught. Only without loss scaling. Same benchmark: 1.00x plain Keras.
- ``"auto"`` (default): ``"gradients"`` with loss scaling, ``"loss"`` without.

The loss check needs the loss: Keras's `train_step` (hence `fit`) and
`tfmp.scaled_gradients` pass it to `scale_loss` before taking gradients. A step
that calls `apply` without a `scale_loss` call recorded for it (see `StepRecord`)
gets the gradients check instead, so a custom loop is never left unguarded.

Unscaled loss (`LossScaleWarning`): with dynamic loss scaling `apply` divides the
gradients by the scale, so gradients of a loss that was never multiplied by it
(a custom `train_step` written as in the Keras guide, without `scale_loss`) make
every update `scale` times too small. `warn_if_unscaled` warns once per optimizer
when gradients arrive and `scale_loss` has never run on it.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import tensorflow as tf

from tfmp._src.errors import invalid_argument

#: Values of the `guard` argument of `tfmp.LossScaleOptimizer`.
GUARDS = ("auto", "loss", "gradients")


class LossScaleWarning(UserWarning):
    """Gradients reached a loss-scaling optimizer from a loss it did not scale.

    Make it an error with ``warnings.simplefilter("error", tfmp.LossScaleWarning)``.
    """


def check_guard(guard: Any, loss_scaling: bool) -> None:
    """Validates the `guard` argument against `loss_scaling`.

    Raises:
        ValueError: In the project's template, for an unknown guard, or
            ``"loss"`` together with loss scaling (an overflow shows up only in the
            gradients).
    """
    if guard not in GUARDS:
        raise invalid_argument("guard", guard, "one of 'auto', 'loss', 'gradients'", choices=GUARDS)
    if guard == "loss" and loss_scaling:
        raise invalid_argument(
            "guard", guard, "'auto' or 'gradients' with loss_scaling=True",
            fix="Dynamic loss scaling detects overflow in the gradients: keep guard='auto' "
            "under mixed_float16, or pass loss_scaling=False (bfloat16, float32).",
        )


def resolve(guard: str, loss_scaling: bool) -> str:
    """String, ``"loss"`` or ``"gradients"``: the check a `guard` value stands for."""
    if guard == "auto":
        return "gradients" if loss_scaling else "loss"
    return guard


class StepRecord:
    """Python-side record of `scale_loss` calls on one optimizer (nothing runs per step).

    A `tf.function` step is traced once: `scale_loss` and `apply` of Keras's
    `train_step` both run while its graph is traced, so "the loss was recorded in
    this step" means "in the graph now being traced, or one enclosing it". An
    eager step means "since the previous eager `apply`" (with one replica; under
    several replicas eager steps get the gradients check).

    Attributes:
        ever: Bool. `scale_loss` ran on this optimizer at least once.
        warned: Bool. `warn_if_unscaled` has warned for this optimizer.
    """

    def __init__(self) -> None:
        self._graphs: "weakref.WeakSet[Any]" = weakref.WeakSet()
        self._eager_pending = False
        self.ever = False
        self.warned = False

    def note_scale_loss(self, loss_recorded: bool) -> None:
        """Called by `scale_loss`; `loss_recorded` is whether it stored the loss's status."""
        self.ever = True
        if not loss_recorded:
            return
        if tf.executing_eagerly():
            self._eager_pending = True
        else:
            self._graphs.add(tf.compat.v1.get_default_graph())

    def take_loss_recorded(self) -> bool:
        """Bool. Called by `apply`: whether this step's loss status was recorded."""
        if tf.executing_eagerly():
            recorded, self._eager_pending = self._eager_pending, False
            context = tf.distribute.get_replica_context()  # None in a cross-replica context
            return recorded and context is not None and context.num_replicas_in_sync == 1
        graph = tf.compat.v1.get_default_graph()
        while graph is not None:
            if graph in self._graphs:
                return True
            graph = getattr(graph, "outer_graph", None)
        return False


def warn_if_unscaled(optimizer: Any, record: StepRecord, from_unscale: bool) -> None:
    """Warns once per optimizer when dynamic loss scaling meets gradients of an unscaled loss.

    Silent when the optimizer does not scale (`loss_scaling=False`), when the
    gradients came from `get_unscaled_gradients` (`from_unscale`), or once
    `scale_loss` has run on the optimizer, in any step or function: gradients
    computed in one `tf.function` and applied in another cannot be told apart,
    so only an optimizer that never scaled a loss is reported.

    Warns:
        tfmp.LossScaleWarning: naming the factor and the fix.
    """
    if not optimizer.loss_scaling or from_unscale or record.ever or record.warned:
        return
    record.warned = True
    with tf.init_scope():
        scale = optimizer.loss_scale
    warnings.warn(
        f"Gradients reached {type(optimizer).__name__} {optimizer.name!r} (dynamic loss "
        f"scaling, scale {scale:g}), but no loss was scaled by it: `apply` divides the "
        f"gradients by the scale, so each update is {scale:g}x too small and training "
        "barely moves. Scale the loss inside the GradientTape, before tape.gradient: "
        "`loss = self.optimizer.scale_loss(loss)` (or `grads = tfmp.scaled_gradients(tape, "
        "loss, variables, optimizer)`). Warned once per optimizer; make it an error with "
        "warnings.simplefilter('error', tfmp.LossScaleWarning).",
        LossScaleWarning,
        stacklevel=4,
    )
