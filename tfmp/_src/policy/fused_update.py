"""Adam's and SGD's updates in one TensorFlow kernel, for the optimizers `tfmp.LossScaleOptimizer` wraps.

Keras 3 updates a variable with a chain of ops, each a pass over its memory; TensorFlow's
training kernels (``training_ops.cc``, what tf.keras 2 ran) make one pass, equal to Keras's up
to float32 rounding (benchmarks/README.md, "Optimizer updates"). Keras's update stays for
sparse gradients, variables not float32/64 and under ``tf.distribute``.
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
    beta_1, beta_2 = ops.cast(optimizer.beta_1, dtype), ops.cast(optimizer.beta_2, dtype)
    tf.raw_ops.ResourceApplyAdam(
        var=_handle(variable), m=_handle(momentum), v=_handle(velocity), beta1_power=ops.power(beta_1, step),
        beta2_power=ops.power(beta_2, step), lr=ops.cast(learning_rate, dtype), beta1=beta_1, beta2=beta_2,
        epsilon=ops.cast(optimizer.epsilon, dtype), grad=ops.cast(gradient, dtype), use_locking=False)


def _sgd(optimizer: Any, gradient: tf.Tensor, variable: Any, learning_rate: Any) -> None:
    """`keras.optimizers.SGD.update_step` on ``ResourceApplyGradientDescent`` (no momentum)
    or ``ResourceApplyKerasMomentum``."""
    dtype = variable.dtype
    learning_rate, gradient = ops.cast(learning_rate, dtype), ops.cast(gradient, dtype)
    if optimizer.momentum == 0:
        tf.raw_ops.ResourceApplyGradientDescent(
            var=_handle(variable), alpha=learning_rate, delta=gradient, use_locking=False)
        return
    tf.raw_ops.ResourceApplyKerasMomentum(
        var=_handle(variable), accum=_handle(sgd_momentum_slot(optimizer, variable)), lr=learning_rate,
        grad=gradient, momentum=ops.cast(optimizer.momentum, dtype), use_locking=False,
        use_nesterov=bool(optimizer.nesterov))


#: Keras's update_step -> (its kernel version, whether an optimizer's settings allow it).
_KERNEL_UPDATES = {
    keras.optimizers.Adam.update_step: (_adam, lambda optimizer: not getattr(optimizer, "amsgrad", True)),
    keras.optimizers.SGD.update_step: (_sgd, lambda optimizer: True),
}


def _kernel_update(optimizer: Any) -> Optional[Callable]:
    """The kernel version of `optimizer`'s ``update_step``, or None (Keras's stays)."""
    if "update_step" in vars(optimizer):
        return None
    kernel_update, allowed = _KERNEL_UPDATES.get(getattr(type(optimizer), "update_step", None), (None, None))
    return kernel_update if kernel_update is not None and allowed(optimizer) else None


def fusable(optimizer: Any) -> bool:
    """Bool: True for a Keras optimizer whose class keeps ``keras.optimizers.Adam``'s ``update_step``
    with ``amsgrad`` off, or ``keras.optimizers.SGD``'s, and that has no instance-level ``update_step``."""
    return _kernel_update(optimizer) is not None


def _fused_update_step(optimizer: Any, kernel_update: Callable, keras_update: Callable,
                       gradient: Any, variable: Any, learning_rate: Any) -> None:
    """``kernel_update`` where it applies, else ``keras_update`` (Keras's own, below the hook)."""
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
    """Within the block, the Keras `optimizer`'s ``update_step`` runs on a fused kernel (if `fusable`):
    a hook (owner ``"fused_update"``, `keras_hooks.optimizer_steps`) taken off on leaving."""
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
