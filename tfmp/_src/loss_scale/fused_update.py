"""Adam's and SGD's updates in one TensorFlow kernel, for the optimizers `tfmp.LossScaleOptimizer` wraps.

Keras 3's optimizers update each variable with a chain of separate TensorFlow ops,
each one pass over the variable's memory: Adam two ``assign_add``, a square, a
square root, a division and an ``assign_sub``; SGD with momentum two multiplies,
a subtraction, an ``assign`` and an ``assign_add``. TensorFlow's training kernels
(``tensorflow/core/kernels/training_ops.cc``; what tf.keras 2's optimizers ran)
compute the same formulas in one pass, sharded over the CPU's threads:

=========================================  ==================================  ==================================
Keras update                               kernel                              formula
=========================================  ==================================  ==================================
``Adam.update_step`` (Adam, AdamW)         ``ResourceApplyAdam``               ``alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``;
                                                                               ``m += (g - m) * (1 - beta_1)``;
                                                                               ``v += (g**2 - v) * (1 - beta_2)``;
                                                                               ``var -= m * alpha / (sqrt(v) + epsilon)``
``SGD.update_step``, ``momentum == 0``     ``ResourceApplyGradientDescent``    ``var -= lr * g``
``SGD.update_step``, ``momentum > 0``      ``ResourceApplyKerasMomentum``      ``m = m * momentum - lr * g``; ``var += m``
                                                                               (Nesterov: ``var += m * momentum - lr * g``)
=========================================  ==================================  ==================================

SGD's kernels compute Keras's float32 operations in Keras's order: the weights
equal Keras's bit for bit, with or without momentum, weight decay, ``clipnorm``,
``clipvalue``, schedules and EMA. With ``global_clipnorm``, gradient accumulation
(a count not a power of two) or XLA they may differ by float32 rounding (up to
1.5e-8 seen after 3 steps): Grappler's arithmetic optimizer reorders the
multiplies and divides of Keras's own chain of ops, which the kernel takes as
one operand (with it off the two are equal; ``tests/test_fused_update.py``),
and XLA compiles the two differently. Adam's differ in rounding only: Keras computes ``1 - beta_1`` in
double precision before casting it, the kernel in the variable's dtype, so ``m``
and ``v`` move by a few float32 ulps. Speed of the update alone on an AMD Zen 4
(2 cores, ``benchmarks/fused_update.py``): see benchmarks/README.md.

tfmp runs the inner optimizer's ``apply`` with the kernel update when the
wrapper's ``fused_updates`` is True (not under ``enable(speedups=False)``, nor
by default on a machine with a GPU or TPU: measured on CPUs only;
`tfmp._src.policy.speedups`) and `fusable`:
``update_step`` is Keras's Adam's (Adam, AdamW, and subclasses that keep it) with
``amsgrad`` off, or Keras's SGD's (SGD and subclasses that keep it), and the
instance has no ``update_step`` of its own. Per variable it falls back to Keras's
own update for a sparse gradient (``tf.IndexedSlices``), a variable that is not
float32/float64, and under a ``tf.distribute`` strategy. Everything else of
``apply`` stays Keras's: weight decay, clipping, gradient accumulation, EMA, the
learning-rate schedule and the ``iterations`` count. The switch is a hook on the
optimizer's ``update_step`` through `tfmp._src.keras_hooks.optimizer_steps` (owner
``"fused_update"``) that lasts for the ``apply`` call only (its trace, under
``tf.function``), so nothing stays on the user's optimizer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator, Optional

import keras
import tensorflow as tf
from keras import ops

from tfmp._src.keras_hooks import availability, optimizer_steps
from tfmp._src.keras_hooks.optimizer_steps import adam_slots, sgd_momentum_slot

#: Variable dtypes updated by the fused kernels (others take Keras's own update).
FUSED_DTYPES = (tf.float32, tf.float64)


def _handle(variable: Any) -> tf.Tensor:
    """The resource handle of a `tf.Variable` or of the one a `keras.Variable` holds."""
    return variable.value.handle if isinstance(variable, keras.Variable) else variable.handle


def _adam(optimizer: Any, gradient: tf.Tensor, variable: Any, learning_rate: Any) -> None:
    """`keras.optimizers.Adam.update_step` (amsgrad off) on ``ResourceApplyAdam``."""
    dtype = variable.dtype
    momentum, velocity = adam_slots(optimizer, variable)
    step = ops.cast(optimizer.iterations + 1, dtype)
    beta_1 = ops.cast(optimizer.beta_1, dtype)
    beta_2 = ops.cast(optimizer.beta_2, dtype)
    tf.raw_ops.ResourceApplyAdam(
        var=_handle(variable),
        m=_handle(momentum),
        v=_handle(velocity),
        beta1_power=ops.power(beta_1, step),
        beta2_power=ops.power(beta_2, step),
        lr=ops.cast(learning_rate, dtype),
        beta1=beta_1,
        beta2=beta_2,
        epsilon=ops.cast(optimizer.epsilon, dtype),
        grad=ops.cast(gradient, dtype),
        use_locking=False,
    )


def _sgd(optimizer: Any, gradient: tf.Tensor, variable: Any, learning_rate: Any) -> None:
    """`keras.optimizers.SGD.update_step` on ``ResourceApplyGradientDescent`` (no momentum)
    or ``ResourceApplyKerasMomentum``."""
    dtype = variable.dtype
    learning_rate = ops.cast(learning_rate, dtype)
    gradient = ops.cast(gradient, dtype)
    if optimizer.momentum == 0:
        tf.raw_ops.ResourceApplyGradientDescent(
            var=_handle(variable), alpha=learning_rate, delta=gradient, use_locking=False)
        return
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=_handle(variable),
        accum=_handle(sgd_momentum_slot(optimizer, variable)),
        lr=learning_rate,
        grad=gradient,
        momentum=ops.cast(optimizer.momentum, dtype),
        use_locking=False,
        use_nesterov=bool(optimizer.nesterov),
    )


#: Keras's update_step -> (its kernel version, whether an optimizer's settings allow it).
_KERNEL_UPDATES = {
    keras.optimizers.Adam.update_step: (_adam, lambda optimizer: not getattr(optimizer, "amsgrad", True)),
    keras.optimizers.SGD.update_step: (_sgd, lambda optimizer: True),
}


def _kernel_update(optimizer: Any) -> Optional[Callable]:
    """The kernel version of `optimizer`'s ``update_step``, or None (Keras's stays)."""
    if "update_step" in vars(optimizer):
        return None
    kernel_update, allowed = _KERNEL_UPDATES.get(getattr(type(optimizer), "update_step", None),
                                                 (None, None))
    return kernel_update if kernel_update is not None and allowed(optimizer) else None


def fusable(optimizer: Any) -> bool:
    """Whether `optimizer`'s updates can run on a fused kernel.

    Args:
        optimizer: A Keras optimizer (the inner optimizer of a
            `tfmp.LossScaleOptimizer`).

    Returns:
        Bool. True for an optimizer whose class keeps ``keras.optimizers.Adam``'s
        ``update_step`` with ``amsgrad`` off, or ``keras.optimizers.SGD``'s, and
        that has no instance-level ``update_step``.
    """
    return _kernel_update(optimizer) is not None


def _fused_update_step(optimizer: Any, kernel_update: Callable, keras_update: Callable,
                       gradient: Any, variable: Any, learning_rate: Any) -> None:
    """``kernel_update`` where it applies, else ``keras_update`` (the update below the hook:
    Keras's own)."""
    if (isinstance(gradient, tf.IndexedSlices) or variable.dtype not in FUSED_DTYPES
            or tf.distribute.has_strategy() or availability.off("fused_update")):
        keras_update(gradient, variable, learning_rate)
        return
    try:
        kernel_update(optimizer, gradient, variable, learning_rate)
    except AttributeError as error:  # Keras moved a slot it reads (before any op was made)
        availability.switch_off("fused_update", error)
        keras_update(gradient, variable, learning_rate)


@contextlib.contextmanager
def fused_updates(optimizer: Any) -> Iterator[None]:
    """Within the block, `optimizer`'s ``update_step`` runs on a fused kernel (if `fusable`).

    The switch is a hook on this optimizer's ``update_step`` (owner
    ``"fused_update"``, `tfmp._src.keras_hooks.optimizer_steps`), taken off on leaving.

    Args:
        optimizer: A Keras optimizer.

    Yields:
        None. On leaving, the optimizer's own ``update_step`` is back.
    """
    kernel_update = _kernel_update(optimizer)
    if kernel_update is None or availability.off("fused_update"):
        yield
        return

    def wrap(keras_update: Callable) -> Callable:
        return functools.partial(_fused_update_step, optimizer, kernel_update, keras_update)

    hook = optimizer_steps.subscribe(optimizer, "update_step", wrap, owner="fused_update")
    try:
        yield
    finally:
        hook.remove()
