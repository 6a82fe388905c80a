"""Adam's update in one TensorFlow kernel, for the optimizers `tfmp.LossScaleOptimizer` wraps.

Keras 3's ``Adam.update_step`` updates each variable with a chain of separate
TensorFlow ops (two ``assign_add``, a square, a square root, a division, an
``assign_sub`` and their operands), each one pass over the variable's memory.
TensorFlow's ``ResourceApplyAdam`` kernel computes the same formula,

    alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)
    m += (g - m) * (1 - beta_1)
    v += (g**2 - v) * (1 - beta_2)
    var -= m * alpha / (sqrt(v) + epsilon)

in one pass, sharded over the CPU's threads (``ApplyAdamNonCuda`` in
``tensorflow/core/kernels/training_ops.cc``; the update tf.keras 2's Adam ran).
On the benchmark MLP's 10.5 million float32 master weights the update runs 3.6x
faster, on ResNet50's 2.4x (AMD Zen 4, 2 cores; ``benchmarks/fused_adam.py``). The two differ only in
rounding: Keras computes ``1 - beta_1`` in double precision before casting it,
the kernel in the variable's dtype, so ``m`` and ``v`` move by a few float32 ulps.

tfmp runs the inner optimizer's ``apply`` with the fused update when
`fusable`: ``update_step`` is Keras's Adam's (Adam, AdamW, and subclasses that
keep it), ``amsgrad`` is off and the instance has no ``update_step`` of its own.
Per variable it falls back to Keras's own update for a sparse gradient
(``tf.IndexedSlices``), a variable that is not float32/float64, and under a
``tf.distribute`` strategy. Everything else of ``apply`` stays Keras's: weight
decay, clipping, gradient accumulation, EMA, the learning-rate schedule and the
``iterations`` count. The switch is a hook on the optimizer's ``update_step``
through `tfmp._src.keras_hooks.patches` (owner ``"fused_adam"``) that lasts for
the ``apply`` call only (its trace, under ``tf.function``), so nothing stays on
the user's optimizer.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterator

import keras
import tensorflow as tf
from keras import ops

from tfmp._src.keras_hooks import patches
from tfmp._src.keras_hooks.keras_private import adam_slots

#: Variable dtypes updated by the fused kernel (others take Keras's own update).
FUSED_DTYPES = (tf.float32, tf.float64)


def fusable(optimizer: Any) -> bool:
    """Whether `optimizer`'s updates can run on the fused kernel.

    Args:
        optimizer: A Keras optimizer (the inner optimizer of a
            `tfmp.LossScaleOptimizer`).

    Returns:
        Bool. True for an optimizer whose class keeps ``keras.optimizers.Adam``'s
        ``update_step``, with ``amsgrad`` off and no instance-level ``update_step``.
    """
    return (getattr(type(optimizer), "update_step", None) is keras.optimizers.Adam.update_step
            and not getattr(optimizer, "amsgrad", True)
            and "update_step" not in vars(optimizer))


def _handle(variable: Any) -> tf.Tensor:
    """The resource handle of a `tf.Variable` or of the one a `keras.Variable` holds."""
    return variable.value.handle if isinstance(variable, keras.Variable) else variable.handle


def _fused_update_step(optimizer: Any, keras_update: Callable, gradient: Any, variable: Any,
                       learning_rate: Any) -> None:
    """`keras.optimizers.Adam.update_step` on ``ResourceApplyAdam`` where it applies, else
    ``keras_update`` (the update below the hook: Keras's own)."""
    if (isinstance(gradient, tf.IndexedSlices) or variable.dtype not in FUSED_DTYPES
            or tf.distribute.has_strategy()):
        keras_update(gradient, variable, learning_rate)
        return
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


@contextlib.contextmanager
def fused_updates(optimizer: Any) -> Iterator[None]:
    """Within the block, `optimizer`'s ``update_step`` runs on the fused kernel (if `fusable`).

    The switch is a hook on this optimizer's ``update_step`` (owner
    ``"fused_adam"``, `tfmp._src.keras_hooks.patches`), taken off on leaving.

    Args:
        optimizer: A Keras optimizer.

    Yields:
        None. On leaving, the optimizer's own ``update_step`` is back.
    """
    if not fusable(optimizer):
        yield
        return

    def wrap(keras_update: Callable) -> Callable:
        return functools.partial(_fused_update_step, optimizer, keras_update)

    hook = patches.install(optimizer, "update_step", wrap, owner="fused_adam")
    try:
        yield
    finally:
        hook.remove()
